// The broker as a program: options from flags and GPUIPC_* variables, then Server::run(). Shared by gpuipcd and
// `gpuipc daemon --foreground`.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "broker/server.hpp"

namespace gpuipc::broker {

/// Options with their defaults from the environment registry (GPUIPC_RUNTIME_DIR, GPUIPC_QUOTA_*,
/// GPUIPC_IDLE_TIMEOUT_MS applies only when `on_demand`).
ServerOptions default_options(bool on_demand);

/// Adds --runtime-dir, --idle-timeout-ms, --quota-bytes, --quota-segments to `app`, bound to `options`.
void add_options(CLI::App& app, ServerOptions& options);

/// Runs a broker until SIGTERM/SIGINT or idle. Returns the process exit code: 0 after a clean shutdown, 3 when
/// another broker already serves the directory, 1 on other errors (printed to stderr).
int run_daemon(const ServerOptions& options);

}  // namespace gpuipc::broker
