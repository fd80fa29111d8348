// Hostile and broken clients against a real gpuipcd: each gets an error or its connection closed, and everyone
// else keeps being served. Also the daemon's lifecycle: single instance, SIGTERM, idle exit.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>
#include <thread>

#include "base/config.hpp"
#include "gpuipc/segment.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "support/broker_env.hpp"
#include "support/raw_client.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

TEST(BrokerRobustness, GarbageGetsAnErrorAndTheConnectionClosed) {
  auto sock = raw_connect();
  std::vector<std::byte> junk(100);
  for (std::size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<std::byte>(i * 37 + 11);
  send_bytes(sock.get(), junk);
  expect_error_then_closed(sock.get(), ErrorCode::Protocol);
  expect_still_serving();
}

TEST(BrokerRobustness, WrongVersionIsToldTheVersionTheBrokerSpeaks) {
  auto sock = raw_connect();
  auto bytes = proto::encode(proto::Message{1, proto::Hello{1, "old"}});
  bytes[4] = std::byte{9};  // version field
  send_bytes(sock.get(), bytes);
  proto::Message msg;
  ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  const auto* e = std::get_if<proto::ErrorReply>(&msg.body);
  ASSERT_NE(e, nullptr);
  EXPECT_NE(e->message.find(fmt::format("version {}", proto::kVersion)), std::string::npos) << e->message;
  EXPECT_EQ(receive(sock.get(), msg), os::IoStatus::Closed);
  expect_still_serving();
}

TEST(BrokerRobustness, RequestBeforeHelloIsRefused) {
  auto sock = raw_connect();
  send_bytes(sock.get(), proto::encode(proto::Message{1, proto::List{0}}));
  expect_error_then_closed(sock.get(), ErrorCode::Protocol);
}

TEST(BrokerRobustness, OversizedMessageIsRefused) {
  auto sock = raw_connect();
  std::vector<std::byte> huge(proto::kMaxMessageSize + 2048, std::byte{0x41});
  send_bytes(sock.get(), huge);
  expect_error_then_closed(sock.get(), ErrorCode::Protocol);
  expect_still_serving();
}

TEST(BrokerRobustness, FdFloodLeaksNothingInTheBroker) {
  const int fds0 = BrokerEnvironment::broker_fd_baseline();
  auto sock = raw_connect();
  send_bytes(sock.get(), proto::encode(proto::Message{1, proto::Hello{1, "flood"}}));
  proto::Message msg;
  ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  // A List carrying fds it should not: the maximum the socket layer allows.
  std::vector<os::UniqueFd> owned;
  std::vector<int> fds;
  for (std::size_t i = 0; i < os::kMaxFds; ++i) {
    owned.push_back(os::memfd_create("flood", 4096));
    fds.push_back(owned.back().get());
  }
  send_bytes(sock.get(), proto::encode(proto::Message{2, proto::List{0}}, 0), fds);
  expect_error_then_closed(sock.get(), ErrorCode::Protocol);
  sock.reset();
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds0; }, 2s))
      << BrokerEnvironment::broker_fd_count() << " vs " << fds0;
  expect_still_serving();
}

// Closing an fd a client sent can take long: a socket lingering over unsent data, up to its linger time; a FUSE file
// whose daemon does not answer FLUSH, for ever and unkillably (any user who may mount FUSE could send one, with any
// message, garbage included). The broker closed them on its loop, and every other client waited as long. They are
// closed on a thread of their own.
TEST(BrokerRobustness, AnFdSlowToCloseDoesNotHoldUpTheBroker) {
  os::UniqueFd peer;
  os::UniqueFd slow = lingering_socket(20, peer);
  auto sock = raw_connect();
  const pid_t broker = BrokerEnvironment::broker_pid();
  // Stopped, the broker cannot close its copy before ours is closed: its copy is the last, as an attacker's would be.
  ASSERT_EQ(::kill(broker, SIGSTOP), 0);
  std::vector<std::byte> junk(64, std::byte{0x5A});
  const int fd = slow.get();
  send_bytes(sock.get(), junk, std::span<const int>(&fd, 1));
  slow.reset();
  ASSERT_EQ(::kill(broker, SIGCONT), 0);
  const auto t0 = std::chrono::steady_clock::now();
  expect_error_then_closed(sock.get(), ErrorCode::Protocol);
  expect_still_serving();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s) << "the broker waited for the close (20 s)";
}

