// gpuipcd SIGKILLed and started again (issue "Nothing lost, nothing hangs": broker death and restart): clients
// keep working through shared memory; each process's watcher (or else its next library call) starts a new broker
// and gives it back the names and memberships it still holds, with the owner and mode from the broker's journal;
// names nobody maps go after the grace time. A member that dies before it rejoined is repaired too: the journal
// names its process. A broker stopped on purpose is not started again behind its back.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <span>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "base/config.hpp"
#include "core/client.hpp"
#include "gpuipc/broker.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/liveness.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "proto/messages.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

/// SIGKILLs the broker and waits until it is gone. The next library call starts another.
void kill_broker() { ASSERT_TRUE(BrokerEnvironment::kill_broker()); }

TEST(BrokerRestart, ANameSomeoneStillMapsComesBackWithItsOwnerAndMode) {
  const auto name = unique_name();
  auto seg = Segment::create(name, 1 << 20, {.kind = SegmentKind::Host, .device = 0, .mode = 0640});
  std::memset(seg.data(), 0x5A, 1 << 20);
  const pid_t before = BrokerEnvironment::broker_pid();
  kill_broker();
  // Shared memory needs no broker: still there.
  EXPECT_EQ(static_cast<unsigned char*>(seg.data())[12345], 0x5A);
  const SegmentInfo info = Segment::stat(name);  // reconnects: a new broker, to which the name is given back
  EXPECT_NE(BrokerEnvironment::broker_pid(), before);
  EXPECT_EQ(info.owner_uid, ::getuid());
  EXPECT_EQ(info.mode, 0640U);
  EXPECT_EQ(info.kind, SegmentKind::Host);
  EXPECT_EQ(info.references, 1U);
  EXPECT_EQ(seg.id(), info.id);
  // Another process opens it by name and reads the same memory.
  EXPECT_EQ(run_child([&] {
              auto other = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(static_cast<const unsigned char*>(other.data())[777] == 0x5A);
              return 0;
            }),
            0);
  Segment::unlink(name);
}

TEST(BrokerRestart, AnUnlimitedGraceGivesANameBackToItsHolder) {
  // "unlimited" was INT64_MAX ms, which the broker turned into a grace of -1 ms: every journaled name went at
  // once, before any holder could announce it.
  ::setenv("GPUIPC_RESTORE_GRACE_MS", "unlimited", 1);  // for the broker the library starts next
  const auto name = unique_name();
  auto seg = Segment::create(name, 4096);
  kill_broker();
  EXPECT_NO_THROW((void)Segment::stat(name));
  ::unsetenv("GPUIPC_RESTORE_GRACE_MS");
  Segment::unlink(name);
}

