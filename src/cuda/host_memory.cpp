#include "cuda/host_memory.hpp"

#include <fmt/format.h>

#include <utility>

#include "base/log.hpp"
#include "cuda/driver.hpp"

namespace gpuipc::cuda {

PinnedHostBuffer::PinnedHostBuffer(std::size_t bytes) : m_bytes(bytes) {
  check(driver().cuMemHostAlloc(&m_ptr, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc",
        fmt::format("{} bytes of pinned host memory", bytes));
}

PinnedHostBuffer::PinnedHostBuffer(PinnedHostBuffer&& other) noexcept
    : m_ptr(std::exchange(other.m_ptr, nullptr)), m_bytes(std::exchange(other.m_bytes, 0)) {}

PinnedHostBuffer& PinnedHostBuffer::operator=(PinnedHostBuffer&& other) noexcept {
  if (this != &other) {
    PinnedHostBuffer old(std::move(*this));
    m_ptr = std::exchange(other.m_ptr, nullptr);
    m_bytes = std::exchange(other.m_bytes, 0);
  }
  return *this;
}

PinnedHostBuffer::~PinnedHostBuffer() {
  if (m_ptr == nullptr) return;
  if (const auto* d = loaded_driver()) {
    if (const CUresult r = d->cuMemFreeHost(m_ptr); r != CUDA_SUCCESS) {
      GPUIPC_LOG_WARN("cuMemFreeHost of {} bytes failed: {}", m_bytes, result_name(r));
    }
  }
}

void enable_peer_access(CUcontext peer) {
  const CUresult r = driver().cuCtxEnablePeerAccess(peer, 0);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED) {
    check(r, "cuCtxEnablePeerAccess", "peer context");
  }
}

}  // namespace gpuipc::cuda
