#include "core/stream_park.hpp"

#include <chrono>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace gpuipc::core {

namespace {

struct Parked {
  Segment first;
  Segment second;
  std::unique_ptr<StreamTouches> use;
};

/// Process-wide, never destroyed: at exit the parked segments stay mapped, as a stream may still run.
struct ParkedList {
  std::mutex mutex;
  std::vector<Parked> list;
};
ParkedList& parked() {
  static auto* p = new ParkedList;  // NOLINT: deliberately never destroyed (see above)
  return *p;
}

}  // namespace

void park(Segment& first, Segment& second, std::unique_ptr<StreamTouches>& use) noexcept {
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
      p.list.push_back(Parked{std::move(first), std::move(second), std::move(use)});  // (no allocation: reserved)
      return;
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!use->done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  // Still not done: a callback may still hold it as its data. A few bytes leaked beat a write into freed memory.
  if (!use->done()) (void)use.release();
}

void reap_parked() noexcept {
  std::vector<Parked> done;  // destroyed after the lock is let go
  auto& p = parked();
  const std::unique_lock lock(p.mutex);
  if (p.list.empty()) return;
  for (auto it = p.list.begin(); it != p.list.end();) {
    if (!it->use->done()) {
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

std::size_t parked_count() noexcept {
  auto& p = parked();
  const std::lock_guard lock(p.mutex);
  return p.list.size();
}

}  // namespace gpuipc::core
