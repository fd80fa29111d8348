// What the gpuipc programs share (tools/gpuipc, tools/gpuipc-demo, tools/gpuipc-bench): the exit codes of
// docs/cli/gpuipc.md and one main loop that turns CLI11's and the library's errors into them. Header-only, over
// the public API (include/gpuipc) and CLI11; nothing else may include it.
#pragma once

#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>
#include <string_view>

#include "gpuipc/error.hpp"

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

/// Parses `argv` into `app` (whose callbacks run the command and store its code in `exit_code`) and returns the
/// process exit code: `exit_code`, or the code of the error that ended the command, printed as "gpuipc: ...".
inline int run(CLI::App& app, int argc, char** argv, const int& exit_code) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : kExitUsage;
  } catch (const Error& e) {
    std::cerr << "gpuipc: " << e.what() << "\n";
    // The broker could not be reached or started (connect, hello, or a dead connection).
    if (e.call() == "connect" || e.call() == "hello" || e.call() == "send" || e.call() == "recv") {
      return kExitBroker;
    }
    switch (e.code()) {
      case ErrorCode::NoDriver: return kExitNoDriver;
      case ErrorCode::NoDevice: return kExitNoDevice;
      case ErrorCode::NotFound: return kExitNotFound;
      case ErrorCode::PermissionDenied: return kExitPermission;
      default: return kExitFailure;
    }
  } catch (const std::exception& e) {
    std::cerr << "gpuipc: " << e.what() << "\n";
    return kExitFailure;
  }
  return exit_code;
}

}  // namespace gpuipc::cli
