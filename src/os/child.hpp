// Forked children: one that runs a body and leaves with its exit code, one that reports one string back, and the
// bounded wait that reaps either. How gpuipc's tools keep the parent free of CUDA: a process that has initialised CUDA
// cannot give CUDA to children it forks later, so probes and workers run in children. The benchmark harness
// (bench/harness/workers.hpp) and the tests' helpers (tests/support/support.hpp) fork through here.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "os/fd.hpp"

namespace gpuipc::os {

/// Forks (after flushing stdio, so buffered output is not written twice); the child runs `body` and leaves with
/// _exit(what it returns), or with _exit(`threw_code`) after writing the exception to stderr when `body` throws. It
/// never returns into the caller's code. Throws Error(System) when fork fails.
pid_t fork_child(const std::function<int()>& body, int threw_code);

/// How a child ended.
struct ChildExit {
  bool finished = false;  ///< it ended within the timeout (else it was SIGKILLed)
  int wait_status = 0;    ///< as from waitpid
};

/// Waits at most `timeout` for child `pid` to end and reaps it; when the time runs out it SIGKILLs and reaps it.
/// Throws Error(System) when waitpid fails (not our child).
ChildExit wait_child(pid_t pid, std::chrono::milliseconds timeout);

/// The exit code of a wait status: the exit status, 128 + the signal that ended it, or -1.
int exit_code(int wait_status) noexcept;

/// In a forked child: asks to be SIGKILLed when `parent` (the forking process, its pid taken before the fork) ends.
/// False when it has already ended: the child should leave at once.
bool tie_to_parent(pid_t parent) noexcept;

/// A running child and the read end of its report pipe.
struct ReportingChild {
  pid_t pid = -1;
  UniqueFd report;
};

/// What came back.
struct ChildReport {
  bool finished = false;  ///< exited within the timeout (else it was SIGKILLed)
  int wait_status = 0;    ///< as from waitpid
  std::string text;       ///< everything the body returned (empty if it died first)
};

/// Forks; the child sets `env`, runs `body`, writes what it returns to the report pipe and leaves with _exit(0)
/// (_exit(1) after writing "error: <what>" when `body` throws). Throws Error(System) when fork fails.
ReportingChild fork_reporting(const std::function<std::string()>& body,
                              const std::vector<std::pair<std::string, std::string>>& env = {});

/// Reads the child's report and reaps it, waiting at most `timeout` (then SIGKILL). Never throws.
ChildReport join_reporting(ReportingChild& child, std::chrono::milliseconds timeout);

}  // namespace gpuipc::os