TEST(BrokerRestart, ANameNobodyMapsWaitsItsGraceTimeThenGoes) {
  ::setenv("GPUIPC_RESTORE_GRACE_MS", "1500", 1);  // for the broker the library starts next
  const auto name = unique_name();
  {
    auto seg = Segment::create(name, 4096);
  }  // nobody maps it now: only the broker's reference keeps it
  kill_broker();
  try {
    Segment::open(name);
    ADD_FAILURE() << "opened a name whose memory died with the broker";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_NE(std::string(e.what()).find("previous broker died"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Segment::create(name, 4096), Error);  // held for its holders during the grace time
  EXPECT_TRUE(wait_until(
      [&] {
        try {
          auto again = Segment::create(name, 4096);
          return true;
        } catch (const Error&) {
          return false;
        }
      },
      10s, 100ms));
  Segment::unlink(name);
  ::unsetenv("GPUIPC_RESTORE_GRACE_MS");
}

TEST(BrokerRestart, AChannelKeepsWorkingAndAMemberKilledAfterTheRestartIsRepaired) {
  const auto name = unique_name("chan");
  ChannelOptions o;
  o.kind = SegmentKind::Host;
  o.slots = 2;
  o.slot_bytes = 64;
  auto producer = Channel::create(name, o, ChannelRole::Producer);
  SyncPipe joined, restarted;
  const pid_t consumer = start_child([&] {
    auto ch = Channel::open(name, ChannelRole::Consumer);
    joined.notify();
    const auto until = std::chrono::steady_clock::now() + 60s;  // the test kills it long before
    for (bool rebound = false; std::chrono::steady_clock::now() < until;) {
      MessageView m;
      if (ch.receive(nullptr, std::chrono::milliseconds(20), m) == Status::Ok) (void)ch.release(nullptr);
      if (!rebound && restarted.wait(0ms)) {
        (void)Segment::stat(name);  // its next broker call: reconnects, gives its names back and rejoins
        rebound = true;
        joined.notify();
      }
    }
    return 0;
  });
  ASSERT_TRUE(joined.wait(10s));
  kill_broker();
  // Without a broker, messages still flow.
  for (int i = 0; i < 20; ++i) {
    std::uint64_t seq = 0;
    ASSERT_EQ(producer.send(nullptr, &i, sizeof i, {}, std::chrono::seconds(5), seq), Status::Ok) << i;
  }
  (void)Segment::stat(name);  // the producer gives the name back first
  restarted.notify();
  ASSERT_TRUE(joined.wait(10s));
  // The consumer rejoined the new broker: its death is repaired, and the producer is told.
  ::kill(consumer, SIGKILL);
  EXPECT_EQ(wait_child(consumer), 128 + SIGKILL);
  Status st = Status::Ok;
  EXPECT_TRUE(wait_until(
      [&] {
        int v = 0;
        std::uint64_t seq = 0;
        st = producer.send(nullptr, &v, sizeof v, {}, std::chrono::milliseconds(50), seq);
        return st == Status::PeerDied;
      },
      10s))
      << "last status " << static_cast<int>(st);
  producer = Channel();
  Channel::unlink(name);
}

/// A host channel of two slots this test process produces into, and a consumer of it in a child that receives and
/// releases in host waits (no broker call of its own) `consume` messages in all, or none: it then only holds its
/// membership until it is killed. No child outlives the test.
class BrokerRestartPipeline : public ::testing::Test {
 protected:
  void start_consumer(int consume) {
    ChannelOptions o;
    o.kind = SegmentKind::Host;
    o.slots = 2;
    o.slot_bytes = 64;
    producer = Channel::create(name, o, ChannelRole::Producer);
    SyncPipe joined;
    consumer = start_child([&] {
      auto ch = Channel::open(name, ChannelRole::Consumer);
      joined.notify();
      for (int got = 0; got < consume; ++got) {
        MessageView m;
        GPUIPC_CHILD_CHECK(ch.receive(nullptr, std::chrono::seconds(30), m) == Status::Ok);
        GPUIPC_CHILD_CHECK(ch.release(nullptr) == Status::Ok);
      }
      if (consume == 0) ::pause();
      return 0;
    });
    ASSERT_TRUE(joined.wait(10s));
  }
  /// Two messages nobody has received: the ring is full, and the next acquire waits for a consumer's release (a
  /// host wait: no broker call).
  void fill() {
    for (int i = 0; i < 2; ++i) {
      std::uint64_t seq = 0;
      ASSERT_EQ(producer.send(nullptr, &i, sizeof i, {}, std::chrono::seconds(5), seq), Status::Ok) << i;
    }
  }
  void kill_consumer() {
    ::kill(consumer, SIGKILL);
    EXPECT_EQ(wait_child(consumer), 128 + SIGKILL);
    consumer = 0;
  }
  /// The next acquire (a host wait) returns PeerDied within 10 s: the last consumer was repaired.
  void expect_told_peer_died() {
    SlotView slot;
    EXPECT_EQ(producer.acquire(nullptr, std::chrono::seconds(10), slot), Status::PeerDied);
  }
  void TearDown() override {
    if (consumer > 0 && ::kill(consumer, SIGKILL) == 0) wait_child(consumer, 10s);
    producer = Channel();
    if (!unlinked) Channel::unlink(name);
  }

  std::string name = unique_name("chan");
  Channel producer;
  pid_t consumer = 0;
  bool unlinked = false;  // the test unlinked the channel
};

/// Waits, from another process (this one makes no broker call), until the broker lists each pid of `wanted` among
/// the holders of `name`, with its role containing the role beside it: their names and memberships came back. On
/// failure it prints what the broker lists and the broker's log.
bool holders_back(const std::string& name, const std::vector<std::pair<pid_t, std::string>>& wanted) {
  return run_child(
             [&] {
               const bool back = wait_until(
                   [&] {
                     try {
                       const auto hs = holders(name);
                       return std::all_of(wanted.begin(), wanted.end(), [&](const auto& w) {
                         return std::any_of(hs.begin(), hs.end(), [&](const Holder& h) {
                           return static_cast<pid_t>(h.pid) == w.first && h.role.find(w.second) != std::string::npos;
                         });
                       });
                     } catch (const Error&) {
                       return false;  // not given back yet
                     }
                   },
                   // 30 s: under a full parallel `make test` on two cores a new broker's start took long enough once
                   // that 10 s ran out (the names came back in every one of 32 reruns).
                   30s, 5ms);
               if (back) return 0;
               try {
                 for (const auto& h : holders(name))
                   std::fprintf(stderr, "holder: pid %u, %s\n", h.pid, h.role.c_str());
               } catch (const Error& e) {
                 std::fprintf(stderr, "holders: %s\n", e.what());
               }
               const auto log = read_file(BrokerEnvironment::runtime_dir() + "/broker.log");
               std::fprintf(stderr, "broker log:\n%s\n", log.value_or("(none)").c_str());
               return 1;
             },
             45s) == 0;
}

TEST_F(BrokerRestartPipeline, AProcessThatMakesNoCallGivesItsNamesAndMembershipsBackAtOnce) {
  start_consumer(0);
  fill();
  kill_broker();
  // Neither process calls the library from here on: their watchers reconnect, give the name back and rejoin.
  ASSERT_TRUE(holders_back(name, {{::getpid(), "producer"}, {consumer, "consumer"}}));
  // The consumer's connection to the new broker closes with it: repaired as ever, and the producer is told.
  kill_consumer();
  expect_told_peer_died();
}

TEST_F(BrokerRestartPipeline, AMemberThatDiedWithTheBrokerIsRepairedWhenItsChannelComesBack) {
  start_consumer(0);
  fill();
  // Stopped, it cannot rejoin: it dies while no broker watches it (as when a container's processes die together).
  ASSERT_EQ(::kill(consumer, SIGSTOP), 0);
  kill_broker();
  kill_consumer();
  // The producer's watcher gives the channel back; the new broker finds the consumer's entry in its journal, its
  // process gone, and repairs it.
  expect_told_peer_died();
}

TEST_F(BrokerRestartPipeline, AMemberThatHasNotRejoinedIsRepairedWhenItsProcessExits) {
  start_consumer(0);
  fill();
  ASSERT_EQ(::kill(consumer, SIGSTOP), 0);
  kill_broker();
  ASSERT_TRUE(holders_back(name, {{::getpid(), "producer"}}));
  // Stopped, not dead: nothing is repaired.
  SlotView slot;
  EXPECT_EQ(producer.acquire(nullptr, std::chrono::milliseconds(300), slot), Status::Timeout);
  kill_consumer();
  expect_told_peer_died();
}

TEST_F(BrokerRestartPipeline, AMemberThatRejoinsLateIsNotRepaired) {
  constexpr int kMessages = 22;
  start_consumer(kMessages);
  ASSERT_EQ(::kill(consumer, SIGSTOP), 0);
  fill();
  kill_broker();
  ASSERT_TRUE(holders_back(name, {{::getpid(), "producer"}}));
  ASSERT_EQ(::kill(consumer, SIGCONT), 0);
  ASSERT_TRUE(holders_back(name, {{consumer, "consumer"}}));
  for (int i = 2; i < kMessages; ++i) {
    std::uint64_t seq = 0;
    ASSERT_EQ(producer.send(nullptr, &i, sizeof i, {}, std::chrono::seconds(10), seq), Status::Ok) << i;
  }
  EXPECT_EQ(wait_child(consumer), 0);  // it received every message: it was never taken for dead
  consumer = 0;
}

// A channel unlinked while its members use it (a common way: unlink once everyone has opened it, so that no name
// outlives them). Before, the next broker knew nothing of it: its members kept working, but a death among them was
// never repaired again (the producer here waited until its time ran out, and no PeerDied came).
TEST_F(BrokerRestartPipeline, AMemberOfAnUnlinkedChannelThatDiedWithTheBrokerIsRepaired) {
  start_consumer(0);
  fill();
  Channel::unlink(name);
  unlinked = true;
  ASSERT_EQ(::kill(consumer, SIGSTOP), 0);
  kill_broker();
  kill_consumer();
  // The producer's watcher gives the channel back by its memory; the journal kept the consumer's entry under it.
  expect_told_peer_died();
}

// The same, its name taken by another segment, and the broker killed twice: the channel comes back under no name each
// time, and the name stays the other segment's.
TEST_F(BrokerRestartPipeline, AChannelUnlinkedWhileHeldComesBackUnderNoNameAfterEachRestart) {
  start_consumer(0);
  fill();
  Channel::unlink(name);
  unlinked = true;
  auto other = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  for (int restart = 0; restart < 2; ++restart) {
    kill_broker();
    const SegmentInfo info = Segment::stat(name);  // reconnects: this process gives back what it maps
    EXPECT_EQ(info.id, other.id());
    EXPECT_EQ(info.size, 4096U);
  }
  kill_consumer();
  expect_told_peer_died();
  other = Segment();
  Segment::unlink(name);
}

// A process's mapping of a name, bound through a broker that died, was taken for fresh once the next broker's names
// generation (counted from 1 again) reached the number it was bound at: an open of the name returned it, though the
// name stood for another segment by then.
TEST(BrokerRestart, AnOpenAfterARestartAsksWhetherTheNameStillStandsForTheSameSegment) {
  const auto name = unique_name();
  auto& client = core::BrokerClient::instance();
  Segment::unlink(Segment::create(unique_name("before"), 4096).name());  // a generation of 2 at least
  const auto created = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  const auto mine = Segment::open(name);  // cached at this generation
  const std::uint64_t bound = client.names_generation();
  ASSERT_GE(bound, 2U);
  kill_broker();
  (void)Segment::stat(name);  // reconnects: the name is given back
  ASSERT_LT(client.names_generation(), bound);
  // Another process makes the name another segment's (an unlink: one generation more).
  ASSERT_EQ(run_child([&] {
              Segment::unlink(name);
              (void)Segment::create(name, 8192, {.kind = SegmentKind::Host});
              return 0;
            }),
            0);
  while (client.names_generation() < bound) Segment::unlink(Segment::create(unique_name("bump"), 4096).name());
  ASSERT_EQ(client.names_generation(), bound);
  const auto opened = Segment::open(name);
  EXPECT_EQ(opened.size(), 8192U);
  EXPECT_NE(opened.id(), mine.id());
  Segment::unlink(name);
}

TEST(BrokerRestart, AProcessThatExitsWhileItsWatcherReconnectsExitsCleanly) {
  // exit() runs the static destructors while the watcher thread may be reconnecting (spawning a broker, saying
  // Hello, giving names back): nothing it uses may be gone from under it.
  const auto name = unique_name("exitrace");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0644});
  std::vector<int> codes;
  for (int trial = 0; trial < 30; ++trial) {
    SyncPipe ready;
    SyncPipe go;
    const pid_t kid = start_child([&, trial] {
      auto mine = Segment::open(name, {.access = Access::ReadOnly});  // maps it: the watcher runs
      ready.notify();
      if (!go.wait(10s)) return 3;
      std::this_thread::sleep_for(std::chrono::microseconds(trial * 700));
      std::exit(0);  // NOLINT(concurrency-mt-unsafe): the point of the test
    });
    ASSERT_TRUE(ready.wait(10s));
    kill_broker();
    go.notify();
    codes.push_back(wait_child(kid, 20s));
    (void)Segment::stat(name);  // a broker again, with the name
  }
  std::string bad;
  for (std::size_t i = 0; i < codes.size(); ++i) {
    if (codes[i] != 0) bad += fmt::format(" trial {}: {}", i, codes[i]);
  }
  EXPECT_TRUE(bad.empty()) << bad;
  seg = Segment();
  Segment::unlink(name);
}

