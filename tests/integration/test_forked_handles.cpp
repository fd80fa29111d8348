// A handle copied into a forked child: its member entry is the parent's. The child's calls on it are refused
// (InvalidState, saying to open the object again) and its copy's close touches nothing shared, so the parent keeps
// its entry, its permits, its messages and its blocks, and the other side sees no departure. Before, the child's
// close left for the parent: a semaphore was poisoned while its signaller lived, a pool's blocks were freed while
// their owner used them, a channel's held message went back to the queue.
#include <gtest/gtest.h>

#include <array>
#include <cstddef>

#include "gpuipc/channel.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using namespace std::chrono_literals;

const bool kRegistered = register_broker_environment();

/// Moves `handle` out and lets the copy close: what a forked child's exit, or its code dropping the handle, does.
template <typename Handle>
void close_copy(Handle& handle) {
  Handle gone = std::move(handle);
}

TEST(ForkedHandles, ACountingSemaphoresPermitsStayTheParents) {
  const auto name = unique_name("fork");
  auto a = CountingSemaphore::create(name, {.initial = 1, .max_count = 2});
  ASSERT_EQ(a.try_acquire(1), Status::Ok);  // the parent holds both permits
  EXPECT_EQ(run_child([&] {
              GPUIPC_CHILD_CHECK(fails_with([&] { (void)a.try_acquire(1); }, ErrorCode::InvalidState,
                                            "open the semaphore again in this process"));
              GPUIPC_CHILD_CHECK(fails_with([&] { a.release(1); }, ErrorCode::InvalidState, "forked"));
              GPUIPC_CHILD_CHECK(a.held() == 0);
              close_copy(a);
              auto own = CountingSemaphore::open(name);  // the child's own handle works
              GPUIPC_CHILD_CHECK(own.held() == 0 && own.try_acquire(1) == Status::WouldBlock);
              return 0;
            }),
            0);
  EXPECT_EQ(a.held(), 2U);
  EXPECT_EQ(a.available(), 0U);
  EXPECT_EQ(CountingSemaphore::stat(name).holders, 1U);
  a.release(2);  // still the parent's permits
  EXPECT_EQ(a.available(), 2U);
  CountingSemaphore::unlink(name);
}

TEST(ForkedHandles, ASemaphoreIsNotPoisonedWhileItsSignallerLives) {
  const auto name = unique_name("fork");
  auto sem = Semaphore::create(name, {.initial = 1, .kind = SegmentKind::Host, .device = 0, .mode = 0600});
  auto waiter = Semaphore::open(name, {.role = SemaphoreRole::Waiter});
  EXPECT_EQ(run_child([&] {
              // Not the child's to signal: it is no signaller (the parent's value moved, silently, before).
              GPUIPC_CHILD_CHECK(sem.signal_host(5) == Status::InvalidState);
              close_copy(sem);
              close_copy(waiter);
              return 0;
            }),
            0);
  EXPECT_EQ(sem.value(), 1U);
  // The parent is still the semaphore's signaller: its signal arrives, and nobody was told it left.
  EXPECT_EQ(sem.signal_host(2), Status::Ok);
  const auto r = waiter.wait_host(2, 0ns);
  EXPECT_EQ(r.status, Status::Ok);
  EXPECT_EQ(r.value, 2U);
  EXPECT_EQ(Semaphore::stat(name).signallers, 1U);
  Semaphore::unlink(name);
}

TEST(ForkedHandles, AChannelsMessagesAndMembersStayTheParents) {
  const auto name = unique_name("fork");
  auto prod = Channel::create(name, {.slots = 2, .slot_bytes = 64, .header_bytes = 8, .kind = SegmentKind::Host},
                              ChannelRole::Producer);
  auto cons = Channel::open(name, ChannelRole::Consumer);
  const std::array<std::byte, 4> payload{std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  std::uint64_t seq = 0;
  ASSERT_EQ(prod.send(nullptr, payload.data(), payload.size(), {}, 1s, seq), Status::Ok);
  MessageView msg;
  ASSERT_EQ(cons.receive(nullptr, 1s, msg), Status::Ok);
  EXPECT_EQ(run_child([&] {
              MessageView other;
              GPUIPC_CHILD_CHECK(cons.receive(nullptr, 0ns, other) == Status::InvalidState);
              GPUIPC_CHILD_CHECK(cons.release(nullptr) == Status::InvalidState);
              SlotView slot;
              GPUIPC_CHILD_CHECK(prod.acquire(nullptr, 0ns, slot) == Status::InvalidState);
              close_copy(cons);
              close_copy(prod);
              return 0;
            }),
            0);
  const auto st = Channel::stat(name);
  EXPECT_EQ(st.producers, 1U);
  EXPECT_EQ(st.consumers, 1U);
  EXPECT_EQ(st.queued, 0U);  // the message is still the parent's, not back in the queue
  EXPECT_EQ(cons.held(), 1U);
  EXPECT_EQ(cons.release(nullptr), Status::Ok);
  ASSERT_EQ(prod.send(nullptr, payload.data(), payload.size(), {}, 1s, seq), Status::Ok);  // no Closed
  Channel::unlink(name);
}

TEST(ForkedHandles, APoolsBlocksStayTheParentsUntilItFreesThem) {
  const auto name = unique_name("fork");
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = 64 << 10, .max_bytes = 64 << 10});
  Block block = pool.allocate(4096);
  static_cast<char*>(block.data())[0] = 'p';
  EXPECT_EQ(run_child([&] {
              GPUIPC_CHILD_CHECK(fails_with([&] { (void)pool.allocate(16); }, ErrorCode::InvalidState,
                                            "open the pool again in this process"));
              GPUIPC_CHILD_CHECK(fails_with([&] { pool.hold(block.ref()); }, ErrorCode::InvalidState, "forked"));
              Block other;
              GPUIPC_CHILD_CHECK(pool.try_allocate(16, 256, other) == Status::InvalidState);
              // Its free is refused too (it returned, freeing nothing), and the Block stays for close_copy.
              GPUIPC_CHILD_CHECK(fails_with([&] { pool.free(std::move(block), nullptr); }, ErrorCode::InvalidState,
                                            "forked"));
              GPUIPC_CHILD_CHECK(static_cast<bool>(block));
              close_copy(block);  // the Block's destructor frees a block of the child's own, not this one
              close_copy(pool);
              return 0;
            }),
            0);
  const auto st = Pool::stat(name);
  EXPECT_EQ(st.live_blocks, 1U);
  EXPECT_EQ(st.members, 1U);
  // Not handed out again: a new block is elsewhere, and the parent's bytes are where it left them.
  Block next = pool.allocate(4096);
  EXPECT_NE(next.ref().offset, block.ref().offset);
  EXPECT_EQ(static_cast<char*>(block.data())[0], 'p');
  pool.free(std::move(block), nullptr);
  EXPECT_EQ(Pool::stat(name).live_blocks, 1U);
  Pool::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
