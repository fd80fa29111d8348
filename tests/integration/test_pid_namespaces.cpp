// Containers without shared PID namespaces, /dev/shm or ptrace: processes in different PID namespaces (each the
// pid 1 of its own, as in a container) share host segments and a host channel through one runtime directory, and
// the SIGKILL of one is repaired for the others by member tokens, never by pids (every member here has pid 1). A
// second test gives the consumer its own mount namespace, where the runtime directory is reachable only through a
// bind mount at another path and /dev/shm is an empty tmpfs of its own: the runtime directory is all it needs.
// Needs CAP_SYS_ADMIN for unshare(2); skips, saying why, where namespaces cannot be made.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>

#include "gpuipc/channel.hpp"
#include "gpuipc/segment.hpp"
#include "os/process.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr auto kChildLife = std::chrono::seconds(60);
constexpr std::int64_t kRepairBoundNs = 100'000'000;  // docs/architecture.md: "tests bound it at 100 ms"

/// Exit code of a probe child: 10 + errno of the failed step (errno values stay below 115).
constexpr int kProbeErrnoBase = 10;

/// Why this process cannot make the namespaces the tests need, or nullopt when it can. Probes in a child, so
/// this process's own namespaces are never touched. `mounts`: also a private mount namespace with a bind mount.
std::optional<std::string> namespaces_unavailable(bool mounts) {
  TempDir probe_dir("gpuipc-nsprobe");
  const int rc = run_child([&] {
    if (::unshare(CLONE_NEWPID) != 0) return kProbeErrnoBase + errno;
    const pid_t inner = ::fork();
    if (inner < 0) return kProbeErrnoBase + errno;
    if (inner == 0) {
      if (::getpid() != 1) ::_exit(1);
      if (mounts) {
        if (::unshare(CLONE_NEWNS) != 0) ::_exit(kProbeErrnoBase + errno);
        if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(kProbeErrnoBase + errno);
        if (::mount("/tmp", probe_dir.path().c_str(), nullptr, MS_BIND, nullptr) != 0) {
          ::_exit(kProbeErrnoBase + errno);
        }
      }
      ::_exit(0);
    }
    return wait_child(inner, std::chrono::seconds(10));
  });
  if (rc == 0) return std::nullopt;
  const char* what = mounts ? "unshare(CLONE_NEWPID | CLONE_NEWNS) + a private bind mount" : "unshare(CLONE_NEWPID)";
  if (rc >= kProbeErrnoBase && rc < kChildThrew) {
    return std::string(what) + " failed: " + std::strerror(rc - kProbeErrnoBase) +
           " (needs CAP_SYS_ADMIN and no seccomp filter against it: run as root outside a restricted container)";
  }
  return std::string(what) + ": the probe child ended with status " + std::to_string(rc);
}

/// A process that is pid 1 of a new PID namespace: a child of this process calls unshare(CLONE_NEWPID) and forks
/// `body` (which becomes the namespace's init), reports its pid as this namespace sees it, and exits with the body's
/// status (128 + signal when a signal killed it). The body runs with GPUIPC_NO_AUTOSTART=1: it must reach the test's
/// broker, not start one of its own inside its namespace. The destructor SIGKILLs the body if it still runs and
/// reaps both.
class NamespacedChild {
 public:
  explicit NamespacedChild(const std::function<int()>& body)
      : m_host_pid(std::make_unique<Shared<std::atomic<pid_t>>>()) {
    auto* slot = m_host_pid->get();
    m_outer = start_child([&body, slot] {
      if (::unshare(CLONE_NEWPID) != 0) return 90;
      ::setenv("GPUIPC_NO_AUTOSTART", "1", 1);
      const pid_t inner = start_child(body);
      slot->store(inner);
      return wait_child(inner, kChildLife);
    });
    if (!wait_until([&] { return slot->load() != 0 || task_state(m_outer) == 'Z'; }, std::chrono::seconds(10))) {
      ADD_FAILURE() << "the namespaced child did not start";
    }
  }
  NamespacedChild(const NamespacedChild&) = delete;
  NamespacedChild& operator=(const NamespacedChild&) = delete;
  ~NamespacedChild() {
    if (m_outer <= 0) return;
    if (const pid_t p = host_pid(); p > 0) ::kill(p, SIGKILL);
    wait_child(m_outer);
  }

