#include "broker/daemon.hpp"

#include <fmt/format.h>

#include <cstdio>

#include "base/config.hpp"
#include "base/log.hpp"
#include "os/socket.hpp"

namespace gpuipc::broker {

ServerOptions default_options(bool on_demand) {
  ServerOptions o;
  o.runtime_dir = config::runtime_dir();
  o.quotas.bytes = config::env_u64("GPUIPC_QUOTA_BYTES", UINT64_MAX);
  o.quotas.segments = config::env_u64("GPUIPC_QUOTA_SEGMENTS", 4096);
  o.quotas.opens = config::env_u64("GPUIPC_QUOTA_OPENS", 65536);
  o.quotas.opens_total = config::env_u64("GPUIPC_QUOTA_OPENS_TOTAL", std::uint64_t{1} << 20);
  o.restore_grace = config::env_ms("GPUIPC_RESTORE_GRACE_MS", std::chrono::milliseconds(30000));
  o.rejoin_grace = config::env_ms("GPUIPC_REJOIN_GRACE_MS", std::chrono::milliseconds(5000));
  o.hello_timeout = config::env_ms("GPUIPC_HELLO_TIMEOUT_MS", std::chrono::milliseconds(10000));
  o.poll =
      std::chrono::microseconds(std::min<std::uint64_t>(config::env_u64("GPUIPC_BROKER_POLL_US", 1000), 1'000'000));
  o.idle_timeout = on_demand ? config::env_ms("GPUIPC_IDLE_TIMEOUT_MS", std::chrono::milliseconds(30000))
                             : std::chrono::milliseconds(0);
  return o;
}

void add_options(CLI::App& app, ServerOptions& options) {
  app.add_option("--runtime-dir", options.runtime_dir, "directory of the socket and lock file (GPUIPC_RUNTIME_DIR)")
      ->capture_default_str();
  app.add_option_function<std::int64_t>(
         "--idle-timeout-ms", [&](std::int64_t ms) { options.idle_timeout = std::chrono::milliseconds(ms); },
         "exit after this long with no client and nothing registered; 0 = never")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--quota-bytes", options.quotas.bytes, "bytes of segments one uid may register (GPUIPC_QUOTA_BYTES)");
  app.add_option("--quota-segments", options.quotas.segments,
                 "segments one uid may register (GPUIPC_QUOTA_SEGMENTS)");
  app.add_option("--quota-opens", options.quotas.opens,
                 "segments one uid's processes may hold open together, each process's counted apart "
                 "(GPUIPC_QUOTA_OPENS)");
  app.add_option("--quota-opens-total", options.quotas.opens_total,
                 "the same over every uid's processes (GPUIPC_QUOTA_OPENS_TOTAL)");
}

int run_daemon(ServerOptions options) {
  try {
    if (auto inherited = os::take_activation_socket()) {
      options.listen_fd = std::move(inherited->fd);
      options.listen_path = inherited->path;
      options.mode = proto::BrokerMode::SocketActivated;
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "gpuipcd: %s\n", e.what());  // NOLINT(cert-err33-c)
    return kExitActivation;
  }
  try {
    Server server(std::move(options));
    server.run();
    return 0;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::AlreadyExists) {
      std::fprintf(stderr, "gpuipcd: %s\n", e.what());  // NOLINT(cert-err33-c)
      return 3;
    }
    std::fprintf(stderr, "gpuipcd: %s\n", e.what());  // NOLINT(cert-err33-c)
    return 1;
  }
}

}  // namespace gpuipc::broker
