// Liveness across real processes: who holds a name (pid, role), and a Watcher (and `gpuipc watch`) seeing a join,
// a leave, a SIGKILLed holder's death and a missed heartbeat, each within a bound.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <fstream>
#include <sstream>
#include <thread>

#include "gpuipc/channel.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/liveness.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "os/process.hpp"
#include "proto/messages.hpp"
#include "support/broker_env.hpp"
#include "support/raw_client.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

/// The next event within 5 s, failing the test when none comes.
WatchEvent next_event(Watcher& w) {
  auto e = w.next(5s);
  if (!e) {
    ADD_FAILURE() << "no event within 5 s";
    return {};
  }
  return *e;
}

TEST(Liveness, HoldersListsPidsAndRoles) {
  const auto name = unique_name("live");
  auto sem = CountingSemaphore::create(name, {.initial = 1, .max_count = 1});
  SyncPipe ready;
  const pid_t reader = start_child([&] {
    auto seg = Segment::open(name, {.access = Access::ReadOnly});
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  const auto hs = holders(name);
  ASSERT_EQ(hs.size(), 2U);
  const auto me = std::find_if(hs.begin(), hs.end(),
                               [](const Holder& h) { return h.pid == static_cast<std::uint32_t>(::getpid()); });
  const auto them =
      std::find_if(hs.begin(), hs.end(), [&](const Holder& h) { return h.pid == static_cast<std::uint32_t>(reader); });
  ASSERT_NE(me, hs.end());
  ASSERT_NE(them, hs.end());
  EXPECT_EQ(me->role, "creator+holder");
  EXPECT_TRUE(me->read_write);
  EXPECT_EQ(them->role, "read-only");
  EXPECT_FALSE(them->read_write);
  EXPECT_EQ(them->uid, static_cast<std::uint32_t>(::getuid()));
  ::kill(reader, SIGKILL);
  EXPECT_EQ(wait_child(reader), 128 + SIGKILL);
  EXPECT_TRUE(wait_until([&] { return holders(name).size() == 1; }, 5s));
  try {
    (void)holders(name + "-none");
    ADD_FAILURE() << "holders of a missing name";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
  }
  CountingSemaphore::unlink(name);
}

TEST(Liveness, AStatOrAListingIsNoHolderWatchersHearOf) {
  // stat() and the CLI's listings (gpuipc ls, stat, top) open a control block to read it: every one of them reached
  // the watchers as a join and a leave (`gpuipc watch --count 1` ended at the first `gpuipc ls`), and holders()
  // listed it meanwhile.
  const auto sem = unique_name("look-sem"), ch = unique_name("look-ch"), cs = unique_name("look-cs"),
             pool = unique_name("look-pool");
  auto s = Semaphore::create(sem, {.initial = 0, .kind = SegmentKind::Host, .device = 0, .mode = 0600});
  auto c = Channel::create(ch, {.slots = 2, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                           ChannelRole::Producer);
  auto k = CountingSemaphore::create(cs, {.initial = 1, .max_count = 1});
  auto p = Pool::create(pool, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 16, .max_bytes = 1 << 16});
  std::vector<Watcher> watchers;
  for (const auto& n : {sem, ch, cs, pool}) watchers.push_back(Watcher::watch(n));
  EXPECT_EQ(run_child([&] {
              GPUIPC_CHILD_CHECK(Semaphore::stat(sem).signallers == 1);
              GPUIPC_CHILD_CHECK(Channel::stat(ch).producers == 1);
              GPUIPC_CHILD_CHECK(CountingSemaphore::stat(cs).available == 1);
              GPUIPC_CHILD_CHECK(Pool::stat(pool).chunks <= 1);
              return 0;
            }),
            0);
  const std::string cli = std::string(GPUIPC_BUILD_BIN_DIR) + "/gpuipc";
  EXPECT_EQ(wait_child(start_program(cli, {"ls"}, {}, -1, "/dev/null")), 0);
  EXPECT_EQ(wait_child(start_program(cli, {"stat", ch}, {}, -1, "/dev/null")), 0);
  // A holder now: the first event each watcher hears is its join.
  SyncPipe go;
  const pid_t holder = start_child([&] {
    auto held = Segment::open(sem, {.access = Access::ReadOnly});
    GPUIPC_CHILD_CHECK(go.wait(10s));
    return 0;
  });
  const auto e = next_event(watchers[0]);
  EXPECT_EQ(e.event, LivenessEvent::Joined);
  EXPECT_EQ(e.holder.pid, static_cast<std::uint32_t>(holder));
  for (std::size_t i = 1; i < watchers.size(); ++i) EXPECT_FALSE(watchers[i].next(0ns).has_value()) << i;
  go.notify();
  EXPECT_EQ(wait_child(holder), 0);
  s = Semaphore();
  c = Channel();
  k = CountingSemaphore();
  p = Pool();
  Semaphore::unlink(sem);
  Channel::unlink(ch);
  CountingSemaphore::unlink(cs);
  Pool::unlink(pool);
}

TEST(Liveness, WatcherSeesJoinLeaveDeathAndAHungHeartbeat) {
  const auto name = unique_name("live");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  auto w = Watcher::watch(name);
  ASSERT_GE(w.fd(), 0);
  EXPECT_FALSE(w.next(0ns).has_value());  // nothing yet

  // A join and a leave.
  SyncPipe go;
  const pid_t visitor = start_child([&] {
    auto s = Segment::open(name);
    GPUIPC_CHILD_CHECK(go.wait(10s));
    s.close();
    return 0;
  });
  pollfd p{w.fd(), POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);  // the fd says an event waits
  auto e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Joined);
  EXPECT_EQ(e.holder.pid, static_cast<std::uint32_t>(visitor));
  EXPECT_EQ(e.name, name);
  EXPECT_EQ(e.holder.role, "read-write");
  go.notify();
  e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Left);
  EXPECT_EQ(e.holder.pid, static_cast<std::uint32_t>(visitor));
  EXPECT_EQ(wait_child(visitor), 0);

  // A SIGKILLed holder: Died.
  SyncPipe ready;
  const pid_t victim = start_child([&] {
    auto s = Segment::open(name, {.access = Access::ReadOnly});
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Joined);
  ::kill(victim, SIGKILL);
  e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Died);
  EXPECT_EQ(e.holder.pid, static_cast<std::uint32_t>(victim));
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);

  // A heartbeat with a 100 ms deadline, then silence: Hung after about 100 ms; a beat again: Alive.
  SyncPipe beat_again;
  const pid_t beater = start_child([&] {
    auto s = Segment::open(name);
    heartbeat(name, 100ms);
    GPUIPC_CHILD_CHECK(beat_again.wait(10s));
    heartbeat(name, 100ms);
    heartbeat(name, 0ms);  // stops: no Hung after this
    ::usleep(300'000);
    return 0;
  });
  e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Joined);
  const std::int64_t joined = os::monotonic_ns();
  e = next_event(w);
  const std::int64_t hung = os::monotonic_ns() - joined;
  EXPECT_EQ(e.event, LivenessEvent::Hung);
  EXPECT_EQ(e.holder.pid, static_cast<std::uint32_t>(beater));
  EXPECT_EQ(e.holder.heartbeat, HeartbeatState::Hung);
  EXPECT_EQ(e.holder.heartbeat_deadline, 100ms);
  EXPECT_GE(hung, 50'000'000);
  EXPECT_LT(hung, 1'000'000'000);
  const auto listed = holders(name);
  EXPECT_TRUE(std::any_of(listed.begin(), listed.end(), [&](const Holder& h) {
    return h.pid == static_cast<std::uint32_t>(beater) && h.heartbeat == HeartbeatState::Hung;
  }));
  beat_again.notify();
  e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Alive);
  e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Left);  // its Segment closes on the way out
  EXPECT_EQ(wait_child(beater), 0);
  EXPECT_FALSE(w.next(200ms).has_value());  // it stopped beating before it left: no Hung after Alive
  Segment::unlink(name);
}

