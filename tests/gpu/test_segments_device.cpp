// Device-kind segments on a real GPU, across real processes. All CUDA work happens in forked children (the test
// process never initialises CUDA, so it can keep forking).
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>

#include "gpuipc/channel.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/gpu_worker.hpp"
#include "support/support.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kBytes = 64ULL << 20;
constexpr std::size_t kWords = kBytes / 4;

TEST(SegmentsDevice, ACountingSemaphoreOpenOrStatOfADeviceSegmentIsRefused) {
  // Both read the block at the segment's address: for a device segment a GPU address, which the host read as
  // memory (the process crashed) instead of saying that it is no counting semaphore.
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto seg = Segment::create(name, 1 << 20, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
              for (const auto& call : {std::function<void()>([&] { (void)CountingSemaphore::open(name); }),
                                       std::function<void()>([&] { (void)CountingSemaphore::stat(name); })}) {
                GPUIPC_CHILD_CHECK(fails_with(call, ErrorCode::InvalidArgument, "is not a gpuipc counting semaphore"));
              }
              return 0;
            }),
            0);
  Segment::unlink(name);
}

TEST(SegmentsDevice, ASemaphoreOrChannelOpenOrStatOfADeviceSegmentIsRefused) {
  // Semaphore::open and stat, and Channel::stat, read the block at the segment's address like the counting
  // semaphore did: a name another user took with a device segment crashed the process that opened it (or `gpuipc
  // top`, when a name changed hands between its list and its stat).
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  EXPECT_EQ(
      run_child([&] {
        Gpu g;
        auto seg = Segment::create(name, 1 << 20, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
        for (const auto& call :
             {std::function<void()>([&] { (void)Semaphore::open(name); }),
              std::function<void()>([&] { (void)Semaphore::open(name, {.role = SemaphoreRole::Waiter}); }),
              std::function<void()>([&] { (void)Semaphore::stat(name); })}) {
          GPUIPC_CHILD_CHECK(fails_with(call, ErrorCode::InvalidArgument, "is not a gpuipc semaphore"));
        }
        for (const auto& call : {std::function<void()>([&] { (void)Channel::stat(name); }),
                                 std::function<void()>([&] { (void)Channel::open(name, ChannelRole::Consumer); })}) {
          GPUIPC_CHILD_CHECK(fails_with(call, ErrorCode::InvalidArgument, "is not a"));
        }
        return 0;
      }),
      0);
  Segment::unlink(name);
}

TEST(SegmentsDevice, DataWrittenByAIsReadByBAndBack) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe created, b_done;
  const pid_t a = start_child([&] {
    Gpu g;
    auto seg = Segment::create(name, kBytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    GPUIPC_CHILD_CHECK(seg.kind() == SegmentKind::Device && seg.size() >= kBytes && seg.device() == 0);
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 1);
    g.stream.synchronize();
    created.notify();
    GPUIPC_CHILD_CHECK(b_done.wait(60s));
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 2) == 0);
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto seg = Segment::open(name);
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 1) == 0);
              auto again = Segment::open(name);  // cached: the same mapping
              GPUIPC_CHILD_CHECK(again.device_pointer() == seg.device_pointer());
              g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 2);
              g.stream.synchronize();
              return 0;
            }),
            0);
  b_done.notify();
  EXPECT_EQ(wait_child(a), 0);
  Segment::unlink(name);
}

void survives_creator(bool sigkill) {
  const std::size_t baseline = gpu_free_memory();
  ASSERT_GT(baseline, 0U);
  const auto name = unique_name();
  SyncPipe filled;
  const pid_t a = start_child([&] {
    Gpu g;
    auto seg = Segment::create(name, kBytes * 4, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords * 4, 7);
    g.stream.synchronize();
    filled.notify();
    if (sigkill) ::pause();
    return 0;
  });
  ASSERT_TRUE(filled.wait(60s));
  if (sigkill) ::kill(a, SIGKILL);
  EXPECT_EQ(wait_child(a), sigkill ? 128 + SIGKILL : 0);
  // The creator is gone; the broker (CUDA-free) holds the exported fd: the data survives.
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto seg = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords * 4, 7) == 0);
              return 0;
            }),
            0);
  Segment::unlink(name);
  // Nobody maps it and the name is gone: the GPU memory is back.
  std::size_t after = 0;
  EXPECT_TRUE(wait_until(
      [&] {
        after = gpu_free_memory();
        return after + (16ULL << 20) >= baseline;
      },
      10s, 200ms))
      << "free before " << baseline << ", after " << after;
}

TEST(SegmentsDevice, DataSurvivesItsCreatorsExitAndMemoryReturnsAfterLastClose) {
  GPUIPC_REQUIRE_GPU();
  survives_creator(false);
}

TEST(SegmentsDevice, DataSurvivesSigkillOfItsCreator) {
  GPUIPC_REQUIRE_GPU();
  survives_creator(true);
}

