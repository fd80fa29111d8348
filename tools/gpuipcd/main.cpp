// gpuipcd: the CUDA-free broker. Normally started on demand by the library; see docs/cli/gpuipcd.md.
// `gpuipc daemon --foreground` runs it too (tools/gpuipc/cmd_daemon.cpp hands over with --gpuipc-cli), and then it
// exits with gpuipc's codes (docs/cli/daemon.md#exit-status).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <string_view>

#include "base/log.hpp"
#include "broker/daemon.hpp"
#include "cli.hpp"
#include "gpuipc/version.hpp"
#include "proto/messages.hpp"

namespace {

// gpuipc's exit codes (tools/common/cli.hpp), for a broker run as `gpuipc daemon --foreground`.
constexpr int kCliFailure = 1;
constexpr int kCliUsage = 2;
constexpr int kCliBroker = 7;

}  // namespace

int main(int argc, char** argv) {
  // Looked for before parsing: it decides how a failure to read the defaults is reported.
  const bool as_cli =
      std::any_of(argv + 1, argv + argc, [](const char* a) { return std::string_view(a) == "--gpuipc-cli"; });
  const char* prefix = as_cli ? "gpuipc" : "gpuipcd";
  CLI::App app{"gpuipcd: the gpuipc broker (names, permissions and references of shared GPU memory)", "gpuipcd"};
  bool on_demand = false;
  bool verbose = false;
  bool cli_given = false;
  // The broker does not link the library (src/core), so it prints the headers' version: the same number.
  app.set_version_flag("--version", std::string("gpuipcd " GPUIPC_VERSION_STRING " (protocol version ") +
                                        std::to_string(gpuipc::proto::kVersion) + ")");
  app.add_flag("--on-demand", on_demand, "started by the library: exit when idle (GPUIPC_IDLE_TIMEOUT_MS)");
  app.add_flag("-v,--verbose", verbose, "log at debug level");
  app.add_flag("--gpuipc-cli", cli_given)->group("");  // run as `gpuipc daemon --foreground`
  gpuipc::broker::ServerOptions options;
  gpuipc::broker::add_options(app, options);
  for (const char* count :
       {"--idle-timeout-ms", "--quota-bytes", "--quota-segments", "--quota-opens", "--quota-opens-total"}) {
    app.get_option(count)->transform(gpuipc::cli::kWholeNumber);  // "-1" would read as 2^64 - 1, "010" as octal
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return as_cli && rc != 0 ? kCliUsage : rc;
  }
  if (verbose) gpuipc::log::set_level(gpuipc::log::Level::Debug);
  // The environment after the command line: --help and --version work whatever it holds, and a flag given
  // overrides its variable (a malformed GPUIPC_QUOTA_BYTES failed `gpuipcd --quota-bytes 1000`).
  try {
    gpuipc::broker::options_from_environment(options, on_demand, [&](const char* flag) { return app.count(flag) > 0; });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", prefix, e.what());  // NOLINT(cert-err33-c)
    return as_cli ? kCliFailure : 2;
  }
  if (on_demand) options.mode = gpuipc::proto::BrokerMode::OnDemand;
  const int rc = gpuipc::broker::run_daemon(std::move(options));
  if (!as_cli) return rc;
  return rc == 0 ? 0 : rc == 3 ? kCliBroker : kCliFailure;
}