/// Sends `bytes` with `fds` in one message, however many (os::send_message takes at most kMaxFds).
void send_with_fds(int sock, const std::vector<std::byte>& bytes, const std::vector<int>& fds) {
  iovec iov{const_cast<std::byte*>(bytes.data()), bytes.size()};
  std::vector<char> control(CMSG_SPACE(fds.size() * sizeof(int)));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
  std::memcpy(CMSG_DATA(cmsg), fds.data(), fds.size() * sizeof(int));
  ASSERT_EQ(::sendmsg(sock, &msg, MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size())) << std::strerror(errno);
}

/// Another connection's List is answered within 3 s (a close on the broker's loop would hold it 20 s).
void expect_answered_meanwhile() {
  auto other = raw_hello(::getpid(), "meanwhile");
  const auto r = raw_request(other.get(), 2, proto::List{});
  EXPECT_TRUE(std::holds_alternative<proto::ListReply>(r.body)) << "the broker did not answer within 3 s";
}

// Two ways a client's fd was still closed on the broker's loop, though a closer thread takes those it is given: fds
// beyond what the receive buffer had room for (24), which the kernel closed inside recvmsg, and fds in a message
// still unread when the broker closed the connection, which the kernel closed with the socket. A socket lingering
// over unsent data, sent either way, held every other client off for its 20 s.
TEST(BrokerRobustness, NoFdAClientSendsIsClosedOnTheBrokersLoop) {
  const pid_t broker = BrokerEnvironment::broker_pid();
  const std::vector<std::byte> junk(64, std::byte{0x5A});
  for (const bool unread : {false, true}) {
    SCOPED_TRACE(unread ? "in a message left unread" : "beyond the receive buffer");
    os::UniqueFd peer;
    os::UniqueFd slow = lingering_socket(20, peer);
    std::vector<os::UniqueFd> memfds;
    std::vector<int> fds;
    if (!unread) {
      for (int i = 0; i < 29; ++i) {
        memfds.push_back(os::memfd_create("many", 4096));
        fds.push_back(memfds.back().get());
      }
    }
    fds.push_back(slow.get());
    auto sock = raw_connect();
    // Stopped, the broker cannot close its copy before ours is closed: its copy is the last, as an attacker's would be.
    ASSERT_EQ(::kill(broker, SIGSTOP), 0);
    if (unread) send_bytes(sock.get(), junk);  // the broker answers this one and closes the connection
    send_with_fds(sock.get(), junk, fds);
    slow.reset();
    memfds.clear();
    ASSERT_EQ(::kill(broker, SIGCONT), 0);
    if (unread) {  // (closed over an unread message, the socket tells this end ECONNRESET before the reply)
      proto::Message msg;
      while (receive(sock.get(), msg) == os::IoStatus::Ok) {
      }
    } else {
      expect_error_then_closed(sock.get(), ErrorCode::Protocol);
    }
    sock.reset();
    expect_answered_meanwhile();
    peer.reset();  // ends the linger: the broker's closer is free again
  }
  expect_still_serving();
}

// A broker out of file descriptors gets a request with an fd: the kernel gives it the message and not the fd, and says
// only MSG_CTRUNC. The broker took that for a message too large and closed the client's connection, which repaired its
// semaphores, channels and pools as if its process had died. It refuses that request, saying why, and serves on.
TEST(BrokerRobustness, ARequestWhoseFdTheBrokerHasNoRoomForIsRefusedAndItsConnectionStays) {
  auto sock = raw_hello(::getpid(), "no-room");
  const pid_t broker = BrokerEnvironment::broker_pid();
  rlimit before{};
  ASSERT_EQ(::prlimit(broker, RLIMIT_NOFILE, nullptr, &before), 0);
  const auto memfd = os::memfd_create("no-room", 4096);
  const int fd = memfd.get();
  proto::Message refused;
  // The broker's lowest free fd number becomes its limit: every number below is taken. (An fd the broker closes
  // meanwhile, under a parallel run, frees a number below: then the Create goes through, and the test tries again.)
  for (std::uint32_t attempt = 0; attempt < 20; ++attempt) {
    std::set<int> open;
    for (const auto& e : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", broker))) {
      open.insert(std::stoi(e.path().filename().string()));
    }
    int lowest_free = 0;
    while (open.count(lowest_free) != 0) ++lowest_free;
    rlimit low = before;
    low.rlim_cur = static_cast<rlim_t>(lowest_free);
    ASSERT_EQ(::prlimit(broker, RLIMIT_NOFILE, &low, nullptr), 0);
    const std::string name = unique_name("no-room-" + std::to_string(attempt));
    refused = raw_request(sock.get(), 7 + 2 * attempt, proto::Create{name, proto::Kind::Host, 0600, 4096, {}, 0},
                          std::span<const int>(&fd, 1));
    ASSERT_EQ(::prlimit(broker, RLIMIT_NOFILE, &before, nullptr), 0);
    if (!std::holds_alternative<proto::OpenReply>(refused.body)) break;
    (void)raw_request(sock.get(), 8 + 2 * attempt, proto::Unlink{name});
  }
  EXPECT_EQ(refused.request_id % 2, 1U);  // a Create's (odd ids), answered on its own id
  const auto* e = std::get_if<proto::ErrorReply>(&refused.body);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->code, static_cast<std::uint8_t>(ErrorCode::QuotaExceeded));
  EXPECT_NE(e->message.find("out of file descriptors"), std::string::npos) << e->message;
  // The same connection is served on.
  EXPECT_TRUE(std::holds_alternative<proto::ListReply>(raw_request(sock.get(), 100, proto::List{0}).body));
  expect_still_serving();
}

