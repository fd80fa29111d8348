#include <fmt/format.h>

#include <exception>
#include <iostream>

#include "base/log.hpp"
#include "commands.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/version.hpp"

int main(int argc, char** argv) {
  CLI::App app{"gpuipc: share GPU memory and GPU synchronization between processes", "gpuipc"};
  app.require_subcommand(1);
  app.set_version_flag("--version",
                       fmt::format("gpuipc {} (protocol version {})", gpuipc::version(), gpuipc::protocol_version()));
  bool verbose = false;
  app.add_flag("-v,--verbose", verbose, "log at debug level (same as GPUIPC_LOG=debug)");
  int exit_code = gpuipc::cli::kExitOk;
  gpuipc::cli::register_doctor(app, exit_code);
  gpuipc::cli::register_daemon(app, exit_code);
  gpuipc::cli::register_segments(app, exit_code);
  gpuipc::cli::register_top(app, exit_code);
  gpuipc::cli::register_demo(app, exit_code);
  gpuipc::cli::register_bench(app, exit_code);
  gpuipc::cli::register_watch(app, exit_code);
  gpuipc::cli::register_mps(app, exit_code);
  app.parse_complete_callback([&] {
    if (verbose) gpuipc::log::set_level(gpuipc::log::Level::Debug);
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : gpuipc::cli::kExitUsage;
  } catch (const gpuipc::Error& e) {
    std::cerr << "gpuipc: " << e.what() << "\n";
    // The broker could not be reached or started (connect, hello, or a dead connection).
    if (e.call() == "connect" || e.call() == "hello" || e.call() == "send" || e.call() == "recv") {
      return gpuipc::cli::kExitBroker;
    }
    switch (e.code()) {
      case gpuipc::ErrorCode::NoDriver: return gpuipc::cli::kExitNoDriver;
      case gpuipc::ErrorCode::NoDevice: return gpuipc::cli::kExitNoDevice;
      case gpuipc::ErrorCode::NotFound: return gpuipc::cli::kExitNotFound;
      case gpuipc::ErrorCode::PermissionDenied: return gpuipc::cli::kExitPermission;
      default: return gpuipc::cli::kExitFailure;
    }
  } catch (const std::exception& e) {
    std::cerr << "gpuipc: " << e.what() << "\n";
    return gpuipc::cli::kExitFailure;
  }
  return exit_code;
}
