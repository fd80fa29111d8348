// Owning file descriptors.
#pragma once

#include <utility>

namespace gpuipc::os {

/// Owns one file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : m_fd(fd) {}
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  UniqueFd(UniqueFd&& other) noexcept : m_fd(std::exchange(other.m_fd, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(std::exchange(other.m_fd, -1));
    return *this;
  }
  ~UniqueFd() { reset(); }

  int get() const noexcept { return m_fd; }
  bool valid() const noexcept { return m_fd >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  /// Gives up ownership without closing.
  [[nodiscard]] int release() noexcept { return std::exchange(m_fd, -1); }
  /// Closes the current fd (if any; close(2) errors, including EINTR, are ignored: the fd is gone on Linux) and
  /// takes `fd`.
  void reset(int fd = -1) noexcept;

 private:
  int m_fd = -1;
};

/// dup(2) with O_CLOEXEC. Throws Error(System) naming `what`.
UniqueFd dup_fd(int fd, const char* what = "fd");

/// Points `fd` at /dev/null (O_CLOEXEC), keeping its number, so that whatever it was is no longer held through it
/// and its owner's later close is harmless. Async-signal-safe (for fork handlers); does nothing if /dev/null cannot
/// be opened.
void replace_with_dev_null(int fd) noexcept;

/// Number of entries in /proc/self/fd (the directory's own fd excluded). For leak checks in tests and tools.
int count_open_fds();

}  // namespace gpuipc::os
