// The work the library puts on streams, and waits for: synchronous and stream-ordered copies, stream-ordered
// 64-bit memory operations (the semaphore mechanism), host functions in stream order (how a GPU stream wakes a
// sleeping host thread), and synchronisation of streams and contexts. All in the context current on the calling
// thread. The streams themselves belong to the caller.
#pragma once

#include <cuda.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace gpuipc::cuda {

/// Synchronous copies in the current context (cuMemcpyHtoD, cuMemcpyDtoH, cuMemcpyDtoD): they return once the work
/// is done (the legacy stream is synchronised after those the driver returns from early). Throw Error naming the
/// size.
void copy_to_device(CUdeviceptr dst, const void* src, std::size_t size);
void copy_to_host(void* dst, CUdeviceptr src, std::size_t size);
void copy_device_to_device(CUdeviceptr dst, CUdeviceptr src, std::size_t size);
/// cuStreamSynchronize of a stream the caller does not own as a Stream; `what` names it in errors. Throws Error.
void synchronize(CUstream stream, std::string_view what);
/// cuCtxSynchronize of the current context: every stream of it is done. `what` names the reason in errors.
/// Throws Error.
void synchronize_context(std::string_view what);

/// Stream-ordered 64-bit memory operations on registered host or device memory (the semaphore mechanism).
/// Hot path: no exception, no allocation; they return the CUresult (CUDA_ERROR_NOT_INITIALIZED without a
/// driver). write: cuStreamWriteValue64 (flags CU_STREAM_WRITE_VALUE_DEFAULT orders it after prior work).
/// wait: cuStreamWaitValue64 (CU_STREAM_WAIT_VALUE_GEQ by default).
CUresult stream_write_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value,
                              unsigned flags = CU_STREAM_WRITE_VALUE_DEFAULT) noexcept;
CUresult stream_wait_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value,
                             unsigned flags = CU_STREAM_WAIT_VALUE_GEQ) noexcept;
/// Whether `stream` still has work to do (cuStreamQuery says CUDA_ERROR_NOT_READY). Hot path: false on any other
/// answer, including errors.
bool stream_busy(CUstream stream) noexcept;
/// Whether an operation enqueued on `stream` now would run at once: everything enqueued on it so far has finished
/// (cuStreamQuery), and so has everything such an operation would wait for implicitly. A non-blocking stream waits
/// for nothing else; a blocking stream, and the per-thread default stream, also wait for the legacy default stream,
/// which must then be idle too (false for a stream of another context than the current one: its legacy stream
/// is not the one a query here would ask). An operation on the legacy default stream (0 or CU_STREAM_LEGACY) waits for every
/// blocking stream of its context, which no query can list: false for it (see legacy_stream_reached_now). Hot
/// path: false on any error, so a caller that takes a shortcut on true never takes it by mistake.
bool stream_reached_now(CUstream stream) noexcept;
/// The same for the legacy default stream of the current context, by recording `probe` (an event of that context)
/// on it and querying the event for up to `spin` (an idle GPU completes it within microseconds). False when the
/// stream has work queued (one cuStreamQuery, no record), on any error, or when `spin` passed.
bool legacy_stream_reached_now(CUevent probe, std::chrono::nanoseconds spin) noexcept;
/// A CU_EVENT_DISABLE_TIMING event of the current context for legacy_stream_reached_now; null when the driver
/// refuses. Hot path: no exception.
CUevent create_probe_event() noexcept;
/// cuEventDestroy; errors ignored.
void destroy_event(CUevent event) noexcept;
/// cuMemcpyAsync in `stream` order (unified addresses: host or device on either side). Hot path: returns the
/// CUresult, no exception.
CUresult copy_async(CUdeviceptr dst, CUdeviceptr src, std::size_t size, CUstream stream) noexcept;

/// cuLaunchHostFunc(stream, fn, data). Hot path: no exception; returns the CUresult
/// (CUDA_ERROR_NOT_INITIALIZED without a driver). The function runs on a driver thread once the stream reaches
/// it and must not call CUDA.
CUresult launch_host_func(CUstream stream, void (*fn)(void*), void* data) noexcept;

/// What a stream operation touches, which decides the context it runs in on the legacy default stream (0).
enum class StreamTarget : unsigned char {
  /// Memory of one GPU (a channel's slots and words): stream 0 is that GPU's legacy stream, `ctx`'s, not the
  /// caller's (say torch's cuda:0 current for a channel on GPU 1).
  GpuMemory,
  /// Words of host memory registered portable and device-mapped (semaphores, a pool's `released` words): valid in
  /// every context, so stream 0 is the legacy stream of the caller's current context, ordered after the work the
  /// caller queued there; `ctx` only on a thread with no context current.
  HostWords,
};

/// A stream operation's context, for the scope of the operation: for the legacy default stream (0) of a
/// GpuMemory operation, `ctx`, restored on exit; otherwise (other streams carry their context; HostWords operations
/// take the caller's) `ctx` only on a thread with no context current, which keeps it (as the CUDA runtime does on a
/// thread's first call). Nothing for a null `ctx` (host memory). Hot path: no exception; ok() false when the driver
/// refused.
class StreamContextScope {
 public:
  StreamContextScope(CUcontext ctx, CUstream stream, StreamTarget target) noexcept;
  ~StreamContextScope();
  StreamContextScope(const StreamContextScope&) = delete;
  StreamContextScope& operator=(const StreamContextScope&) = delete;
  bool ok() const noexcept { return m_ok; }

 private:
  CUcontext m_saved = nullptr;
  bool m_restore = false;
  bool m_ok = true;
};

}  // namespace gpuipc::cuda
