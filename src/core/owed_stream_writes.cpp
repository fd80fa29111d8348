#include "core/owed_stream_writes.hpp"

#include <thread>

#include "core/shm_wait.hpp"

namespace gpuipc::core {

std::atomic<std::uint32_t> g_owed_stream_writes{0};  // NOLINT: process-wide by nature

void settle_owed_stream_writes() noexcept {
  for (unsigned i = 1; g_owed_stream_writes.load(std::memory_order_acquire) != 0; ++i) {
    if (i < 4096) {
      cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace gpuipc::core
