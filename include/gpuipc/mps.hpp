// A private MPS control daemon for this user (docs/mps.md): its folders, the control program, one command to it,
// and starting it. `gpuipc mps` is built on these. Without MPS, kernels of different processes take turns on a GPU
// (time slices); under MPS they run side by side.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace gpuipc {

/// The folders of one MPS control daemon: `pipe` (its control pipe) and `log`, under `base`.
struct MpsDirs {
  std::string base, pipe, log;
  /// CUDA_MPS_PIPE_DIRECTORY=pipe and CUDA_MPS_LOG_DIRECTORY=log: what puts a process under this daemon.
  std::vector<std::string> env() const;
};

/// The folders under `dir` (made absolute), or under <runtime dir>/mps when `dir` is empty. Creates nothing.
MpsDirs mps_dirs(const std::string& dir = {});

/// The path of nvidia-cuda-mps-control, or throws Error(NoDriver) saying where it comes from.
std::string mps_control_program();

/// Sends one command ("get_server_list", "quit") to the control daemon of `dirs` through `program` and returns its
/// answer; nullopt when none answers there.
std::optional<std::string> mps_ask(const std::string& program, const MpsDirs& dirs, const std::string& command);

/// What `program -d` did: its exit code and output.
struct MpsStart {
  int exit_code = 0;
  std::string output;
};

/// Makes the folders of `dirs` (private, mode 0700) and runs `program -d` with them (at most 30 s). Does not wait
/// for the daemon to answer: poll mps_ask for that. Throws Error(System/PermissionDenied) for the folders.
MpsStart mps_start_daemon(const std::string& program, const MpsDirs& dirs);

}  // namespace gpuipc
