// Futex wait/wake on a word in memory shared between processes.
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <new>
#include <thread>

#include "os/futex.hpp"
#include "os/memfd.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

using namespace std::chrono_literals;
using os::FutexResult;

// A shared page (MAP_SHARED memfd mapping, inherited by fork) holding the futex word and a "child is about to
// wait" flag.
struct SharedPage {
  os::UniqueFd fd = os::memfd_create("futex", os::page_size());
  os::Mapping map = os::Mapping::map(fd.get(), os::page_size(), true);
  std::atomic<std::uint32_t>* word = new (map.data()) std::atomic<std::uint32_t>(0);
  std::atomic<std::uint32_t>* ready = new (static_cast<char*>(map.data()) + 64) std::atomic<std::uint32_t>(0);
};

TEST(OsFutex, WakeAcrossProcesses) {
  SharedPage page;
  const pid_t child = test::start_child([&] {
    page.ready->store(1);
    const auto start = std::chrono::steady_clock::now();
    const FutexResult r = os::futex_wait(page.word, 0, 10s);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    GPUIPC_CHILD_CHECK(r == FutexResult::Woken);
    GPUIPC_CHILD_CHECK(elapsed < 5s);
    GPUIPC_CHILD_CHECK(page.word->load() == 1);
    return 0;
  });
  ASSERT_TRUE(test::wait_until([&] { return page.ready->load() == 1; }, 10s));
  // Wake only once the child sleeps in the kernel, so that the wake (not a value check) is what releases it.
  ASSERT_TRUE(test::wait_until_sleeping(child, 10s));
  page.word->store(1);
  int woken = 0;
  // The child may be asleep in something other than the futex for a moment (page fault, ...): retry briefly.
  ASSERT_TRUE(test::wait_until([&] { return (woken += os::futex_wake(page.word)) >= 1; }, 5s));
  EXPECT_EQ(woken, 1);
  EXPECT_EQ(test::wait_child(child), 0);
}

TEST(OsFutex, WakeWithNoWaiterWakesNobody) {
  SharedPage page;
  EXPECT_EQ(os::futex_wake(page.word), 0);
  EXPECT_EQ(os::futex_wake(page.word, 1), 0);
}

TEST(OsFutex, WakeCountLimitsWaiters) {
  SharedPage page;
  std::atomic<int> done{0};
  std::atomic<pid_t> tids[2] = {0, 0};
  const auto waiter = [&](int i) {
    tids[i].store(::gettid());
    if (os::futex_wait(page.word, 0, 10s) == FutexResult::Woken) done.fetch_add(1);
  };
  std::jthread t1(waiter, 0);
  std::jthread t2(waiter, 1);
  EXPECT_TRUE(test::wait_until([&] { return tids[0].load() != 0 && tids[1].load() != 0; }, 5s));
  EXPECT_TRUE(test::wait_until_sleeping(tids[0].load(), 5s));
  EXPECT_TRUE(test::wait_until_sleeping(tids[1].load(), 5s));
  // (EXPECT, not ASSERT: the threads must be joined; each waits at most 10 s.)
  // Both threads asleep: count 1 wakes exactly one, then the other.
  EXPECT_EQ(os::futex_wake(page.word, 1), 1);
  EXPECT_TRUE(test::wait_until([&] { return done.load() == 1; }, 5s));
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(done.load(), 1);
  EXPECT_EQ(os::futex_wake(page.word, 1), 1);
  t1.join();
  t2.join();
  EXPECT_EQ(done.load(), 2);
}

TEST(OsFutex, TimeoutIsHonoured) {
  SharedPage page;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(os::futex_wait(page.word, 0, 100ms), FutexResult::Timeout);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_GE(elapsed, 95ms);
  EXPECT_LT(elapsed, 2s);

  EXPECT_EQ(os::futex_wait(page.word, 0, 0ns), FutexResult::Timeout);
  EXPECT_EQ(os::futex_wait(page.word, 0, -5ms), FutexResult::Timeout) << "a negative timeout counts as zero";
}

TEST(OsFutex, ValueChangedWhenTheWordDiffers) {
  SharedPage page;
  page.word->store(7);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(os::futex_wait(page.word, 6, 5s), FutexResult::ValueChanged);
  EXPECT_EQ(os::futex_wait(page.word, 0, std::nullopt), FutexResult::ValueChanged);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
}

TEST(OsFutex, SignalInterruptsTheWait) {
  SharedPage page;
  const test::ScopedSignalCounter counter(SIGUSR1);
  const auto start = std::chrono::steady_clock::now();
  FutexResult r = FutexResult::Woken;
  {
    const test::SignalPulser pulser(::pthread_self(), SIGUSR1, 50ms, 50ms);
    r = os::futex_wait(page.word, 0, 10s);
  }
  EXPECT_EQ(r, FutexResult::Interrupted);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_GE(counter.count(), 1);
}

}  // namespace
}  // namespace gpuipc