  /// The body's pid in this (the test's) PID namespace: what the broker sees, and what kill(2) takes here.
  pid_t host_pid() const { return m_host_pid->get()->load(); }

  /// SIGKILLs the body from this namespace.
  void kill() const { ::kill(host_pid(), SIGKILL); }

  /// Waits for the body and returns its status (see wait_child).
  int wait(std::chrono::milliseconds timeout = kDefaultChildTimeout) {
    const int rc = wait_child(m_outer, timeout);
    m_outer = 0;
    return rc;
  }

 private:
  std::unique_ptr<Shared<std::atomic<pid_t>>> m_host_pid;
  pid_t m_outer = 0;
};

/// `gpuipc ls --json` of this build, run from this process's namespaces; throws if the output is not JSON.
nlohmann::json gpuipc_ls() {
  std::string out;
  FILE* pipe = ::popen(GPUIPC_BUILD_BIN_DIR "/gpuipc ls --json", "r");  // NOLINT(cert-env33-c): a test
  if (pipe == nullptr) return {};
  char buffer[4096];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  ::pclose(pipe);
  return nlohmann::json::parse(out);
}

/// The mapper pids `gpuipc ls --json` shows for segment `name` (empty when it is not listed).
std::set<pid_t> ls_pids(const std::string& name) {
  std::set<pid_t> pids;
  for (const auto& s : gpuipc_ls()) {
    if (s.at("name") == name) {
      for (const auto& p : s.at("mapper_pids")) pids.insert(p.get<pid_t>());
    }
  }
  return pids;
}

std::uint8_t pattern(std::size_t i) { return static_cast<std::uint8_t>(i * 7 + 3); }

constexpr std::size_t kSegmentBytes = 1 << 16;
constexpr std::uint32_t kFromB = 5;  // messages the first producer publishes before it is killed

/// What the namespaced processes tell the test and each other (shared memory made before the forks).
struct Board {
  std::atomic<pid_t> own_pid[3];  // getpid() inside their namespaces: B, C, D
  std::atomic<int> b_ready, c_joined, d_joined, d_go, b_published;
  std::atomic<std::uint32_t> received;
  std::atomic<std::uint32_t> values[kFromB + 1];
  std::atomic<std::int64_t> peer_died_ns;
};

