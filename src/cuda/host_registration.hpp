// Page-locked host memory the library uses: host memory registered with the driver (cuMemHostRegister: host_pinned
// segments, semaphore and channel words that streams write) and pinned host allocations (cuMemHostAlloc: a pool's
// saved contents while it is paused).
#pragma once

#include <cuda.h>

#include <cstddef>

#include "cuda/unique_handle.hpp"

namespace gpuipc::cuda {

/// Host memory registered with the driver (page-locked, GPU-visible); cuMemHostUnregister on destruction. The
/// caller keeps the memory mapped for as long as the registration lives.
class HostRegistration {
 public:
  HostRegistration() noexcept = default;
  /// cuMemHostRegister(ptr, size, CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP, plus READ_ONLY when `read_only`) in
  /// the current context. ptr and size must be page-aligned (a memfd mapping is). Throws Error naming the size;
  /// Error(Unsupported) when the device cannot register host memory (or read-only memory).
  static HostRegistration register_memory(void* ptr, std::size_t size, bool read_only = false);

  /// The address GPU code and stream memory operations use for the registered memory (cuMemHostGetDevicePointer;
  /// with unified addressing it equals the host address). Throws Error(Cuda).
  CUdeviceptr device_pointer() const;
  void* host_pointer() const noexcept { return m_owned.get().ptr; }
  std::size_t size() const noexcept { return m_owned.get().size; }
  explicit operator bool() const noexcept { return host_pointer() != nullptr; }

 private:
  struct Registered {
    void* ptr = nullptr;
    std::size_t size = 0;
    CUcontext ctx = nullptr;
    bool operator==(const Registered&) const = default;
  };
  struct Release {
    void operator()(const Registered& registered) const noexcept;
  };
  explicit HostRegistration(Registered registered) noexcept : m_owned(registered) {}
  UniqueHandle<Registered, Release> m_owned;
};

/// cuMemHostAlloc(bytes, CU_MEMHOSTALLOC_PORTABLE) in the current context; cuMemFreeHost on destruction.
/// Move-only. Throws Error naming the size.
class PinnedHostBuffer {
 public:
  explicit PinnedHostBuffer(std::size_t bytes);
  void* get() const noexcept { return m_owned.get().ptr; }
  std::size_t size() const noexcept { return m_owned.get().bytes; }

 private:
  struct Allocated {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    bool operator==(const Allocated&) const = default;
  };
  struct Release {
    void operator()(const Allocated& allocated) const noexcept;
  };
  UniqueHandle<Allocated, Release> m_owned;
};

}  // namespace gpuipc::cuda