// The watcher gives the names back under the connection's lock, holding a reference to each mapping meanwhile. A
// handle the program drops during that time leaves the watcher with the last reference: the mapping's Close then
// takes the lock its own thread holds (BrokerClient's mutex is recursive for this; with a plain mutex the process
// hung here, every later broker call with it). The child wraps the library's rebind hook so that the first Announce
// waits until the program has dropped its handles: the drop lands in the window every time.
namespace drop_while_giving_back {
core::BrokerClient::RebindHook g_library_hook = nullptr;
const SyncPipe* g_in_hook = nullptr;
const SyncPipe* g_dropped = nullptr;

void hook(std::uint64_t old_generation, std::uint64_t new_generation, const core::BrokerClient::Exchange& exchange) {
  bool paused = false;
  const core::BrokerClient::Exchange pausing = [&](const proto::Body& body, std::span<const int> fds) {
    if (!paused && std::holds_alternative<proto::Announce>(body)) {
      paused = true;
      g_in_hook->notify();
      (void)g_dropped->wait(10s);
    }
    return exchange(body, fds);
  };
  g_library_hook(old_generation, new_generation, pausing);
}
}  // namespace drop_while_giving_back

TEST(BrokerRestart, HandlesDroppedWhileTheWatcherGivesNamesBackDoNotHangTheProcess) {
  constexpr int kSegments = 8;
  const std::string base = unique_name("drop");
  const auto name_of = [&](int i) { return fmt::format("{}-{}", base, i); };
  SyncPipe ready;
  SyncPipe go;
  SyncPipe in_hook;
  SyncPipe dropped;
  const pid_t kid = start_child([&] {
    std::vector<Segment> segs;
    for (int i = 0; i < kSegments; ++i) segs.push_back(Segment::create(name_of(i), 4096));
    namespace d = drop_while_giving_back;
    d::g_library_hook = core::BrokerClient::rebind_hook();
    if (d::g_library_hook == nullptr) return 5;
    d::g_in_hook = &in_hook;
    d::g_dropped = &dropped;
    core::BrokerClient::instance().set_rebind_hook(&d::hook);
    ready.notify();
    if (!go.wait(10s)) return 3;
    if (!in_hook.wait(10s)) return 4;  // the watcher reconnected and is giving the names back
    segs.clear();                      // the watcher now holds the last references
    dropped.notify();
    (void)Segment::list();  // must be answered
    return 0;
  });
  ASSERT_TRUE(ready.wait(30s));
  kill_broker();
  go.notify();
  EXPECT_EQ(wait_child(kid, 20s), 0) << "3, 4: a step timed out; 5: no rebind hook; otherwise the child hung";
  for (int i = 0; i < kSegments; ++i) {
    try {
      Segment::unlink(name_of(i));
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): not given back (its process hung)
    }
  }
}

