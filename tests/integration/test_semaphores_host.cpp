// Host-kind semaphores across real processes: signal and wait, timeouts, roles and permissions, and poison when
// the last signaller dies or leaves.
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>

#include "gpuipc/semaphore.hpp"
#include "os/process.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

SemaphoreOptions host_options(std::uint64_t initial = 0) {
  return {.initial = initial, .kind = SegmentKind::Host, .device = 0, .mode = 0600};
}

TEST(SemaphoresHost, SignalInOneProcessWakesAWaiterInAnother) {
  const auto name = unique_name("sem");
  auto sem = Semaphore::create(name, host_options(5));
  EXPECT_EQ(sem.value(), 5U);
  const pid_t child = start_child([&] {
    auto w = Semaphore::open(name, {.role = SemaphoreRole::Waiter});
    GPUIPC_CHILD_CHECK(w.wait_host(5, 0ns).status == Status::Ok);  // already there
    for (std::uint64_t v = 6; v <= 1005; ++v) {
      const auto r = w.wait_host(v, 10s);
      GPUIPC_CHILD_CHECK(r.status == Status::Ok);
      GPUIPC_CHILD_CHECK(r.value >= v);
    }
    return 0;
  });
  for (std::uint64_t v = 6; v <= 1005; ++v) ASSERT_EQ(sem.signal_host(v), Status::Ok);
  EXPECT_EQ(wait_child(child), 0);
  // Never lowered.
  EXPECT_EQ(sem.signal_host(3), Status::Ok);
  EXPECT_EQ(sem.value(), 1005U);
  Semaphore::unlink(name);
}

TEST(SemaphoresHost, WaitTimesOutAndWaitersCannotSignal) {
  const auto name = unique_name("sem");
  auto sem = Semaphore::create(name, host_options());
  auto w = Semaphore::open(name, {.role = SemaphoreRole::Waiter});
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(w.wait_host(1, std::chrono::milliseconds(100)).status, Status::Timeout);
  const auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(dt, 95ms);
  EXPECT_LT(dt, 2s);
  EXPECT_EQ(w.signal_host(1), Status::InvalidState);
  EXPECT_EQ(sem.signal_host(kSemaphoreMaxValue + 1), Status::InvalidState);
  // A value the semaphore can never reach is refused at once, not waited for (without a timeout: for ever).
  EXPECT_EQ(w.wait_host(kSemaphoreMaxValue + 1, std::chrono::nanoseconds::max()).status, Status::InvalidState);
  // Host-kind semaphores have no GPU side.
  EXPECT_EQ(sem.signal(nullptr, 1), Status::InvalidState);
  EXPECT_EQ(sem.wait(nullptr, 1), Status::InvalidState);
  Semaphore::unlink(name);
}

TEST(SemaphoresHost, SignallerKilledPoisonsPendingAndLaterWaitsWithin100ms) {
  const auto name = unique_name("sem");
  SyncPipe ready;
  const pid_t signaller = start_child([&] {
    auto s = Semaphore::create(name, host_options(1));
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  auto w = Semaphore::open(name, {.role = SemaphoreRole::Waiter});
  std::atomic<std::int64_t> killed{0};
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);
    killed = os::monotonic_ns();
    ::kill(signaller, SIGKILL);
  });
  const auto r = w.wait_host(2, 10s);  // pending when the signaller dies
  const std::int64_t seen = os::monotonic_ns();
  killer.join();
  EXPECT_EQ(r.status, Status::PeerDied);
  EXPECT_EQ(r.value, 1U);
  EXPECT_LT(seen - killed.load(), 100'000'000);
  EXPECT_EQ(w.wait_host(2, 10s).status, Status::PeerDied);  // later waits return at once
  EXPECT_EQ(w.status(), Status::PeerDied);
  EXPECT_EQ(wait_child(signaller), 128 + SIGKILL);
  Semaphore::unlink(name);
}

TEST(SemaphoresHost, PoisonOnlyWhenTheLastSignallerGoes) {
  const auto name = unique_name("sem");
  auto a = Semaphore::create(name, host_options());
  SyncPipe ready;
  const pid_t b = start_child([&] {
    auto s = Semaphore::open(name, {.role = SemaphoreRole::Signaller});
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  auto w = Semaphore::open(name, {.role = SemaphoreRole::Waiter});
  ::kill(b, SIGKILL);
  EXPECT_EQ(wait_child(b), 128 + SIGKILL);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(w.status(), Status::Ok);  // `a` can still signal
  EXPECT_EQ(a.signal_host(3), Status::Ok);
  EXPECT_EQ(w.wait_host(3, 1s).status, Status::Ok);
  a = Semaphore();  // the last signaller closes cleanly
  EXPECT_EQ(w.wait_host(4, 1s).status, Status::Closed);
  Semaphore::unlink(name);
}

TEST(SemaphoresHost, PermissionsFollowTheModeBits) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to setuid a child to another uid";
  const auto name = unique_name("sem");
  auto sem = Semaphore::create(name, {.initial = 0, .kind = SegmentKind::Host, .device = 0, .mode = 0644});
  EXPECT_EQ(run_child([&] {
              if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 90;
              auto w = Semaphore::open(name, {.role = SemaphoreRole::Waiter});  // r for others: may wait
              try {
                Semaphore::open(name, {.role = SemaphoreRole::Signaller});  // no w: may not signal
                return 2;
              } catch (const Error& e) {
                GPUIPC_CHILD_CHECK(e.code() == ErrorCode::PermissionDenied);
              }
              return 0;
            }),
            0);
  Semaphore::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
