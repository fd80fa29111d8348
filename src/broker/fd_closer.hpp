// Closes the fds clients sent that the broker does not keep, on a thread of its own. Closing a file of a FUSE
// filesystem sends its daemon a FLUSH and waits for the answer, and no signal ends that wait (the kernel sends FLUSH
// as a forced request): a daemon that never answers held the broker's loop there for good, unkillable, and any local
// user who may mount FUSE (fusermount3, a user namespace) could send it one with any message, garbage included. Here
// only the closer's thread waits; the loop goes on serving. A close that has waited kStuckNs is ended by aborting
// that FUSE connection (/sys/fs/fuse/connections/N/abort, which only root may write: a shared broker runs as root),
// which fails the FLUSH: the broker's exit would wait for it too. Other closes can block as long (a TCP socket set
// to linger with unsent data, which arrives inside a unix socket a client sent, where the broker cannot unset
// SO_LINGER first): one that could not be ended leaves its thread to it, and another thread closes what follows,
// up to kMostStuck threads left so.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "os/fd.hpp"

namespace gpuipc::broker {

class FdCloser {
 public:
  /// A close that has waited this long is ended (FUSE abort), and said so in the log.
  static constexpr std::int64_t kStuckNs = 1'000'000'000;
  /// Threads left in closes that could not be ended, at most, before what follows waits for one of them.
  static constexpr unsigned kMostStuck = 16;

  FdCloser();
  /// Closes what is queued and stops the thread; a close that cannot be ended is left to it (logged).
  ~FdCloser();
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

  /// Takes every open fd of `fds` (leaving them closed, as far as the caller can tell) to close on the thread.
  void close_later(std::vector<os::UniqueFd>& fds) noexcept;
  /// Fds taken and not closed yet (tests).
  std::size_t pending() const noexcept;
  /// Closes that were ended by aborting their FUSE connection (tests).
  std::uint64_t aborted() const noexcept;

 private:
  struct State;  // shared with the threads, which may outlive this object (a close that cannot be ended)
  /// Starts a thread that closes what is queued until stop, or until its close was stuck and another took over.
  static void start_closer(const std::shared_ptr<State>& state);
  std::shared_ptr<State> m_state;
};

}  // namespace gpuipc::broker
