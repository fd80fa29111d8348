// The counting semaphore's shared-memory protocol on a block built in memory: the creator's grant, operations,
// and the broker's repair of a member killed at each step of an operation (before its intent reached `state`,
// after it did but before its held count was updated), and the helping that completes a half-made operation.
#include <gtest/gtest.h>

#include <memory>

#include "broker/repair.hpp"
#include "proto/shm.hpp"
#include "shm/counting_block.hpp"

namespace gpuipc::shm {
namespace {

using proto::atomic;

struct Block {
  explicit Block(std::uint32_t initial, std::uint32_t max) : mem(std::make_unique<proto::CountingBlock>()) {
    auto& b = *mem;
    b = proto::CountingBlock{};
    b.magic = proto::kCountingMagic;
    b.version = proto::kCountingVersion;
    b.max_count = max;
    b.initial = initial;
    b.state = initial;
    cb = broker::ControlBlock{mem.get(), sizeof(proto::CountingBlock), proto::kFlagCounting, {}};
  }
  std::uint32_t join(std::uint32_t token, bool creator = false) {
    ErrorCode code{};
    std::string why;
    return broker::join_member(cb, proto::Role::Holder, token, creator, code, why);
  }
  bool remove(std::uint32_t member, std::uint32_t token) {
    return broker::remove_member(cb, broker::Joined{member, token, proto::Role::Holder});
  }
  std::uint32_t total() const {
    std::uint32_t n = counting_available(*mem);
    for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) n += counting_held(*mem, i);
    return n;
  }
  std::unique_ptr<proto::CountingBlock> mem;
  broker::ControlBlock cb;
};

TEST(ShmCounting, CheckAndTheCreatorsGrant) {
  Block b(1, 4);
  ASSERT_EQ(broker::check_control(b.cb), "");
  EXPECT_EQ(b.cb.counting_max, 4U);
  const auto creator = b.join(10, true);
  ASSERT_NE(creator, proto::kNoMember);
  EXPECT_EQ(counting_held(*b.mem, creator), 3U);
  const auto other = b.join(11, true);  // the grant is given once
  EXPECT_EQ(counting_held(*b.mem, other), 0U);
  EXPECT_EQ(b.total(), 4U);

  Block bad(5, 4);
  EXPECT_NE(broker::check_control(bad.cb), "");
  Block zero(0, 0);
  EXPECT_NE(broker::check_control(zero.cb), "");
  Block used(1, 1);
  used.mem->state = 0;  // not the initial state
  EXPECT_NE(broker::check_control(used.cb), "");
  EXPECT_EQ(broker::check_control(used.cb, false), "");  // a restarted broker takes it as it is
}

TEST(ShmCounting, ApplyAcquiresReleasesAndRefusesOverRelease) {
  Block b(3, 3);
  ASSERT_EQ(broker::check_control(b.cb), "");
  const auto m = b.join(1);
  EXPECT_EQ(counting_apply(*b.mem, m, false, 2, 3), CountingResult::Done);
  EXPECT_EQ(counting_apply(*b.mem, m, false, 2, 3), CountingResult::NotEnough);
  EXPECT_EQ(counting_apply(*b.mem, m, true, 3, 3), CountingResult::OverRelease);
  EXPECT_EQ(counting_held(*b.mem, m), 2U);
  EXPECT_EQ(counting_apply(*b.mem, m, true, 2, 3), CountingResult::Done);
  EXPECT_EQ(counting_available(*b.mem), 3U);
  EXPECT_EQ(counting_apply(*b.mem, proto::kMaxMembers, false, 1, 3), CountingResult::OverRelease);
}

TEST(ShmCounting, RepairGivesBackWhatADeadMemberHeld) {
  Block b(5, 5);
  ASSERT_EQ(broker::check_control(b.cb), "");
  const auto m = b.join(7);
  ASSERT_EQ(counting_apply(*b.mem, m, false, 4, 5), CountingResult::Done);
  EXPECT_FALSE(b.remove(m, 8));  // another token: not its entry
  EXPECT_TRUE(b.remove(m, 7));
  EXPECT_EQ(counting_available(*b.mem), 5U);
  EXPECT_EQ(counting_members(*b.mem), 0U);
  EXPECT_FALSE(b.remove(m, 7));  // once only
}

TEST(ShmCounting, DeathAfterTheCountChangedBeforeHeldIsCompletedByTheRepair) {
  Block b(5, 5);
  ASSERT_EQ(broker::check_control(b.cb), "");
  const auto m = b.join(7);
  ASSERT_EQ(counting_apply(*b.mem, m, false, 1, 5), CountingResult::Done);
  const std::uint64_t held_before = b.mem->slots[m].held;
  ASSERT_EQ(counting_apply(*b.mem, m, false, 3, 5), CountingResult::Done);
  b.mem->slots[m].held = held_before;  // killed between the CAS on `state` and the update of held
  EXPECT_EQ(counting_available(*b.mem), 1U);
  EXPECT_EQ(counting_held(*b.mem, m), 1U);
  EXPECT_TRUE(b.remove(m, 7));
  EXPECT_EQ(counting_available(*b.mem), 5U);  // the 3 it took and the 1 it held
}

TEST(ShmCounting, DeathBeforeTheCountChangedTakesNothing) {
  Block b(5, 5);
  ASSERT_EQ(broker::check_control(b.cb), "");
  const auto m = b.join(7);
  ASSERT_EQ(counting_apply(*b.mem, m, false, 2, 5), CountingResult::Done);
  // An intent for a release of 2 that never reached `state` (killed before its CAS).
  const std::uint64_t seq = ((b.mem->slots[m].held >> 40) + 1) & 0xFFFFFF;
  b.mem->slots[m].intent = (seq << 40) | (1ULL << 32) | 2;
  EXPECT_TRUE(b.remove(m, 7));
  EXPECT_EQ(counting_available(*b.mem), 5U);  // given back once, not twice
}

TEST(ShmCounting, AnotherMembersOperationCompletesAHalfMadeOne) {
  Block b(6, 6);
  ASSERT_EQ(broker::check_control(b.cb), "");
  const auto m1 = b.join(1);
  const auto m2 = b.join(2);
  const std::uint64_t held_before = b.mem->slots[m1].held;
  ASSERT_EQ(counting_apply(*b.mem, m1, false, 2, 6), CountingResult::Done);
  b.mem->slots[m1].held = held_before;  // half-made: the count changed, held not yet
  ASSERT_EQ(counting_apply(*b.mem, m2, false, 1, 6), CountingResult::Done);  // overwrites m1's tag: completes it
  EXPECT_EQ(counting_held(*b.mem, m1), 2U);
  EXPECT_TRUE(b.remove(m1, 1));  // nothing half-made any more: it gives back exactly 2
  EXPECT_EQ(counting_available(*b.mem), 5U);
  EXPECT_EQ(b.total(), 6U);
}

TEST(ShmCounting, QueueOrderAndRepairOfADeadWaiter) {
  Block b(0, 2);
  ASSERT_EQ(broker::check_control(b.cb), "");
  const auto m1 = b.join(1);
  const auto m2 = b.join(2);
  counting_enqueue(*b.mem, m1, 1);
  counting_enqueue(*b.mem, m2, 1);
  EXPECT_TRUE(counting_is_head(*b.mem, m1));
  EXPECT_FALSE(counting_is_head(*b.mem, m2));
  EXPECT_EQ(b.mem->waiting, 2U);
  EXPECT_TRUE(b.remove(m1, 1));  // died waiting
  EXPECT_TRUE(counting_is_head(*b.mem, m2));
  EXPECT_EQ(b.mem->waiting, 1U);
  counting_dequeue(*b.mem, m2);
  EXPECT_EQ(b.mem->waiting, 0U);
  EXPECT_FALSE(counting_is_head(*b.mem, m2));
}

TEST(ShmCounting, ScribbledWordsNeitherCrashNorLoopTheRepair) {
  Block b(4, 4);
  ASSERT_EQ(broker::check_control(b.cb), "");
  const auto m = b.join(3);
  ASSERT_EQ(counting_apply(*b.mem, m, false, 2, 4), CountingResult::Done);
  b.mem->state = ~0ULL;  // a tag naming member 254, count 2^32 - 1
  b.mem->slots[m].intent = ~0ULL;
  b.mem->slots[m].held = 0xFFFFFFFFULL;
  EXPECT_TRUE(b.remove(m, 3));
  EXPECT_LE(counting_available(*b.mem), 4U);  // clamped to max_count, never above
}

}  // namespace
}  // namespace gpuipc::shm
