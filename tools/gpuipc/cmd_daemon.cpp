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
  cmd->callback([&exit_code] {
    if (foreground) {
      exit_code = broker::run_daemon(options);
      return;
    }
    auto& client = core::BrokerClient::instance();
    if (stop) {
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
