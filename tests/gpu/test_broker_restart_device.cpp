// gpuipcd SIGKILLed under a device segment: the owner's mapping keeps working, its next call gives the name back to
// the new broker (a device fd carries no identity, so only the owner or root can), and a new process opens it by
// name and reads what the owner wrote.
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>

#include "cuda/context.hpp"
#include "gpuipc/segment.hpp"
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
  const pid_t broker = BrokerEnvironment::broker_pid();
  ASSERT_EQ(::kill(broker, SIGKILL), 0);
  ASSERT_TRUE(wait_until([&] { return ::kill(broker, 0) != 0 || task_state(broker) == 'Z'; }, 5s));
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

}  // namespace
}  // namespace gpuipc::test
