// The process's broker connection under waits: a broker that answers late does not make this process look dead
// (its connection stays, the late answers are discarded and the references they counted given back), and an open
// that waits for its name does not hold up the process's other threads' calls.
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/config.hpp"
#include "core/client.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/liveness.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

using namespace std::chrono_literals;

pid_t this_thread_id() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

/// Sets an environment variable for the scope (this test's thread is the only one that reads it meanwhile).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : m_name(name) {
    if (const char* old = std::getenv(name)) m_old = old;  // NOLINT(concurrency-mt-unsafe)
    ::setenv(name, value, 1);                              // NOLINT(concurrency-mt-unsafe)
  }
  ~ScopedEnv() {
    if (m_old) {
      ::setenv(m_name, m_old->c_str(), 1);  // NOLINT(concurrency-mt-unsafe)
    } else {
      ::unsetenv(m_name);  // NOLINT(concurrency-mt-unsafe)
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* m_name;
  std::optional<std::string> m_old;
};

/// Stops the broker (SIGSTOP) for the scope: it takes requests and answers none until it continues.
class StoppedBroker {
 public:
  StoppedBroker() : m_pid(BrokerEnvironment::broker_pid()) { m_ok = ::kill(m_pid, SIGSTOP) == 0; }
  ~StoppedBroker() { resume(); }
  StoppedBroker(const StoppedBroker&) = delete;
  StoppedBroker& operator=(const StoppedBroker&) = delete;
  bool ok() const noexcept { return m_ok; }
  void resume() {
    if (m_ok) ::kill(m_pid, SIGCONT);
    m_ok = false;
  }

 private:
  pid_t m_pid;
  bool m_ok = false;
};

/// The sockets this process has open ("socket:[inode]", from /proc/self/fd).
std::set<std::string> socket_fds() {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    std::error_code link_ec;
    const std::string target = std::filesystem::read_symlink(entry.path(), link_ec).string();
    if (!link_ec && target.starts_with("socket:")) out.insert(target);
  }
  return out;
}

/// The code of the Error `call` threw; nullopt when it returned.
std::optional<ErrorCode> code_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.code();
  }
  return std::nullopt;
}

