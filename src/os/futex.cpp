#include "os/futex.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <ctime>

#include "base/errors.hpp"

namespace gpuipc::os {
namespace {

// The kernel compares and sleeps on the 32-bit word at the atomic's address: the atomic must be exactly that word.
static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "futex words must be lock-free atomics");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "atomic<uint32_t> must be a plain word");
static_assert(alignof(std::atomic<std::uint32_t>) >= alignof(std::uint32_t), "futex words must be 4-byte aligned");

std::uint32_t* word_address(const std::atomic<std::uint32_t>* word) {
  // NOLINTNEXTLINE(cppcoreguidelines-pro-type-const-cast): FUTEX_WAIT only reads; FUTEX_WAKE never touches it.
  return reinterpret_cast<std::uint32_t*>(const_cast<std::atomic<std::uint32_t>*>(word));
}

}  // namespace

FutexResult futex_wait(const std::atomic<std::uint32_t>* word, std::uint32_t expected,
                       std::optional<std::chrono::nanoseconds> timeout) {
  timespec ts{};
  timespec* ts_ptr = nullptr;
  if (timeout) {
    const auto ns = std::max(timeout->count(), std::chrono::nanoseconds::rep{0});
    ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(ns % 1'000'000'000);
    ts_ptr = &ts;
  }
  // Shared futex (no FUTEX_PRIVATE_FLAG): the word may live in memory mapped by several processes. The timeout of
  // FUTEX_WAIT is relative.
  const long rc = ::syscall(SYS_futex, word_address(word), FUTEX_WAIT, expected, ts_ptr, nullptr, 0);
  if (rc == 0) return FutexResult::Woken;
  const int err = errno;
  switch (err) {
    case EAGAIN:
      return FutexResult::ValueChanged;
    case ETIMEDOUT:
      return FutexResult::Timeout;
    case EINTR:
      return FutexResult::Interrupted;
    default:
      throw_system("futex(FUTEX_WAIT)", fmt::format("futex word at {}", static_cast<const void*>(word)), err);
  }
}

int futex_wake(const std::atomic<std::uint32_t>* word, int count) {
  const long rc = ::syscall(SYS_futex, word_address(word), FUTEX_WAKE, std::max(count, 0), nullptr, nullptr, 0);
  if (rc < 0) throw_system("futex(FUTEX_WAKE)", fmt::format("futex word at {}", static_cast<const void*>(word)));
  return static_cast<int>(rc);
}

}  // namespace gpuipc::os
