// epoll, for the broker's event loop.
#pragma once

#include <sys/epoll.h>

#include <cstdint>
#include <span>

#include "os/fd.hpp"

namespace gpuipc::os {

/// An epoll instance (CLOEXEC). Move-only.
class Epoll {
 public:
  Epoll();
  /// Registers fd for `events` (EPOLLIN, ...) with `key` returned in epoll_event.data.u64. Throws Error.
  void add(int fd, std::uint32_t events, std::uint64_t key);
  void modify(int fd, std::uint32_t events, std::uint64_t key);
  /// Unregisters fd; ignores ENOENT/EBADF.
  void remove(int fd) noexcept;
  /// epoll_wait, retrying EINTR; returns the number of events written into `out` (0 on timeout).
  int wait(std::span<epoll_event> out, int timeout_ms);
  /// wait(), but first looks without sleeping for up to `spin_ns` (yielding the CPU between looks), then sleeps
  /// for what is left of `timeout_ms`. See spin_readable (os/socket.hpp) for why.
  int wait_spinning(std::span<epoll_event> out, int timeout_ms, std::int64_t spin_ns);
  int fd() const noexcept { return m_fd.get(); }

 private:
  UniqueFd m_fd;
};

}  // namespace gpuipc::os
