// gpuipcd under systemd socket activation, played the way systemd does it: the test binds and listens on the
// socket, forks, puts it at fd 3 in the child, sets LISTEN_PID to the child's pid and LISTEN_FDS=1, then execs
// gpuipcd (support's run_program / start_program). Clients then create and open segments through it, `gpuipc daemon
// status` says socket-activated, and after the broker exits the socket stays and a pending client is served by the
// next broker given the same socket (what systemd does on the next connection). An fd that is not a listening
// SOCK_SEQPACKET socket is refused with a message and exit code 4. Also `gpuipc daemon status` of an on-demand
// broker and with no broker.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>

#include "gpuipc/segment.hpp"
#include "os/socket.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr const char* kGpuipcd = GPUIPC_BUILD_BIN_DIR "/gpuipcd";
constexpr const char* kGpuipc = GPUIPC_BUILD_BIN_DIR "/gpuipc";

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A listening socket as a .socket unit with ListenSequentialPacket= makes it: blocking, no CLOEXEC on the child's copy.
os::UniqueFd systemd_style_listener(const std::string& path) {
  auto fd = os::listen_seqpacket(path, 0666);
  os::set_nonblocking(fd.get(), false);
  return fd;
}

// The environment of a client of the activated broker: its runtime directory, and never a broker of its own.
std::vector<std::string> client_env(const TempDir& dir) {
  return {"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_NO_AUTOSTART=1"};
}

nlohmann::json status_json(const TempDir& dir, int expect_exit = 0) {
  const auto o = run_program(kGpuipc, {"daemon", "status", "--json"}, client_env(dir));
  EXPECT_EQ(o.exit_code, expect_exit) << o.out << o.err;
  try {
    return nlohmann::json::parse(o.out);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not JSON: " << o.out << " (" << e.what() << ")";
    return {};
  }
}

TEST(SocketActivation, BrokerServesThePassedSocketAndComesBackOnTheNextConnection) {
  TempDir dir("gpuipc-act");
  const std::string sock_path = dir.file("broker.sock");
  auto listener = systemd_style_listener(sock_path);
  const pid_t broker = start_program(kGpuipcd, {"--runtime-dir", dir.path()}, {"GPUIPC_LOG=info"}, listener.get(),
                                     dir.file("broker1.log"));

  // A client creates and fills a segment and leaves; another opens it and reads it back.
  const std::string name = unique_name();
  const auto env = client_env(dir);
  EXPECT_EQ(run_child([&] {
              for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));  // NOLINT: the child's own copy
              auto seg = Segment::create(name, 4096);
              std::memset(seg.data(), 0x5a, 4096);
              return 0;
            }),
            0)
      << read_file(dir.file("broker1.log")).value_or("");
  EXPECT_EQ(run_child([&] {
              for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));  // NOLINT
              auto seg = Segment::open(name);
              const auto* p = static_cast<const unsigned char*>(seg.data());
              GPUIPC_CHILD_CHECK(seg.size() == 4096 && p[0] == 0x5a && p[4095] == 0x5a);
              Segment::unlink(name);
              return 0;
            }),
            0);

  // The broker says how it was started.
  const auto j = status_json(dir);
  EXPECT_EQ(j.value("running", false), true);
  EXPECT_EQ(j.value("mode", ""), "socket-activated");
  EXPECT_EQ(j.value("pid", 0), broker);
  EXPECT_EQ(j.value("socket", ""), sock_path);
  EXPECT_EQ(j.value("idle_timeout_ms", 1), 0);
  EXPECT_TRUE(j.contains("uptime_s") && j["uptime_s"].is_number());
  const auto text = run_program(kGpuipc, {"daemon", "status"}, env);
  EXPECT_EQ(text.exit_code, 0) << text.err;
  EXPECT_TRUE(contains(text.out, "mode:      socket-activated")) << text.out;
  EXPECT_TRUE(contains(text.out, "pid:       " + std::to_string(broker))) << text.out;
  EXPECT_TRUE(contains(text.out, "socket:    " + sock_path)) << text.out;

  // Stopped, it leaves the socket alone: it is systemd's (here the test's), still bound and listening.
  ASSERT_EQ(::kill(broker, SIGTERM), 0);
  EXPECT_EQ(wait_child(broker), 0) << read_file(dir.file("broker1.log")).value_or("");
  struct stat st {};
  ASSERT_EQ(::lstat(sock_path.c_str(), &st), 0) << "the broker unlinked the socket it was passed";
  EXPECT_TRUE(S_ISSOCK(st.st_mode));

  // A client connecting now waits in the socket's queue; systemd would start the service, as the test does here,
  // and the new broker answers it. This broker exits when idle: with activation that is safe.
  const pid_t waiting = start_program(kGpuipc, {"daemon", "status", "--json"}, env, -1, dir.file("status.out"));
  ASSERT_TRUE(wait_until([&] { return task_state(waiting) == 'S'; }, 5s));
  const pid_t broker2 = start_program(kGpuipcd, {"--runtime-dir", dir.path(), "--idle-timeout-ms", "300"},
                                      {"GPUIPC_LOG=info"}, listener.get(), dir.file("broker2.log"));
  EXPECT_EQ(wait_child(waiting), 0);
  const auto out = read_file(dir.file("status.out")).value_or("");
  const auto j2 = nlohmann::json::parse(out.substr(0, out.find('\n')), nullptr, false);
  ASSERT_FALSE(j2.is_discarded()) << out;
  EXPECT_EQ(j2.value("mode", ""), "socket-activated") << out;
  EXPECT_EQ(j2.value("pid", 0), broker2) << out;
  EXPECT_EQ(j2.value("idle_timeout_ms", 0), 300) << out;
  EXPECT_EQ(wait_child(broker2, 10s), 0) << read_file(dir.file("broker2.log")).value_or("");
  EXPECT_TRUE(contains(read_file(dir.file("broker2.log")).value_or(""), "idle"));
  ASSERT_EQ(::lstat(sock_path.c_str(), &st), 0) << "the idle exit unlinked the socket it was passed";
}

