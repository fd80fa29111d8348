// The broker as a client sees it: where it lives (runtime directory, socket, the gpuipcd the library would start),
// whether one runs, what it says of itself, and how to ask it to stop. For front ends (the gpuipc CLI, the Python
// module) and supervisors; none of these calls is needed to use segments, semaphores or channels, which start a
// broker on demand (docs/architecture.md#the-broker).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace gpuipc {

/// The broker's runtime directory: $GPUIPC_RUNTIME_DIR, else $XDG_RUNTIME_DIR/gpuipc, else /tmp/gpuipc-$UID unless
/// another user made that first, then $HOME/.gpuipc (docs/env/GPUIPC_RUNTIME_DIR.md). Creates nothing.
std::string runtime_dir();

/// The broker's socket path inside runtime_dir(). Creates nothing.
std::string socket_path();

/// Creates the runtime directory as the library does before it starts a broker (private to this user, mode 0755)
/// and returns its path. Throws Error(PermissionDenied) for a directory another user owns or others may write,
/// Error(System) when it cannot be made.
std::string ensure_runtime_dir();

/// The path of the gpuipcd the library would start: $GPUIPC_DAEMON, else next to the executable, else next to the
/// library, else on $PATH. Empty when none is found.
std::string daemon_path();

/// Whether a broker listens on socket_path() now (connects and disconnects; never starts one): false only when
/// nothing listens there (no socket, or one nobody accepts on). Throws Error for anything else: PermissionDenied
/// (a socket this user may not connect to), Timeout (a broker too busy to accept), InvalidArgument (a malformed
/// GPUIPC_* variable).
bool broker_listening();

/// How the running broker was started (its status page; docs/protocol.md#the-status-page).
enum class BrokerMode : std::uint32_t {
  Unknown = 0,          ///< a broker older than this library
  OnDemand = 1,         ///< started by the library (`gpuipcd --on-demand`): exits when idle
  SocketActivated = 2,  ///< started by a service manager that passed its listening socket (systemd)
  Manual = 3,           ///< started by hand or by a supervisor: `gpuipcd`, `gpuipc daemon --foreground`
};

/// "on-demand", "socket-activated", "manual" or "unknown".
std::string_view to_string(BrokerMode mode) noexcept;

/// What the running broker says of itself (its Hello reply and its status page).
struct BrokerInfo {
  std::uint32_t pid = 0;       ///< its pid in its own PID namespace, as it reports it
  std::uint32_t pid_here = 0;  ///< its pid in this process's PID namespace (SO_PEERCRED); 0 when not visible here
  std::string version;         ///< its release
  BrokerMode mode = BrokerMode::Unknown;
  std::uint64_t started_unix_ns = 0;  ///< when it started (CLOCK_REALTIME); 0 when unknown
  std::uint64_t idle_timeout_ms = 0;  ///< it exits after this long idle; 0: never
  std::string socket_path;            ///< where this process connected
  /// Requests it takes beyond those of every broker of this protocol version ("unlink_id": a create given up on
  /// after a Timeout leaves no name behind). Empty from a broker that predates them; a bit this library does not
  /// know is named "bit N".
  std::vector<std::string> features;
};

/// The running broker's report. Connects if needed, starting a broker on demand like any call (check
/// broker_listening() first not to). Throws Error as any broker request does (connect, hello).
BrokerInfo broker_info();

/// Asks the broker this process is connected to (connects if needed) to shut down: SIGTERM to its pid in this PID
/// namespace. Returns that pid, or 0 (and sends nothing) when the broker runs in a PID namespace this process cannot
/// see. Throws Error as broker_info() does, or Error(System/PermissionDenied) when the signal cannot be sent.
std::uint32_t stop_broker();

/// This process's id as the broker lists it in SegmentInfo::mapper_pids (when both share a PID namespace).
std::uint32_t client_pid() noexcept;

}  // namespace gpuipc