// A connection can close while its process lives on (the broker cuts one whose replies go unread, the library drops
// one to a broker that leaves its requests unanswered): its library reconnects and gives its segments back. Its
// watchers used to be told it died (and a supervisor would restart a live worker). They hear of its death when it
// dies.
TEST(Liveness, AHolderWhoseConnectionClosesWhileItRunsIsNotReportedDead) {
  const auto name = unique_name("live");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  auto w = Watcher::watch(name);
  SyncPipe ready, shut, cut;
  const pid_t holder = start_child([&] {
    auto s = Segment::open(name);
    ready.notify();
    GPUIPC_CHILD_CHECK(shut.wait(10s));
    GPUIPC_CHILD_CHECK(shut_broker_connections() > 0);
    cut.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  auto e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Joined);
  shut.notify();
  ASSERT_TRUE(cut.wait(10s));
  const auto deadline = std::chrono::steady_clock::now() + BrokerEnvironment::kRejoinGrace + 1s;
  while (std::chrono::steady_clock::now() < deadline) {
    const auto other = w.next(100ms);
    if (other) {
      EXPECT_NE(other->event, LivenessEvent::Died) << "a live process was reported dead";
    }
  }
  const auto now = holders(name);
  EXPECT_TRUE(std::any_of(now.begin(), now.end(), [&](const Holder& h) {
    return h.pid == static_cast<std::uint32_t>(holder);
  })) << "it did not give the segment back";
  ::kill(holder, SIGKILL);
  e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Died);
  EXPECT_EQ(e.holder.pid, static_cast<std::uint32_t>(holder));
  EXPECT_EQ(wait_child(holder), 128 + SIGKILL);
}