TEST(BrokerRobustness, AClientThatNeverReadsIsCutOffAndOthersAreServed) {
  auto sock = raw_connect();
  send_bytes(sock.get(), proto::encode(proto::Message{1, proto::Hello{1, "deaf"}}));
  // Fill the socket: the broker queues what it cannot send, then gives up on this client.
  os::set_nonblocking(sock.get(), true);
  const auto req = proto::encode(proto::Message{2, proto::List{0}});
  bool closed = false;
  for (int i = 0; i < 20000 && !closed; ++i) {
    auto st = os::send_message(sock.get(), req);
    if (st == os::IoStatus::Closed) closed = true;
    if (st == os::IoStatus::WouldBlock) {
      expect_still_serving();  // the broker is not stuck on us
      std::this_thread::sleep_for(1ms);
    }
    if (i % 1000 == 999) expect_still_serving();
  }
  expect_still_serving();
  if (!closed) {
    // Drain: we must eventually see EOF because the broker closed us.
    os::set_nonblocking(sock.get(), false);
    proto::Message msg;
    os::IoStatus st = os::IoStatus::Ok;
    for (int i = 0; i < 100000 && st == os::IoStatus::Ok; ++i) st = receive(sock.get(), msg, 3000);
    EXPECT_EQ(st, os::IoStatus::Closed);
  }
}

TEST(BrokerRobustness, CreateWithoutFdOrWithALiarsSizeIsRefused) {
  auto sock = raw_connect();
  send_bytes(sock.get(), proto::encode(proto::Message{1, proto::Hello{1, "liar"}}));
  proto::Message msg;
  ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  proto::Create c;
  c.name = unique_name();
  c.kind = proto::Kind::Host;
  c.mode = 0600;
  c.size = 1 << 20;
  auto fd = os::memfd_create("liar", 4096);  // smaller than declared
  const int raw = fd.get();
  send_bytes(sock.get(), proto::encode(proto::Message{2, c}, 1), std::span<const int>(&raw, 1));
  ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  const auto* e = std::get_if<proto::ErrorReply>(&msg.body);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->code, static_cast<std::uint8_t>(ErrorCode::InvalidArgument));
  EXPECT_NE(e->message.find("memfd is 4096 bytes"), std::string::npos) << e->message;
  // Honest size: accepted, and sealed against shrinking.
  auto good = os::memfd_create("honest", 1 << 20);
  const int g = good.get();
  send_bytes(sock.get(), proto::encode(proto::Message{3, c}, 1), std::span<const int>(&g, 1));
  ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(msg.body));
  EXPECT_NE(::ftruncate(good.get(), 0), 0) << "the broker must seal host segments against shrinking";
  sock.reset();
  Segment::unlink(c.name);
}

TEST(BrokerRobustness, CloseOfAReferenceNotHeldIsAnError) {
  const auto name = unique_name();
  auto s = Segment::create(name, 4096);
  auto sock = raw_connect();
  send_bytes(sock.get(), proto::encode(proto::Message{1, proto::Hello{1, "thief"}}));
  proto::Message msg;
  ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  send_bytes(sock.get(), proto::encode(proto::Message{2, proto::Close{s.id()}}));
  ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  ASSERT_TRUE(std::holds_alternative<proto::ErrorReply>(msg.body));
  EXPECT_EQ(BrokerEnvironment::references_of(name), 1U);  // our reference was not stolen
  Segment::unlink(name);
}

