// The one owner of driver objects. Every RAII class of src/cuda (and of testkit/) is a few lines over
// UniqueHandle: a handle value plus a stateless release function, with defaulted moves (rmm's cuda_stream.hpp over
// a unique_ptr with a deleter is the model). Owners are move-only (copy deleted, move noexcept); their release never
// throws: a failed release is logged with GPUIPC_LOG_WARN. Throwing calls throw gpuipc::Error naming the driver call
// and the object (size, device), via cuda::check. In a child forked after CUDA was initialised, and in a process
// whose driver never loaded, releases do nothing: the objects belong to the parent, or do not exist.
//
// Context rules (docs/architecture.md, Layers): VMM calls (create, export, import, reserve, map, set_access) need
// no particular context. Copies, streams, events, host registration, plain allocation, legacy IPC and modules work
// in the context current on the calling thread (make one current with PrimaryContext::make_current); their owners
// remember that context and make it current again, for the release only, when released from a thread where it is
// not (release_in below).
#pragma once

#include <cuda.h>

#include <string_view>
#include <utility>

#include "cuda/driver.hpp"

namespace gpuipc::cuda {

/// Owns one driver object. `Handle` is a value type whose value-initialised state means "nothing" (a CUstream, or
/// a struct of the handle and what its release needs, with a defaulted operator==); `Release` is a stateless
/// function object, called as Release{}(handle) once per owned handle, noexcept. Move-only: a moved-from owner is
/// empty.
template <typename Handle, typename Release>
class UniqueHandle {
 public:
  UniqueHandle() noexcept = default;
  /// Takes ownership of `handle`.
  explicit UniqueHandle(Handle handle) noexcept : m_handle(std::move(handle)) {}
  UniqueHandle(const UniqueHandle&) = delete;
  UniqueHandle& operator=(const UniqueHandle&) = delete;
  UniqueHandle(UniqueHandle&& other) noexcept : m_handle(std::exchange(other.m_handle, Handle{})) {}
  UniqueHandle& operator=(UniqueHandle&& other) noexcept {
    if (this != &other) {
      reset();
      m_handle = std::exchange(other.m_handle, Handle{});
    }
    return *this;
  }
  ~UniqueHandle() { reset(); }

  const Handle& get() const noexcept { return m_handle; }
  bool empty() const noexcept { return m_handle == Handle{}; }
  /// Releases the object now (if any); the owner is empty after.
  void reset() noexcept {
    if (empty()) return;
    Release{}(m_handle);
    m_handle = Handle{};
  }

 private:
  Handle m_handle{};
};

/// Logs a release that failed. CUDA_SUCCESS is not logged, nor CUDA_ERROR_DEINITIALIZED: every call returns it
/// while the process exits after the driver tore itself down, and nothing is left to release then.
void warn_release(CUresult r, const char* call, std::string_view what) noexcept;

/// Runs `call(api)` (a driver call returning CUresult) with `ctx` current: switches (and back) only when `ctx` is
/// not null and another context, or none, is current. Never throws; a failed switch leaves the call to fail.
template <typename Call>
CUresult call_in(const DriverApi& api, CUcontext ctx, Call&& call) noexcept {
  CUcontext previous = nullptr;
  bool switched = false;
  if (ctx != nullptr && api.cuCtxGetCurrent(&previous) == CUDA_SUCCESS && previous != ctx) {
    switched = api.cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
  }
  const CUresult r = call(api);
  if (switched) api.cuCtxSetCurrent(previous);
  return r;
}

/// An owner's release: `release(api)` through call_in(ctx), nothing when loaded_driver() is null. A failure is
/// logged with warn_release as `call` failing on `what()` (a callable: the text is made only then).
template <typename Call, typename What>
void release_in(CUcontext ctx, const char* call, Call&& release, What&& what) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return;
  const CUresult r = call_in(*api, ctx, release);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) warn_release(r, call, what());
}

}  // namespace gpuipc::cuda