// A holder whose connection closed and that does not come back while it runs (it exec'd, or cannot reach the
// broker) is reported dead when the rejoin grace runs out.
TEST(Liveness, AHolderThatDoesNotComeBackWithinTheGraceIsReportedDead) {
  const auto name = unique_name("live");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  auto w = Watcher::watch(name);
  SyncPipe opened, go;
  const pid_t holder = start_child([&] {
    auto sock = raw_hello(static_cast<std::uint32_t>(::getpid()));
    const auto reply = raw_request(sock.get(), 2, proto::Open{name, proto::Access::ReadOnly, 0});
    GPUIPC_CHILD_CHECK(std::holds_alternative<proto::OpenReply>(reply.body));
    opened.notify();
    GPUIPC_CHILD_CHECK(go.wait(10s));
    GPUIPC_CHILD_CHECK(::shutdown(sock.get(), SHUT_RDWR) == 0);
    ::pause();
    return 0;
  });
  ASSERT_TRUE(opened.wait(10s));
  auto e = next_event(w);
  EXPECT_EQ(e.event, LivenessEvent::Joined);
  const auto before_cut = std::chrono::steady_clock::now();
  go.notify();
  e = next_event(w);  // within 5 s: the grace is 2
  EXPECT_EQ(e.event, LivenessEvent::Died);
  EXPECT_EQ(e.holder.pid, static_cast<std::uint32_t>(holder));
  // Not a timing bound: before the grace ran out the process was alive, and it is not dead to its watchers.
  EXPECT_GE(std::chrono::steady_clock::now() - before_cut, BrokerEnvironment::kRejoinGrace) << "told before the grace";
  ::kill(holder, SIGKILL);
  EXPECT_EQ(wait_child(holder), 128 + SIGKILL);
}

TEST(Liveness, AWatcherThatFallsBehindIsToldLostAndIsNotCutOff) {
  // Whoever may open a watched name makes events at will. A watcher that does not keep up was cut off once 256
  // waited; now the broker drops them and says Lost once the watcher has read what waits.
  const auto name = unique_name("flood");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  auto watcher = Watcher::watch(name);
  auto sock = raw_hello(1, "toggler");
  std::uint32_t rid = 2;
  for (int i = 0; i < 1500; ++i) {  // 3000 events, none read meanwhile
    std::vector<os::UniqueFd> fds;
    const auto r = raw_request(sock.get(), rid++, proto::Open{name, proto::Access::ReadOnly, 0}, {}, &fds);
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(r.body));
    ASSERT_TRUE(std::holds_alternative<proto::OkReply>(
        raw_request(sock.get(), rid++, proto::Close{std::get<proto::OpenReply>(r.body).info.id}).body));
  }
  int before = 0;
  bool lost = false;
  while (auto e = watcher.next(2s)) {
    if (e->event == LivenessEvent::Lost) {
      EXPECT_EQ(e->name, name);
      EXPECT_EQ(e->holder.pid, 0U);
      EXPECT_EQ(to_string(e->event), "lost");
      lost = true;
      break;
    }
    ++before;
  }
  EXPECT_TRUE(lost) << "no Lost after " << before << " events";
  EXPECT_LT(before, 3000);
  // Still watching: the next change comes.
  std::vector<os::UniqueFd> fds;
  const auto r = raw_request(sock.get(), rid++, proto::Open{name, proto::Access::ReadOnly, 0}, {}, &fds);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(r.body));
  std::optional<WatchEvent> joined;
  while ((joined = watcher.next(2s)) && joined->event != LivenessEvent::Joined) {
  }
  ASSERT_TRUE(joined.has_value());
  EXPECT_EQ(joined->holder.pid, static_cast<std::uint32_t>(::getpid()));
  sock.reset();
  seg = Segment();
  Segment::unlink(name);
}