TEST(BrokerDaemon, SecondInstanceOnTheSameDirectoryRefusesToStart) {
  BrokerEnvironment::broker_pid();
  const pid_t child = start_child([] {
    ::execl(GPUIPC_BUILD_BIN_DIR "/gpuipcd", "gpuipcd", "--runtime-dir", BrokerEnvironment::runtime_dir().c_str(),
            static_cast<char*>(nullptr));
    return 99;
  });
  EXPECT_EQ(wait_child(child, 10s), 3);
  expect_still_serving();
}

TEST(BrokerDaemon, SigtermShutsDownCleanlyAndIdleTimeoutExits) {
  TempDir dir("gpuipc-rt2");
  const std::string sock = dir.file("broker.sock");
  // Foreground broker, no idle timeout: SIGTERM ends it with status 0 and removes the socket.
  const pid_t a = start_child([&] {
    ::execl(GPUIPC_BUILD_BIN_DIR "/gpuipcd", "gpuipcd", "--runtime-dir", dir.path().c_str(),
            static_cast<char*>(nullptr));
    return 99;
  });
  ASSERT_TRUE(wait_until([&] { return read_file(sock).has_value() || ::access(sock.c_str(), F_OK) == 0; }, 5s));
  ::kill(a, SIGTERM);
  EXPECT_EQ(wait_child(a, 10s), 0);
  EXPECT_NE(::access(sock.c_str(), F_OK), 0);
  // Idle timeout: exits by itself with nothing registered and nobody connected.
  const pid_t b = start_child([&] {
    ::execl(GPUIPC_BUILD_BIN_DIR "/gpuipcd", "gpuipcd", "--runtime-dir", dir.path().c_str(), "--idle-timeout-ms",
            "200", static_cast<char*>(nullptr));
    return 99;
  });
  EXPECT_EQ(wait_child(b, 10s), 0);
}

TEST(BrokerDaemon, PollSettingIsCheckedAtStartAndZeroStillServes) {
  TempDir dir("gpuipc-rt3");
  const std::string bin = GPUIPC_BUILD_BIN_DIR "/gpuipcd";
  // A malformed GPUIPC_BROKER_POLL_US stops the broker before it takes the directory, naming the variable.
  const auto bad = run_program(bin, {"--runtime-dir", dir.path()}, {"GPUIPC_BROKER_POLL_US=soon"}, -1, 10s);
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("GPUIPC_BROKER_POLL_US"), std::string::npos) << bad.err;
  EXPECT_NE(::access(dir.file("broker.sock").c_str(), F_OK), 0);
  // 0: the broker sleeps at once between requests (the old behaviour) and serves a client's whole life as before;
  // the client here polls (it reads the variable of this process, unset: the default).
  const pid_t broker = start_program(bin, {"--runtime-dir", dir.path(), "--idle-timeout-ms", "300"},
                                     {"GPUIPC_BROKER_POLL_US=0"}, -1, dir.file("broker.log"));
  const std::string sock = dir.file("broker.sock");
  ASSERT_TRUE(wait_until([&] { return ::access(sock.c_str(), F_OK) == 0; }, 5s));
  const auto made =
      run_program(GPUIPC_BUILD_BIN_DIR "/gpuipc", {"ls"},
                  {"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_NO_AUTOSTART=1", "GPUIPC_BROKER_POLL_US=0"});
  EXPECT_EQ(made.exit_code, 0) << made.err;
  EXPECT_EQ(wait_child(broker, 10s), 0) << read_file(dir.file("broker.log")).value_or("");
}

/// A connection to the broker just started at `sock`, once it listens (not only bound: a connect between the two
/// is refused, the file existing from bind on); none when it does not within 5 s.
os::UniqueFd connect_once_listening(const std::string& sock) {
  os::UniqueFd conn;
  (void)wait_until(
      [&] {
        try {
          conn = os::connect_seqpacket(sock);
          return true;
        } catch (const Error&) {
          return false;
        }
      },
      5s);
  return conn;
}

