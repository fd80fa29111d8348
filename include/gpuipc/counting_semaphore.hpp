// gpuipc::CountingSemaphore: a named set of permits that processes acquire and release, like a POSIX named
// semaphore, except that the permits a process holds come back when it dies (SIGKILL included) or closes its
// handle: the broker counts them per member and gives them back. Acquire and release are a few atomic operations
// on a shared page (no broker round trip); waiters sleep on a futex, in the order they started waiting.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"

namespace gpuipc {

/// Most permits a counting semaphore has (2^31 - 1).
inline constexpr std::uint32_t kCountingSemaphoreMaxCount = 0x7FFFFFFF;

struct CountingSemaphoreOptions {
  /// Permits available at creation. The creator holds the other max_count - initial (it releases them when their
  /// resource is ready; if it dies first they come back like any other held permits).
  std::uint32_t initial = 1;
  std::uint32_t max_count = 1;  ///< permits in all: available plus held; 1 to kCountingSemaphoreMaxCount
  unsigned mode = 0600;         ///< r: may read its counts (stat); w: may acquire and release
};

struct CountingSemaphoreOpenOptions {
  std::chrono::milliseconds wait{0};  ///< wait this long for the semaphore to be created
};

/// What CountingSemaphore::stat reads from a semaphore's page (for monitoring: `gpuipc ls`, `stat`, `top`).
struct CountingSemaphoreStats {
  std::uint32_t available = 0;  ///< permits nobody holds
  std::uint32_t max_count = 0;  ///< permits in all
  std::uint32_t held = 0;       ///< permits members hold (available + held == max_count once the creator joined)
  std::uint32_t holders = 0;    ///< handles open on it (members)
  std::uint32_t waiting = 0;    ///< handles waiting in acquire
};

class CountingSemaphore {
 public:
  /// Creates counting semaphore `name` (a host segment of one block; no GPU needed) and joins it. Throws Error:
  /// AlreadyExists, InvalidArgument (name; max_count 0 or above kCountingSemaphoreMaxCount; initial > max_count),
  /// QuotaExceeded, and the broker connection's errors.
  static CountingSemaphore create(std::string_view name, const CountingSemaphoreOptions& options = {});
  /// Opens counting semaphore `name` and joins it (one broker round trip; read and write permission needed).
  /// Throws Error like Segment::open; InvalidArgument when `name` is not a counting semaphore of this version;
  /// QuotaExceeded when it already has 64 members.
  static CountingSemaphore open(std::string_view name, const CountingSemaphoreOpenOptions& options = {});
  /// Removes the name (like Segment::unlink): open handles keep working.
  static void unlink(std::string_view name);
  /// Reads counting semaphore `name` without joining it (read permission). Throws Error like Segment::open,
  /// InvalidArgument when it is not a counting semaphore of this version.
  static CountingSemaphoreStats stat(std::string_view name);

  CountingSemaphore() noexcept;
  CountingSemaphore(CountingSemaphore&&) noexcept;
  CountingSemaphore& operator=(CountingSemaphore&&) noexcept;
  CountingSemaphore(const CountingSemaphore&) = delete;
  CountingSemaphore& operator=(const CountingSemaphore&) = delete;
  /// Leaves: every permit this handle still holds is released (waking waiters), as when the process dies. In a
  /// forked child, a copy of its parent's handle releases nothing.
  ~CountingSemaphore();

  /// Takes `n` permits, waiting up to `timeout` (negative: forever) for them. Waiters are served in the order they
  /// started waiting, and an acquire that finds anyone waiting queues behind them (no overtaking). Returns Ok, Timeout,
  /// or WouldBlock for a zero timeout with too few permits free. n == 0 returns Ok. Throws Error(InvalidArgument) for
  /// n above max_count (it could never succeed) or an empty handle, Error(InvalidState) in a forked child for its
  /// parent's handle (the permits it counts are the parent's: open the semaphore again). Uncontended: no system call,
  /// no allocation. Thread-safe; threads of one handle wait one at a time.
  Status acquire(std::uint32_t n, std::chrono::nanoseconds timeout);
  /// acquire, calling `interrupted(context)` about every 50 ms while it sleeps: when that returns true it leaves
  /// the queue and returns Interrupted (how the Python module lets Ctrl-C through without losing its place).
  Status acquire(std::uint32_t n, std::chrono::nanoseconds timeout, bool (*interrupted)(void*), void* context);
  /// acquire(n, 0): Ok or WouldBlock.
  Status try_acquire(std::uint32_t n = 1);
  /// Gives back `n` permits this handle holds and wakes waiters (a system call only when someone sleeps).
  /// Throws Error(InvalidArgument) when this handle holds fewer than `n` (the message says how many it holds),
  /// Error(InvalidState) like acquire.
  void release(std::uint32_t n = 1);

  /// Permits this handle holds (0 in a forked child for its parent's handle).
  std::uint32_t held() const noexcept;
  /// Permits available now (a snapshot).
  std::uint32_t available() const noexcept;
  /// Handles waiting in acquire now, this one included (a snapshot).
  std::uint32_t waiting() const noexcept;
  std::uint32_t max_count() const noexcept;
  const std::string& name() const noexcept;
  explicit operator bool() const noexcept { return m_impl != nullptr; }

  struct Impl;

 private:
  explicit CountingSemaphore(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> m_impl;
};

}  // namespace gpuipc
