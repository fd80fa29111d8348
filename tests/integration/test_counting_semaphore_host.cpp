// Counting semaphores across real processes: basic semantics, timeouts, over-release, permits of a SIGKILLed or
// closing holder coming back, queue order, contention between processes with no permit lost or duplicated, a
// creator that goes before it joins and a miscounted queue (a handle copied into a forked child:
// test_forked_handles.cpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <thread>

#include "core/segment_internal.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "os/process.hpp"
#include "proto/shm.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

TEST(CountingSemaphore, AcquireReleaseAndTheCreatorsGrant) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 2, .max_count = 3});
  EXPECT_EQ(a.max_count(), 3U);
  EXPECT_EQ(a.available(), 2U);
  EXPECT_EQ(a.held(), 1U);  // max_count - initial is the creator's
  EXPECT_EQ(a.try_acquire(2), Status::Ok);
  EXPECT_EQ(a.held(), 3U);
  EXPECT_EQ(a.available(), 0U);
  EXPECT_EQ(a.try_acquire(1), Status::WouldBlock);
  a.release(3);
  EXPECT_EQ(a.available(), 3U);
  EXPECT_EQ(a.acquire(0, 0s), Status::Ok);
  auto b = CountingSemaphore::open(name);
  EXPECT_EQ(b.held(), 0U);  // only the creator gets the grant
  EXPECT_EQ(b.acquire(3, 1s), Status::Ok);
  const auto st = CountingSemaphore::stat(name);
  EXPECT_EQ(st.available, 0U);
  EXPECT_EQ(st.held, 3U);
  EXPECT_EQ(st.holders, 2U);
  EXPECT_EQ(st.max_count, 3U);
  try {
    (void)b.acquire(4, 0s);
    ADD_FAILURE() << "acquire above max_count succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
  }
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, CreateChecksItsCounts) {
  const auto name = unique_name("csem");
  for (auto o :
       {CountingSemaphoreOptions{.initial = 0, .max_count = 0}, CountingSemaphoreOptions{.initial = 3, .max_count = 2},
        CountingSemaphoreOptions{.initial = 1, .max_count = kCountingSemaphoreMaxCount + 1}}) {
    try {
      CountingSemaphore::create(name, o);
      ADD_FAILURE() << "created with initial " << o.initial << " max " << o.max_count;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
    }
  }
}

