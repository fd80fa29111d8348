// Contexts: a device's retained primary context, a context made current for a scope, and the context and device
// current on the calling thread. Which calls need a current context: cuda/unique_handle.hpp.
#pragma once

#include <cuda.h>

#include "cuda/unique_handle.hpp"

namespace gpuipc::cuda {

/// A retained primary context of one device (cuDevicePrimaryCtxRetain / cuDevicePrimaryCtxRelease). Keep it alive
/// as long as anything allocated in it: the context is destroyed when its last retain is released.
class PrimaryContext {
 public:
  PrimaryContext() noexcept = default;
  /// Retains device `ordinal`'s primary context (creating it: ~100 ms and some GPU memory the first time). Throws
  /// Error(NoDevice) for a bad ordinal, Error(NoDriver) without a driver.
  explicit PrimaryContext(int ordinal);

  /// Binds the context to the calling thread (cuCtxSetCurrent). Throws Error(Cuda).
  void make_current() const;
  CUcontext get() const noexcept { return m_owned.get().ctx; }
  CUdevice device() const noexcept { return m_owned.get().device; }
  int ordinal() const noexcept { return m_owned.get().ordinal; }
  explicit operator bool() const noexcept { return !m_owned.empty(); }

 private:
  struct Retained {
    int ordinal = -1;
    CUdevice device = 0;
    CUcontext ctx = nullptr;
    bool operator==(const Retained&) const = default;
  };
  struct Release {
    void operator()(const Retained& retained) const noexcept;
  };
  UniqueHandle<Retained, Release> m_owned;
};

/// Makes `ctx` current on this thread for its lifetime and restores the previous context after. Throws
/// Error(Cuda) when the switch fails; the restore never throws (logged).
class ScopedContext {
 public:
  explicit ScopedContext(CUcontext ctx);
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  ScopedContext(ScopedContext&&) = delete;
  ScopedContext& operator=(ScopedContext&&) = delete;
  ~ScopedContext();

 private:
  CUcontext m_previous = nullptr;
  bool m_switched = false;
};

/// The context current on the calling thread (nullptr when none): what an owner remembers at creation. Throws
/// Error(NoDriver).
CUcontext current_context();
/// The same on hot paths: nullptr also without a driver or when the driver refuses. No exception.
CUcontext current_context_or_null() noexcept;

/// The ordinal of the device of the current context. Throws Error(Cuda) when no context is current.
int current_ordinal();

/// cuDeviceGet for device `ordinal`. Throws Error naming the GPU.
CUdevice device_handle(int ordinal);

/// cuDeviceGetAttribute for device `ordinal`. Throws Error naming the attribute number.
int device_attribute(CUdevice_attribute attribute, int ordinal);

}  // namespace gpuipc::cuda