TEST(BrokerDaemon, AConnectionThatSaysNoHelloIsClosedAfterTheHelloTimeout) {
  TempDir dir("gpuipc-rt-hello");
  const std::string bin = GPUIPC_BUILD_BIN_DIR "/gpuipcd";
  const auto bad = run_program(bin, {"--runtime-dir", dir.path()}, {"GPUIPC_HELLO_TIMEOUT_MS=soon"}, -1, 10s);
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("GPUIPC_HELLO_TIMEOUT_MS"), std::string::npos) << bad.err;
  const pid_t broker = start_program(bin, {"--runtime-dir", dir.path(), "--verbose"}, {"GPUIPC_HELLO_TIMEOUT_MS=300"},
                                     -1, dir.file("broker.log"));
  const std::string sock = dir.file("broker.sock");
  os::UniqueFd silent = connect_once_listening(sock);
  ASSERT_TRUE(silent);
  const auto t0 = std::chrono::steady_clock::now();
  const os::UniqueFd greeted = os::connect_seqpacket(sock);
  send_bytes(greeted.get(), proto::encode(proto::Message{1, proto::Hello{1, "greeted"}}));
  proto::Message msg;
  ASSERT_EQ(receive(greeted.get(), msg), os::IoStatus::Ok);
  ASSERT_TRUE(std::holds_alternative<proto::HelloReply>(msg.body));
  // The silent one is closed, without a reply, once its time is up; not before.
  EXPECT_EQ(receive(silent.get(), msg, 5000), os::IoStatus::Closed);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 290ms);
  // The one that said Hello stays, however quiet, and is served.
  std::this_thread::sleep_for(300ms);
  const proto::Message listed = raw_request(greeted.get(), 2, proto::List{});
  EXPECT_TRUE(std::holds_alternative<proto::ListReply>(listed.body));
  ::kill(broker, SIGTERM);
  EXPECT_EQ(wait_child(broker, 10s), 0);
  const std::string log = read_file(dir.file("broker.log")).value_or("");
  EXPECT_NE(log.find("said no Hello within 300 ms"), std::string::npos) << log;
}

TEST(BrokerDaemon, AFloodOfConnectsDoesNotHoldOffAConnectedClientsRequest) {
  // Connections that wait to be accepted are taken at most 32 a turn, between which the broker serves requests:
  // a process that connects in a loop kept every other client waiting while the broker accepted until the queue
  // was empty. The broker is stopped while 64 connections queue up behind a request of a connected client; its
  // log (one line per accepted connection, one for the request) shows which it served first. (64: the log takes
  // 100 lines a second, and drops the rest.)
  TempDir dir("gpuipc-rt-flood");
  const pid_t broker = start_program(GPUIPC_BUILD_BIN_DIR "/gpuipcd", {"--runtime-dir", dir.path(), "--verbose"}, {},
                                     -1, dir.file("broker.log"));
  const std::string sock = dir.file("broker.sock");
  const os::UniqueFd client = connect_once_listening(sock);
  ASSERT_TRUE(client);
  send_bytes(client.get(), proto::encode(proto::Message{1, proto::Hello{1, "served"}}));
  proto::Message msg;
  ASSERT_EQ(receive(client.get(), msg), os::IoStatus::Ok);
  ASSERT_TRUE(std::holds_alternative<proto::HelloReply>(msg.body));
  ASSERT_EQ(::kill(broker, SIGSTOP), 0);
  ASSERT_TRUE(wait_until([&] { return task_state(broker) == 'T'; }, 5s)) << task_state(broker);
  // The listener is ready first (its first connection), the client's socket after: the broker's next turn sees
  // them in that order.
  constexpr int kFlood = 64;
  std::vector<os::UniqueFd> flood;
  for (int i = 0; i < kFlood; ++i) {
    flood.push_back(os::connect_seqpacket(sock, 0ms));
    send_bytes(flood.back().get(), proto::encode(proto::Message{1, proto::Hello{1, "flood"}}));
  }
  const std::vector<std::byte> malformed(4, std::byte{0x5a});  // shorter than any header: logged, then closed
  send_bytes(client.get(), malformed);
  ASSERT_EQ(::kill(broker, SIGCONT), 0);
  EXPECT_EQ(receive(client.get(), msg, 10000), os::IoStatus::Ok);
  // Every one of them is served too.
  for (auto& f : flood) {
    ASSERT_EQ(receive(f.get(), msg, 10000), os::IoStatus::Ok);
    ASSERT_TRUE(std::holds_alternative<proto::HelloReply>(msg.body));
  }
  flood.clear();
  ::kill(broker, SIGTERM);
  EXPECT_EQ(wait_child(broker, 10s), 0);
  const std::string log = read_file(dir.file("broker.log")).value_or("");
  // Connections accepted after the client's and before its request was served.
  std::istringstream lines(log);
  std::string line;
  int accepted = -1;  // the client's own comes first
  bool served = false;
  while (std::getline(lines, line)) {
    if (line.find("malformed message") != std::string::npos) {
      served = true;
      break;
    }
    if (line.find(" from pid ") != std::string::npos && line.find("connection ") != std::string::npos) ++accepted;
  }
  ASSERT_TRUE(served) << log;
  EXPECT_LE(accepted, 32) << "connections accepted before the connected client's request was served\n" << log;
}