TEST(BrokerClient, ABrokerThatAnswersLateDoesNotTakeThisProcessForDead) {
  const auto seg_name = unique_name("late");
  const auto sem_name = unique_name("latesem");
  auto seg = Segment::create(seg_name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  auto sem = Semaphore::create(sem_name, {.kind = SegmentKind::Host});  // this process is its signaller
  {
    const ScopedEnv env("GPUIPC_CONNECT_TIMEOUT_MS", "300");
    StoppedBroker stopped;
    ASSERT_TRUE(stopped.ok());
    EXPECT_EQ(code_of([&] { (void)Segment::stat(seg_name); }), ErrorCode::Timeout);
    // Answered once the broker continues, with a reference this process never maps: given back then.
    EXPECT_EQ(code_of([&] { (void)Segment::open(seg_name, {.access = Access::ReadOnly}); }), ErrorCode::Timeout);
  }
  // The next calls get their own answers, on the same connection: the broker never saw this process go.
  EXPECT_EQ(Segment::stat(seg_name).id, seg.id());
  bool signaller = false;
  for (const auto& h : holders(sem_name)) signaller |= h.pid == static_cast<std::uint32_t>(::getpid());
  EXPECT_TRUE(signaller) << "this process is no longer a holder of its semaphore";
  // Had the broker taken it for dead, its semaphore would be poisoned: waits would give PeerDied.
  EXPECT_EQ(sem.wait_host(1, 100ms).status, Status::Timeout);
  sem.signal_host(1);
  EXPECT_EQ(sem.wait_host(1, 1s).status, Status::Ok);
  // The late Open's reference was given back: only the creator's is left.
  EXPECT_TRUE(wait_until([&] { return Segment::stat(seg_name).references == 1; }, 5s))
      << Segment::stat(seg_name).references << " references";
  sem = Semaphore();
  Semaphore::unlink(sem_name);
  seg = Segment();
  Segment::unlink(seg_name);
}

TEST(BrokerClient, CallsToAStoppedBrokerTimeOutOneByOneAndNeverHang) {
  const auto name = unique_name("stopped");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  {
    const ScopedEnv env("GPUIPC_CONNECT_TIMEOUT_MS", "20");
    StoppedBroker stopped;
    ASSERT_TRUE(stopped.ok());
    // More requests than the broker's socket queues and than the client leaves unanswered (64): each ends in
    // Timeout, none blocks in a send to a full queue.
    for (int i = 0; i < 100; ++i) {
      EXPECT_EQ(code_of([&] { (void)Segment::stat(name); }), ErrorCode::Timeout) << i;
    }
  }
  EXPECT_TRUE(wait_until([&] { return Segment::stat(name).id == seg.id(); }, 10s));
  seg = Segment();
  Segment::unlink(name);
}

TEST(BrokerClient, AChildForkedWhileTheProcessConnectsDoesNotKeepItsConnection) {
  // A child forked by another thread while the process connects (here: waiting on a stopped broker's full
  // backlog) must not keep the connection: the broker would not see the process die while the child lives, and
  // would repair nothing. The connection's socket used to be made before, and recorded for the fork handler only
  // after, the connect.
  const auto name = unique_name("forkconn");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  const std::uint64_t base = BrokerEnvironment::references_of(name);
  SyncPipe go;
  SyncPipe forked;
  SyncPipe opened;
  Shared<std::atomic<pid_t>> grandchild;
  const pid_t proc = start_child([&] {
    GPUIPC_CHILD_CHECK(go.wait(10s));
    const std::set<std::string> before = socket_fds();
    std::thread forker([&] {
      // The main thread is in its connect once its new socket exists and it sleeps (between two attempts: the
      // broker is stopped, its backlog full).
      const bool connecting = wait_until(
          [&] {
            return std::ranges::any_of(socket_fds(), [&](const std::string& s) { return !before.contains(s); }) &&
                   task_state(::getpid()) == 'S';
          },
          10s);
      if (!connecting) {  // the parent's wait for `forked` fails the test
        report_child_failure(__FILE__, __LINE__, "the main thread never waited in its connect");
        return;
      }
      const pid_t kid = ::fork();
      if (kid == 0) {
        ::pause();  // lives on, holding whatever fds it inherited
        ::_exit(0);
      }
      grandchild[0] = kid;
      forked.notify();
    });
    const Segment opened_seg = Segment::open(name);  // connects: waits until the broker continues
    forker.join();
    opened.notify();
    ::pause();
    return 0;
  });
  {
    StoppedBroker stopped;
    ASSERT_TRUE(stopped.ok());
    std::vector<os::UniqueFd> backlog;  // fills the listener's queue, so that a connect waits
    for (int i = 0; i < 4096; ++i) {
      try {
        backlog.push_back(os::connect_seqpacket(config::socket_path(), 0ms));
      } catch (const Error& e) {
        ASSERT_EQ(e.code(), ErrorCode::Timeout) << e.what();
        break;
      }
    }
    go.notify();
    ASSERT_TRUE(forked.wait(10s));
    stopped.resume();
  }
  ASSERT_TRUE(opened.wait(10s));
  EXPECT_EQ(BrokerEnvironment::references_of(name), base + 1);
  ::kill(proc, SIGKILL);
  EXPECT_EQ(wait_child(proc), 128 + SIGKILL);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::references_of(name) == base; }, 5s))
      << BrokerEnvironment::references_of(name) << " references: the killed process's connection is still open";
  ::kill(grandchild[0].load(), SIGKILL);  // reparented: reaped by init (or the subreaper)
  seg = Segment();
  Segment::unlink(name);
}

/// A counting semaphore of one permit this process created (`mine`), and a child process that holds the permit.
class OnePermit {
 public:
  explicit OnePermit(const std::string& suffix)
      : name(unique_name(suffix)), mine(CountingSemaphore::create(name, {.initial = 1, .max_count = 1})) {}
  ~OnePermit() {
    mine = CountingSemaphore();
    CountingSemaphore::unlink(name);
  }
  OnePermit(const OnePermit&) = delete;
  OnePermit& operator=(const OnePermit&) = delete;

  /// Starts the child: it opens the semaphore (and joins semaphore `signals` as a signaller, when given), takes the
  /// permit, then runs `then` (its result is the child's exit code). Returns once the child holds the permit.
  pid_t start_holder(const std::function<int(CountingSemaphore&)>& then, const std::string& signals = {}) {
    SyncPipe held;
    const pid_t pid = start_child([&] {
      auto sem = CountingSemaphore::open(name);
      const Semaphore sig =
          signals.empty() ? Semaphore() : Semaphore::open(signals, {.role = SemaphoreRole::Signaller});
      GPUIPC_CHILD_CHECK(sem.acquire(1, 5s) == Status::Ok);
      held.notify();
      return then(sem);
    });
    EXPECT_TRUE(held.wait(10s));
    return pid;
  }

