// The edges of the public C++ API: "wait for ever" written as the largest duration (std::chrono::nanoseconds::max(),
// milliseconds::max()) waits, it does not time out at once, spin a core or drop the broker connection; enum values
// out of range are refused with gpuipc::Error; the names a channel or a pool makes beside its own are reserved; a
// program found through a relative PATH entry is named by an absolute path.
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <filesystem>
#include <thread>

#include "gpuipc/channel.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/programs.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

using namespace std::chrono_literals;
constexpr auto kForever = std::chrono::nanoseconds::max();

/// CPU time this thread has used.
std::chrono::microseconds thread_cpu() {
  rusage u{};
  ::getrusage(RUSAGE_THREAD, &u);
  return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

TEST(ApiEdges, ASemaphoreWaitOfTheLargestDurationWaits) {
  const auto name = unique_name("sem");
  auto sem = Semaphore::create(name, {.kind = SegmentKind::Host});
  std::thread later([&] {
    std::this_thread::sleep_for(200ms);
    sem.signal_host(1);
  });
  const auto t0 = std::chrono::steady_clock::now();
  const WaitResult r = sem.wait_host(1, kForever);  // the deadline overflowed into the past: Timeout at once
  const auto waited = std::chrono::steady_clock::now() - t0;
  later.join();
  EXPECT_EQ(r.status, Status::Ok);
  EXPECT_GE(waited, 150ms);
  Semaphore::unlink(name);
}

TEST(ApiEdges, AChannelReceiveOfTheLargestDurationWaits) {
  const auto name = unique_name("chan");
  auto rx = Channel::create(name, {.slots = 2, .slot_bytes = 4096, .kind = SegmentKind::Host}, ChannelRole::Consumer);
  auto tx = Channel::open(name, ChannelRole::Producer);
  std::thread later([&] {
    std::this_thread::sleep_for(200ms);
    SlotView slot;
    ASSERT_EQ(tx.acquire(nullptr, 10s, slot), Status::Ok);
    ASSERT_EQ(tx.publish(nullptr, {}, 8), Status::Ok);
  });
  MessageView msg;
  EXPECT_EQ(rx.receive(nullptr, kForever, msg), Status::Ok);
  later.join();
  EXPECT_EQ(msg.size, 8u);
  EXPECT_EQ(rx.release(nullptr), Status::Ok);
  tx = Channel();
  rx = Channel();
  Channel::unlink(name);
}

TEST(ApiEdges, ACountingAcquireOfTheLargestDurationSleepsWhileItWaits) {
  const auto name = unique_name("cs");
  auto cs = CountingSemaphore::create(name, {.initial = 0, .max_count = 1});  // the creator holds the permit
  auto other = CountingSemaphore::open(name);
  std::thread later([&] {
    std::this_thread::sleep_for(300ms);
    cs.release(1);
  });
  const auto cpu0 = thread_cpu();
  EXPECT_EQ(other.acquire(1, kForever), Status::Ok);
  const auto cpu = thread_cpu() - cpu0;
  later.join();
  // It spun: its deadline overflowed, every wait timed out at once and the loop went round again.
  EXPECT_LT(cpu, 150ms) << "the waiting thread used " << cpu.count() << " us of CPU in a 300 ms wait";
  other.release(1);
  CountingSemaphore::unlink(name);
}

TEST(ApiEdges, AnOpenThatWaitsLongerThanAnIntOfMillisecondsWaitsAndKeepsTheConnection) {
  const auto name = unique_name("seg");
  const auto sem_name = unique_name("sem");
  auto mine = Semaphore::create(sem_name, {.kind = SegmentKind::Host});  // a membership the broker must not drop
  // Another process creates it (this one's broker calls wait behind the open: one connection).
  const pid_t creator = start_child([&] {
    std::this_thread::sleep_for(1500ms);
    (void)Segment::create(name, 4096, {.kind = SegmentKind::Host});
    return 0;
  });
  // 2^32 - 1 ms (+ 1 s) cast to int was 999 ms: the open gave up after a second and dropped the connection, and
  // the broker took this process for gone (its semaphore poisoned).
  for (const auto wait : {std::chrono::milliseconds(UINT32_MAX), std::chrono::milliseconds::max()}) {
    Segment s = Segment::open(name, {.access = Access::ReadOnly, .wait = wait});
    EXPECT_EQ(s.size(), 4096u);
  }
  EXPECT_EQ(wait_child(creator), 0);
  EXPECT_EQ(Semaphore::stat(sem_name).status, Status::Ok);
  EXPECT_EQ(mine.signal_host(1), Status::Ok);
  Segment::unlink(name);
  Semaphore::unlink(sem_name);
}

/// Whether `code` throws gpuipc::Error InvalidArgument whose message holds `needle`.
template <typename F>
::testing::AssertionResult invalid(F&& code, const std::string& needle) {
  try {
    code();
  } catch (const Error& e) {
    if (e.code() == ErrorCode::InvalidArgument && std::string(e.what()).find(needle) != std::string::npos) {
      return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "Error " << static_cast<int>(e.code()) << ": " << e.what();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "not a gpuipc::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "nothing thrown";
}

TEST(ApiEdges, EnumValuesOutOfRangeAreInvalidArgument) {
  const auto name = unique_name("edge");
  EXPECT_TRUE(invalid([&] { Segment::create(name, 4096, {.kind = static_cast<SegmentKind>(9)}); },
                      "kind 9 is not a segment kind"));
  EXPECT_TRUE(invalid([&] { Segment::create(name, 4096, {.kind = static_cast<SegmentKind>(0)}); },
                      "kind 0 is not a segment kind"));
  (void)Segment::create(name, 4096, {.kind = SegmentKind::Host});
  EXPECT_TRUE(invalid([&] { Segment::open(name, {.access = static_cast<Access>(7)}); },
                      "access 7 is neither ReadOnly nor ReadWrite"));
  Segment::unlink(name);
  EXPECT_TRUE(invalid([&] { Semaphore::create(name, {.kind = SegmentKind::DeviceIpc}); }, "kind must be host_pinned"));
  EXPECT_TRUE(invalid([&] { Pool::create(name, {.kind = SegmentKind::DeviceIpc}); }, "not a pool kind"));
  EXPECT_TRUE(invalid([&] { Channel::create(name, {.kind = static_cast<SegmentKind>(9)}, ChannelRole::Producer); },
                      "kind device or host"));
}

TEST(ApiEdges, AnInvalidNameIsShownAsPrintableText) {
  // A NUL in the name cut the message short at it; other control bytes went to the terminal as they were.
  EXPECT_TRUE(invalid([&] { Segment::create(std::string("ab\0cd\x1b", 6), 4096, {.kind = SegmentKind::Host}); },
                      "invalid segment name 'ab\\x00cd\\x1b'"));
}

TEST(ApiEdges, TheNamesOfChannelBuffersAndPoolChunksAreReserved) {
  const auto name = unique_name("edge");
  // A channel's create reclaims an `X.slots` that nobody holds: a user's segment of that name was wiped.
  EXPECT_TRUE(invalid([&] { Segment::create(name + ".slots", 4096, {.kind = SegmentKind::Host}); }, "reserved"));
  EXPECT_TRUE(invalid([&] { Segment::create(name + ".chunk.3", 4096, {.kind = SegmentKind::Host}); }, "reserved"));
  for (const std::string ok : {".chunky", ".chunk.3a", ".slotsx", ".chunk."}) {
    (void)Segment::create(name + ok, 4096, {.kind = SegmentKind::Host});
    Segment::unlink(name + ok);
  }
}

TEST(ApiEdges, UnlinksOfAChannelOrAPoolRemoveOnlyAChannelOrAPool) {
  const auto name = unique_name("edge");
  auto sem = Semaphore::create(name, {.kind = SegmentKind::Host});
  // By name alone, Channel::unlink removed the semaphore, and Pool::unlink a segment and a user's `X.chunk.3`.
  EXPECT_TRUE(invalid([&] { Channel::unlink(name); }, "is not a channel"));
  EXPECT_TRUE(invalid([&] { Pool::unlink(name); }, "is not a pool"));
  // (Channel::open said "no segment named NAME.slots".)
  EXPECT_TRUE(invalid([&] { Channel::open(name, ChannelRole::Consumer); }, "is not a channel"));
  EXPECT_EQ(Semaphore::stat(name).status, Status::Ok);  // still there
  sem = Semaphore();
  Semaphore::unlink(name);
}

TEST(ApiEdges, APoolsChunksAreSweptAfterItsControlBlockWentAlone) {
  const auto name = unique_name("edge");
  { auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 16, .max_bytes = 1 << 16}); }
  Segment::unlink(name);  // what `gpuipc rm` did: the chunk stayed, and no pool of that name could be made again
  EXPECT_NO_THROW(Segment::stat(name + ".chunk.0"));
  Pool::unlink(name);  // (it threw NotFound before its sweep)
  EXPECT_THROW(Segment::stat(name + ".chunk.0"), Error);
  { auto again = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 16, .max_bytes = 1 << 16}); }
  Pool::unlink(name);
  EXPECT_THROW(Pool::unlink(name), Error);  // nothing left: NotFound
}

TEST(ApiEdges, AProgramFoundThroughARelativePathEntryIsNamedAbsolutely) {
  // exec_program (`gpuipc demo`) and the broker's start take only absolute paths: with PATH=bin:..., program_path
  // answered "bin/gpuipc-...", which they refused.
  test::TempDir dir;
  ASSERT_EQ(::mkdir(dir.file("bin").c_str(), 0700), 0);
  test::write_file(dir.file("bin/gpuipc-relative-test"), "#!/bin/sh\n");
  ASSERT_EQ(::chmod(dir.file("bin/gpuipc-relative-test").c_str(), 0700), 0);
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
  const char* old = std::getenv("PATH");
  const std::string saved = old != nullptr ? old : "";
  ASSERT_EQ(::chdir(dir.path().c_str()), 0);
  ::setenv("PATH", "bin", 1);
  const std::string found = program_path("gpuipc-relative-test");
  ::setenv("PATH", saved.c_str(), 1);
  ASSERT_EQ(::chdir(cwd), 0);
  ASSERT_TRUE(found.starts_with('/')) << found;
  EXPECT_TRUE(std::filesystem::equivalent(found, dir.file("bin/gpuipc-relative-test"))) << found;
}

}  // namespace
}  // namespace gpuipc::test
