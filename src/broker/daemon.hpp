// The broker as a program: options from flags and GPUIPC_* variables, then Server::run(). Shared by gpuipcd and
// `gpuipc daemon --foreground`.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "broker/server.hpp"

namespace gpuipc::broker {

/// Sets the options of `o` that the command line did not give (`given(flag)` false) from the environment registry
/// (GPUIPC_RUNTIME_DIR, GPUIPC_QUOTA_*, ...; GPUIPC_IDLE_TIMEOUT_MS applies only when `on_demand`). A variable is
/// read only for an option not given: a flag overrides a malformed variable. Throws Error (InvalidArgument) for a
/// malformed one that applies.
void options_from_environment(ServerOptions& o, bool on_demand, const std::function<bool(const char*)>& given);

/// Adds --runtime-dir, --idle-timeout-ms, --quota-bytes, --quota-segments to `app`, bound to `options`.
void add_options(CLI::App& app, ServerOptions& options);

/// Exit code of run_daemon when the service manager passed a socket it cannot serve (docs/cli/gpuipcd.md).
inline constexpr int kExitActivation = 4;

/// Runs a broker until SIGTERM/SIGINT or idle. When systemd passed a listening socket (LISTEN_PID, LISTEN_FDS:
/// os::take_activation_socket) it serves that one and runs in mode SocketActivated, whatever `options` says.
/// Returns the process exit code: 0 after a clean shutdown, 3 when another broker already serves the directory,
/// kExitActivation (4) when the passed socket is unusable, 1 on other errors (each printed to stderr).
/// Call from main before threads start (it unsets the LISTEN_* variables).
int run_daemon(ServerOptions options);

}  // namespace gpuipc::broker