  /// Whether the permit stays with the holder past the grace a member that has not rejoined gets.
  bool stays_held() { return mine.acquire(1, BrokerEnvironment::kRejoinGrace + 1s) == Status::Timeout; }

  /// SIGKILLs the holder: its death gives the permit back.
  void kill_holder(pid_t holder) {
    ::kill(holder, SIGKILL);
    EXPECT_EQ(wait_child(holder), 128 + SIGKILL);
    EXPECT_EQ(mine.acquire(1, 10s), Status::Ok) << "the holder's death was not repaired";
    mine.release(1);
  }

  const std::string name;
  CountingSemaphore mine;
};

// A process's connection can close while it lives: the broker cuts one whose replies go unread or whose request
// fails; the library drops one to a broker that left its requests unanswered. Its members used to be repaired at
// once, as if it had died: a counting semaphore's permit went to another process while it held it (two processes in
// a critical section of one), its semaphores were poisoned while it signalled. It keeps them, reconnects and
// rejoins; its death after that is repaired as any other.
TEST(BrokerClient, AHolderWhoseConnectionClosesWhileItRunsKeepsItsPermitAndItsDeathIsStillRepaired) {
  OnePermit permit("lostconn");
  SyncPipe shut;
  SyncPipe go;
  SyncPipe again;
  const pid_t holder = permit.start_holder([&](CountingSemaphore& sem) {
    GPUIPC_CHILD_CHECK(shut_broker_connections() > 0);
    shut.notify();
    GPUIPC_CHILD_CHECK(go.wait(20s));
    GPUIPC_CHILD_CHECK(sem.held() == 1U);
    sem.release(1);  // still its own: not an over-release
    GPUIPC_CHILD_CHECK(sem.acquire(1, 5s) == Status::Ok);
    again.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(shut.wait(10s));
  EXPECT_TRUE(permit.stays_held()) << "the permit of a holder whose connection closed was given to another";
  go.notify();
  ASSERT_TRUE(again.wait(10s));
  permit.kill_holder(holder);  // after it rejoined
}

// The same when the library drops the connection itself: a stopped broker left 64 requests unanswered. Once the
// broker runs again, the process reconnects at once and rejoins (its watcher), within the grace.
TEST(BrokerClient, AConnectionTheLibraryDropsForUnansweredRequestsLeavesItsMembersToIt) {
  OnePermit permit("dropped");
  auto signaller = Semaphore::create(unique_name("droppedsem"), {.kind = SegmentKind::Host});
  const std::string sem_name = signaller.name();
  SyncPipe go;
  SyncPipe dropped;
  const pid_t holder = permit.start_holder(
      [&](CountingSemaphore&) {
        GPUIPC_CHILD_CHECK(go.wait(20s));  // the broker is stopped
        {
          const ScopedEnv env("GPUIPC_CONNECT_TIMEOUT_MS", "20");
          // Each times out unanswered (the broker is stopped); the library drops the connection past 64.
          for (int i = 0; i < 80; ++i) GPUIPC_CHILD_CHECK(code_of([&] { (void)Segment::stat(sem_name); }).has_value());
        }
        dropped.notify();
        ::pause();
        return 0;
      },
      sem_name);
  signaller = Semaphore();  // the child is its only signaller now
  auto waiter = Semaphore::open(sem_name, {.role = SemaphoreRole::Waiter});
  {
    StoppedBroker stopped;
    ASSERT_TRUE(stopped.ok());
    go.notify();
    ASSERT_TRUE(dropped.wait(30s));
  }
  EXPECT_TRUE(permit.stays_held())
      << "the permit of a holder whose library dropped its connection was given to another";
  EXPECT_EQ(waiter.status(), Status::Ok) << "poisoned while its signaller runs";
  permit.kill_holder(holder);
  EXPECT_EQ(waiter.wait_host(1, 10s).status, Status::PeerDied);
  waiter = Semaphore();
  Semaphore::unlink(sem_name);
}

// A process that exec's loses its connection (close-on-exec) and keeps its pid, running a program that will never
// rejoin: its members are repaired once the grace has run out, while it still runs.
TEST(BrokerClient, AMemberThatExecsIsRepairedOnceTheGraceRunsOut) {
  OnePermit permit("execs");
  const pid_t holder = permit.start_holder([](CountingSemaphore&) {
    ::execlp("sleep", "sleep", "60", static_cast<char*>(nullptr));
    return 2;
  });
  EXPECT_EQ(permit.mine.acquire(1, BrokerEnvironment::kRejoinGrace + 10s), Status::Ok);
  EXPECT_TRUE(os::process_alive(holder) && task_state(holder) != 'Z') << "the program it exec'd has exited";
  ::kill(holder, SIGKILL);
  EXPECT_EQ(wait_child(holder), 128 + SIGKILL);
  permit.mine.release(1);
}

TEST(BrokerClient, AJoinAnsweredAfterItsTimeoutIsLeftAgain) {
  // A Join given up on (the broker stopped) whose answer comes late: the member entry it took must be left, or the
  // semaphore keeps a signaller nobody uses. Its last real signaller's close would then not poison it (Closed),
  // and its waiters would wait until this process exited.
  const auto name = unique_name("latejoin");
  auto creator = Semaphore::create(name, {.kind = SegmentKind::Host});  // a signaller
  auto waiter = Semaphore::open(name, {.role = SemaphoreRole::Waiter});
  const Segment seg = Segment::open(name);  // read-write: may Join
  auto& client = core::BrokerClient::instance();
  {
    const ScopedEnv env("GPUIPC_CONNECT_TIMEOUT_MS", "300");
    StoppedBroker stopped;
    ASSERT_TRUE(stopped.ok());
    EXPECT_EQ(
        code_of([&] {
          (void)client.request(proto::Join{seg.id(), static_cast<std::uint8_t>(proto::Role::Signaller)}, {}, 300ms);
        }),
        ErrorCode::Timeout);
  }
  // The next call reads the late answer and leaves the entry (the Leave goes before this call's request).
  (void)Segment::stat(name);
  creator = Semaphore();  // the last signaller leaves: poisoned, Closed
  EXPECT_EQ(waiter.wait_host(1, 5s).status, Status::Closed);
  waiter = Semaphore();
  Semaphore::unlink(name);
}

TEST(BrokerClient, ACreateAnsweredAfterItsTimeoutLeavesNoNameBehind) {
  // A Create given up on (the broker stopped) whose answer comes late: the broker registered the name and holds the
  // memory, which nobody holds any more (the caller had its Timeout and let its memory go). The name must go again,
  // or the memory (a GPU allocation, for a device segment) stays until someone unlinks a name they never got.
  const auto name = unique_name("latecreate");
  const int fds_before = BrokerEnvironment::broker_fd_baseline();
  {
    const ScopedEnv env("GPUIPC_CONNECT_TIMEOUT_MS", "300");
    StoppedBroker stopped;
    ASSERT_TRUE(stopped.ok());
    EXPECT_EQ(code_of([&] { (void)Segment::create(name, 1 << 20, {.kind = SegmentKind::Host, .mode = 0600}); }),
              ErrorCode::Timeout);
  }
  // The next call reads the late answer and undoes it (its requests go before this call's).
  (void)Segment::list();
  EXPECT_EQ(code_of([&] { (void)Segment::stat(name); }), ErrorCode::NotFound)
      << "the name of the abandoned Create is still registered";
  for (const auto& info : Segment::list()) EXPECT_NE(info.name, name);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds_before; }, 5s))
      << "the broker still holds the abandoned segment's memory: " << BrokerEnvironment::broker_fd_count() << " fds, "
      << fds_before << " before";
  // The name is free for a new Create. (That UnlinkId spares a segment made since under the same name is the next
  // test's.)
  auto again = Segment::create(name, 4096, {.kind = SegmentKind::Host, .mode = 0600});
  EXPECT_EQ(Segment::stat(name).id, again.id());
  again = Segment();
  Segment::unlink(name);
}