// Producers B and D and consumer C, each pid 1 of its own PID namespace; the broker in the test's (root)
// namespace. B creates a host segment and a host channel; C reads B's data and messages; B is SIGKILLed: C drains
// it and goes on receiving from D (B's repair touched neither C's nor D's membership, though all three said pid 1
// in Hello); D is SIGKILLed: C gets PeerDied within the bound. References and the broker's fds return to their
// baseline.
TEST(PidNamespaces, SegmentAndChannelSharedAcrossNamespacesAndKillsRepairedByToken) {
  if (auto why = namespaces_unavailable(false)) GTEST_SKIP() << *why;
  const auto seg = unique_name("seg");
  const auto ch = unique_name("ch");
  const auto refs0 = BrokerEnvironment::broker_references();
  const int fds0 = BrokerEnvironment::broker_fd_baseline();
  Shared<Board> shared;
  Board& board = *shared.get();

  NamespacedChild b([&] {
    board.own_pid[0] = ::getpid();
    auto s = Segment::create(seg, kSegmentBytes, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
    auto* p = static_cast<std::uint8_t*>(s.data());
    for (std::size_t i = 0; i < kSegmentBytes; ++i) p[i] = pattern(i);
    auto prod = Channel::create(ch, {.slots = 8, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                                ChannelRole::Producer);
    board.b_ready = 1;
    GPUIPC_CHILD_CHECK(wait_until([&] { return board.c_joined.load() != 0; }, std::chrono::seconds(20)));
    for (std::uint32_t i = 0; i < kFromB; ++i) {
      SlotView slot;
      GPUIPC_CHILD_CHECK(prod.acquire(nullptr, std::chrono::seconds(5), slot) == Status::Ok);
      static_cast<std::uint32_t*>(slot.data)[0] = 1000 + i;
      GPUIPC_CHILD_CHECK(prod.publish(nullptr, {}, 4) == Status::Ok);
    }
    board.b_published = 1;
    ::pause();  // killed here
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return board.b_ready.load() != 0; }, 20s));

  NamespacedChild c([&] {
    board.own_pid[1] = ::getpid();
    auto s = Segment::open(seg, {.access = Access::ReadOnly});
    const auto* p = static_cast<const std::uint8_t*>(s.data());
    for (std::size_t i = 0; i < kSegmentBytes; ++i) GPUIPC_CHILD_CHECK(p[i] == pattern(i));
    auto cons = Channel::open(ch, ChannelRole::Consumer);
    board.c_joined = 1;
    for (;;) {
      MessageView m;
      const Status st = cons.receive(nullptr, std::chrono::seconds(30), m);
      if (st == Status::PeerDied) {
        board.peer_died_ns = os::monotonic_ns();
        break;
      }
      GPUIPC_CHILD_CHECK(st == Status::Ok);
      const std::uint32_t n = board.received.load();
      GPUIPC_CHILD_CHECK(n <= kFromB);
      board.values[n] = static_cast<const std::uint32_t*>(m.data)[0];
      GPUIPC_CHILD_CHECK(cons.release(nullptr) == Status::Ok);
      board.received = n + 1;
    }
    // The data outlives its creator's death (like /dev/shm), across namespaces too.
    for (std::size_t i = 0; i < kSegmentBytes; ++i) GPUIPC_CHILD_CHECK(p[i] == pattern(i));
    GPUIPC_CHILD_CHECK(cons.stats().free_slots == 8U);
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return board.c_joined.load() != 0; }, 20s));

  NamespacedChild d([&] {
    board.own_pid[2] = ::getpid();
    auto prod = Channel::open(ch, ChannelRole::Producer);
    board.d_joined = 1;
    GPUIPC_CHILD_CHECK(wait_until([&] { return board.d_go.load() != 0; }, std::chrono::seconds(30)));
    SlotView slot;
    GPUIPC_CHILD_CHECK(prod.acquire(nullptr, std::chrono::seconds(5), slot) == Status::Ok);
    static_cast<std::uint32_t*>(slot.data)[0] = 2000;
    GPUIPC_CHILD_CHECK(prod.publish(nullptr, {}, 4) == Status::Ok);
    ::pause();  // killed here
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return board.d_joined.load() != 0; }, 20s));
  ASSERT_TRUE(wait_until([&] { return board.received.load() == kFromB; }, 20s)) << board.received.load();
  for (std::uint32_t i = 0; i < kFromB; ++i) EXPECT_EQ(board.values[i].load(), 1000 + i);

  // Each is pid 1 where it runs; the broker, and `gpuipc ls` from here, see three distinct pids of this namespace.
  for (const auto& own : board.own_pid) EXPECT_EQ(own.load(), 1);
  const std::set<pid_t> host{b.host_pid(), c.host_pid(), d.host_pid()};
  ASSERT_EQ(host.size(), 3U);
  EXPECT_EQ(ls_pids(seg), (std::set<pid_t>{b.host_pid(), c.host_pid()}));
  EXPECT_EQ(ls_pids(ch), host) << "the channel's control block is mapped by B, C and D";

  // Kill B. Its references go; C keeps its membership: no PeerDied while D is a producer.
  b.kill();
  EXPECT_EQ(b.wait(), 128 + SIGKILL);
  ASSERT_TRUE(wait_until([&] { return BrokerEnvironment::references_of(seg) == 1; }, 2s))
      << BrokerEnvironment::references_of(seg) << " references to " << seg;
  EXPECT_EQ(ls_pids(seg), std::set<pid_t>{c.host_pid()});
  EXPECT_EQ(board.peer_died_ns.load(), 0) << "B's repair must not touch the consumer";
  board.d_go = 1;
  ASSERT_TRUE(wait_until([&] { return board.received.load() == kFromB + 1; }, 10s))
      << "D's message did not reach C after B's death";
  EXPECT_EQ(board.values[kFromB].load(), 2000U);
  EXPECT_EQ(board.peer_died_ns.load(), 0);

  // Kill D, the last producer: C, blocked in receive, gets PeerDied within the bound.
  ASSERT_TRUE(wait_until_sleeping(c.host_pid(), 5s));
  const std::int64_t killed = os::monotonic_ns();
  d.kill();
  EXPECT_EQ(d.wait(), 128 + SIGKILL);
  EXPECT_EQ(c.wait(), 0);
  ASSERT_NE(board.peer_died_ns.load(), 0);
  EXPECT_LT(board.peer_died_ns.load() - killed, kRepairBoundNs) << "PeerDied must reach C within 100 ms";

  Segment::unlink(seg);
  Channel::unlink(ch);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == refs0; }, 2s))
      << BrokerEnvironment::broker_references() << " references vs " << refs0;
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds0; }, 2s))
      << BrokerEnvironment::broker_fd_count() << " broker fds vs " << fds0;
}

