// gpuipc daemon: run the broker in the foreground, start it in the background, or stop it.
#include <fmt/format.h>

#include <csignal>
#include <iostream>

#include "broker/daemon.hpp"
#include "commands.hpp"
#include "core/client.hpp"
#include "gpuipc/error.hpp"
#include "os/module.hpp"

namespace gpuipc::cli {

void register_daemon(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("daemon", "run or control the broker (gpuipcd) of the runtime directory");
  static bool foreground = false;
  static bool stop = false;
  static broker::ServerOptions options;
  cmd->add_flag("--foreground", foreground, "run the broker in this process until SIGTERM/SIGINT");
  cmd->add_flag("--stop", stop, "ask the running broker to shut down (SIGTERM)");
  cmd->preparse_callback([](std::size_t) { options = broker::default_options(false); });
  broker::add_options(*cmd, options);
  cmd->callback([cmd, &exit_code] {
    if (foreground) {
      const int rc = broker::run_daemon(options);
      exit_code = rc == 0 ? kExitOk : rc == 3 ? kExitBroker : kExitFailure;
      return;
    }
    for (const char* o : {"--runtime-dir", "--idle-timeout-ms", "--quota-bytes", "--quota-segments"}) {
      if (cmd->count(o) > 0) {
        throw CLI::ValidationError(o, "applies to --foreground only; for a broker started on demand set the "
                                      "GPUIPC_* environment variables instead (docs/env/)");
      }
    }
    auto& client = core::BrokerClient::instance();
    if (stop) {
      if (!core::BrokerClient::broker_listening()) {
        std::cout << "no gpuipc broker is running\n";
        exit_code = kExitOk;
        return;
      }
      const auto pid = client.broker_pid();
      // The pid comes from the broker itself over its socket, so this signals the process serving it.
      os::send_signal(static_cast<pid_t>(pid), SIGTERM);
      std::cout << fmt::format("sent SIGTERM to gpuipcd pid {}\n", pid);
      exit_code = kExitOk;
      return;
    }
    std::cout << fmt::format("gpuipcd pid {} serves {}\n", client.broker_pid(), options.runtime_dir);
    exit_code = kExitOk;
  });
}

}  // namespace gpuipc::cli
