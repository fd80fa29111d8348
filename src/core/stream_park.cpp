#include "core/stream_park.hpp"

#include <chrono>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

namespace gpuipc::core {

namespace {

/// Process-wide, never destroyed: at exit the parked segments stay mapped, as a stream may still run.
struct ParkedList {
  std::mutex mutex;
  std::vector<std::unique_ptr<StreamTouches>> list;
};
ParkedList& parked() {
  static auto* p = new ParkedList;  // NOLINT: deliberately never destroyed (see above)
  return *p;
}

}  // namespace

void park(std::unique_ptr<StreamTouches> use) noexcept {
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
  if (p.list.empty()) return;
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

std::size_t parked_count() noexcept {
  auto& p = parked();
  const std::lock_guard lock(p.mutex);
  return p.list.size();
}

}  // namespace gpuipc::core
