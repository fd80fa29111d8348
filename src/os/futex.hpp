// Futex wait and wake on a 32-bit word in memory shared between processes (no FUTEX_PRIVATE_FLAG).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

namespace gpuipc::os {

enum class FutexResult {
  Woken,         ///< a wake arrived (or a spurious wake-up: callers re-check their condition)
  ValueChanged,  ///< *word != expected when called (EAGAIN)
  Timeout,       ///< the timeout passed
  Interrupted,   ///< a signal handler ran (EINTR): the caller decides whether to retry
};

/// Sleeps while *word == expected, at most `timeout` (nullopt: no limit). Throws Error(System) on EFAULT/EINVAL.
FutexResult futex_wait(const std::atomic<std::uint32_t>* word, std::uint32_t expected,
                       std::optional<std::chrono::nanoseconds> timeout);

/// Wakes up to `count` waiters on word; returns how many were woken.
int futex_wake(const std::atomic<std::uint32_t>* word, int count = INT32_MAX);

}  // namespace gpuipc::os