TEST(BrokerRestart, ABrokerStoppedOnPurposeIsNotStartedAgainBehindItsBack) {
  const auto name = unique_name();
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  const pid_t pid = BrokerEnvironment::broker_pid();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  ASSERT_TRUE(wait_until([&] { return ::kill(pid, 0) != 0 || task_state(pid) == 'Z'; }, 5s));
  std::this_thread::sleep_for(500ms);
  EXPECT_FALSE(broker_listening());              // this process holds a name, yet its watcher started no broker
  const SegmentInfo info = Segment::stat(name);  // the next call does, and gives the name back
  EXPECT_EQ(info.id, seg.id());
  seg = Segment();
  Segment::unlink(name);
}

TEST(BrokerRestart, AJoinThroughTheNextBrokerNamesThatBrokersIdOfTheSegment) {
  // A Join was made with the segment id of the broker the handle was opened through, then sent on the connection to
  // the next one (which numbers from 1 again): it joined whatever had that id there, or was refused.
  for (int i = 0; i < 3; ++i) {  // ids the next broker gives to the two semaphores below, not to these
    const auto pad = unique_name("pad");
    Segment::create(pad, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
    Segment::unlink(pad);
  }
  const auto a = unique_name("a"), b = unique_name("b");
  auto sa = Semaphore::create(a, {.initial = 0, .kind = SegmentKind::Host, .device = 0, .mode = 0600});
  auto sb = Semaphore::create(b, {.initial = 0, .kind = SegmentKind::Host, .device = 0, .mode = 0600});
  auto warm = Semaphore::open(a, {.role = SemaphoreRole::Signaller});
  const auto before_a = Semaphore::stat(a).signallers, before_b = Semaphore::stat(b).signallers;
  // Stopped on purpose: the watchers start no broker, so the next call reconnects itself, with its request made.
  const pid_t pid = BrokerEnvironment::broker_pid();
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  ASSERT_TRUE(wait_until([&] { return ::kill(pid, 0) != 0 || task_state(pid) == 'Z'; }, 5s));
  auto again = Semaphore::open(a, {.role = SemaphoreRole::Signaller});  // mapped already: only the Join goes out
  EXPECT_EQ(Semaphore::stat(a).signallers, before_a + 1);
  EXPECT_EQ(Semaphore::stat(b).signallers, before_b);
  again = Semaphore();
  warm = Semaphore();
  sa = Semaphore();
  sb = Semaphore();
  Semaphore::unlink(a);
  Semaphore::unlink(b);
}

TEST(BrokerRestart, TheJournalStaysSmallWhileNamesComeAndGo) {
  const auto kept = unique_name("kept");
  auto seg = Segment::create(kept, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  const std::string journal = BrokerEnvironment::runtime_dir() + "/names.journal";
  // About 170 bytes of journal a create and unlink: 16k of them would be 2.7 MB without compaction.
  for (int i = 0; i < 16000; ++i) {
    const auto name = unique_name("churn-" + std::to_string(i));
    { auto s = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600}); }
    Segment::unlink(name);
  }
  const std::string text = read_file(journal).value_or("");
  EXPECT_LT(text.size(), (1U << 20) + (64U << 10));
  EXPECT_NE(text.find("L " + kept + " "), std::string::npos);
  // And it still brings the name back.
  kill_broker();
  const std::uint64_t id = Segment::stat(kept).id;  // after it, the name has been given back (by whichever thread)
  EXPECT_EQ(id, seg.id());
  seg = Segment();
  Segment::unlink(kept);
}

}  // namespace
}  // namespace gpuipc::test
