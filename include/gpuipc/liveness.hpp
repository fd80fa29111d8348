// Liveness: who has a name open, and following them. The broker knows every process that holds a reference to a
// segment (semaphores, channels, pools and counting semaphores are segments too) and learns of a process's death at
// once, from its socket. gpuipc::holders lists them; gpuipc::Watcher follows joins, leaves, deaths and missed
// heartbeats through a pollable fd; gpuipc::heartbeat promises the next beat within a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuipc/error.hpp"

namespace gpuipc {

/// A holder's heartbeat as the broker sees it.
enum class HeartbeatState : std::uint8_t {
  None,   ///< it never promised one (or stopped)
  Alive,  ///< its last beat came within its deadline
  Hung,   ///< it missed its deadline
};

/// One process holding a name open.
struct Holder {
  std::uint32_t pid = 0;  ///< as the broker sees it (SO_PEERCRED; the broker's PID namespace)
  std::uint32_t uid = 0;
  std::uint32_t references = 0;  ///< open references it holds (0 in a Left or Died event)
  bool read_write = false;       ///< whether any of its references is read-write
  bool creator = false;          ///< its connection created the name
  /// Its roles, most specific first, joined by '+': "creator", then the member roles it joined ("signaller",
  /// "producer", "consumer", "holder" for pools and counting semaphores), else "read-write" or "read-only".
  std::string role;
  HeartbeatState heartbeat = HeartbeatState::None;
  std::chrono::milliseconds heartbeat_deadline{0};  ///< the deadline it promised (0: none)
};

/// Who has `name` open, by pid. One broker round trip. Throws Error(NotFound) when there is no such name or the
/// caller may not read it, and the broker connection's errors.
std::vector<Holder> holders(std::string_view name);

/// Promises the broker another heartbeat for `name` within `deadline` (1 ms to 1 hour; 0 stops beating). When
/// the deadline passes first, watchers see this process as hung until its next beat. This process must hold `name`
/// open. One broker round trip. Throws Error(InvalidArgument) when it does not hold it, or for the deadline.
void heartbeat(std::string_view name, std::chrono::milliseconds deadline);

/// What happened to a holder.
enum class LivenessEvent : std::uint8_t {
  Joined,  ///< it opened the name (its first reference)
  Left,    ///< it closed its last reference
  Died,    ///< its process went (exit or kill) while it held references
  Hung,    ///< it missed its heartbeat deadline
  Alive,   ///< it beat again after missing a deadline
  /// Not about a holder (`holder` is empty): this watcher fell behind, and the broker dropped events of the name
  /// rather than queue them without bound. Read holders(name) again for where things stand.
  Lost,
};

/// "joined", "left", "died", "hung", "alive", "lost".
std::string_view to_string(LivenessEvent event) noexcept;
/// "none", "alive", "hung".
std::string_view to_string(HeartbeatState state) noexcept;

struct WatchEvent {
  LivenessEvent event = LivenessEvent::Joined;
  std::string name;           ///< the name watched
  Holder holder;              ///< the process it is about, after the change
  std::uint64_t unix_ns = 0;  ///< when the broker saw it
};

/// Follows the holders of names through a connection of its own to the broker: readable on fd() when an event
/// is waiting. Move-only; closing it stops the events.
class Watcher {
 public:
  /// Watches `name` (read permission needed). Throws Error(NotFound), and the broker connection's errors.
  static Watcher watch(std::string_view name);

  Watcher() noexcept;
  Watcher(Watcher&&) noexcept;
  Watcher& operator=(Watcher&&) noexcept;
  Watcher(const Watcher&) = delete;
  Watcher& operator=(const Watcher&) = delete;
  ~Watcher();

  /// Also watches `name` on this connection (at most 64 names). Throws as watch().
  void add(std::string_view name);
  /// The next event, waiting up to `timeout` (negative: forever); nullopt when none came in time. Throws
  /// Error(PeerDied) when the broker went away (a restarted broker knows nothing of this watch: watch again).
  std::optional<WatchEvent> next(std::chrono::nanoseconds timeout);
  /// A file descriptor that polls readable (POLLIN) when next() has an event to return at once.
  int fd() const noexcept;
  explicit operator bool() const noexcept { return m_impl != nullptr; }

  struct Impl;

 private:
  explicit Watcher(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> m_impl;
};

}  // namespace gpuipc