/// Open fds of process `pid`: the least of six reads over ~20 ms, so that an fd caught in flight (a reply's, dup'ed
/// for sendmsg and closed right after) does not count.
int settled_fd_count(pid_t pid) {
  const auto count = [&] {
    int n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(fmt::format("/proc/{}/fd", pid))) ++n;
    return n;
  };
  int least = count();
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(4ms);
    least = std::min(least, count());
  }
  return least;
}

/// A connection to the broker at `sock` that said Hello.
os::UniqueFd greeted_connection(const std::string& sock) {
  os::UniqueFd conn = os::connect_seqpacket(sock);
  send_bytes(conn.get(), proto::encode(proto::Message{1, proto::Hello{1, "raw"}}));
  proto::Message msg;
  EXPECT_EQ(receive(conn.get(), msg), os::IoStatus::Ok);
  EXPECT_TRUE(std::holds_alternative<proto::HelloReply>(msg.body));
  return conn;
}

/// Whether the broker closed `conn` (seen without reading what waits in it).
bool hung_up(int conn) {
  pollfd p{conn, 0, 0};
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLHUP) != 0;
}

/// A gpuipcd of its own in `dir`, limited to `fds` file descriptors (its budgets follow: a quarter for connections),
/// its log in dir/broker.log.
pid_t start_broker_with_fds(const TempDir& dir, int fds) {
  return start_program("/bin/sh",
                       {"-c", fmt::format("ulimit -n {} && exec \"$0\" \"$@\"", fds), GPUIPC_BUILD_BIN_DIR "/gpuipcd",
                        "--runtime-dir", dir.path()},
                       {}, -1, dir.file("broker.log"));
}

TEST(BrokerDaemon, OneUidsUnreadRepliesCannotTakeEveryFdOfTheBroker) {
  // A reply that waits to be read holds its fd in the broker (an Open's: the segment's memory). Each connection
  // could hold 64 so, and one uid has 512 connections: more than a broker with a limit of a few thousand fds has
  // for everyone. They are bounded over a uid's connections too, to half of an eighth of the broker's limit (here
  // 256: 16 fds). Five connections of this uid ask for a segment without reading the replies, each until 8 to 15 of
  // them wait in the broker (the rest of each sits in its socket, where it holds no fd of the broker's).
  TempDir dir("gpuipc-rt-fds");
  const pid_t broker = start_broker_with_fds(dir, 256);
  const std::string sock = dir.file("broker.sock");
  ASSERT_TRUE(connect_once_listening(sock));
  const os::UniqueFd owner = greeted_connection(sock);
  const auto memfd = os::memfd_create("fds", 4096);
  const int fd = memfd.get();
  const auto made =
      raw_request(owner.get(), 2, proto::Create{"fds", proto::Kind::Host, 0600, 4096, {}, 0}, std::span(&fd, 1));
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(made.body));
  const int base = settled_fd_count(broker);
  std::vector<os::UniqueFd> deaf;
  std::vector<int> held;  // fds each one's unread replies hold in the broker
  for (int k = 0; k < 5; ++k) {
    deaf.push_back(greeted_connection(sock));
    const int conn = deaf.back().get();
    const int before = settled_fd_count(broker);
    int queued = 0;
    for (std::uint32_t rid = 2; rid < 2000 && queued < 8 && !hung_up(conn); rid += 8) {
      for (std::uint32_t i = 0; i < 8; ++i) {
        (void)os::send_message(conn,
                               proto::encode(proto::Message{rid + i, proto::Open{"fds", proto::Access::ReadWrite, 0}}));
      }
      // Until the broker has read them all: it answers each as it reads it.
      int unread = 1;
      for (int t = 0; t < 1000 && unread > 0; ++t) {
        if (::ioctl(conn, SIOCOUTQ, &unread) != 0) unread = 0;
        if (unread > 0) std::this_thread::sleep_for(1ms);
      }
      queued = settled_fd_count(broker) - before;
    }
    held.push_back(hung_up(conn) ? -1 : queued);
  }
  const int holding = settled_fd_count(broker) - base;
  // Another connection of the uid is served.
  const os::UniqueFd other = greeted_connection(sock);
  std::vector<os::UniqueFd> fds;
  const auto opened = raw_request(other.get(), 2, proto::Open{"fds", proto::Access::ReadOnly, 0}, {}, &fds);
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(opened.body) && fds.size() == 1)
      << (std::holds_alternative<proto::ErrorReply>(opened.body) ? std::get<proto::ErrorReply>(opened.body).message
                                                                 : "no reply");
  // The first keeps its replies; the others are cut off once the uid's 16 are taken.
  EXPECT_GE(held.front(), 8);
  EXPECT_LE(holding, 16 + 4)
      << "fds the broker holds for these connections and their unread replies (replies after each: " << held[0] << ", "
      << held[1] << ", " << held[2] << ", " << held[3] << ", " << held[4] << "; -1: cut off)";
  EXPECT_EQ(std::count(held.begin(), held.end(), -1), 4);
  deaf.clear();
  ::kill(broker, SIGTERM);
  EXPECT_EQ(wait_child(broker, 10s), 0) << read_file(dir.file("broker.log")).value_or("");
}