TEST(BrokerClient, AnUnlinkByIdRemovesOnlyTheNameOfThatSegment) {
  // UnlinkId names a segment, not a name: after an unlink and a new Create under the same name, the old id finds
  // nothing and the new segment keeps its name. Owner-or-root, like Unlink.
  const auto name = unique_name("unlinkid");
  auto& client = core::BrokerClient::instance();
  auto first = Segment::create(name, 4096, {.kind = SegmentKind::Host, .mode = 0600});
  const std::uint64_t old_id = first.id();
  Segment::unlink(name);
  auto second = Segment::create(name, 4096, {.kind = SegmentKind::Host, .mode = 0600});
  EXPECT_EQ(code_of([&] { (void)client.request(proto::UnlinkId{old_id}, {}, 5s); }), ErrorCode::NotFound);
  EXPECT_EQ(Segment::stat(name).id, second.id());
  EXPECT_EQ(code_of([&] { (void)client.request(proto::UnlinkId{old_id + 1000000}, {}, 5s); }), ErrorCode::NotFound);
  (void)client.request(proto::UnlinkId{second.id()}, {}, 5s);
  EXPECT_EQ(code_of([&] { (void)Segment::stat(name); }), ErrorCode::NotFound);
  EXPECT_EQ(code_of([&] { (void)client.request(proto::UnlinkId{second.id()}, {}, 5s); }), ErrorCode::NotFound);
  first = Segment();
  second = Segment();
}