TEST(Liveness, WatcherFdIsReadableForAnEventReadWhileAddWaitedForItsReply) {
  const auto first = unique_name("livq");
  const auto second = unique_name("livq2");
  auto a = Segment::create(first, 4096, {.kind = SegmentKind::Host});
  auto b = Segment::create(second, 4096, {.kind = SegmentKind::Host});
  auto w = Watcher::watch(first);
  SyncPipe done;
  const pid_t visitor = start_child([&] {
    auto s = Segment::open(first);
    GPUIPC_CHILD_CHECK(done.wait(10s));
    return 0;
  });
  // The broker sent the Joined event before it answered this (one thread, in order): it waits on the socket.
  ASSERT_TRUE(wait_until([&] { return holders(first).size() == 2; }, 5s));
  w.add(second);  // reads that event off the socket while it waits for its reply, and queues it
  pollfd p{w.fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 1);  // still readable: the event is there for next()
  const auto e = w.next(0ns);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->event, LivenessEvent::Joined);
  EXPECT_EQ(::poll(&p, 1, 0), 0);  // and no longer once it was taken
  done.notify();
  EXPECT_EQ(wait_child(visitor), 0);
}

TEST(Liveness, AHeartbeatUnderANameThatIsUnlinkedEndsWithoutAFalseHung) {
  const auto name = unique_name("livu");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  auto w = Watcher::watch(name);
  heartbeat(name, 100ms);
  Segment::unlink(name);  // this process still holds it, alive: no more heartbeats can name it
  const auto e = w.next(400ms);
  EXPECT_FALSE(e.has_value()) << "event " << to_string(e->event);
}

TEST(Liveness, AWatcherGetsItsWatchSlotsBackWhenTheSegmentsAreFreed) {
  const auto kept = unique_name("livk");
  auto keep = Segment::create(kept, 4096, {.kind = SegmentKind::Host});
  auto w = Watcher::watch(kept);
  for (int round = 0; round < 2; ++round) {  // 2 x 40 names on one connection, at most 64 at a time
    std::vector<std::string> names;
    for (int i = 0; i < 40; ++i) {
      names.push_back(unique_name("livs" + std::to_string(round * 100 + i)));
      auto s = Segment::create(names.back(), 4096, {.kind = SegmentKind::Host});
      ASSERT_NO_THROW(w.add(names.back())) << "round " << round << ", name " << i;
      Segment::unlink(names.back());  // freed when `s` closes: the watch goes with it
    }
  }
}

TEST(Liveness, HeartbeatNeedsAReferenceAndASaneDeadline) {
  const auto name = unique_name("live");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  EXPECT_EQ(run_child([&] {
              try {
                heartbeat(name, 100ms);  // this child holds no reference
                return 2;
              } catch (const Error& e) {
                GPUIPC_CHILD_CHECK(e.code() == ErrorCode::InvalidArgument);
              }
              return 0;
            }),
            0);
  try {
    heartbeat(name, std::chrono::hours(2));
    ADD_FAILURE() << "a two-hour deadline was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
  }
  Segment::unlink(name);
}

// `gpuipc who` and `gpuipc watch` echoed an invalid name as it was: an escape sequence in it reached the terminal,
// a 100000-byte name was printed whole, and nothing said which names are allowed. They say it as `gpuipc stat` does.
TEST(Liveness, AnInvalidNameIsShownEscapedAndShortWithTheRules) {
  const std::string escape = "x\x1b[2Jy";
  const std::string long_name(100000, 'n');
  EXPECT_TRUE(
      fails_with([&] { (void)holders(escape); }, ErrorCode::InvalidArgument, "invalid segment name 'x\\x1b[2Jy'"));
  EXPECT_TRUE(fails_with([&] { (void)Watcher::watch(escape); }, ErrorCode::InvalidArgument,
                         "invalid segment name 'x\\x1b[2Jy'"));
  EXPECT_TRUE(fails_with([&] { heartbeat(escape, 100ms); }, ErrorCode::InvalidArgument, "invalid segment name"));
  for (const auto& command : {"who", "watch", "stat"}) {
    for (const auto& name : {escape, long_name}) {
      const auto o = run_program(std::string(GPUIPC_BUILD_BIN_DIR) + "/gpuipc", {command, name});
      EXPECT_EQ(o.exit_code, 1) << command << ": " << o.err.substr(0, 300);
      EXPECT_EQ(o.err.find('\x1b'), std::string::npos) << command << ": the escape reached the terminal";
      EXPECT_NE(o.err.find("gpuipc: invalid segment name '"), std::string::npos)
          << command << ": " << o.err.substr(0, 300);
      EXPECT_NE(o.err.find("(use 1-128 characters of A-Z a-z 0-9 . _ -"), std::string::npos)
          << command << ": " << o.err.substr(0, 300);
      EXPECT_LT(o.err.size(), 600U) << command << ": the name was printed whole";
    }
  }
}

