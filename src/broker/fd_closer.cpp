#include "broker/fd_closer.hpp"

#include <fmt/format.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <list>
#include <mutex>
#include <string>
#include <thread>

#include "base/log.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"

namespace gpuipc::broker {

namespace {

/// A close in progress, on one closer thread.
struct Closing {
  int fd = -1;            // its number (owned by the thread until it is closed)
  std::uint64_t dev = 0;  // its filesystem's device, numbered as the kernel numbers FUSE connections
  std::int64_t since_ns = 0;
  bool abort_tried = false;
  bool replaced = false;  // another thread took over the queue: this one ends once its close returns
  bool reported = false;  // said to be stuck while kMostStuck others were
};

}  // namespace

struct FdCloser::State {
  std::mutex mutex;
  std::condition_variable work;      // the closers: fds queued, or stop
  std::condition_variable progress;  // the watchdog and the destructor: a close began or ended, or stop
  std::deque<os::UniqueFd> queue;
  std::list<Closing> closing;  // one per thread in a close
  unsigned replaced = 0;       // threads replaced while their close went on (at most kMostStuck at once)
  std::uint64_t aborted = 0;
  bool stop = false;
};

void FdCloser::start_closer(const std::shared_ptr<State>& shared) {
  // Without signals: the broker reads its stop signals from a signalfd, and a thread that took SIGTERM would end it
  // on the spot.
  os::start_thread_without_signals([state = shared] {
    for (;;) {
      os::UniqueFd fd;
      std::list<Closing>::iterator mine;
      {
        std::unique_lock lock(state->mutex);
        // (Timed waits: an untimed condition_variable::wait is a symbol of GCC 12's libstdc++, GLIBCXX_3.4.30,
        // newer than the wheel's manylinux_2_34 allows.)
        while (!state->stop && state->queue.empty()) state->work.wait_for(lock, std::chrono::hours(1));
        if (state->queue.empty()) break;
        fd = std::move(state->queue.front());
        state->queue.pop_front();
        mine = state->closing.insert(state->closing.end(), Closing{fd.get(), 0, os::monotonic_ns()});
      }
      const std::uint64_t dev = os::filesystem_device(fd.get());
      os::close_without_lingering(fd.get());  // a TCP socket set to linger would wait for its peer
      {
        std::lock_guard lock(state->mutex);
        mine->dev = dev;
      }
      state->progress.notify_all();
      fd.reset();
      bool replaced = false;
      {
        std::lock_guard lock(state->mutex);
        replaced = mine->replaced;
        if (replaced) --state->replaced;
        state->closing.erase(mine);
      }
      state->progress.notify_all();
      if (replaced) return;  // another thread serves the queue now
    }
    state->progress.notify_all();
  });
}

FdCloser::FdCloser() : m_state(std::make_shared<State>()) {
  start_closer(m_state);
  os::start_thread_without_signals([state = m_state] {
    std::unique_lock lock(state->mutex);
    while (!state->stop || !state->closing.empty()) {
      if (state->closing.empty()) {
        while (!state->stop && state->closing.empty()) state->progress.wait_for(lock, std::chrono::hours(1));
        continue;
      }
      state->progress.wait_for(lock, std::chrono::milliseconds(250));
      for (auto& c : state->closing) {
        if (c.replaced || os::monotonic_ns() - c.since_ns < FdCloser::kStuckNs) continue;
        if (c.reported && state->replaced >= FdCloser::kMostStuck) continue;
        if (!c.abort_tried) {
          c.abort_tried = true;
          const std::uint64_t dev = c.dev;
          lock.unlock();
          const bool aborted = dev != 0 && os::abort_fuse_connection(dev);
          lock.lock();
          if (aborted) {
            ++state->aborted;
            GPUIPC_LOG_WARN(
                "closing an fd a client sent has waited over a second (a FUSE file whose daemon does not answer): "
                "aborted that FUSE connection ({})",
                dev);
          }
          // `c` may be gone (its close returned while the lock was let go): the next look replaces its thread if
          // the close still waits, an aborted one having had the time to return.
          break;
        }
        // Not a FUSE file, or the abort did not end it (aborting needs root): the queue goes on on a new thread,
        // with at most kMostStuck threads left waiting at once; past that the queue waits for one of them.
        if (state->replaced >= FdCloser::kMostStuck) {
          if (!c.reported) {
            GPUIPC_LOG_ERROR(
                "closing an fd a client sent has waited over a second (a file of device {}:{}) and {} "
                "such closes are waiting already: what clients send is closed once one of them returns",
                c.dev >> 20, c.dev & 0xFFFFF, state->replaced);
          }
          c.reported = true;
          break;
        }
        c.replaced = true;
        ++state->replaced;
        GPUIPC_LOG_ERROR(
            "closing an fd a client sent has waited over a second (a file of device {}:{}, a FUSE file "
            "whose daemon does not answer?) and cannot be ended from here: another thread closes what "
            "follows; the broker's exit will wait for that close",
            c.dev >> 20, c.dev & 0xFFFFF);
        try {
          start_closer(state);
        } catch (const std::exception& e) {  // this thread serves the queue again once its close returns
          c.replaced = false;
          --state->replaced;
          GPUIPC_LOG_ERROR("cannot start another closer thread: {}", e.what());
        }
        break;  // (the list may have changed meanwhile)
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
  const bool done = m_state->progress.wait_for(lock, std::chrono::seconds(3),
                                               [&] { return m_state->queue.empty() && m_state->closing.empty(); });
  if (!done) {
    GPUIPC_LOG_ERROR("{} fds sent by clients are still being closed; leaving them",
                     m_state->queue.size() + m_state->closing.size());
  }
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
  return m_state->queue.size() + m_state->closing.size();
}

std::uint64_t FdCloser::aborted() const noexcept {
  std::lock_guard lock(m_state->mutex);
  return m_state->aborted;
}

}  // namespace gpuipc::broker
