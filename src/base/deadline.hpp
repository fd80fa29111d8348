// Deadlines from user timeouts, saturated: `now + timeout` overflows for a timeout near its type's maximum (what
// callers pass as "wait for ever", e.g. std::chrono::nanoseconds::max()) and lands in the past, so the wait would
// time out at once.
#pragma once

#include <chrono>

namespace gpuipc::base {

/// `now + timeout`, or time_point::max() ("never") for a negative timeout or one past what the clock can hold.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::steady_clock::time_point now,
                                                            std::chrono::nanoseconds timeout) noexcept {
  using time_point = std::chrono::steady_clock::time_point;
  if (timeout.count() < 0 || timeout >= time_point::max() - now) return time_point::max();
  return now + timeout;
}

}  // namespace gpuipc::base
