// A private MPS control daemon for benchmark suites: its own pipe and log directories under /tmp, so it neither
// sees nor disturbs another MPS on the machine. Workers started with env() run under it.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace gpuipc::bench {

/// Starts `nvidia-cuda-mps-control -d` with private directories; stops it (quit) on destruction.
class MpsDaemon {
 public:
  MpsDaemon();
  ~MpsDaemon();
  MpsDaemon(const MpsDaemon&) = delete;
  MpsDaemon& operator=(const MpsDaemon&) = delete;
  MpsDaemon(MpsDaemon&&) = delete;
  MpsDaemon& operator=(MpsDaemon&&) = delete;
  bool started() const noexcept { return m_started; }
  /// The environment of a worker that should run under this daemon.
  std::vector<std::pair<std::string, std::string>> env() const;

 private:
  std::string m_dir;
  std::string m_program;  // nvidia-cuda-mps-control, when found on PATH
  bool m_started = false;
};

/// Whether workers started with `env` really run under MPS (the device attribute, where the driver has it).
/// Asks in a forked worker (the caller stays free of CUDA). Throws gpuipc::Error when the worker fails.
bool mps_active(const std::vector<std::pair<std::string, std::string>>& env);

/// Starts a private MPS control daemon, runs `body` with the environment of its clients (MpsDaemon::env()), stops
/// the daemon and returns true. Where MPS cannot be had (the daemon does not start, or contexts started under it do
/// not report MPS), adds a note to `notes` that says why and that there are no `missing` (e.g. "_mps metrics"), and
/// returns false.
bool run_under_mps(std::vector<std::string>& notes, const std::string& missing,
                   const std::function<void(const std::vector<std::pair<std::string, std::string>>&)>& body);

}  // namespace gpuipc::bench
