#include "cuda/stream_ops.hpp"

#include <fmt/format.h>

#include <chrono>

#include "cuda/driver.hpp"

namespace gpuipc::cuda {
namespace {

// cuMemcpyHtoD (from pageable memory) and cuMemcpyDtoD on device memory may return before the work is done
// (CUDA's "API synchronization behavior"): wait for the legacy stream they ran on, so that "synchronous" means
// done — before a mapping is torn down, or a kernel on a non-blocking stream reads the result.
void finish_legacy_stream(const char* after) { synchronize(nullptr, after); }

}  // namespace

void copy_to_device(CUdeviceptr dst, const void* src, std::size_t size) {
  check(driver().cuMemcpyHtoD(dst, src, size), "cuMemcpyHtoD", fmt::format("copying {} bytes to {:#x}", size, dst));
  finish_legacy_stream("after cuMemcpyHtoD");
}

void copy_to_host(void* dst, CUdeviceptr src, std::size_t size) {
  check(driver().cuMemcpyDtoH(dst, src, size), "cuMemcpyDtoH", fmt::format("copying {} bytes from {:#x}", size, src));
}

void copy_device_to_device(CUdeviceptr dst, CUdeviceptr src, std::size_t size) {
  check(driver().cuMemcpyDtoD(dst, src, size), "cuMemcpyDtoD",
        fmt::format("copying {} bytes from {:#x} to {:#x}", size, src, dst));
  finish_legacy_stream("after cuMemcpyDtoD");
}

void synchronize(CUstream stream, std::string_view what) {
  check(driver().cuStreamSynchronize(stream), "cuStreamSynchronize", what);
}

void synchronize_context(std::string_view what) { check(driver().cuCtxSynchronize(), "cuCtxSynchronize", what); }

CUresult stream_write_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value, unsigned flags) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return api->cuStreamWriteValue64(stream, addr, value, flags);
}

CUresult stream_wait_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value, unsigned flags) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return api->cuStreamWaitValue64(stream, addr, value, flags);
}

bool stream_busy(CUstream stream) noexcept {
  const DriverApi* api = loaded_driver();
  return api != nullptr && api->cuStreamQuery(stream) == CUDA_ERROR_NOT_READY;
}

bool stream_reached_now(CUstream stream) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr || stream == nullptr || stream == CU_STREAM_LEGACY) return false;
  if (api->cuStreamQuery(stream) != CUDA_SUCCESS) return false;
  // The legacy stream asked below is the current context's: it must be the stream's (a blocking stream of another
  // GPU waits for that GPU's legacy stream, which this thread cannot ask without switching).
  CUcontext own = nullptr;
  CUcontext current = nullptr;
  if (api->cuStreamGetCtx(stream, &own) != CUDA_SUCCESS || api->cuCtxGetCurrent(&current) != CUDA_SUCCESS ||
      own != current) {
    return false;
  }
  unsigned flags = 0;
  if (stream != CU_STREAM_PER_THREAD) {
    if (api->cuStreamGetFlags(stream, &flags) != CUDA_SUCCESS) return false;
    if ((flags & CU_STREAM_NON_BLOCKING) != 0) return true;
  }
  return api->cuStreamQuery(CU_STREAM_LEGACY) == CUDA_SUCCESS;
}

CUevent create_probe_event() noexcept {
  const DriverApi* api = loaded_driver();
  CUevent event = nullptr;
  if (api == nullptr || api->cuEventCreate(&event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS) return nullptr;
  return event;
}

void destroy_event(CUevent event) noexcept {
  const DriverApi* api = loaded_driver();
  if (api != nullptr && event != nullptr) (void)api->cuEventDestroy(event);
}

bool legacy_stream_reached_now(CUevent probe, std::chrono::nanoseconds spin) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr || probe == nullptr || api->cuStreamQuery(CU_STREAM_LEGACY) != CUDA_SUCCESS) return false;
  if (api->cuEventRecord(probe, CU_STREAM_LEGACY) != CUDA_SUCCESS) return false;
  const auto deadline = std::chrono::steady_clock::now() + spin;
  for (;;) {
    const CUresult r = api->cuEventQuery(probe);
    if (r == CUDA_SUCCESS) return true;
    if (r != CUDA_ERROR_NOT_READY || std::chrono::steady_clock::now() >= deadline) return false;
  }
}

CUresult copy_async(CUdeviceptr dst, CUdeviceptr src, std::size_t size, CUstream stream) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return api->cuMemcpyAsync(dst, src, size, stream);
}

CUresult launch_host_func(CUstream stream, void (*fn)(void*), void* data) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr || api->cuLaunchHostFunc == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return api->cuLaunchHostFunc(stream, fn, data);
}

StreamContextScope::StreamContextScope(CUcontext ctx, CUstream stream, StreamTarget target) noexcept {
  if (ctx == nullptr) return;
  const DriverApi* api = loaded_driver();
  if (api == nullptr || api->cuCtxGetCurrent(&m_saved) != CUDA_SUCCESS) {
    m_ok = false;
    return;
  }
  const bool keep_callers = stream != nullptr || target == StreamTarget::HostWords;
  if (m_saved == ctx || (keep_callers && m_saved != nullptr)) return;
  m_ok = api->cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
  // A thread with no context keeps the one made current (as the runtime's first call would); another gets its back.
  m_restore = m_ok && m_saved != nullptr;
}

StreamContextScope::~StreamContextScope() {
  if (m_restore) (void)loaded_driver()->cuCtxSetCurrent(m_saved);
}

}  // namespace gpuipc::cuda
