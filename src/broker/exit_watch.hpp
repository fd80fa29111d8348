// The processes the broker waits for the exit of: a dead member's before its repair or its owed stream writes are
// made (a killed process's GPU work runs on until its exit), a member's that left owing stream work. One pidfd per
// process, shared by every wait for it, and charged to its uid: each wait used to take a pidfd of its own, so a
// process that joined a channel and closed its connection in a loop, owing a write each time, made the broker hold
// a pidfd a round until its fds ran out for every user.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "os/fd.hpp"

namespace gpuipc::broker {

/// A process being waited for.
struct WatchedProcess {
  os::UniqueFd pidfd;
  pid_t pid = 0;
  std::uint64_t start = 0;  ///< os::process_start_ticks; 0: unknown
};

/// A share of a watched process; empty: nothing to wait for.
using ProcessWatch = std::shared_ptr<const WatchedProcess>;

/// Whether the watched process has exited (true for an empty watch).
bool exited(const ProcessWatch& process) noexcept;

/// Hands out one shared watch per process. Watches may outlive it.
class ExitWatch {
 public:
  ExitWatch();

  /// A watch of process `pid`, if it still runs and started at `start` (0: any start), shared with every other
  /// watch of it, and charged to `uid` while any share is held. Empty when the process is gone, `pid` <= 0 (one
  /// this broker cannot see), no pidfd can be taken, or `uid` already has `allowed` processes watched (logged):
  /// then nothing waits for it. Never throws.
  ProcessWatch watch(pid_t pid, std::uint64_t start, uid_t uid, std::size_t allowed) noexcept;

  /// How many processes are watched for `uid` (each holds one of the broker's fds).
  std::size_t watched(uid_t uid) const noexcept;

 private:
  struct State;
  std::shared_ptr<State> m_state;
};

}  // namespace gpuipc::broker
