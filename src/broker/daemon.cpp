#include "broker/daemon.hpp"

#include <fmt/format.h>

#include <cstdio>

#include "base/config.hpp"
#include "base/log.hpp"
#include "os/socket.hpp"

namespace gpuipc::broker {

void options_from_environment(ServerOptions& o, bool on_demand, const std::function<bool(const char*)>& given) {
  if (!given("--runtime-dir")) o.runtime_dir = config::runtime_dir();
  if (!given("--quota-bytes")) o.quotas.bytes = config::env_u64("GPUIPC_QUOTA_BYTES", UINT64_MAX);
  if (!given("--quota-segments")) o.quotas.segments = config::env_u64("GPUIPC_QUOTA_SEGMENTS", 4096);
  if (!given("--quota-opens")) o.quotas.opens = config::env_u64("GPUIPC_QUOTA_OPENS", 65536);
  if (!given("--quota-opens-total")) {
    o.quotas.opens_total = config::env_u64("GPUIPC_QUOTA_OPENS_TOTAL", std::uint64_t{1} << 20);
  }
  o.restore_grace = config::env_ms("GPUIPC_RESTORE_GRACE_MS", std::chrono::milliseconds(30000));
  o.rejoin_grace = config::env_ms("GPUIPC_REJOIN_GRACE_MS", std::chrono::milliseconds(5000));
  o.hello_timeout = config::env_ms("GPUIPC_HELLO_TIMEOUT_MS", std::chrono::milliseconds(10000));
  o.poll =
      std::chrono::microseconds(std::min<std::uint64_t>(config::env_u64("GPUIPC_BROKER_POLL_US", 1000), 1'000'000));
  if (!given("--idle-timeout-ms")) {
    o.idle_timeout = on_demand ? config::env_ms("GPUIPC_IDLE_TIMEOUT_MS", std::chrono::milliseconds(30000))
                               : std::chrono::milliseconds(0);
  }
}

namespace {

const CLI::Validator absolute_path(
    [](const std::string& dir) {
      return !dir.empty() && dir.front() == '/'
                 ? std::string()
                 : fmt::format("'{}' is not an absolute path (give one, e.g. \"$PWD/{}\")", dir, dir);
    },
    "ABSOLUTE PATH", "absolute_path");

}  // namespace

void add_options(CLI::App& app, ServerOptions& options) {
  // Absolute, as GPUIPC_RUNTIME_DIR must be: clients refuse a relative one, so a broker serving `./dir` served nobody.
  app.add_option("--runtime-dir", options.runtime_dir,
                 "directory of the socket and lock file, an absolute path (default: GPUIPC_RUNTIME_DIR, else "
                 "$XDG_RUNTIME_DIR/gpuipc, else /tmp/gpuipc-$UID)")
      ->check(absolute_path);
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
