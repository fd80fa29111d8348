#include <fmt/format.h>

#include "commands.hpp"
#include "gpuipc/log.hpp"
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
    if (verbose) gpuipc::set_log_level(gpuipc::LogLevel::Debug);
  });
  return gpuipc::cli::run(app, argc, argv, exit_code);
}
