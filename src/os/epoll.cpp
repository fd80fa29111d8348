#include "os/epoll.hpp"

#include <fmt/format.h>
#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>

#include "base/errors.hpp"
#include "os/process.hpp"

namespace gpuipc::os {

Epoll::Epoll() : m_fd(::epoll_create1(EPOLL_CLOEXEC)) {
  if (!m_fd) throw_system("epoll_create1", "epoll instance");
  m_fd = above_stdio(std::move(m_fd), "epoll instance");
}

void Epoll::add(int fd, std::uint32_t events, std::uint64_t key) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = key;
  if (::epoll_ctl(m_fd.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
    throw_system("epoll_ctl(EPOLL_CTL_ADD)", fmt::format("fd {} in epoll {}", fd, m_fd.get()));
  }
}

void Epoll::modify(int fd, std::uint32_t events, std::uint64_t key) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = key;
  if (::epoll_ctl(m_fd.get(), EPOLL_CTL_MOD, fd, &ev) != 0) {
    throw_system("epoll_ctl(EPOLL_CTL_MOD)", fmt::format("fd {} in epoll {}", fd, m_fd.get()));
  }
}

void Epoll::remove(int fd) noexcept {
  epoll_event ev{};  // non-null for kernels before 2.6.9
  ::epoll_ctl(m_fd.get(), EPOLL_CTL_DEL, fd, &ev);
}

int Epoll::wait(std::span<epoll_event> out, int timeout_ms) {
  if (out.empty()) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("epoll {}: epoll_wait needs room for one event", m_fd.get()),
                "epoll_wait", EINVAL);
  }
  const int max_events = static_cast<int>(std::min<std::size_t>(out.size(), INT_MAX));
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  int remaining = timeout_ms;
  for (;;) {
    const int n = ::epoll_wait(m_fd.get(), out.data(), max_events, remaining);
    if (n >= 0) return n;
    if (errno != EINTR) throw_system("epoll_wait", fmt::format("epoll {}", m_fd.get()));
    if (timeout_ms >= 0) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      remaining = static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
    }
  }
}

int Epoll::wait_spinning(std::span<epoll_event> out, int timeout_ms, std::int64_t spin_ns) {
  if (spin_ns <= 0 || timeout_ms == 0) return wait(out, timeout_ms);
  const std::int64_t start = monotonic_ns();
  const std::int64_t spin_end =
      start + (timeout_ms > 0 ? std::min<std::int64_t>(spin_ns, timeout_ms * 1'000'000LL) : spin_ns);
  do {
    if (const int n = wait(out, 0); n > 0) return n;
    ::sched_yield();
  } while (monotonic_ns() < spin_end);
  if (timeout_ms < 0) return wait(out, -1);
  const std::int64_t left_ms = timeout_ms - (monotonic_ns() - start) / 1'000'000;
  return wait(out, static_cast<int>(std::max<std::int64_t>(left_ms, 0)));
}

}  // namespace gpuipc::os
