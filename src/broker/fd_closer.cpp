#include "broker/fd_closer.hpp"

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "base/log.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"

namespace gpuipc::broker {

struct FdCloser::State {
  std::mutex mutex;
  std::condition_variable work;      // the closer: fds queued, or stop
  std::condition_variable progress;  // the watchdog and the destructor: a close began or ended, or stop
  std::deque<os::UniqueFd> queue;
  int closing = -1;                  // the fd being closed now (its number; owned by the closer until it is closed)
  std::uint64_t closing_dev = 0;     // its filesystem's device, numbered as the kernel numbers FUSE connections
  std::int64_t closing_since_ns = 0;
  bool abort_tried = false;  // for the close in progress
  std::uint64_t aborted = 0;
  bool stop = false;
};

FdCloser::FdCloser() : m_state(std::make_shared<State>()) {
  // Without signals: the broker reads its stop signals from a signalfd, and a thread that took SIGTERM would end it
  // on the spot.
  os::start_thread_without_signals([state = m_state] {
    for (;;) {
      os::UniqueFd fd;
      {
        std::unique_lock lock(state->mutex);
        // (Timed waits: an untimed condition_variable::wait is a symbol of GCC 12's libstdc++, GLIBCXX_3.4.30,
        // newer than the wheel's manylinux_2_34 allows.)
        while (!state->stop && state->queue.empty()) state->work.wait_for(lock, std::chrono::hours(1));
        if (state->queue.empty()) break;
        fd = std::move(state->queue.front());
        state->queue.pop_front();
      }
      const std::uint64_t dev = os::filesystem_device(fd.get());
      {
        std::lock_guard lock(state->mutex);
        state->closing = fd.get();
        state->closing_dev = dev;
        state->closing_since_ns = os::monotonic_ns();
        state->abort_tried = false;
      }
      state->progress.notify_all();
      fd.reset();
      {
        std::lock_guard lock(state->mutex);
        state->closing = -1;
      }
      state->progress.notify_all();
    }
    state->progress.notify_all();
  });
  os::start_thread_without_signals([state = m_state] {
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
      const bool aborted = dev != 0 && os::abort_fuse_connection(dev);
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
  });
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
        m_state->queue.push_back(std::move(fd));
        any = true;
      } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory: closed here (by `fds`), as before
      }
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
