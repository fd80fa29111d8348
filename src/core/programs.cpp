// include/gpuipc/programs.hpp and include/gpuipc/broker.hpp: the library's programs and the broker as front ends
// see it, over core::BrokerClient, base/config and src/os.
#include "gpuipc/programs.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <csignal>
#include <filesystem>

#include "base/config.hpp"
#include "core/client.hpp"
#include "gpuipc/broker.hpp"
#include "os/exec.hpp"
#include "os/identity.hpp"
#include "os/path.hpp"
#include "os/process.hpp"
#include "proto/status_page.hpp"

namespace gpuipc {
namespace {

std::string dir_of(const std::string& path) {
  if (path.empty()) return {};
  return std::filesystem::path(path).parent_path().string();
}

}  // namespace

std::string program_path(std::string_view name) {
  const std::string program(name);
  const std::vector<std::string> dirs{dir_of(os::self_exe_path()),
                                      dir_of(os::module_path(reinterpret_cast<const void*>(&program_path)))};
  for (const auto& d : dirs) {
    if (d.empty()) continue;
    for (const std::string rel : {"/", "/../bin/", "/bin/"}) {
      const std::string p = d + rel + program;
      if (os::is_executable(p)) return std::filesystem::weakly_canonical(p).string();
    }
  }
  // Absolute, as exec_program and the broker's start need: a relative PATH entry ("bin") finds a relative path.
  const std::string found = os::find_in_path(program);
  return found.empty() ? found : std::filesystem::absolute(found).lexically_normal().string();
}

void exec_program(const std::vector<std::string>& argv) { os::exec_replace(argv); }

std::string runtime_dir() { return config::runtime_dir(); }

std::string socket_path() { return config::socket_path(); }

std::string ensure_runtime_dir() {
  std::string dir = config::runtime_dir();
  os::ensure_private_dir(dir, 0755);  // the mode the broker and the client (core::BrokerClient) use
  return dir;
}

std::string daemon_path() { return core::BrokerClient::find_daemon(); }

bool broker_listening() { return core::BrokerClient::broker_listening(); }

std::string_view to_string(BrokerMode mode) noexcept {
  return proto::broker_mode_name(static_cast<proto::BrokerMode>(mode));
}

BrokerInfo broker_info() {
  auto& client = core::BrokerClient::instance();
  const auto s = client.broker_status();
  BrokerInfo info{.pid = s.pid,
                  .pid_here = client.broker_pid_here(),
                  .version = s.version,
                  .mode = static_cast<BrokerMode>(s.mode),
                  .started_unix_ns = s.started_unix_ns,
                  .idle_timeout_ms = s.idle_timeout_ms,
                  .socket_path = s.socket_path,
                  .features = {}};
  for (unsigned i = 0; i < 32; ++i) {
    const std::uint32_t bit = 1U << i;
    if ((s.features & bit) == 0) continue;
    const char* name = proto::feature_name(bit);
    info.features.emplace_back(name != nullptr ? std::string(name) : fmt::format("bit {}", i));
  }
  return info;
}

std::uint32_t stop_broker() {
  // The kernel's pid of the process at the other end of the socket, in this PID namespace: the broker's own report
  // (HelloReply) is a pid of its namespace, which from another namespace names some other process.
  const auto pid = core::BrokerClient::instance().broker_pid_here();
  if (pid == 0) return pid;
  try {
    os::send_signal(static_cast<pid_t>(pid), SIGTERM);
  } catch (const Error& e) {
    if (e.sys_errno() != EPERM) throw;
    throw Error(ErrorCode::PermissionDenied,
                fmt::format("the broker of {} (pid {}) runs as another user: stop it as that user, or as root",
                            runtime_dir(), pid),
                "kill", EPERM);
  }
  return pid;
}

std::uint32_t client_pid() noexcept { return static_cast<std::uint32_t>(os::current_pid()); }

}  // namespace gpuipc
