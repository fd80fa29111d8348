// Host-side waiting on shared control blocks (semaphores and channels).
#pragma once

#include <chrono>
#include <cstdint>

#include "base/deadline.hpp"
#include "gpuipc/error.hpp"
#include "proto/shm.hpp"
#include "shm/sync.hpp"

namespace gpuipc::core {

/// Sleeps on `futex_word` while it still reads `seen`, at most `slice`.
void futex_sleep(const std::uint32_t& futex_word, std::uint32_t seen, std::chrono::nanoseconds slice) noexcept;

/// One spin-loop pause.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/// How long wait_on polls before it sleeps, unless told otherwise.
inline constexpr std::chrono::nanoseconds kDefaultSpin = std::chrono::microseconds(20);

/// Waits until `ready()` returns true (its captures carry the result). Spins for `spin` (20 us by default), then
/// sleeps on `futex_word` with a timeout that starts at 50 us and doubles up to 1 ms, so changes that do not bump
/// the word (a GPU stream's write) are still seen. A negative timeout waits forever. Returns Ok when ready() said
/// so, Timeout when `timeout` passed first. Does not allocate.
template <typename Ready>
Status wait_on(const std::uint32_t& futex_word, std::chrono::nanoseconds timeout, Ready&& ready,
               std::uint32_t* sleepers = nullptr, std::chrono::nanoseconds spin = kDefaultSpin) noexcept {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const auto deadline = base::deadline_after(start, timeout);  // (nanoseconds::max(): never, not the past)
  // Spinning first: a peer that answers within microseconds is seen without two context switches.
  while (clock::now() - start < spin) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return Status::Ok;
      cpu_relax();
    }
    if (clock::now() >= deadline) return ready() ? Status::Ok : Status::Timeout;
  }
  std::chrono::nanoseconds backoff = std::chrono::microseconds(50);
  constexpr std::chrono::nanoseconds kMaxBackoff = std::chrono::milliseconds(1);
  for (;;) {
    // Announce the sleep before the last look (sequentially consistent on both sides, with bump_and_wake):
    // either the waker sees us counted and wakes us, or we see its change here.
    if (sleepers != nullptr) proto::atomic(*sleepers).fetch_add(1, std::memory_order_seq_cst);
    const std::uint32_t seen = proto::atomic(const_cast<std::uint32_t&>(futex_word)).load(std::memory_order_seq_cst);
    const bool done = ready();
    const auto now = clock::now();
    if (!done && now < deadline) {
      futex_sleep(futex_word, seen, std::min<std::chrono::nanoseconds>(backoff, deadline - now));
    }
    if (sleepers != nullptr) proto::atomic(*sleepers).fetch_sub(1, std::memory_order_seq_cst);
    if (done) return Status::Ok;
    if (now >= deadline) return Status::Timeout;
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

}  // namespace gpuipc::core