TEST(SegmentsDevice, WriteThroughReadOnlyMappingFaultsOnlyTheReader) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe created, reader_done;
  const pid_t writer = start_child([&] {
    Gpu g;
    auto seg = Segment::create(name, kBytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 3);
    g.stream.synchronize();
    created.notify();
    GPUIPC_CHILD_CHECK(reader_done.wait(60s));
    // The writer keeps running: its context is fine and the data is untouched by the reader's write.
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 3) == 0);
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 4);
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 4) == 0);
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  const int reader = run_child([&] {
    Gpu g;
    auto seg = Segment::open(name, {.access = Access::ReadOnly});
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 3) == 0);  // reads work
    g.k.write_one(g.stream.get(), seg.device_pointer() + 4096, 0xdeadbeef);
    try {
      g.stream.synchronize();
    } catch (const Error& e) {
      std::fprintf(stderr, "reader faulted as expected: %s\n", e.what());
      return 42;  // the fault, confined to this process
    }
    return 1;
  });
  EXPECT_EQ(reader, 42);
  reader_done.notify();
  EXPECT_EQ(wait_child(writer), 0);
  Segment::unlink(name);
}

TEST(SegmentsDevice, HostPinnedIsVisibleToTheGpuAndHostOfAnotherProcess) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  constexpr std::size_t kPinnedWords = (1 << 20) / 4;
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto pinned = Segment::create(name, 1 << 20, {.kind = SegmentKind::HostPinned, .device = 0, .mode = 0600});
              GPUIPC_CHILD_CHECK(pinned.device_pointer() != 0 && pinned.data() != nullptr);
              g.k.fill_pattern(g.stream.get(), pinned.device_pointer(), kPinnedWords, 9);
              g.stream.synchronize();
              return 0;  // exits: the name stays
            }),
            0);
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto pinned = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(pinned.kind() == SegmentKind::HostPinned);
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), pinned.device_pointer(), kPinnedWords, 9) == 0);
              const auto* host = static_cast<const std::uint32_t*>(pinned.data());
              for (std::size_t i = 0; i < kPinnedWords; ++i) GPUIPC_CHILD_CHECK(host[i] == kernels::pattern_word(9, i));
              return 0;
            }),
            0);
  Segment::unlink(name);
}

TEST(SegmentsDevice, HundredCyclesLeakNoGpuMemoryOrBrokerFds) {
  GPUIPC_REQUIRE_GPU();
  const std::size_t baseline = gpu_free_memory();
  const int broker_fds = BrokerEnvironment::broker_fd_baseline();
  EXPECT_EQ(run_child([&] {
              Gpu g;
              const auto name = unique_name();
              for (int i = 0; i < 100; ++i) {
                auto s = Segment::create(name, 8 << 20, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
                Segment::unlink(name);
              }
              return 0;
            }),
            0);
  EXPECT_LE(BrokerEnvironment::broker_fd_count(), broker_fds);  // no more than before
  EXPECT_EQ(BrokerEnvironment::broker_references(), 0U);
  std::size_t after = 0;
  EXPECT_TRUE(wait_until(
      [&] {
        after = gpu_free_memory();
        return after + (16ULL << 20) >= baseline;
      },
      10s, 200ms))
      << "free before " << baseline << ", after " << after;
}

TEST(SegmentsDevice, OtherUidIsRefusedAndAKilledOpenersReferenceReturns) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe created, done;
  const pid_t creator = start_child([&] {
    Gpu g;
    auto seg = Segment::create(name, 8 << 20, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), (8 << 20) / 4, 11);
    g.stream.synchronize();
    created.notify();
    GPUIPC_CHILD_CHECK(done.wait(120s));
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), (8 << 20) / 4, 11) == 0);
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  if (::getuid() == 0) {
    // Refused by the broker before any import: the message names the owner and the mode.
    EXPECT_EQ(run_child([&] {
                if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 90;
                try {
                  Segment::open(name, {.access = Access::ReadOnly});
                  return 2;
                } catch (const Error& e) {
                  const std::string msg = e.what();
                  GPUIPC_CHILD_CHECK(e.code() == ErrorCode::PermissionDenied);
                  GPUIPC_CHILD_CHECK(msg.find("mode 0600") != std::string::npos);
                  GPUIPC_CHILD_CHECK(msg.find("owned by uid 0") != std::string::npos);
                }
                return 0;
              }),
              0);
  }
  // An opener that imported and mapped the memory is SIGKILLed: its reference goes, the creator's data stays.
  EXPECT_EQ(BrokerEnvironment::references_of(name), 1U);
  SyncPipe mapped;
  const pid_t opener = start_child([&] {
    Gpu g;
    auto seg = Segment::open(name);
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), (8 << 20) / 4, 11) == 0);
    mapped.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(mapped.wait(60s));
  EXPECT_EQ(BrokerEnvironment::references_of(name), 2U);
  ::kill(opener, SIGKILL);
  EXPECT_EQ(wait_child(opener), 128 + SIGKILL);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::references_of(name) == 1; }, 5s));
  done.notify();
  EXPECT_EQ(wait_child(creator), 0);
  Segment::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
