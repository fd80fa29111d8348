#include "support/broker_env.hpp"

#include <dirent.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>

#include <csignal>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <thread>

#include "base/config.hpp"
#include "core/client.hpp"
#include "gpuipc/segment.hpp"
#include "os/process.hpp"

namespace gpuipc::test {

std::unique_ptr<TempDir> BrokerEnvironment::s_dir;

void BrokerEnvironment::SetUp() {
  s_dir = std::make_unique<TempDir>("gpuipc-rt");
  ::chmod(s_dir->path().c_str(), 0755);
  ::setenv("GPUIPC_RUNTIME_DIR", s_dir->path().c_str(), 1);
  // The gpuipcd beside this test binary (build/tests -> build/bin), wherever the tree was copied: not the path it
  // was built at, which on another machine may hold another build, or none.
  ::setenv("GPUIPC_DAEMON", (build_bin_dir() + "/gpuipcd").c_str(), 1);
  ::setenv("GPUIPC_QUOTA_BYTES", std::to_string(kQuotaBytes).c_str(), 1);
  ::setenv("GPUIPC_IDLE_TIMEOUT_MS", "600000", 1);
  // A process whose connection closes while it lives gets 2 s to rejoin (5 s by default): tests wait past it.
  ::setenv("GPUIPC_REJOIN_GRACE_MS", std::to_string(kRejoinGrace.count()).c_str(), 1);
}

void BrokerEnvironment::TearDown() {
  if (!s_dir) return;
  std::string pid_text;
  if (auto t = read_file(s_dir->file("broker.pid"))) pid_text = *t;
  const pid_t pid = pid_text.empty() ? 0 : static_cast<pid_t>(std::atoi(pid_text.c_str()));
  if (pid > 0 && ::kill(pid, SIGTERM) == 0) {
    wait_until([&] { return !os::process_alive(pid) || task_state(pid) == 'Z'; }, 5s);
  }
  s_dir.reset();
}

const std::string& BrokerEnvironment::runtime_dir() { return s_dir->path(); }

pid_t BrokerEnvironment::broker_pid() { return static_cast<pid_t>(core::BrokerClient::instance().broker_pid()); }

bool BrokerEnvironment::kill_broker() {
  const pid_t pid = broker_pid();
  if (pid <= 0 || ::kill(pid, SIGKILL) != 0) return false;
  return wait_until([&] { return ::kill(pid, 0) != 0 || task_state(pid) == 'Z'; }, 5s);
}

int BrokerEnvironment::broker_fd_count() {
  const std::string dir = "/proc/" + std::to_string(broker_pid()) + "/fd";
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

int BrokerEnvironment::broker_fd_baseline() {
  int least = broker_fd_count();
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(4));
    least = std::min(least, broker_fd_count());
  }
  return least;
}

std::uint64_t BrokerEnvironment::broker_references() {
  std::uint64_t n = 0;
  for (const auto& s : Segment::list()) n += s.references;
  return n;
}

std::uint64_t BrokerEnvironment::references_of(const std::string& name) {
  for (const auto& s : Segment::list()) {
    if (s.name == name) return s.references;
  }
  return 0;
}

bool register_broker_environment() {
  static bool done = false;
  if (!done) {
    ::testing::AddGlobalTestEnvironment(new BrokerEnvironment());  // NOLINT: gtest takes ownership
    done = true;
  }
  return true;
}

std::string unique_name(const std::string& suffix) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string base = info != nullptr ? std::string(info->test_suite_name()) + "." + info->name() : "test";
  for (char& c : base) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) c = '_';
  }
  return base + "-" + std::to_string(::getpid()) + "-" + suffix;
}

int shut_broker_connections() {
  int n = 0;
  const std::string path = config::socket_path();
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(entry.path().filename().c_str());
    int type = 0;
    socklen_t type_len = sizeof type;
    sockaddr_un peer{};
    socklen_t peer_len = sizeof peer;
    if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) != 0 || type != SOCK_SEQPACKET ||
        ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 || peer.sun_family != AF_UNIX ||
        path != peer.sun_path) {
      continue;
    }
    if (::shutdown(fd, SHUT_RDWR) == 0) ++n;
  }
  return n;
}

}  // namespace gpuipc::test