TEST(BrokerClient, AnOpenThatWaitsForItsNameDoesNotHoldUpTheProcesssOtherCalls) {
  const auto waited = unique_name("waited");
  const auto other = unique_name("other");
  std::atomic<pid_t> waiter_tid{0};
  std::optional<Segment> opened;
  std::optional<ErrorCode> failed;
  std::thread waiter([&] {
    waiter_tid = this_thread_id();
    try {
      opened = Segment::open(waited, {.access = Access::ReadWrite, .wait = 10s});
    } catch (const Error& e) {
      failed = e.code();
    }
  });
  ASSERT_TRUE(wait_until([&] { return waiter_tid.load() != 0; }, 5s));
  ASSERT_TRUE(wait_until_sleeping(waiter_tid.load(), 5s));
  // While it waits, this thread's calls are answered: had the open held the connection, this create would wait
  // until the open gave up (NotFound, 10 s), and the name it waits for would come too late.
  auto second = Segment::create(other, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  EXPECT_EQ(Segment::stat(other).id, second.id());
  auto first = Segment::create(waited, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  waiter.join();
  EXPECT_EQ(failed, std::nullopt);
  ASSERT_TRUE(opened.has_value());
  EXPECT_EQ(opened->id(), first.id());
  opened.reset();
  first = Segment();
  second = Segment();
  Segment::unlink(waited);
  Segment::unlink(other);
}

TEST(BrokerClient, OpensThatWaitInSeveralThreadsEachGetTheirOwnAnswer) {
  constexpr int kThreads = 4;
  std::vector<std::string> names;
  for (int i = 0; i < kThreads; ++i) names.push_back(unique_name("many" + std::to_string(i)));
  std::vector<std::optional<Segment>> opened(kThreads);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> waiters;
  struct JoinAll {
    std::vector<std::thread>& threads;
    ~JoinAll() {
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } join_all{waiters};
  for (int i = 0; i < kThreads; ++i) {
    waiters.emplace_back([&, i] {
      try {
        opened[i] = Segment::open(names[i], {.access = Access::ReadWrite, .wait = 20s});
      } catch (const Error& e) {
        errors[i] = e.what();
      }
    });
  }
  // Created in the reverse order: each answer is read by whichever thread reads the connection, and reaches its own.
  std::vector<Segment> made;
  for (int i = kThreads - 1; i >= 0; --i) {
    std::this_thread::sleep_for(20ms);
    made.push_back(Segment::create(names[i], 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600}));
  }
  for (auto& t : waiters) t.join();
  for (int i = 0; i < kThreads; ++i) {
    ASSERT_TRUE(opened[i].has_value()) << names[i] << ": " << errors[i];
    EXPECT_EQ(opened[i]->id(), made[kThreads - 1 - i].id()) << names[i];
  }
  opened.clear();
  made.clear();
  for (const auto& n : names) Segment::unlink(n);
}

TEST(BrokerClient, AnOpenThatWaitsGivesUpAtItsWait) {
  const auto name = unique_name("never");
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(code_of([&] { (void)Segment::open(name, {.access = Access::ReadWrite, .wait = 300ms}); }),
            ErrorCode::Timeout);  // the broker's answer
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
  // The connection is as it was: the next call is answered.
  EXPECT_EQ(code_of([&] { (void)Segment::stat(name); }), ErrorCode::NotFound);
}

}  // namespace
}  // namespace gpuipc::test
