#include "shm/sync.hpp"

#include <atomic>
#include <limits>

#include "os/futex.hpp"

namespace gpuipc::shm {

using proto::atomic;

void bump_and_wake(std::uint32_t& word, std::uint32_t* sleepers) noexcept {
  atomic(word).fetch_add(1, std::memory_order_seq_cst);
  if (sleepers != nullptr && atomic(*sleepers).load(std::memory_order_seq_cst) == 0) return;
  try {
    static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
    os::futex_wake(reinterpret_cast<const std::atomic<std::uint32_t>*>(&word));  // NOLINT: the futex is the word
  } catch (...) {  // NOLINT(bugprone-empty-catch): sleepers also wake by timeout
  }
}

void raise_to(std::uint64_t& word, std::uint64_t value) noexcept {
  auto a = atomic(word);
  std::uint64_t cur = a.load(std::memory_order_acquire);
  // Bounded: the broker runs this on words every member may write.
  for (int tries = 0; tries < kMostCasTries; ++tries) {
    if (!garbage(cur) && (cur & ~proto::kPoisonBit) >= value) return;
    if (a.compare_exchange_weak(cur, value, std::memory_order_acq_rel)) return;
  }
}

std::uint32_t saturating_decrement(std::uint32_t& word) noexcept {
  auto a = atomic(word);
  std::uint32_t cur = a.load(std::memory_order_acquire);
  for (int tries = 0; tries < kMostCasTries && cur != 0; ++tries) {  // bounded, as raise_to
    if (a.compare_exchange_weak(cur, cur - 1, std::memory_order_acq_rel)) break;
  }
  return cur;
}

std::uint32_t saturating_increment(std::uint32_t& word) noexcept {
  auto a = atomic(word);
  std::uint32_t cur = a.load(std::memory_order_acquire);
  for (int tries = 0; tries < kMostCasTries && cur != std::numeric_limits<std::uint32_t>::max(); ++tries) {
    if (a.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel)) break;
  }
  return cur;
}

}  // namespace gpuipc::shm
