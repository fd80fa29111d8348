#include "os/fd.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>

#include "base/errors.hpp"
#include "os/process.hpp"

namespace gpuipc::os {

void UniqueFd::reset(int fd) noexcept {
  // Resetting to the fd already owned must not close it under the new owner.
  if (m_fd >= 0 && m_fd != fd) {
    // On Linux the fd is released even when close reports EINTR or EIO: retrying could close a reused number.
    ::close(m_fd);
  }
  m_fd = fd;
}

UniqueFd above_stdio(UniqueFd fd, const char* what) {
  if (fd.get() >= 3 || !fd) return fd;
  const int moved = ::fcntl(fd.get(), F_DUPFD_CLOEXEC, 3);
  if (moved < 0) throw_system("fcntl(F_DUPFD_CLOEXEC)", what);
  return UniqueFd(moved);
}

void replace_with_dev_null(int fd) noexcept {
  const int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
  if (null < 0) return;
  (void)::dup3(null, fd, O_CLOEXEC);
  (void)::close(null);
}

namespace {

// The fds of ParentOnlyFds, each plus one (0: a free slot), in blocks chained from g_first (zero-initialized before
// any constructor runs; the next block is allocated when every slot is taken, and never freed: readers hold
// pointers into it), and the gate that fork(2) waits at (pthread_atfork: the prepare handler takes it, the parent and
// child handlers give it back, as POSIX's rationale for pthread_atfork has it). Slots change only under the gate, so
// the child handler, which runs while the forking thread holds it, sees none half-changed. A plain pthread mutex: the
// child handler must be async-signal-safe (it only reads the chain, closes and dups).
struct SlotBlock {
  std::array<std::atomic<int>, 64> fds;
  std::atomic<SlotBlock*> next;
};
SlotBlock g_first;
pthread_mutex_t g_fork_gate = PTHREAD_MUTEX_INITIALIZER;

void hold_forks() noexcept { (void)::pthread_mutex_lock(&g_fork_gate); }
void release_forks() noexcept { (void)::pthread_mutex_unlock(&g_fork_gate); }
void forget_in_child() noexcept {
  for (SlotBlock* b = &g_first; b != nullptr; b = b->next.load()) {
    for (auto& slot : b->fds) {
      const int fd = slot.exchange(0) - 1;
      if (fd >= 0) replace_with_dev_null(fd);
    }
  }
  release_forks();
}

/// A free slot, holding `fd` + 1 now; a new block when every one is taken; nullptr when none can be allocated. Under
/// the gate.
std::atomic<int>* record(int fd) noexcept {
  for (SlotBlock* b = &g_first;; b = b->next.load()) {
    for (auto& slot : b->fds) {
      if (slot.load() == 0) {
        slot.store(fd + 1);
        return &slot;
      }
    }
    if (b->next.load() == nullptr) {
      auto* added = new (std::nothrow) SlotBlock();  // NOLINT(cppcoreguidelines-owning-memory): never freed, above
      if (added == nullptr) return nullptr;
      b->next.store(added);
    }
  }
}

/// Holds off fork(2) in the process's other threads for its scope. Registers the fork handlers on first use.
/// Signals are blocked in this thread meanwhile (from before the registration, which takes glibc's atfork lock): a
/// handler that forked here would wait for the gate, or that lock, held by its own thread.
class ForkGate {
 public:
  ForkGate() noexcept {
    static std::once_flag registered;
    std::call_once(registered, [] { at_fork(hold_forks, release_forks, forget_in_child); });
    hold_forks();
  }
  ~ForkGate() { release_forks(); }
  ForkGate(const ForkGate&) = delete;
  ForkGate& operator=(const ForkGate&) = delete;

 private:
  const SignalsBlocked m_blocked;  // first: blocked before the registration and the gate, restored after both
};

}  // namespace

ParentOnlyFd::ParentOnlyFd(const std::function<UniqueFd()>& make) {
  const ForkGate gate;
  UniqueFd fd = make();
  if (!fd) return;
  m_slot = record(fd.get());
  m_fd = fd.release();
}

void ParentOnlyFd::reset() noexcept {
  if (m_fd < 0) return;
  const ForkGate gate;
  if (m_slot != nullptr) {
    // Only if it still holds this fd: in a forked child the handler has cleared it, and the child's own
    // ParentOnlyFds may have taken the slot since (this fd, still open, cannot be theirs).
    int expected = m_fd + 1;
    (void)m_slot->compare_exchange_strong(expected, 0);
  }
  ::close(m_fd);
  m_fd = -1;
  m_slot = nullptr;
}

UniqueFd dup_fd(int fd, const char* what) {
  const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 3);  // (above the standard streams: see above_stdio)
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
