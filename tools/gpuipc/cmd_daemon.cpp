// gpuipc daemon: run the broker in the foreground, start it in the background, stop it, or say how it runs.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "gpuipc/broker.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/programs.hpp"

namespace gpuipc::cli {
namespace {

std::string describe_mode(BrokerMode mode) {
  switch (mode) {
    case BrokerMode::OnDemand:
      return "on-demand (started by the library; exits when idle)";
    case BrokerMode::SocketActivated:
      return "socket-activated (systemd passed its socket; it starts the broker again on the next connection)";
    case BrokerMode::Manual:
      return "manual (started by hand or by a supervisor: gpuipcd, gpuipc daemon --foreground)";
    case BrokerMode::Unknown:
      break;
  }
  return "unknown (a broker older than this tool)";
}

std::string describe_duration(std::uint64_t seconds) {
  if (seconds < 60) return fmt::format("{}s", seconds);
  if (seconds < 3600) return fmt::format("{}m{:02}s", seconds / 60, seconds % 60);
  if (seconds < 86400) return fmt::format("{}h{:02}m", seconds / 3600, seconds % 3600 / 60);
  return fmt::format("{}d{:02}h", seconds / 86400, seconds % 86400 / 3600);
}

// `gpuipc daemon status`: never starts an on-demand broker (a socket-activated one is started by systemd when
// this connects, as by any client).
/// Refuses (PermissionDenied, exit 6) a runtime directory the library would not use, as every other command does:
/// one another user owns, or others may write. A missing one is left so.
void check_runtime_dir() {
  std::error_code ec;
  if (std::filesystem::exists(runtime_dir(), ec)) (void)ensure_runtime_dir();
}

int daemon_status(bool json) {
  check_runtime_dir();
  const std::string socket = socket_path();
  if (!broker_listening()) {
    if (json) {
      std::cout << json_text(nlohmann::json{{"running", false}, {"socket", socket}}) << "\n";
    } else {
      std::cout << fmt::format("no gpuipc broker is running on {}\n", socket);
    }
    return kExitNotFound;
  }
  const BrokerInfo s = broker_info();
  const auto now_ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  const bool known_start = s.started_unix_ns != 0;
  const double uptime_s =
      known_start && now_ns > s.started_unix_ns ? static_cast<double>(now_ns - s.started_unix_ns) / 1e9 : 0.0;
  if (json) {
    nlohmann::json j{{"running", true},
                     {"mode", std::string(to_string(s.mode))},
                     {"pid", s.pid},
                     {"socket", s.socket_path},
                     {"runtime_dir", runtime_dir()},
                     {"version", s.version},
                     {"idle_timeout_ms", s.idle_timeout_ms},
                     {"features", s.features}};
    j["started_unix_ns"] = known_start ? nlohmann::json(s.started_unix_ns) : nlohmann::json(nullptr);
    j["uptime_s"] = known_start ? nlohmann::json(uptime_s) : nlohmann::json(nullptr);
    std::cout << json_text(j) << "\n";
    return kExitOk;
  }
  std::cout << fmt::format("mode:      {}\n", describe_mode(s.mode)) << fmt::format("pid:       {}\n", s.pid)
            << fmt::format("uptime:    {}\n",
                           known_start ? describe_duration(static_cast<std::uint64_t>(uptime_s)) : "unknown")
            << fmt::format("socket:    {}\n", s.socket_path)
            << fmt::format("version:   {}\n", s.version.empty() ? "unknown" : s.version)
            << fmt::format("idle exit: {}\n",
                           s.idle_timeout_ms == 0
                               ? std::string("never")
                               : fmt::format("after {} ms with no client and nothing registered", s.idle_timeout_ms))
            << fmt::format("features:  {}\n", s.features.empty() ? std::string("none (a broker older than this tool)")
                                                                 : fmt::format("{}", fmt::join(s.features, " ")));
  return kExitOk;
}

/// The broker's options of `gpuipc daemon --foreground`, as given: gpuipcd parses them again (src/broker/daemon.cpp).
struct ForegroundOptions {
  std::string runtime_dir, idle_timeout_ms, quota_bytes, quota_segments, quota_opens, quota_opens_total;
};

/// Hands `--foreground` to gpuipcd, which runs the broker in this process (the same pid) with gpuipc's exit codes.
[[noreturn]] void run_foreground(const CLI::App& cmd, const ForegroundOptions& o) {
  const std::string daemon = daemon_path();
  if (daemon.empty()) {
    throw Error(ErrorCode::NotFound, "gpuipcd is not next to gpuipc nor on PATH (set GPUIPC_DAEMON)", "daemon");
  }
  std::vector<std::string> args{"--gpuipc-cli"};
  const std::pair<const char*, const std::string*> given[] = {
      {"--runtime-dir", &o.runtime_dir}, {"--idle-timeout-ms", &o.idle_timeout_ms},
      {"--quota-bytes", &o.quota_bytes}, {"--quota-segments", &o.quota_segments},
      {"--quota-opens", &o.quota_opens}, {"--quota-opens-total", &o.quota_opens_total}};
  for (const auto& [flag, value] : given) {
    if (cmd.count(flag) > 0) args.insert(args.end(), {flag, *value});
  }
  try {
    hand_over(daemon, args);
  } catch (const Error& e) {
    if (std::getenv("GPUIPC_DAEMON") == nullptr) throw;
    throw Error(e.code(), fmt::format("{}; GPUIPC_DAEMON names it: point it at gpuipcd, or unset it", e.what()),
                e.call(), e.sys_errno());
  }
}

}  // namespace

void register_daemon(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("daemon", "run or control the broker (gpuipcd) of the runtime directory");
  static bool foreground = false;
  static bool stop = false;
  static ForegroundOptions options;
  cmd->add_flag("--foreground", foreground, "run the broker in this process until SIGTERM/SIGINT");
  cmd->add_flag("--stop", stop, "ask the running broker to shut down (SIGTERM)");
  // The options of gpuipcd (src/broker/daemon.cpp add_options), passed on as given: it checks them (a relative
  // --runtime-dir, say) after `gpuipc daemon --help` has had its say, whatever the GPUIPC_* variables hold.
  cmd->add_option("--runtime-dir", options.runtime_dir,
                  "directory of the socket and lock file, an absolute path (default: GPUIPC_RUNTIME_DIR, else "
                  "$XDG_RUNTIME_DIR/gpuipc, else /tmp/gpuipc-$UID)");
  cmd->add_option("--idle-timeout-ms", options.idle_timeout_ms,
                  "exit after this long with no client and nothing registered; 0 = never")
      ->transform(kWholeNumber);
  cmd->add_option("--quota-bytes", options.quota_bytes, "bytes of segments one uid may register (GPUIPC_QUOTA_BYTES)")
      ->transform(kWholeNumber);
  cmd->add_option("--quota-segments", options.quota_segments, "segments one uid may register (GPUIPC_QUOTA_SEGMENTS)")
      ->transform(kWholeNumber);
  cmd->add_option("--quota-opens", options.quota_opens,
                  "segments one uid's processes may hold open together, each process's counted apart "
                  "(GPUIPC_QUOTA_OPENS)")
      ->transform(kWholeNumber);
  cmd->add_option("--quota-opens-total", options.quota_opens_total,
                  "the same over every uid's processes (GPUIPC_QUOTA_OPENS_TOTAL)")
      ->transform(kWholeNumber);
  auto* status = cmd->add_subcommand("status", "say how the running broker was started, its pid, uptime and socket");
  static bool json = false;
  status->add_flag("--json", json, "one JSON object instead of text");
  status->callback([cmd, &exit_code] {
    for (const char* o : {"--foreground", "--stop", "--runtime-dir", "--idle-timeout-ms", "--quota-bytes",
                          "--quota-segments", "--quota-opens", "--quota-opens-total"}) {
      if (cmd->count(o) > 0) throw CLI::ValidationError(o, "does not go with `daemon status`");
    }
    exit_code = daemon_status(json);
  });
  cmd->callback([cmd, status, &exit_code] {
    if (status->parsed()) return;  // its own callback ran
    if (foreground) run_foreground(*cmd, options);
    for (const char* o : {"--runtime-dir", "--idle-timeout-ms", "--quota-bytes", "--quota-segments", "--quota-opens",
                          "--quota-opens-total"}) {
      if (cmd->count(o) > 0) {
        throw CLI::ValidationError(o, "applies to --foreground only; for a broker started on demand set the "
                                      "GPUIPC_* environment variables instead (docs/env/)");
      }
    }
    if (stop) {
      check_runtime_dir();
      if (!broker_listening()) {
        std::cout << "no gpuipc broker is running\n";
        exit_code = kExitOk;
        return;
      }
      const auto pid = stop_broker();
      if (pid == 0) {
        std::cerr << fmt::format(
            "gpuipc daemon --stop: the broker (pid {} in its own PID namespace) runs in a PID "
            "namespace this process cannot see; stop it from there (or its container)\n",
            broker_info().pid);
        exit_code = kExitFailure;
        return;
      }
      std::cout << fmt::format("sent SIGTERM to gpuipcd pid {}\n", pid);
      exit_code = kExitOk;
      return;
    }
    std::cout << fmt::format("gpuipcd pid {} serves {}\n", broker_info().pid, runtime_dir());
    exit_code = kExitOk;
  });
}

}  // namespace gpuipc::cli
