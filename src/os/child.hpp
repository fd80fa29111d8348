// Work in a forked child that reports one string back. How gpuipc's tools keep the parent free of CUDA: a process
// that has initialised CUDA cannot give CUDA to children it forks later, so probes and workers run in children.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "os/fd.hpp"

namespace gpuipc::os {

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
