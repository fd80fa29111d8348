#include "core/stream_park.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "os/process.hpp"

namespace gpuipc::core {

namespace {

using namespace std::chrono_literals;

/// Process-wide, never destroyed: at exit the parked segments stay mapped, as a stream may still run, and a reaper
/// thread still returning from its last reap may touch the list.
struct ParkedList {
  std::mutex mutex;
  std::vector<std::unique_ptr<StreamTouches>> list;
  std::condition_variable wake;  // the reaper's sleep, cut short at exit
  std::condition_variable gone;  // the reaper returned (exit waits for it)
  bool reaper = false;           // a reaper thread of this process runs (a forked child's copy has none)
  bool exiting = false;          // exit(3) began: no reaper starts or reaps again
};
ParkedList& parked() {
  static auto* p = new ParkedList;  // NOLINT: deliberately never destroyed (see above)
  return *p;
}

/// The longest a parked record waits for the reaper's next look once its streams are done.
constexpr auto kLongestPause = 100ms;

/// Takes the records whose streams are done out of the list (destroyed by the caller, outside the lock: the last
/// handle of a mapping going sends the broker a Close).
void take_done(ParkedList& p, std::vector<std::unique_ptr<StreamTouches>>& done) noexcept {
  for (auto it = p.list.begin(); it != p.list.end();) {
    if (!(*it)->done()) {
      ++it;
      continue;
    }
    try {
      done.push_back(std::move(*it));
    } catch (const std::bad_alloc&) {
      return;  // left parked (moved from only on success): a later reap lets it go
    }
    it = p.list.erase(it);
  }
}

/// While records are parked: looks at them after 1 ms, then at doubling pauses up to kLongestPause, and lets go of
/// those whose streams are done, so that a process that opens and closes nothing more still gets its memory back.
void reap_while_parked() noexcept {
  auto& p = parked();
  auto pause = 1ms;
  std::unique_lock lock(p.mutex);
  while (!p.exiting && !p.list.empty()) {
    p.wake.wait_for(lock, pause);
    if (p.exiting) break;
    std::vector<std::unique_ptr<StreamTouches>> done;
    take_done(p, done);
    if (!done.empty()) {
      lock.unlock();
      done.clear();  // (exit waits for this: `reaper` is still set)
      lock.lock();
    }
    pause = std::min<std::chrono::milliseconds>(pause * 2, kLongestPause);
  }
  p.reaper = false;
  p.gone.notify_all();
}

/// exit(3): stops the reaper before static objects it may use (the broker connection, the CUDA driver) are
/// destroyed, waiting for a reap in progress to end (bounded: its streams are done, so it does not block).
void stop_reaper_at_exit() noexcept {
  auto& p = parked();
  std::unique_lock lock(p.mutex);
  p.exiting = true;
  p.wake.notify_all();
  p.gone.wait_for(lock, 5s, [&] { return !p.reaper; });
}

// fork(2) with the list's lock held by another thread (the reaper, every few milliseconds) would leave it taken
// for good in the child: fork waits for it, and the child, which has no reaper thread, starts its own.
void lock_for_fork() noexcept { parked().mutex.lock(); }
void unlock_after_fork() noexcept { parked().mutex.unlock(); }
void unlock_in_child() noexcept {
  parked().reaper = false;
  parked().mutex.unlock();
}

/// Starts the reaper thread unless one runs; called with the list's lock held, after a record was added.
void start_reaper(ParkedList& p) noexcept {
  if (p.reaper || p.exiting) return;
  try {
    os::start_thread_without_signals(reap_while_parked);
    p.reaper = true;
  } catch (const std::exception&) {  // (std::system_error, or bad_alloc for the std::function)
    // No thread: the records are let go at the process's later opens and closes (reap_parked), as before.
  }
}

void register_handlers_once() noexcept {
  static const bool registered = [] {
    os::at_fork(lock_for_fork, unlock_after_fork, unlock_in_child);
    (void)std::atexit(stop_reaper_at_exit);
    return true;
  }();
  (void)registered;
}

}  // namespace

void park(std::unique_ptr<StreamTouches> use) noexcept {
  register_handlers_once();
  auto& p = parked();
  {
    const std::lock_guard lock(p.mutex);
    bool room = true;
    try {
      p.list.reserve(p.list.size() + 1);
    } catch (const std::bad_alloc&) {
      room = false;
    }
    if (room) {
      p.list.push_back(std::move(use));  // (no allocation: reserved)
      start_reaper(p);
      return;
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!use->done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (!use->done()) (void)use.release();  // (see park's comment)
}

void reap_parked() noexcept {
  std::vector<std::unique_ptr<StreamTouches>> done;  // destroyed after the lock is let go
  auto& p = parked();
  const std::unique_lock lock(p.mutex);
  if (!p.list.empty()) take_done(p, done);
}

std::size_t parked_count() noexcept {
  auto& p = parked();
  const std::lock_guard lock(p.mutex);
  return p.list.size();
}

}  // namespace gpuipc::core