/// Exit codes of the mount-namespace consumer when a mount step fails (the probe passed, so these are failures).
enum MountStep : int { kUnshareNs = 80, kMakePrivate, kBindRuntimeDir, kHideRuntimeDir, kPrivateDevShm };

struct MountBoard {
  std::atomic<int> joined, replied, done;
  std::atomic<std::uint32_t> values[3];
};

// A consumer that is pid 1 of its own PID namespace and has its own mount namespace, like a container: the
// runtime directory is reachable only through a bind mount at another path (the original path is covered by an
// empty tmpfs), /dev/shm is an empty tmpfs of its own, and it may not start a broker (GPUIPC_NO_AUTOSTART=1). It
// still opens the test's segment and channel, receives messages, and creates a segment the test opens: memory
// travels as fds over the socket, so the runtime directory is all it needs.
TEST(MountNamespaces, ARuntimeDirectoryBindMountedElsewhereIsAllAConsumerNeeds) {
  if (auto why = namespaces_unavailable(true)) GTEST_SKIP() << *why;
  const std::string runtime_dir = BrokerEnvironment::runtime_dir();
  TempDir mount_point("gpuipc-ctr");
  const auto seg = unique_name("seg");
  const auto ch = unique_name("ch");
  const auto reply = unique_name("reply");
  const auto refs0 = BrokerEnvironment::broker_references();
  const int fds0 = BrokerEnvironment::broker_fd_baseline();
  auto s = Segment::create(seg, kSegmentBytes, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  for (std::size_t i = 0; i < kSegmentBytes; ++i) static_cast<std::uint8_t*>(s.data())[i] = pattern(i);
  auto prod = Channel::create(ch, {.slots = 4, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                              ChannelRole::Producer);
  Shared<MountBoard> shared;
  MountBoard& board = *shared.get();

  NamespacedChild c([&] {
    // Private propagation first: without it the mounts below would show up in the test's namespace too.
    if (::unshare(CLONE_NEWNS) != 0) return static_cast<int>(kUnshareNs);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return static_cast<int>(kMakePrivate);
    if (::mount(runtime_dir.c_str(), mount_point.path().c_str(), nullptr, MS_BIND, nullptr) != 0) {
      return static_cast<int>(kBindRuntimeDir);
    }
    if (::mount("tmpfs", runtime_dir.c_str(), "tmpfs", 0, "size=64k,mode=0755") != 0) {
      return static_cast<int>(kHideRuntimeDir);
    }
    if (::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=64k,mode=1777") != 0) return static_cast<int>(kPrivateDevShm);
    ::setenv("GPUIPC_RUNTIME_DIR", mount_point.path().c_str(), 1);
    namespace fs = std::filesystem;
    GPUIPC_CHILD_CHECK(!fs::exists(runtime_dir + "/broker.sock"));
    GPUIPC_CHILD_CHECK(fs::exists(mount_point.file("broker.sock")));
    GPUIPC_CHILD_CHECK(fs::is_empty("/dev/shm"));

    auto in = Segment::open(seg, {.access = Access::ReadOnly});
    const auto* p = static_cast<const std::uint8_t*>(in.data());
    for (std::size_t i = 0; i < kSegmentBytes; ++i) GPUIPC_CHILD_CHECK(p[i] == pattern(i));
    auto cons = Channel::open(ch, ChannelRole::Consumer);
    board.joined = 1;
    for (auto& v : board.values) {
      MessageView m;
      GPUIPC_CHILD_CHECK(cons.receive(nullptr, std::chrono::seconds(10), m) == Status::Ok);
      v = static_cast<const std::uint32_t*>(m.data)[0];
      GPUIPC_CHILD_CHECK(cons.release(nullptr) == Status::Ok);
    }
    auto out = Segment::create(reply, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
    std::strcpy(static_cast<char*>(out.data()), "from the other mount namespace");
    board.replied = 1;
    GPUIPC_CHILD_CHECK(wait_until([&] { return board.done.load() != 0; }, std::chrono::seconds(30)));
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return board.joined.load() != 0 || task_state(c.host_pid()) == 'Z'; }, 20s));
  if (board.joined.load() == 0) {
    const int rc = c.wait();
    FAIL() << "the consumer ended with status " << rc << " before it joined (80-84: a mount step failed, see "
           << "MountStep; 1: a check failed)";
  }
  for (std::uint32_t i = 0; i < 3; ++i) {
    SlotView slot;
    ASSERT_EQ(prod.acquire(nullptr, 5s, slot), Status::Ok);
    static_cast<std::uint32_t*>(slot.data)[0] = 300 + i;
    ASSERT_EQ(prod.publish(nullptr, {}, 4), Status::Ok);
  }
  ASSERT_TRUE(wait_until([&] { return board.replied.load() != 0; }, 20s));
  for (std::uint32_t i = 0; i < 3; ++i) EXPECT_EQ(board.values[i].load(), 300 + i);
  {
    auto r = Segment::open(reply, {.access = Access::ReadOnly});
    EXPECT_STREQ(static_cast<const char*>(r.data()), "from the other mount namespace");
  }
  EXPECT_EQ(ls_pids(reply), std::set<pid_t>{c.host_pid()});
  // The child's mounts stayed in its namespace.
  EXPECT_TRUE(std::filesystem::exists(runtime_dir + "/broker.sock"));
  EXPECT_TRUE(std::filesystem::is_empty(mount_point.path()));
  board.done = 1;
  EXPECT_EQ(c.wait(), 0);

  prod = Channel();
  s.close();
  Segment::unlink(seg);
  Segment::unlink(reply);
  Channel::unlink(ch);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == refs0; }, 2s))
      << BrokerEnvironment::broker_references() << " references vs " << refs0;
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds0; }, 2s))
      << BrokerEnvironment::broker_fd_count() << " broker fds vs " << fds0;
}

}  // namespace
}  // namespace gpuipc::test

