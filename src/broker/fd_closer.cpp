#include "broker/fd_closer.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "base/log.hpp"
#include "os/process.hpp"

namespace gpuipc::broker {

struct FdCloser::State {
  std::mutex mutex;
  std::condition_variable work;      // the closer: fds queued, or stop
  std::condition_variable progress;  // the watchdog and the destructor: a close began or ended, or stop
  std::deque<int> queue;             // owned fds
  int closing = -1;                  // the fd being closed now (owned until its close returns)
  std::uint64_t closing_dev = 0;     // its filesystem's device, numbered as the kernel numbers FUSE connections
  std::int64_t closing_since_ns = 0;
  bool abort_tried = false;  // for the close in progress
  std::uint64_t aborted = 0;
  bool stop = false;
};

namespace {

/// The device of `fd`'s filesystem as the kernel numbers it (MKDEV: major << 20 | minor), the name of a FUSE
/// connection's folder under /sys/fs/fuse/connections. From the inode as the kernel has it (AT_STATX_DONT_SYNC):
/// fstat would ask a FUSE daemon. 0 when unknown.
std::uint64_t kernel_dev(int fd) noexcept {
  struct statx sx {};
  if (::statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, STATX_TYPE, &sx) != 0) return 0;
  return (static_cast<std::uint64_t>(sx.stx_dev_major) << 20) | sx.stx_dev_minor;
}

/// Aborts FUSE connection `dev`: its pending requests fail, the FLUSH our close waits for included. False when
/// there is no such connection or this process may not (not root).
bool abort_fuse_connection(std::uint64_t dev) noexcept {
  const std::string path = fmt::format("/sys/fs/fuse/connections/{}/abort", dev);
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "1", 1) == 1;
  ::close(fd);
  return ok;
}

}  // namespace

FdCloser::FdCloser() : m_state(std::make_shared<State>()) {
  std::shared_ptr<State> state = m_state;
  // The threads take no signal: the broker reads its stop signals from a signalfd, and a thread that took SIGTERM
  // would end the broker on the spot. (They inherit the mask they are made with, whatever the broker blocks later.)
  sigset_t all;
  sigset_t before;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &before);
  struct Restore {
    sigset_t& mask;
    ~Restore() { pthread_sigmask(SIG_SETMASK, &mask, nullptr); }
  } restore{before};
  std::thread([state] {
    for (;;) {
      int fd = -1;
      {
        std::unique_lock lock(state->mutex);
        // (Timed waits: an untimed condition_variable::wait is a symbol of GCC 12's libstdc++, GLIBCXX_3.4.30,
        // newer than the wheel's manylinux_2_34 allows.)
        while (!state->stop && state->queue.empty()) state->work.wait_for(lock, std::chrono::hours(1));
        if (state->queue.empty()) break;
        fd = state->queue.front();
        state->queue.pop_front();
      }
      const std::uint64_t dev = kernel_dev(fd);
      {
        std::lock_guard lock(state->mutex);
        state->closing = fd;
        state->closing_dev = dev;
        state->closing_since_ns = os::monotonic_ns();
        state->abort_tried = false;
      }
      state->progress.notify_all();
      ::close(fd);
      {
        std::lock_guard lock(state->mutex);
        state->closing = -1;
      }
      state->progress.notify_all();
    }
    state->progress.notify_all();
  }).detach();
  std::thread([state] {
    std::unique_lock lock(state->mutex);
    while (!state->stop || state->closing >= 0) {
      if (state->closing < 0) {
        while (!state->stop && state->closing < 0) state->progress.wait_for(lock, std::chrono::hours(1));
        continue;
      }
      state->progress.wait_for(lock, std::chrono::milliseconds(250));
      if (state->closing < 0 || state->abort_tried ||
          os::monotonic_ns() - state->closing_since_ns < FdCloser::kStuckNs) {
        continue;
      }
      state->abort_tried = true;
      const std::uint64_t dev = state->closing_dev;
      lock.unlock();
      const bool aborted = dev != 0 && abort_fuse_connection(dev);
      lock.lock();
      if (aborted) {
        ++state->aborted;
        GPUIPC_LOG_WARN(
            "closing an fd a client sent has waited over a second (a FUSE file whose daemon does not answer): "
            "aborted that FUSE connection ({})",
            dev);
      } else {
        GPUIPC_LOG_ERROR(
            "closing an fd a client sent has waited over a second (a file of device {}:{}, a FUSE file whose daemon "
            "does not answer?) and cannot be ended from here (aborting a FUSE connection needs root): the broker "
            "serves on, but its exit will wait for that close",
            dev >> 20, dev & 0xFFFFF);
      }
    }
  }).detach();
}

FdCloser::~FdCloser() {
  std::unique_lock lock(m_state->mutex);
  m_state->stop = true;
  m_state->work.notify_all();
  m_state->progress.notify_all();
  // Up to a few seconds for what is queued (a stuck close is aborted after kStuckNs); past that the threads are left
  // to it, holding their own reference to the state.
  const bool done = m_state->progress.wait_for(lock, std::chrono::seconds(3), [&] {
    return m_state->queue.empty() && m_state->closing < 0;
  });
  if (!done) GPUIPC_LOG_ERROR("{} fds sent by clients are still being closed; leaving them", m_state->queue.size() + 1);
}

void FdCloser::close_later(std::vector<os::UniqueFd>& fds) noexcept {
  bool any = false;
  {
    std::lock_guard lock(m_state->mutex);
    for (auto& fd : fds) {
      if (!fd) continue;
      try {
        m_state->queue.push_back(fd.get());
      } catch (...) {
        continue;  // out of memory: closed here, as before
      }
      (void)fd.release();
      any = true;
    }
  }
  fds.clear();
  if (any) m_state->work.notify_one();
}

std::size_t FdCloser::pending() const noexcept {
  std::lock_guard lock(m_state->mutex);
  return m_state->queue.size() + (m_state->closing >= 0 ? 1 : 0);
}

std::uint64_t FdCloser::aborted() const noexcept {
  std::lock_guard lock(m_state->mutex);
  return m_state->aborted;
}

}  // namespace gpuipc::broker