TEST(CountingSemaphore, OverReleaseIsRefusedSayingWhatIsHeld) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 4, .max_count = 4});
  ASSERT_EQ(a.try_acquire(2), Status::Ok);
  try {
    a.release(3);
    ADD_FAILURE() << "released more than held";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("holds 2 permits"), std::string::npos) << e.what();
  }
  EXPECT_EQ(a.held(), 2U);  // nothing changed
  EXPECT_EQ(a.available(), 2U);
  // Another process cannot release permits this one holds either.
  EXPECT_EQ(run_child([&] {
              auto b = CountingSemaphore::open(name);
              try {
                b.release(1);
                return 2;
              } catch (const Error& e) {
                GPUIPC_CHILD_CHECK(e.code() == ErrorCode::InvalidArgument);
              }
              return 0;
            }),
            0);
  EXPECT_EQ(a.available(), 2U);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, AcquireTimesOut) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 0, .max_count = 1});
  auto b = CountingSemaphore::open(name);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(b.acquire(1, 100ms), Status::Timeout);
  const auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(dt, 95ms);
  EXPECT_LT(dt, 2s);
  EXPECT_EQ(CountingSemaphore::stat(name).waiting, 0U);  // it left the queue
  a.release(1);
  EXPECT_EQ(b.acquire(1, 100ms), Status::Ok);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, ReleaseWakesASleepingWaiterInAnotherProcess) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 0, .max_count = 2});
  const pid_t child = start_child([&] {
    auto b = CountingSemaphore::open(name);
    GPUIPC_CHILD_CHECK(b.acquire(2, 10s) == Status::Ok);
    GPUIPC_CHILD_CHECK(b.held() == 2);
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return CountingSemaphore::stat(name).waiting == 1; }, 10s));
  ASSERT_TRUE(wait_until_sleeping(child, 10s));
  a.release(1);
  std::this_thread::sleep_for(20ms);
  // One permit is not enough for it: still waiting, the permit still free, and back asleep (a single sample of
  // its state could catch it running, between the wake-up and its sleep again, under a sanitizer's slowness).
  EXPECT_EQ(CountingSemaphore::stat(name).waiting, 1U);
  EXPECT_EQ(a.available(), 1U);
  EXPECT_TRUE(wait_until_sleeping(child, 10s));
  a.release(1);
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(a.available(), 2U);  // the child's exit gave them back
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, PermitsOfAKilledHolderComeBack) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 3, .max_count = 3});
  SyncPipe ready;
  const pid_t holder = start_child([&] {
    auto b = CountingSemaphore::open(name);
    GPUIPC_CHILD_CHECK(b.acquire(3, 10s) == Status::Ok);
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  EXPECT_EQ(a.available(), 0U);
  std::atomic<std::int64_t> killed{0};
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);
    killed = os::monotonic_ns();
    ::kill(holder, SIGKILL);
  });
  const Status st = a.acquire(3, 10s);  // pending when the holder dies
  const std::int64_t seen = os::monotonic_ns();
  killer.join();
  EXPECT_EQ(st, Status::Ok);
  EXPECT_LT(seen - killed.load(), 100'000'000);
  EXPECT_EQ(a.held(), 3U);
  EXPECT_EQ(wait_child(holder), 128 + SIGKILL);
  const auto s = CountingSemaphore::stat(name);
  EXPECT_EQ(s.holders, 1U);
  EXPECT_EQ(s.held + s.available, 3U);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, ClosingAHandleGivesItsPermitsBack) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 2, .max_count = 2});
  {
    auto b = CountingSemaphore::open(name);
    ASSERT_EQ(b.try_acquire(2), Status::Ok);
    EXPECT_EQ(a.available(), 0U);
  }
  EXPECT_EQ(a.available(), 2U);
  EXPECT_EQ(CountingSemaphore::stat(name).holders, 1U);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, QueuedWaiterIsServedBeforeANewcomer) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 0, .max_count = 1});
  const pid_t waiter = start_child([&] {
    auto b = CountingSemaphore::open(name);
    GPUIPC_CHILD_CHECK(b.acquire(1, 10s) == Status::Ok);
    ::usleep(100'000);
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return CountingSemaphore::stat(name).waiting == 1; }, 10s));
  auto c = CountingSemaphore::open(name);
  a.release(1);
  // The permit is free for a moment, but the waiter queued first: the newcomer does not take it.
  EXPECT_EQ(c.try_acquire(1), Status::WouldBlock);
  EXPECT_EQ(c.acquire(1, 10s), Status::Ok);  // after the waiter exits with it
  EXPECT_EQ(wait_child(waiter), 0);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, ContendingProcessesNeverLoseOrDuplicatePermits) {
  const auto name = unique_name("csem");
  constexpr std::uint32_t kPermits = 3;
  constexpr int kProcs = 6;
  constexpr int kRounds = 5000;
  auto a = CountingSemaphore::create(name, {.initial = kPermits, .max_count = kPermits});
  struct Counters {
    std::atomic<int> inside;
    std::atomic<int> most;
    std::atomic<int> done;
  };
  Shared<Counters> c;
  std::vector<pid_t> kids;
  for (int p = 0; p < kProcs; ++p) {
    kids.push_back(start_child([&, p] {
      auto s = CountingSemaphore::open(name);
      for (int i = 0; i < kRounds; ++i) {
        const std::uint32_t n = 1 + static_cast<std::uint32_t>((i + p) % 2);
        GPUIPC_CHILD_CHECK(s.acquire(n, 10s) == Status::Ok);
        const int now = c.get()->inside.fetch_add(static_cast<int>(n)) + static_cast<int>(n);
        int most = c.get()->most.load();
        while (now > most && !c.get()->most.compare_exchange_weak(most, now)) {
        }
        if (i % 8 == 0) std::this_thread::yield();  // let the others run while permits are held
        c.get()->inside.fetch_sub(static_cast<int>(n));
        s.release(n);
        c.get()->done.fetch_add(1);
      }
      return 0;
    }));
  }
  // One more contender, SIGKILLed while it takes and gives permits as fast as it can.
  const pid_t victim = start_child([&] {
    auto s = CountingSemaphore::open(name);
    for (;;) {
      if (s.acquire(1, 10s) == Status::Ok) {
        std::this_thread::yield();
        s.release(1);
      }
    }
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return c.get()->done.load() > kRounds; }, 20s));
  ::kill(victim, SIGKILL);
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  for (auto k : kids) EXPECT_EQ(wait_child(k, 60s), 0);
  EXPECT_EQ(c.get()->done.load(), kProcs * kRounds);
  EXPECT_LE(c.get()->most.load(), static_cast<int>(kPermits));  // never more inside than permits
  ASSERT_TRUE(wait_until([&] { return CountingSemaphore::stat(name).holders == 1; }, 5s));
  EXPECT_EQ(a.available(), kPermits);  // none lost, the victim's included
  EXPECT_EQ(CountingSemaphore::stat(name).waiting, 0U);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, LsAndStatShowTheCounts) {
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 3, .max_count = 5});
  ASSERT_EQ(a.try_acquire(1), Status::Ok);
  const std::string cli = std::string(GPUIPC_BUILD_BIN_DIR) + "/gpuipc";
  const auto st = run_program(cli, {"stat", name});
  ASSERT_EQ(st.exit_code, 0) << st.err;
  EXPECT_NE(st.out.find("counting:   2 of 5 permits available, 3 held by 1 holder, 0 waiting"), std::string::npos)
      << st.out;
  const auto js = run_program(cli, {"stat", "--json", name});
  ASSERT_EQ(js.exit_code, 0) << js.err;
  EXPECT_NE(js.out.find("\"counting_semaphore\""), std::string::npos) << js.out;
  EXPECT_NE(js.out.find("\"max_count\": 5"), std::string::npos) << js.out;
  const auto ls = run_program(cli, {"ls"});
  ASSERT_EQ(ls.exit_code, 0) << ls.err;
  EXPECT_NE(ls.out.find("  counting semaphore: 2 of 5 permits available"), std::string::npos) << ls.out;
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, ACreatorThatGoesBeforeJoiningLeavesItsPermitsAvailable) {
  // Create and the creator's Join are two requests: a creator killed between them (or whose Join failed) held
  // the max_count - initial permits of its grant nowhere, and they were lost for good.
  const auto name = unique_name("csem");
  EXPECT_EQ(run_child([&] {
              // What CountingSemaphore::create does, without the join that follows.
              auto seg = detail::create_segment(name, sizeof(proto::CountingBlock), {.kind = SegmentKind::Host},
                                                proto::kFlagCounting, [](void* p) {
                                                  auto* b = static_cast<proto::CountingBlock*>(p);
                                                  b->version = proto::kCountingVersion;
                                                  b->max_count = 4;
                                                  b->initial = 0;
                                                  proto::atomic(b->magic).store(proto::kCountingMagic);
                                                });
              ::_exit(0);  // no destructor: as if killed
              return 0;
            }),
            0);
  auto a = CountingSemaphore::open(name);
  ASSERT_TRUE(wait_until([&] { return a.available() == 4; }, 10s)) << a.available() << " available";
  EXPECT_EQ(a.try_acquire(4), Status::Ok);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, AMiscountedQueueDoesNotKeepTryAcquireFromFreePermits) {
  // `waiting` one too high, as a member of an older release killed while it left the queue left it (or a
  // scribble): nobody is queued, yet every zero-timeout acquire answered WouldBlock.
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 1, .max_count = 1});
  auto raw = Segment::open(name, {.access = Access::ReadWrite, .device = -1});
  proto::atomic(static_cast<proto::CountingBlock*>(raw.data())->waiting).store(1);
  EXPECT_EQ(a.try_acquire(1), Status::Ok);
  // A real waiter still keeps a newcomer out.
  const pid_t waiter = start_child([&] {
    auto b = CountingSemaphore::open(name);
    GPUIPC_CHILD_CHECK(b.acquire(1, 10s) == Status::Ok);
    ::usleep(100'000);
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return CountingSemaphore::stat(name).waiting == 2; }, 10s));
  a.release(1);
  EXPECT_EQ(a.try_acquire(1), Status::WouldBlock);
  EXPECT_EQ(wait_child(waiter), 0);
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, AWaitBehindAnotherThreadOfTheHandleIsInterruptible) {
  // Threads of one handle wait one at a time; the second waited for its turn without looking at `interrupted` (in
  // Python: a Ctrl-C did nothing until the first thread was served or gave up).
  const auto name = unique_name("csem");
  auto a = CountingSemaphore::create(name, {.initial = 0, .max_count = 1});
  std::thread first([&] { EXPECT_EQ(a.acquire(1, 3s), Status::Timeout); });
  ASSERT_TRUE(wait_until([&] { return a.waiting() == 1; }, 10s));
  std::atomic<bool> stop{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(100ms);
    stop = true;
  });
  const auto t0 = std::chrono::steady_clock::now();
  const Status st = a.acquire(
      1, std::chrono::nanoseconds(-1), [](void* c) { return static_cast<std::atomic<bool>*>(c)->load(); }, &stop);
  const auto waited = std::chrono::steady_clock::now() - t0;
  stopper.join();
  first.join();
  EXPECT_EQ(st, Status::Interrupted);
  EXPECT_LT(waited, 2s) << "interrupted only once the first thread gave up (3 s)";
  CountingSemaphore::unlink(name);
}

TEST(CountingSemaphore, OpenChecksTheKind) {
  const auto name = unique_name("csem");
  auto seg = Segment::create(name, 8192, {.kind = SegmentKind::Host});
  try {
    CountingSemaphore::open(name);
    ADD_FAILURE() << "opened a plain segment";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
  }
  Segment::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
