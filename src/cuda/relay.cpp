#include "cuda/relay.hpp"

#include "cuda/driver.hpp"

namespace gpuipc::cuda {

StreamRelay StreamRelay::create() {
  StreamRelay r;
  r.m_writes = Stream::create(true);
  r.m_waits = Stream::create(true);
  r.m_to_writes = Event::create(CU_EVENT_DISABLE_TIMING);
  r.m_from_waits = Event::create(CU_EVENT_DISABLE_TIMING);
  return r;
}

bool StreamRelay::relayable(CUstream stream) noexcept {
  const DriverApi* api = loaded_driver();
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return api != nullptr && api->cuStreamIsCapturing(stream, &status) == CUDA_SUCCESS &&
         status == CU_STREAM_CAPTURE_STATUS_NONE;
}

CUresult StreamRelay::write_after(CUstream stream, CUdeviceptr addr, std::uint64_t value) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  // cuStreamWaitEvent takes the event's latest record at the time of the call: one event serves every write.
  if (m_writes && relayable(stream) && api->cuEventRecord(m_to_writes.get(), stream) == CUDA_SUCCESS &&
      api->cuStreamWaitEvent(m_writes.get(), m_to_writes.get(), 0) == CUDA_SUCCESS) {
    return stream_write_value64(m_writes.get(), addr, value);
  }
  return stream_write_value64(stream, addr, value);  // another context's stream, a capture: the plain way
}

CUresult StreamRelay::wait_before(CUstream stream, CUdeviceptr addr, std::uint64_t value) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  if (m_waits && relayable(stream) && stream_wait_value64(m_waits.get(), addr, value) == CUDA_SUCCESS &&
      api->cuEventRecord(m_from_waits.get(), m_waits.get()) == CUDA_SUCCESS &&
      api->cuStreamWaitEvent(stream, m_from_waits.get(), 0) == CUDA_SUCCESS) {
    return CUDA_SUCCESS;
  }
  // (A side wait that went in before a failure stays harmless: it ends when the word gets there or is poisoned.)
  return stream_wait_value64(stream, addr, value);
}

}  // namespace gpuipc::cuda
