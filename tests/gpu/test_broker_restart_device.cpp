// gpuipcd SIGKILLed under a device segment: the owner's mapping keeps working, its next call gives the name back to
// the new broker (a device fd carries no identity, so only the owner or root can), and a new process opens it by
// name and reads what the owner wrote. And a GPU stream waiting on a semaphore whose signaller died while no broker
// ran is released once the new broker learns of the semaphore.
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>

#include "cuda/context.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/support.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();
constexpr std::size_t kBytes = 16ULL << 20;
constexpr std::size_t kWords = kBytes / 4;

TEST(BrokerRestartDevice, TheOwnerGivesADeviceSegmentsNameBackAndAnotherProcessReadsIt) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe filled, broker_killed, reannounced, read_back;
  const pid_t owner = start_child([&] {
    cuda::PrimaryContext ctx{0};
    ctx.make_current();
    auto stream = cuda::Stream::create();
    kernels::Kernels k;
    auto seg = Segment::create(name, kBytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0644});
    k.fill_pattern(stream.get(), seg.device_pointer(), kWords, 11);
    stream.synchronize();
    filled.notify();
    GPUIPC_CHILD_CHECK(broker_killed.wait(60s));
    const SegmentInfo info = Segment::stat(name);  // reconnects: the name goes back to the new broker
    GPUIPC_CHILD_CHECK(info.kind == SegmentKind::Device && info.mode == 0644U && info.owner_uid == ::getuid());
    reannounced.notify();
    GPUIPC_CHILD_CHECK(read_back.wait(60s));
    return 0;
  });
  ASSERT_TRUE(filled.wait(60s));
  ASSERT_TRUE(BrokerEnvironment::kill_broker());
  broker_killed.notify();
  ASSERT_TRUE(reannounced.wait(60s));
  EXPECT_EQ(run_child([&] {
              cuda::PrimaryContext ctx{0};
              ctx.make_current();
              auto stream = cuda::Stream::create();
              kernels::Kernels k;
              auto seg = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(k.count_mismatches(stream.get(), seg.device_pointer(), kWords, 11) == 0);
              return 0;
            }),
            0);
  read_back.notify();
  EXPECT_EQ(wait_child(owner), 0);
  Segment::unlink(name);
}

TEST(BrokerRestartDevice, AStreamWaitingOnASignallerThatDiedWithTheBrokerIsReleased) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("sem");
  SyncPipe created, waiting;
  const pid_t signaller = start_child([&] {
    cuda::PrimaryContext ctx{0};
    ctx.make_current();
    auto sem = Semaphore::create(name, {.initial = 0, .kind = SegmentKind::HostPinned, .device = 0, .mode = 0600});
    created.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  const pid_t waiter = start_child([&] {
    cuda::PrimaryContext ctx{0};
    ctx.make_current();
    auto stream = cuda::Stream::create();
    auto sem = Semaphore::open(name, {.role = SemaphoreRole::Waiter});
    GPUIPC_CHILD_CHECK(sem.wait(stream.get(), 5) == Status::Ok);
    auto done_within = [&](std::chrono::milliseconds t) { return wait_until([&] { return stream.query(); }, t, 1ms); };
    GPUIPC_CHILD_CHECK(!done_within(300ms));  // blocked on the signaller
    waiting.notify();
    // From here on this process makes no library call: its watcher gives the semaphore back to the new broker,
    // which finds the signaller's entry in its journal, its process gone, and poisons the semaphore.
    GPUIPC_CHILD_CHECK(done_within(20s));
    GPUIPC_CHILD_CHECK(sem.status() == Status::PeerDied);
    return 0;
  });
  ASSERT_TRUE(waiting.wait(60s));
  // Stopped, the signaller cannot rejoin; it dies while no broker runs.
  ASSERT_EQ(::kill(signaller, SIGSTOP), 0);
  ASSERT_TRUE(BrokerEnvironment::kill_broker());
  ::kill(signaller, SIGKILL);
  EXPECT_EQ(wait_child(signaller), 128 + SIGKILL);
  EXPECT_EQ(wait_child(waiter, 60s), 0);
  Semaphore::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