// Runs gpuipcd with `fd` as the passed socket and expects the refusal: exit 4, a message naming fd 3 and `why`, and no
// broker left behind (no socket bound, no lock file).
void expect_refused(int fd, const std::string& why, const std::vector<std::string>& env = {}) {
  TempDir dir("gpuipc-act");
  const auto o = run_program(kGpuipcd, {"--runtime-dir", dir.path()}, env, fd, 10s);
  EXPECT_EQ(o.exit_code, 4) << o.err;
  EXPECT_TRUE(contains(o.err, "gpuipcd: socket activation: ")) << o.err;
  EXPECT_TRUE(contains(o.err, why)) << o.err;
  struct stat st {};
  EXPECT_NE(::lstat(dir.file("broker.sock").c_str(), &st), 0) << "it bound a socket of its own";
  EXPECT_NE(::lstat(dir.file("broker.lock").c_str(), &st), 0) << "it went on to take the directory";
}

TEST(SocketActivation, RefusesAnFdThatIsNotAListeningSeqpacketSocket) {
  TempDir dir("gpuipc-act");
  {
    SCOPED_TRACE("a stream socket (ListenStream=)");
    os::UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string path = dir.file("stream.sock");
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    ASSERT_EQ(::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    ASSERT_EQ(::listen(s.get(), 8), 0);
    expect_refused(s.get(), "fd 3 (LISTEN_FDS=1) is SOCK_STREAM (ListenStream=); gpuipcd needs SOCK_SEQPACKET");
  }
  {
    SCOPED_TRACE("a connected seqpacket socket (Accept=yes)");
    auto [a, b] = os::seqpacket_pair();
    expect_refused(a.get(), "is not listening");
  }
  {
    SCOPED_TRACE("not a socket");
    int p[2];
    ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
    os::UniqueFd r(p[0]);
    os::UniqueFd w(p[1]);
    expect_refused(r.get(), "fd 3 (LISTEN_FDS=1) is not a socket");
  }
  {
    SCOPED_TRACE("an IPv4 socket");
    os::UniqueFd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_TRUE(s);
    expect_refused(s.get(), "is not an AF_UNIX socket");
  }
  {
    SCOPED_TRACE("two sockets");
    auto good = systemd_style_listener(dir.file("two.sock"));
    expect_refused(good.get(), "LISTEN_FDS=2 but gpuipcd takes exactly one socket",
                   {"LISTEN_FDS=2", "LISTEN_FDNAMES=a:b"});
  }
  {
    SCOPED_TRACE("a malformed LISTEN_FDS");
    auto good = systemd_style_listener(dir.file("bad.sock"));
    expect_refused(good.get(), "LISTEN_FDS='one' is not a number", {"LISTEN_FDS=one"});
  }
}

// LISTEN_PID naming another process: the variables are not this broker's, it binds its own socket (mode manual).
TEST(SocketActivation, VariablesOfAnotherProcessAreIgnored) {
  TempDir dir("gpuipc-act");
  const pid_t broker = start_program(kGpuipcd, {"--runtime-dir", dir.path()}, {"LISTEN_PID=1", "LISTEN_FDS=1"}, -1,
                                     dir.file("broker.log"));
  ASSERT_TRUE(wait_until([&] { return os::file_identity(dir.file("broker.sock")).has_value(); }, 10s))
      << read_file(dir.file("broker.log")).value_or("");
  const auto j = status_json(dir);
  EXPECT_EQ(j.value("mode", ""), "manual");
  EXPECT_EQ(j.value("pid", 0), broker);
  ASSERT_EQ(::kill(broker, SIGTERM), 0);
  EXPECT_EQ(wait_child(broker), 0);
  // A socket it bound itself goes with it.
  EXPECT_FALSE(os::file_identity(dir.file("broker.sock")).has_value());
}

TEST(DaemonStatus, OnDemandBrokerAndNoBroker) {
  (void)BrokerEnvironment::broker_pid();  // the test broker, started by the library
  const auto o = run_program(kGpuipc, {"daemon", "status", "--json"}, {});
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto j = nlohmann::json::parse(o.out);
  EXPECT_EQ(j.value("mode", ""), "on-demand");
  EXPECT_EQ(j.value("pid", 0), BrokerEnvironment::broker_pid());
  EXPECT_EQ(j.value("socket", ""), BrokerEnvironment::runtime_dir() + "/broker.sock");
  EXPECT_GT(j.value("idle_timeout_ms", 0), 0);
  // What it takes beyond protocol version 2's requests (the status page's `features`).
  EXPECT_EQ(j.value("features", nlohmann::json()), nlohmann::json::array({"unlink_id", "look"})) << o.out;
  const auto text = run_program(kGpuipc, {"daemon", "status"}, {});
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("features:  unlink_id look\n"), std::string::npos) << text.out;

  TempDir empty("gpuipc-act");
  const auto none = status_json(empty, 5);
  EXPECT_EQ(none.value("running", true), false);
  EXPECT_FALSE(os::file_identity(empty.file("broker.sock")).has_value()) << "status started a broker";
}

}  // namespace
}  // namespace gpuipc::test
