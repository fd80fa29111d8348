#include "testkit/cuda/device_memory.hpp"

#include <fmt/format.h>

#include "cuda/context.hpp"
#include "cuda/stream_ops.hpp"

namespace gpuipc::cuda {

DeviceBuffer DeviceBuffer::allocate(std::size_t size) {
  if (size == 0) throw Error(ErrorCode::InvalidArgument, "device buffer: size must be positive", "cuMemAlloc");
  const DriverApi& api = driver();
  const CUcontext ctx = current_context();
  CUdeviceptr ptr = 0;
  check(api.cuMemAlloc(&ptr, size), "cuMemAlloc", fmt::format("device buffer of {} bytes", size));
  return DeviceBuffer(Allocated{ptr, size, ctx});
}

void DeviceBuffer::Release::operator()(const Allocated& allocated) const noexcept {
  release_in(
      allocated.ctx, "cuMemFree", [&](const DriverApi& api) { return api.cuMemFree(allocated.ptr); },
      [&] { return fmt::format("device buffer at {:#x} of {} bytes", allocated.ptr, allocated.size); });
}

void memset_d8(CUdeviceptr dst, std::uint8_t value, std::size_t size) {
  check(driver().cuMemsetD8(dst, value, size), "cuMemsetD8", fmt::format("setting {} bytes at {:#x}", size, dst));
  // cuMemsetD8 on device memory may return before the work is done (CUDA's "API synchronization behavior").
  synchronize(nullptr, "after cuMemsetD8");
}

void memset_d8_async(CUdeviceptr dst, std::uint8_t value, std::size_t size, CUstream stream) {
  check(driver().cuMemsetD8Async(dst, value, size, stream), "cuMemsetD8Async",
        fmt::format("setting {} bytes at {:#x}", size, dst));
}

void enable_peer_access(CUcontext peer) {
  const CUresult r = driver().cuCtxEnablePeerAccess(peer, 0);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
    check(r, "cuCtxEnablePeerAccess", "peer context");
  }
}

}  // namespace gpuipc::cuda