// A client can send before the broker accepts its connection. A connection the broker refused (too many) was closed
// on its loop with what it had sent, fds included: a socket lingering over unsent data so held every other client
// off for its linger time. Here the broker (64 fds: 16 connections) is full, and the 17th sends one.
TEST(BrokerDaemon, ARefusedConnectionsFdsAreNotClosedOnTheBrokersLoop) {
  TempDir dir("gpuipc-rt-refused");
  const pid_t broker = start_broker_with_fds(dir, 64);
  const std::string path = dir.file("broker.sock");
  ASSERT_TRUE(connect_once_listening(path));
  std::vector<os::UniqueFd> conns;
  for (int i = 0; i < 16; ++i) conns.push_back(greeted_connection(path));
  os::UniqueFd peer;
  os::UniqueFd slow = lingering_socket(20, peer);
  ASSERT_EQ(::kill(broker, SIGSTOP), 0);
  const os::UniqueFd extra = os::connect_seqpacket(path);
  const int fd = slow.get();
  send_bytes(extra.get(), proto::encode(proto::Message{1, proto::Hello{1, "refused"}}), std::span<const int>(&fd, 1));
  slow.reset();
  ASSERT_EQ(::kill(broker, SIGCONT), 0);
  proto::Message msg;  // the refusal, unless the close over the unread Hello (ECONNRESET) comes first
  while (receive(extra.get(), msg) == os::IoStatus::Ok) {
  }
  // A connection already served is answered meanwhile (within raw_request's 3 s; the linger is 20 s).
  const auto r = raw_request(conns.front().get(), 2, proto::List{});
  EXPECT_TRUE(std::holds_alternative<proto::ListReply>(r.body)) << "the broker did not answer within 3 s";
  peer.reset();
  conns.clear();
  ::kill(broker, SIGTERM);
  EXPECT_EQ(wait_child(broker, 10s), 0) << read_file(dir.file("broker.log")).value_or("");
}

TEST(BrokerDaemon, AClientWithAMalformedPollSettingFailsSayingSo) {
  // The client checks the value when it connects, before it sends anything.
  const auto o = run_program(GPUIPC_BUILD_BIN_DIR "/gpuipc", {"ls"},
                             {"GPUIPC_RUNTIME_DIR=" + BrokerEnvironment::runtime_dir(), "GPUIPC_NO_AUTOSTART=1",
                              "GPUIPC_BROKER_POLL_US=soon"});
  EXPECT_NE(o.exit_code, 0) << o.out;
  EXPECT_NE(o.err.find("GPUIPC_BROKER_POLL_US='soon'"), std::string::npos) << o.err;
  expect_still_serving();
}

}  // namespace
}  // namespace gpuipc::test