/// The lines of `path` once it has at least `n` (or after 10 s).
std::vector<std::string> lines_of(const std::string& path, std::size_t n) {
  std::vector<std::string> lines;
  wait_until(
      [&] {
        lines.clear();
        std::ifstream f(path);
        for (std::string l; std::getline(f, l);) lines.push_back(l);
        return lines.size() >= n;
      },
      10s, 5ms);
  return lines;
}

TEST(Liveness, CliWatchPrintsJoinLeaveAndDeathAsJsonLines) {
  const auto name = unique_name("live");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  TempDir dir;
  const std::string log = dir.file("watch.log");
  const pid_t cli = start_program(std::string(GPUIPC_BUILD_BIN_DIR) + "/gpuipc",
                                  {"watch", name, "--json", "--count", "4", "--timeout", "30"}, {}, -1, log);
  auto lines = lines_of(log, 2);  // our own holder line, then "watching"
  ASSERT_EQ(lines.size(), 2U) << (lines.empty() ? "" : lines[0]);
  EXPECT_NE(lines[0].find("\"event\":\"holder\""), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("\"event\":\"watching\""), std::string::npos) << lines[1];
  const pid_t visitor = start_child([&] {
    auto s = Segment::open(name);
    s.close();
    return 0;
  });
  EXPECT_EQ(wait_child(visitor), 0);
  SyncPipe ready;
  const pid_t victim = start_child([&] {
    auto s = Segment::open(name, {.access = Access::ReadOnly});
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  ::kill(victim, SIGKILL);
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  EXPECT_EQ(wait_child(cli, 20s), 0);  // --count 4 reached
  lines = lines_of(log, 6);
  ASSERT_EQ(lines.size(), 6U);
  const std::string v = "\"pid\":" + std::to_string(visitor);
  const std::string k = "\"pid\":" + std::to_string(victim);
  EXPECT_NE(lines[2].find("\"event\":\"joined\""), std::string::npos) << lines[2];
  EXPECT_NE(lines[2].find(v), std::string::npos) << lines[2];
  EXPECT_NE(lines[3].find("\"event\":\"left\""), std::string::npos) << lines[3];
  EXPECT_NE(lines[3].find(v), std::string::npos) << lines[3];
  EXPECT_NE(lines[4].find("\"event\":\"joined\""), std::string::npos) << lines[4];
  EXPECT_NE(lines[5].find("\"event\":\"died\""), std::string::npos) << lines[5];
  EXPECT_NE(lines[5].find(k), std::string::npos) << lines[5];
  Segment::unlink(name);
}

TEST(Liveness, CliWatchStopsAtItsTimeoutAndShowsAHungHeartbeat) {
  const auto name = unique_name("live");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  heartbeat(name, 50ms);  // and then no more
  const auto out = run_program(std::string(GPUIPC_BUILD_BIN_DIR) + "/gpuipc", {"watch", name, "--timeout", "0.5"});
  EXPECT_EQ(out.exit_code, 0) << out.err;
  // Hung before the watch started or during it: either the holder line or an event says so.
  EXPECT_NE(out.out.find("heartbeat hung within 50 ms"), std::string::npos) << out.out;
  heartbeat(name, 0ms);
  const auto who = run_program(std::string(GPUIPC_BUILD_BIN_DIR) + "/gpuipc", {"who", "--json", name});
  EXPECT_EQ(who.exit_code, 0) << who.err;
  EXPECT_NE(who.out.find("\"role\": \"creator+read-write\""), std::string::npos) << who.out;
  Segment::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
