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

/// What the watches of one ExitWatch share: the pass open now (0: none) and how many polls they made.
struct ExitPasses {
  std::uint64_t current = 0;
  std::uint64_t looks = 0;
};

/// A process being waited for.
struct WatchedProcess {
  os::UniqueFd pidfd;
  pid_t pid = 0;
  std::uint64_t start = 0;  ///< os::process_start_ticks; 0: unknown
  // What exited() last saw: gone for good, or running during pass `running_in` of its ExitWatch's `passes`, in
  // which exited() asks the kernel no more.
  ExitPasses* passes = nullptr;
  mutable std::uint64_t running_in = 0;
  mutable bool gone = false;
};

/// A share of a watched process; empty: nothing to wait for.
using ProcessWatch = std::shared_ptr<const WatchedProcess>;

/// Whether the watched process has exited (true for an empty watch). Within an ExitWatch::Pass, a process seen
/// running is taken to run until the pass ends: one poll a process a pass, however many waits share it.
bool exited(const ProcessWatch& process) noexcept;

/// Hands out one shared watch per process. Watches may outlive it.
class ExitWatch {
  struct State;

 public:
  ExitWatch();

  /// A watch of process `pid`, if it still runs and started at `start` (0: any start), shared with every other
  /// watch of it, and charged to `uid` while any share is held. Empty when the process is gone, `pid` <= 0 (one
  /// this broker cannot see), no pidfd can be taken, or `uid` already has `allowed` processes watched (logged):
  /// then nothing waits for it. Never throws.
  ProcessWatch watch(pid_t pid, std::uint64_t start, uid_t uid, std::size_t allowed) noexcept;

  /// How many processes are watched for `uid` (each holds one of the broker's fds).
  std::size_t watched(uid_t uid) const noexcept;

  /// How many times exited() has asked the kernel about a process of this watch (for tests).
  std::uint64_t looks() const noexcept;

  /// One look at the processes waited for (a timer's pass): while it lasts, exited() polls each process once.
  class Pass {
   public:
    explicit Pass(ExitWatch& watch) noexcept;
    ~Pass();
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

   private:
    std::shared_ptr<State> m_state;
    bool m_outer = false;  ///< false: a pass was open already (nested), and stays open
  };

 private:
  std::shared_ptr<State> m_state;
};

}  // namespace gpuipc::broker
