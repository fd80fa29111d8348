// The flags the workers of one measurement (and their parent) share: who is ready, how far each got, when the clock
// started, the parent's signals, and whether a worker failed. It lives in a SharedPage made before the forks, so it
// is plain atomics (no pointers). Every wait on it is bounded, and a wait gives up as soon as a peer has failed
// (spawn_synced marks that), so a worker never hangs on a dead peer.
#pragma once

#include <fmt/format.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <new>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpuipc/error.hpp"
#include "workers.hpp"

namespace gpuipc::bench {

/// Waits until `pred`, at most `timeout`, then throws Error(Timeout) naming `what`; gives up at once with
/// Error(PeerDied) when `failed` (a peer's failure flag) is set. Between tries it yields (`pause` zero: the waits of
/// a timed loop) or sleeps `pause`.
template <typename P>
void await(P&& pred, const char* what, std::chrono::milliseconds timeout = std::chrono::seconds(60),
           const std::atomic<std::uint64_t>* failed = nullptr,
           std::chrono::microseconds pause = std::chrono::microseconds(0)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (failed != nullptr && failed->load() != 0) {
      throw Error(ErrorCode::PeerDied, fmt::format("bench worker: the peer failed while we waited for {}", what),
                  "bench");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw Error(ErrorCode::Timeout, fmt::format("bench worker: timed out waiting for {}", what), "bench");
    }
    if (pause.count() == 0) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
    }
  }
}

struct Sync {
  std::atomic<std::uint64_t> a_ready{0}, b_ready{0};        ///< worker A's / B's step (1: ready; more: later steps)
  std::atomic<std::uint64_t> progress_a{0}, progress_b{0};  ///< iterations done
  std::atomic<std::int64_t> t0{0};                          ///< a start time both read (now_ns)
  std::atomic<std::uint64_t> killed{0}, done{0};            ///< the parent's signals: a peer was killed; all is over
  std::atomic<std::uint64_t> failed{0};                     ///< a worker threw (set by spawn_synced)
  std::atomic<std::int64_t> pid{0};                         ///< a process one worker names to the others
  std::array<std::byte, 64> handle_a{}, handle_b{};         ///< opaque bytes A / B hands its peer (an IPC handle)

  using Handle = std::array<std::byte, 64>;
  /// Copies `value` (trivially copyable: an IPC handle) into `slot`; the peer reads it with take() once a ready flag
  /// set after put() says so.
  template <typename T>
  static void put(Handle& slot, const T& value) noexcept {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(Handle));
    std::memcpy(slot.data(), &value, sizeof value);
  }
  template <typename T>
  static T take(const Handle& slot) noexcept {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(Handle));
    T value;
    std::memcpy(&value, slot.data(), sizeof value);
    return value;
  }

  /// await() that also gives up, with Error(PeerDied), once a worker sharing this Sync has failed.
  template <typename P>
  void await(P&& pred, const char* what, std::chrono::milliseconds timeout = std::chrono::seconds(60),
             std::chrono::microseconds pause = std::chrono::microseconds(0)) const;
};
static_assert(sizeof(Sync) <= 4096, "a Sync lives in one SharedPage");

template <typename P>
void Sync::await(P&& pred, const char* what, std::chrono::milliseconds timeout, std::chrono::microseconds pause) const {
  ::gpuipc::bench::await(std::forward<P>(pred), what, timeout, &failed, pause);
}

/// A SharedPage holding a fresh Sync: make it before forking the workers that share it.
class SyncPage {
 public:
  SyncPage() : m_sync(new (m_page.as<Sync>()) Sync{}) {}
  Sync* get() const noexcept { return m_sync; }

 private:
  SharedPage m_page;
  Sync* m_sync;
};

/// spawn_worker, except that a body that throws marks `sync` failed at once, so its peers stop waiting.
Worker spawn_synced(Sync* sync, std::function<nlohmann::json()> body, const Env& env = {});

}  // namespace gpuipc::bench
