// The gpuipc command-line tool: each subcommand registers itself on the CLI11 app.
// Front end only: parsing, printing and exit codes; the work is done by the library.
#pragma once

#include <CLI/CLI.hpp>

namespace gpuipc::cli {

/// Exit codes shared by every subcommand (docs/cli/gpuipc.md lists them).
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      ///< the command ran and found a problem (doctor: something gpuipc needs is missing)
  kExitUsage = 2,        ///< bad command line
  kExitNoDriver = 3,     ///< no CUDA driver could be loaded
  kExitNoDevice = 4,     ///< the driver loaded but reports no GPU
  kExitNotFound = 5,     ///< the named object does not exist
  kExitPermission = 6,   ///< the caller may not do this
  kExitBroker = 7,       ///< the broker could not be reached or started
  kExitNeedsGpu = 8,     ///< the command needs a GPU and there is none (bench)
};

/// Each register_* adds one subcommand whose callback runs the command and stores its exit code in `exit_code`.
void register_doctor(CLI::App& app, int& exit_code);
void register_daemon(CLI::App& app, int& exit_code);
void register_segments(CLI::App& app, int& exit_code);  // ls, stat, rm
void register_top(CLI::App& app, int& exit_code);
void register_demo(CLI::App& app, int& exit_code);
void register_bench(CLI::App& app, int& exit_code);
void register_watch(CLI::App& app, int& exit_code);  // who, watch
void register_mps(CLI::App& app, int& exit_code);    // mps start, stop, status, env

}  // namespace gpuipc::cli
