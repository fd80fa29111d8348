// gpuipcd: the CUDA-free broker. Normally started on demand by the library; see docs/cli/gpuipcd.md.
#include <CLI/CLI.hpp>

#include "base/log.hpp"
#include "broker/daemon.hpp"
#include "gpuipc/version.hpp"
#include "proto/messages.hpp"

int main(int argc, char** argv) {
  CLI::App app{"gpuipcd: the gpuipc broker (names, permissions and references of shared GPU memory)", "gpuipcd"};
  bool on_demand = false;
  bool verbose = false;
  // The broker does not link the library (src/core), so it prints the headers' version: the same number.
  app.set_version_flag("--version", std::string("gpuipcd " GPUIPC_VERSION_STRING " (protocol version ") +
                                        std::to_string(gpuipc::proto::kVersion) + ")");
  app.add_flag("--on-demand", on_demand, "started by the library: exit when idle (GPUIPC_IDLE_TIMEOUT_MS)");
  app.add_flag("-v,--verbose", verbose, "log at debug level");
  gpuipc::broker::ServerOptions options;
  try {
    options = gpuipc::broker::default_options(false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpuipcd: %s\n", e.what());  // NOLINT(cert-err33-c)
    return 2;
  }
  bool idle_given = false;
  gpuipc::broker::add_options(app, options);
  app.parse_complete_callback([&] { idle_given = app.count("--idle-timeout-ms") > 0; });
  CLI11_PARSE(app, argc, argv);
  if (verbose) gpuipc::log::set_level(gpuipc::log::Level::Debug);
  if (on_demand && !idle_given) {
    try {
      options.idle_timeout = gpuipc::broker::default_options(true).idle_timeout;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gpuipcd: %s\n", e.what());  // NOLINT(cert-err33-c)
      return 2;
    }
  }
  if (on_demand) options.mode = gpuipc::proto::BrokerMode::OnDemand;
  return gpuipc::broker::run_daemon(std::move(options));
}