namespace gpuipc::test {
namespace {

// `gpuipc daemon --stop` signals the pid the kernel gives it for the broker's end of the socket, never the pid the
// broker reports of itself: from a PID namespace that cannot see the broker (the kernel says 0) it refuses and
// signals nothing. It once sent SIGTERM to the caller's namespace's process with the broker's number.
TEST(PidNamespaces, DaemonStopFromANamespaceThatCannotSeeTheBrokerSignalsNothing) {
  if (auto why = namespaces_unavailable(false)) GTEST_SKIP() << *why;
  const pid_t broker = BrokerEnvironment::broker_pid();
  ASSERT_GT(broker, 0);
  Shared<std::array<char, 512>> said;
  NamespacedChild child([&said] {
    const auto o = run_program(GPUIPC_BUILD_BIN_DIR "/gpuipc", {"daemon", "--stop"});
    std::snprintf(said.get()->data(), said.get()->size(), "%s", o.err.c_str());
    return o.exit_code;
  });
  EXPECT_EQ(child.wait(), 1) << said.get()->data();
  EXPECT_NE(std::string(said.get()->data()).find("cannot see"), std::string::npos) << said.get()->data();
  EXPECT_EQ(::kill(broker, 0), 0) << "the broker was signalled";
  EXPECT_EQ(BrokerEnvironment::broker_pid(), broker);
}

}  // namespace
}  // namespace gpuipc::test
