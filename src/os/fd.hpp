// Owning file descriptors.
#pragma once

#include <atomic>
#include <functional>
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

/// dup(2) with O_CLOEXEC, at a number >= 3 (see above_stdio). Throws Error(System) naming `what`.
UniqueFd dup_fd(int fd, const char* what = "fd");

/// `fd` moved to a number >= 3 (F_DUPFD_CLOEXEC) when it is 0, 1 or 2, else as it is. An fd a process keeps (a
/// broker connection, a segment's memfd, a fd received from the broker) must not take the number of a standard
/// stream the process closed: a write meant for that stream (a CLI's output, a printf) would go into it. (A broker
/// connection given fd 1 carried `gpuipc ls --json >&-`'s output to the broker, which dropped the connection.) And
/// a spawned child's dup2 onto 0..2 must never meet a source that is already one of them. Throws Error(System)
/// naming `what` when it cannot be moved (EMFILE).
UniqueFd above_stdio(UniqueFd fd, const char* what);

/// Points `fd` at /dev/null (O_CLOEXEC), keeping its number, so that whatever it was is no longer held through it
/// and its owner's later close is harmless. Async-signal-safe (for fork handlers); does nothing if /dev/null cannot
/// be opened.
void replace_with_dev_null(int fd) noexcept;

/// Owns an fd that a child forked from this process without exec does not keep: in the child it becomes /dev/null
/// (replace_with_dev_null, from a pthread_atfork child handler), so that a connection's peer sees this process go
/// when it exits, whatever children it forked. Making the fd and recording it, and forgetting it and closing it,
/// each hold off fork(2) in the process's other threads: no child sees the fd half-way. Move-only. Any number can be
/// recorded (the record grows by 64 slots at a time, a few hundred bytes, kept for the process's life); only when
/// that allocation fails is an fd not recorded (a child keeps it, as with a UniqueFd).
class ParentOnlyFd {
 public:
  ParentOnlyFd() noexcept = default;
  /// Runs `make`, with fork(2) held off in other threads, and records the fd it returns. `make` must not fork;
  /// what it throws propagates (nothing is recorded).
  explicit ParentOnlyFd(const std::function<UniqueFd()>& make);
  ParentOnlyFd(const ParentOnlyFd&) = delete;
  ParentOnlyFd& operator=(const ParentOnlyFd&) = delete;
  ParentOnlyFd(ParentOnlyFd&& other) noexcept
      : m_fd(std::exchange(other.m_fd, -1)), m_slot(std::exchange(other.m_slot, nullptr)) {}
  ParentOnlyFd& operator=(ParentOnlyFd&& other) noexcept {
    if (this != &other) {
      reset();
      m_fd = std::exchange(other.m_fd, -1);
      m_slot = std::exchange(other.m_slot, nullptr);
    }
    return *this;
  }
  ~ParentOnlyFd() { reset(); }

  int get() const noexcept { return m_fd; }
  bool valid() const noexcept { return m_fd >= 0; }
  explicit operator bool() const noexcept { return valid(); }
  /// Whether a forked child gets /dev/null in its place (false only when the record could not grow).
  bool recorded() const noexcept { return m_slot != nullptr; }
  /// Forgets the record and closes the fd, with fork(2) held off in other threads.
  void reset() noexcept;

 private:
  int m_fd = -1;
  std::atomic<int>* m_slot = nullptr;  ///< its slot in the record (src/os/fd.cpp)
};

/// Number of entries in /proc/self/fd (the directory's own fd excluded). For leak checks in tests and tools.
int count_open_fds();

}  // namespace gpuipc::os
