#include "os/fd.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <memory>

#include "base/errors.hpp"

namespace gpuipc::os {

void UniqueFd::reset(int fd) noexcept {
  // Resetting to the fd already owned must not close it under the new owner.
  if (m_fd >= 0 && m_fd != fd) {
    // On Linux the fd is released even when close reports EINTR or EIO: retrying could close a reused number.
    ::close(m_fd);
  }
  m_fd = fd;
}

void replace_with_dev_null(int fd) noexcept {
  const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null < 0) return;
  (void)::dup3(null, fd, O_CLOEXEC);
  (void)::close(null);
}

UniqueFd dup_fd(int fd, const char* what) {
  const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) throw_system("fcntl(F_DUPFD_CLOEXEC)", what ? what : "fd");
  return UniqueFd(copy);
}

int count_open_fds() {
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir("/proc/self/fd"), ::closedir);
  if (!dir) throw_system("opendir", "/proc/self/fd");
  const int own = ::dirfd(dir.get());
  int count = 0;
  errno = 0;
  // NOLINTNEXTLINE(concurrency-mt-unsafe): readdir is thread-safe on a DIR that no other thread uses.
  while (const dirent* entry = ::readdir(dir.get())) {
    if (entry->d_name[0] == '.') continue;  // "." and ".."
    if (std::strtol(entry->d_name, nullptr, 10) == own) continue;
    ++count;
  }
  if (errno != 0) throw_system("readdir", "/proc/self/fd");
  return count;
}

}  // namespace gpuipc::os
