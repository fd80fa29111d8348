// Pinned host memory from the driver (cuMemHostAlloc) and peer access between contexts: baselines the benchmarks
// compare gpuipc's host_pinned segments and peer-mapped segments against.
#pragma once

#include <cuda.h>

#include <cstddef>

namespace gpuipc::cuda {

/// cuMemHostAlloc(bytes, CU_MEMHOSTALLOC_PORTABLE) in the current context; cuMemFreeHost on destruction.
/// Move-only. Throws Error naming the size.
class PinnedHostBuffer {
 public:
  explicit PinnedHostBuffer(std::size_t bytes);
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer(PinnedHostBuffer&& other) noexcept;
  PinnedHostBuffer& operator=(PinnedHostBuffer&& other) noexcept;
  ~PinnedHostBuffer();
  void* get() const noexcept { return m_ptr; }
  std::size_t size() const noexcept { return m_bytes; }

 private:
  void* m_ptr = nullptr;
  std::size_t m_bytes = 0;
};

/// cuCtxEnablePeerAccess(peer) from the current context (already enabled is fine). Throws Error.
void enable_peer_access(CUcontext peer);

}  // namespace gpuipc::cuda
