// Plain device memory (cuMemAlloc), memset and peer access between contexts: the scratch buffers of GPU tests and
// the baselines the benchmarks compare gpuipc's segments against. Part of testkit/ (README.md there): not in
// libgpuipc.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "cuda/unique_handle.hpp"

namespace gpuipc::cuda {

/// Plain device memory from cuMemAlloc in the current context (baselines and scratch); cuMemFree on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() noexcept = default;
  /// cuMemAlloc(size). Throws Error(Cuda) ("out of GPU memory" when it is) naming the size.
  static DeviceBuffer allocate(std::size_t size);

  CUdeviceptr get() const noexcept { return m_owned.get().ptr; }
  std::size_t size() const noexcept { return m_owned.get().size; }
  explicit operator bool() const noexcept { return get() != 0; }

 private:
  struct Allocated {
    CUdeviceptr ptr = 0;
    std::size_t size = 0;
    CUcontext ctx = nullptr;
    bool operator==(const Allocated&) const = default;
  };
  struct Release {
    void operator()(const Allocated& allocated) const noexcept;
  };
  explicit DeviceBuffer(Allocated allocated) noexcept : m_owned(allocated) {}
  UniqueHandle<Allocated, Release> m_owned;
};

/// cuMemsetD8 in the current context: returns once the memory is set (the legacy stream is synchronised after).
/// Throws Error naming the size.
void memset_d8(CUdeviceptr dst, std::uint8_t value, std::size_t size);
/// cuMemsetD8Async: the same, in `stream` order. Throws Error.
void memset_d8_async(CUdeviceptr dst, std::uint8_t value, std::size_t size, CUstream stream);

/// cuCtxEnablePeerAccess(peer) from the current context (already enabled is fine). Throws Error.
void enable_peer_access(CUcontext peer);

}  // namespace gpuipc::cuda
