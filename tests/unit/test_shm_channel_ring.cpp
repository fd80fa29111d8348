// The channel ring's shared-memory transitions (src/shm/channel_ring.hpp) on a ring built in memory: the host
// steps of a round (claim, publish, take, release), giving back and handing back, then an exhaustive model check.
// The model runs every interleaving, up to a bound, of two producers and two consumers on a two-slot device-kind
// ring: each host call is one step, each member's stream is a queue of the waits and writes the core would enqueue
// (src/core/channel.cpp), executed one at a time as a GPU would (a plain 64-bit store; a cyclic >= wait), and any
// member may leave cleanly or die (its queued stream work dropped, then the broker's repair) at any point. After
// every step it checks that no slot word went backwards, that no message was released twice, and that no message
// handed back is out of the consumers' reach; at every end, that every stream still drains (no GPU wait is left
// for a word nobody will write) and that every message published and not released is still in its slot. Deaths
// come once the dying member's stream ran what it was given in the first case, at any point in the second (the
// broker then makes the writes it owed as their turns come: one more actor of the model).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "proto/shm.hpp"
#include "shm/channel_ring.hpp"
#include "shm/sync.hpp"

namespace gpuipc::shm {
namespace {

using proto::atomic;
using proto::Phase;
using proto::PoisonReason;
using proto::Role;

/// A control block in ordinary memory, filled in as Channel::create fills it in.
class RingBlock {
 public:
  RingBlock(std::uint32_t slots, std::uint32_t header_bytes)
      : m_bytes(proto::channel_control_bytes(slots, header_bytes)),
        m_mem(static_cast<std::byte*>(::operator new(m_bytes, std::align_val_t{64}))) {
    std::memset(m_mem.get(), 0, m_bytes);
    ring_init(m_mem.get(), slots, header_bytes, 4096, 0);
    m_ring = Ring{m_mem.get(), *ring_geometry(m_mem.get(), m_bytes)};
  }
  const Ring& ring() const { return m_ring; }
  proto::ChannelHeader& h() const { return m_ring.header(); }
  proto::Slot& slot(std::uint64_t seq) const { return m_ring.slot(seq); }
  std::uint32_t join(std::uint32_t token, Role role) const { return channel_join(m_ring, token, role); }
  /// What a model state keeps of the block: the header and the slots, and the owed tables of the first
  /// kKeptTables members up to kKeptEntries entries (a model run records fewer).
  std::string bytes() const {
    std::string b(reinterpret_cast<const char*>(m_mem.get()), tables_offset());
    for (std::uint32_t i = 0; i < kKeptTables; ++i) b.append(reinterpret_cast<const char*>(table(i)), kKeptTableBytes);
    return b;
  }
  void restore(const std::string& b) const {
    std::memcpy(m_mem.get(), b.data(), tables_offset());
    for (std::uint32_t i = 0; i < kKeptTables; ++i) {
      std::memcpy(table(i), b.data() + tables_offset() + i * kKeptTableBytes, kKeptTableBytes);
    }
  }
  /// What the broker does when member `index` dies: takes the stream writes it still owed, removes it, and makes
  /// those whose turn has come. Returns those still waiting (ring_settle_owed them later).
  std::vector<proto::OwedWrite> die(std::uint32_t index, std::uint32_t token, Role role) const {
    std::vector<proto::OwedWrite> owed(proto::owed_capacity(m_ring.geometry.slots));
    owed.resize(ring_take_owed(m_ring, index, owed));
    EXPECT_TRUE(channel_remove_member(m_ring.control, m_ring.geometry, index, token, role, PoisonReason::PeerDied));
    owed.resize(ring_settle_owed(m_ring, owed));
    return owed;
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { ::operator delete(p, std::align_val_t{64}); }
  };
  static constexpr std::uint32_t kKeptTables = 4;
  static constexpr std::size_t kKeptTableBytes = sizeof(proto::OwedTable) + 8 * sizeof(proto::OwedWrite);
  std::size_t tables_offset() const {
    return proto::owed_tables_offset(m_ring.geometry.slots, m_ring.geometry.header_bytes);
  }
  void* table(std::uint32_t member) const { return &ring_owed_table(m_ring, member); }
  std::size_t m_bytes;
  std::unique_ptr<std::byte, Free> m_mem;
  Ring m_ring;
};

/// A two-slot ring with producer `p` and consumer `c`, and the out-arguments of their attempts.
class ShmChannelRing : public ::testing::Test {
 protected:
  RingBlock b{2, 8};
  std::uint32_t p = b.join(10, Role::Producer);
  std::uint32_t c = b.join(20, Role::Consumer);
  std::uint64_t seq = 99;
  PoisonReason gone = PoisonReason::None;
};

TEST(ShmChannelRingInit, InitAndGeometry) {
  RingBlock b(4, 16);
  EXPECT_EQ(b.ring().geometry.slots, 4U);
  EXPECT_EQ(b.ring().geometry.header_bytes, 16U);
  EXPECT_EQ(b.h().version, proto::kChannelVersion);
  for (std::uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(b.slot(i).state, proto::pack_state(i, Phase::Free, proto::kNoMember));
  }
  EXPECT_EQ(ring_owed_room(b.ring(), 0), proto::owed_capacity(4));
  EXPECT_FALSE(ring_geometry(b.ring().control, sizeof(proto::ChannelHeader)));  // records outside the mapping
}

TEST_F(ShmChannelRing, HostRoundTrip) {
  ASSERT_FALSE(ring_try_receive(b.ring(), c, seq, gone));  // nothing published
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  EXPECT_EQ(gone, PoisonReason::None);
  EXPECT_EQ(seq, 0U);
  EXPECT_EQ(b.slot(0).state, proto::pack_state(0, Phase::Writing, p));
  EXPECT_EQ(b.h().head, 1U);
  const std::array<std::byte, 3> header{std::byte{1}, std::byte{2}, std::byte{3}};
  ring_publish(b.ring(), 0, p, header, 100, false);
  EXPECT_EQ(b.slot(0).state, proto::pack_state(0, Phase::Published, p));
  EXPECT_EQ(b.slot(0).filled, 1U);
  EXPECT_EQ(b.slot(0).size, 100U);
  EXPECT_EQ(std::memcmp(b.ring().user_header(0), header.data(), header.size()), 0);
  EXPECT_EQ(b.h().published, 1U);
  EXPECT_EQ(b.h().published_bytes, 100U);
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_EQ(seq, 0U);
  EXPECT_EQ(b.slot(0).state, proto::pack_state(0, Phase::Reading, c));
  ring_release(b.ring(), 0, c, false);
  EXPECT_EQ(b.slot(0).state, proto::pack_state(2, Phase::Free, proto::kNoMember));
  EXPECT_EQ(b.slot(0).freed, 1U);
  EXPECT_EQ(ring_free_mark(b.ring(), 2), 1U);
  EXPECT_EQ(ring_owed_room(b.ring(), c), proto::owed_capacity(2));  // a host channel's release owes no stream write
  EXPECT_TRUE(ring_member_writes_done(b.ring(), p));
  EXPECT_TRUE(ring_member_writes_done(b.ring(), c));
}

// A peer that writes a far-ahead round into every slot and sets the head or tail back: a claim helps the index
// along a bounded number of steps, then finds nothing (the caller's wait then times out). It helped for up to 2^48.
TEST_F(ShmChannelRing, AClaimOnARingScribbledFarAheadEnds) {
  constexpr std::uint64_t kFar = (std::uint64_t{1} << 48) - 1;
  for (std::uint64_t i = 0; i < 2; ++i) b.slot(i).state = proto::pack_state(kFar - 1 + i, Phase::Writing, p);
  b.h().head = 0;
  EXPECT_FALSE(ring_try_acquire(b.ring(), p, seq, gone));
  EXPECT_LT(b.h().head, kFar);
  for (std::uint64_t i = 0; i < 2; ++i) b.slot(i).state = proto::pack_state(kFar - 1 + i, Phase::Reading, c);
  b.h().tail = 0;
  EXPECT_FALSE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_LT(b.h().tail, kFar);
}

TEST_F(ShmChannelRing, FullRingAndGivingBack) {
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  EXPECT_FALSE(ring_try_acquire(b.ring(), p, seq, gone));  // every slot in flight
  ring_give_back(b.ring(), 1, p);
  EXPECT_EQ(b.slot(1).state, proto::pack_state(3, Phase::Free, proto::kNoMember));
  EXPECT_EQ(b.h().abandoned, 1U);
  EXPECT_EQ(b.slot(1).freed, 0U);  // an abandoned round writes no `freed`
  EXPECT_EQ(ring_free_mark(b.ring(), 3), 0U);
  ring_publish(b.ring(), 0, p, {}, 0, false);
  EXPECT_FALSE(ring_try_acquire(b.ring(), p, seq, gone));  // sequence 2 waits for message 0's release
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_EQ(seq, 0U);
  ring_release(b.ring(), 0, c, false);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  EXPECT_EQ(seq, 2U);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  EXPECT_EQ(seq, 3U);  // slot 1 serves its next round
  EXPECT_EQ(ring_free_mark(b.ring(), 3), 0U);  // and waits for no `freed`: no message went through it yet
  ring_publish(b.ring(), 2, p, {}, 0, false);
  ring_publish(b.ring(), 3, p, {}, 0, false);
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_EQ(seq, 2U);  // the consumer skips the abandoned sequence
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_EQ(seq, 3U);
}

TEST_F(ShmChannelRing, HandBackGoesToExactlyOneOtherConsumer) {
  const std::uint32_t c1 = c;
  const std::uint32_t c2 = b.join(21, Role::Consumer);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ring_publish(b.ring(), 0, p, {}, 0, false);
  ASSERT_TRUE(ring_try_receive(b.ring(), c1, seq, gone));
  ring_hand_back(b.ring(), 0, c1);
  EXPECT_EQ(b.h().orphans, 1U);
  EXPECT_EQ(b.h().redelivered, 0U);  // counted only for a consumer that left or died
  ASSERT_TRUE(ring_try_receive(b.ring(), c2, seq, gone));
  EXPECT_EQ(seq, 0U);
  EXPECT_EQ(b.slot(0).state, proto::pack_state(0, Phase::Reading, c2));
  EXPECT_FALSE(ring_try_receive(b.ring(), c1, seq, gone));
}

// A consumer asleep at the tail, whose slot a producer claimed while another producer published the next message,
// must be woken when the first gives its slot back: it can take the next message now. Only producers were woken,
// and the consumer slept until another publish or its timeout.
TEST_F(ShmChannelRing, AGiveBackWakesConsumersWaitingBehindIt) {
  const std::uint32_t p2 = b.join(11, Role::Producer);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ASSERT_EQ(seq, 0U);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));
  ASSERT_EQ(seq, 1U);
  ASSERT_TRUE(ring_publish(b.ring(), 1, p2, {}, 0, false));
  EXPECT_FALSE(ring_try_receive(b.ring(), c, seq, gone));  // message 0 is still being written: it sleeps
  const std::uint32_t asleep_at = b.h().published_seq;
  ring_give_back(b.ring(), 0, p);
  EXPECT_NE(b.h().published_seq, asleep_at) << "consumers waiting on published_seq were not woken";
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_EQ(seq, 1U);
}

// A member the broker repaired as gone while its process still ran (its connection closed, and it neither rejoined
// nor exited within the grace) may still release or publish what it held: its round is another member's by then.
// The late store used to overwrite that member's state: a Free under a consumer still reading (the next producer
// then wrote the slot it read), a Published over another producer's claim of the slot's next round.
TEST_F(ShmChannelRing, ALateReleaseOrPublishOfARepairedMemberWritesNothing) {
  const std::uint32_t c2 = b.join(21, Role::Consumer);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ASSERT_TRUE(ring_publish(b.ring(), 0, p, {}, 7, false));
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_TRUE(b.die(c, 20, Role::Consumer).empty());  // message 0 goes back behind the tail
  ASSERT_TRUE(ring_try_receive(b.ring(), c2, seq, gone));
  ASSERT_EQ(seq, 0U);
  EXPECT_FALSE(ring_release(b.ring(), 0, c, false));
  EXPECT_EQ(b.slot(0).state, proto::pack_state(0, Phase::Reading, c2)) << "freed under the consumer reading it";
  EXPECT_EQ(b.slot(0).release_mark, 0U);
  EXPECT_EQ(b.slot(0).freed, 0U);
  EXPECT_TRUE(ring_release(b.ring(), 0, c2, false));

  const std::uint32_t p2 = b.join(11, Role::Producer);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ASSERT_EQ(seq, 1U);
  EXPECT_TRUE(b.die(p, 10, Role::Producer).empty());       // its claim of slot 1 is abandoned (its process has exited)
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));  // round 2, slot 0
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));  // round 3, slot 1 again
  ASSERT_EQ(seq, 3U);
  const std::byte header[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  EXPECT_FALSE(ring_publish(b.ring(), 1, p, header, 99, false));
  EXPECT_EQ(b.slot(1).state, proto::pack_state(3, Phase::Writing, p2)) << "published over another producer's claim";
  EXPECT_EQ(b.slot(1).size, 0U);
  EXPECT_EQ(b.slot(1).filled, 0U);
  EXPECT_EQ(b.h().published, 1U);
}

// Two consumers look behind the tail for a message handed back while a third hands another back, into a slot one of
// them has looked at already. A count of the messages there was zeroed by the look that found none (the other
// consumer had taken the first): the second stayed behind the tail for good, and the ring filled up behind it (about
// 1 run in 100).
TEST(ShmChannelRingRace, AMessageHandedBackWhileConsumersLookIsStillDelivered) {
  constexpr std::uint32_t kSlotsHere = 4096;
  constexpr std::uint64_t kFirst = 4000;  // handed back before the consumers look
  constexpr std::uint64_t kSecond = 10;   // handed back while they look
  RingBlock b{kSlotsHere, 0};
  const std::uint32_t c1 = b.join(1, Role::Consumer);
  const std::uint32_t c2 = b.join(2, Role::Consumer);
  const std::uint32_t c3 = b.join(3, Role::Consumer);
  const std::uint32_t held = b.join(4, Role::Consumer);
  int lost = 0;
  for (int run = 0; run < 3000; ++run) {
    // Messages 0..4095 received (the tail is past them all); the first handed back, the second held.
    b.h().head = kSlotsHere;
    b.h().tail = kSlotsHere;
    for (std::uint64_t i = 0; i < kSlotsHere; ++i) b.slot(i).state = proto::pack_state(i, Phase::Reading, c3);
    b.slot(kSecond).state = proto::pack_state(kSecond, Phase::Reading, held);
    ring_hand_back(b.ring(), kFirst, c3);
    std::atomic<bool> go{false};
    std::array<std::uint64_t, 2> got{~0ULL, ~0ULL};
    auto consumer = [&](std::uint32_t member, std::uint64_t& out) {
      while (!go.load()) {
      }
      PoisonReason gone = PoisonReason::None;
      if (!ring_try_receive(b.ring(), member, out, gone)) out = ~0ULL;
    };
    std::thread a(consumer, c1, std::ref(got[0]));
    std::thread d(consumer, c2, std::ref(got[1]));
    std::thread giver([&] {
      while (!go.load()) {
      }
      for (int i = 0; i < (run % 200) * 20; ++i) std::atomic_signal_fence(std::memory_order_seq_cst);  // a delay
      ring_hand_back(b.ring(), kSecond, held);
    });
    go.store(true);
    a.join();
    d.join();
    giver.join();
    // Whatever the two took, the rest comes to the next look: both messages, each once.
    std::vector<std::uint64_t> delivered;
    for (const std::uint64_t g : got) {
      if (g != ~0ULL) delivered.push_back(g);
    }
    std::uint64_t seq = 0;
    PoisonReason gone = PoisonReason::None;
    while (ring_try_receive(b.ring(), c1, seq, gone)) delivered.push_back(seq);
    std::sort(delivered.begin(), delivered.end());
    if (delivered != std::vector<std::uint64_t>{kSecond, kFirst} && ++lost <= 3) {
      ADD_FAILURE() << "run " << run << ": delivered " << delivered.size() << " of the 2 handed back";
    }
  }
  EXPECT_EQ(lost, 0) << "runs that lost a message handed back";
}

TEST_F(ShmChannelRing, StreamWordsAndTheirRepair) {
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ring_publish(b.ring(), 0, p, {}, 0, true);  // a device channel: the producer's stream writes `filled`
  EXPECT_EQ(b.slot(0).filled, 0U);
  EXPECT_FALSE(ring_member_writes_done(b.ring(), p));
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  ring_release(b.ring(), 0, c, true);
  EXPECT_EQ(b.slot(0).freed, 0U);
  EXPECT_FALSE(ring_member_writes_done(b.ring(), c));
  // The consumer leaves with its `freed` write still queued: the removal writes what its release announced.
  EXPECT_TRUE(channel_remove_member(b.ring().control, b.ring().geometry, c, 20, Role::Consumer, PoisonReason::Closed));
  EXPECT_EQ(b.slot(0).freed, 1U);
  EXPECT_EQ(b.h().consumers_gone, static_cast<std::uint32_t>(PoisonReason::Closed));
  EXPECT_FALSE(channel_remove_member(b.ring().control, b.ring().geometry, c, 20, Role::Consumer,
                                     PoisonReason::PeerDied));  // once
  EXPECT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  EXPECT_EQ(gone, PoisonReason::Closed);
  ring_mark_incomplete(b.slot(0), 0);  // what a failed `filled` enqueue does
  EXPECT_EQ(b.slot(0).filled, 1U);
  EXPECT_EQ(b.slot(0).incomplete, proto::incomplete_mark(0));
  EXPECT_TRUE(ring_member_writes_done(b.ring(), p));
}

// A member's owed table: each device publish records a write until it lands; landed writes are forgotten once
// half the table is used, and a full table leaves no room (Channel's acquire and receive then wait).
TEST_F(ShmChannelRing, TheOwedTableFillsAsStreamsLagAndEmptiesAsWritesLand) {
  const std::uint64_t cap = proto::owed_capacity(2);
  std::uint64_t last = 0;
  for (std::uint64_t i = 0; i < cap; ++i) {
    ASSERT_EQ(ring_owed_room(b.ring(), p), cap - i);
    ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
    ring_publish(b.ring(), seq, p, {}, 0, true);  // the stream has not written `filled`
    ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
    ring_release(b.ring(), seq, c, false);
    last = seq;
  }
  EXPECT_EQ(ring_owed_room(b.ring(), p), 0U);
  EXPECT_FALSE(ring_member_writes_done(b.ring(), p));
  // The stream catches up to all but the last message: all but one are forgotten.
  for (std::uint64_t q = 0; q < last; ++q) raise_to(b.slot(q).filled, q + 1);
  EXPECT_EQ(ring_owed_room(b.ring(), p), cap - 1);
  EXPECT_FALSE(ring_member_writes_done(b.ring(), p));
  raise_to(b.slot(last).filled, last + 1);
  EXPECT_TRUE(ring_member_writes_done(b.ring(), p));
}

// Any member can write into any member's owed table: a table scribbled over bounds every loop by its capacity.
TEST_F(ShmChannelRing, AScribbledOwedTableIsReadNoFurtherThanItsCapacity) {
  auto& t = ring_owed_table(b.ring(), c);
  t.begin = 5;
  t.end = 1ULL << 60;
  EXPECT_LE(ring_owed_room(b.ring(), c), proto::owed_capacity(2));
  (void)ring_member_writes_done(b.ring(), c);
  std::vector<proto::OwedWrite> out(proto::owed_capacity(2));
  EXPECT_LE(ring_take_owed(b.ring(), c, out), out.size());
  EXPECT_TRUE(channel_remove_member(b.ring().control, b.ring().geometry, c, 20, Role::Consumer, PoisonReason::Closed));
}

// A member's own record (Channel keeps one): its room and whether its writes are done are judged from it, so
// entries another member wrote into its table, which never land, do not hold it back; the table is written from it
// again before a leave hands it over.
TEST_F(ShmChannelRing, AMembersOwnRecordOfWhatItOwesIsNotHeldBackByAScribbledTable) {
  const std::uint64_t cap = proto::owed_capacity(2);
  OwnOwed own{std::vector<proto::OwedWrite>(cap), 0, 0};
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ASSERT_TRUE(ring_publish(b.ring(), seq, p, {}, 0, true, &own));  // owed: message 0's `filled`
  EXPECT_EQ(own.end, 1U);
  auto& t = ring_owed_table(b.ring(), p);
  auto* e = reinterpret_cast<proto::OwedWrite*>(&t + 1);
  for (std::uint64_t i = 0; i < cap; ++i) e[i] = {(1ULL << 40) + i, 0};  // writes that never land
  t.begin = 0;
  t.end = cap;
  EXPECT_EQ(ring_owed_room(b.ring(), p), 0U);  // the table alone: no room, for good
  EXPECT_EQ(ring_owed_room(b.ring(), p, &own), cap - 1);
  EXPECT_FALSE(ring_member_writes_done(b.ring(), p, &own));
  raise_to(b.slot(0).filled, 1);  // the stream writes it
  EXPECT_TRUE(ring_member_writes_done(b.ring(), p, &own));
  EXPECT_FALSE(ring_member_writes_done(b.ring(), p));  // (the scribbled table never is)

  // The next publish rewrites the table's bounds from the record; a restore rewrites its entries too, and what the
  // broker takes over is what the member owes.
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ASSERT_TRUE(ring_publish(b.ring(), seq, p, {}, 0, true, &own));
  EXPECT_EQ(t.begin, 0U);
  EXPECT_EQ(t.end, 2U);
  std::vector<proto::OwedWrite> out(cap);
  ring_restore_owed(b.ring(), p, own);
  ASSERT_EQ(ring_take_owed(b.ring(), p, out), 1U);
  EXPECT_EQ(out[0].code, seq);

  // A record of another size is not used: the table is.
  OwnOwed wrong{std::vector<proto::OwedWrite>(cap + 1), 0, 0};
  EXPECT_EQ(ring_owed_room(b.ring(), p, &wrong), ring_owed_room(b.ring(), p));
}

/// Whether a GPU stream wait for `value` passes on `word`: a cyclic 64-bit >= (CU_STREAM_WAIT_VALUE_GEQ).
bool stream_wait_passes(std::uint64_t word, std::uint64_t value) {
  return static_cast<std::int64_t>(word - value) >= 0;
}

// A dead producer's `filled` is the value its stream would have written, flagged incomplete, with no poison mark:
// a stream wait is a cyclic >=, and a marked value left by an earlier round would pass the wait of a later round's
// consumer before that round's producer wrote the slot (the defect b7c6454 fixed for the marks repairs used to write).
TEST_F(ShmChannelRing, ADeadProducersFilledDoesNotReleaseALaterRoundsStreamWait) {
  const std::uint32_t p2 = b.join(11, Role::Producer);
  // Round 0: published, and its producer dies before its stream writes `filled`.
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ring_publish(b.ring(), 0, p, {}, 0, true);
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  EXPECT_TRUE(b.die(p, 10, Role::Producer).empty());
  EXPECT_EQ(b.slot(0).filled, 1U);
  EXPECT_EQ(b.slot(0).incomplete, proto::incomplete_mark(0));
  ring_release(b.ring(), 0, c, false);
  // Round 2 goes through slot 0 (round 1 given back): published by the second producer, whose stream has not
  // written the slot yet. Its consumer's wait must not pass.
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));
  ring_give_back(b.ring(), 1, p2);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));
  ASSERT_EQ(seq, 2U);
  ring_publish(b.ring(), 2, p2, {}, 0, true);
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  ASSERT_EQ(seq, 2U);
  EXPECT_FALSE(stream_wait_passes(b.slot(0).filled, 3));
  EXPECT_NE(b.slot(0).incomplete, proto::incomplete_mark(2));  // round 2 is not flagged incomplete
  // If round 2's producer dies too, its write releases the wait.
  EXPECT_TRUE(b.die(p2, 11, Role::Producer).empty());
  EXPECT_TRUE(stream_wait_passes(b.slot(0).filled, 3));
  EXPECT_EQ(b.slot(0).incomplete, proto::incomplete_mark(2));
}

// A producer that wrote its slot's `filled` with the top bit set and died owing the write: the broker's raise took
// the garbage for a value above the owed one, wrote nothing and dropped the entry, and the consumer's stream (a
// cyclic >=) waited for good, the slot's next producer behind it. The same for a consumer's `freed`.
TEST_F(ShmChannelRing, ADeadMembersOwedWriteReplacesGarbageWithTheTopBitSet) {
  constexpr std::uint64_t kGarbage = 0xC000'0000'0000'0000;
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ring_publish(b.ring(), 0, p, {}, 0, true);
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  b.slot(0).filled = kGarbage;
  EXPECT_TRUE(b.die(p, 10, Role::Producer).empty());
  EXPECT_TRUE(stream_wait_passes(b.slot(0).filled, 1));
  ring_release(b.ring(), 0, c, true);  // in stream order: the consumer's stream owes `freed`
  b.slot(0).freed = kGarbage;
  EXPECT_TRUE(b.die(c, 20, Role::Consumer).empty());
  EXPECT_TRUE(stream_wait_passes(b.slot(0).freed, ring_free_mark(b.ring(), 0)));
}

// The broker decides to flag a dead producer's message incomplete from the slot's state, and its flag can land after
// the slot moved on: the message consumed and released, a later round published (which clears the flag). The flag
// names its message, so the later round is not reported incomplete. Before, it was one bit, and the later message
// read as incomplete.
TEST_F(ShmChannelRing, ALateIncompleteFlagDoesNotFlagALaterRound) {
  const std::uint32_t p2 = b.join(11, Role::Producer);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ring_publish(b.ring(), 0, p, {}, 0, true);              // message 0: its stream has not written `filled`
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));  // the broker reads this state and decides to flag it
  ring_release(b.ring(), 0, c, false);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));
  ring_give_back(b.ring(), 1, p2);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));
  ASSERT_EQ(seq, 2U);
  ring_publish(b.ring(), 2, p2, {}, 0, false);  // message 2 in slot 0, complete
  ring_mark_incomplete(b.slot(0), 0);           // the broker's flag for message 0 lands now
  EXPECT_NE(b.slot(0).incomplete, proto::incomplete_mark(2));
  EXPECT_EQ(b.slot(2).filled, 3U);
}

// The consumer flow docs/channels.md shows releases a message in stream order: the host release comes at once,
// while the consumer's stream still waits for the message's `filled`. A producer that dies then, its stream short
// of `filled`, left a message the consumer reads partly written, and its flag must still say so once the consumer's
// stream is past it (when the consumer checks). Before, the broker flagged a message only while it was in its slot,
// and the slot's next publish cleared the flag.
TEST_F(ShmChannelRing, AMessageReleasedInStreamOrderIsFlaggedWhenItsProducerDiesBeforeWritingIt) {
  const std::uint32_t p2 = b.join(11, Role::Producer);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p, seq, gone));
  ring_publish(b.ring(), 0, p, {}, 0, true);  // message 0: its stream has not written `filled`
  ASSERT_TRUE(ring_try_receive(b.ring(), c, seq, gone));
  ring_release(b.ring(), 0, c, true);  // in stream order: `freed` is owed by the consumer's stream
  // What MessageView::incomplete reads.
  const auto flagged = [&](std::uint64_t message) { return b.slot(0).incomplete == proto::incomplete_mark(message); };
  EXPECT_FALSE(flagged(0));
  EXPECT_TRUE(b.die(p, 10, Role::Producer).empty());
  EXPECT_TRUE(stream_wait_passes(b.slot(0).filled, 1));  // the consumer's stream goes on
  EXPECT_TRUE(flagged(0));
  // The slot's next round, published by the second producer, neither clears the flag nor is flagged by it.
  b.slot(0).freed = 1;  // the consumer's stream reached its release
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));
  ring_give_back(b.ring(), 1, p2);
  ASSERT_TRUE(ring_try_acquire(b.ring(), p2, seq, gone));
  ASSERT_EQ(seq, 2U);
  ring_publish(b.ring(), 2, p2, {}, 0, false);
  EXPECT_TRUE(flagged(0));
  EXPECT_FALSE(flagged(2));
}

// A flag lands late (the broker's, for a dead producer's message released in stream order) on a slot whose later
// round was flagged first (its producer's enqueue of `filled` failed): the later round keeps its flag.
TEST_F(ShmChannelRing, ALateFlagDoesNotTakeALaterRoundsFlag) {
  ring_mark_incomplete(b.slot(0), 2);
  ring_mark_incomplete(b.slot(0), 0);
  EXPECT_EQ(b.slot(0).incomplete, proto::incomplete_mark(2));
  ring_mark_incomplete(b.slot(0), 4);
  EXPECT_EQ(b.slot(0).incomplete, proto::incomplete_mark(4));
  EXPECT_EQ(b.slot(0).filled, 5U);
}

TEST(ShmChannelRingInit, IncompleteMarksAreNeverZeroAndDifferForNearbyRounds) {
  EXPECT_EQ(proto::incomplete_mark(0), 1U);
  EXPECT_NE(proto::incomplete_mark(0xFFFF'FFFEULL), 0U);
  EXPECT_NE(proto::incomplete_mark(0xFFFF'FFFFULL), 0U);
  EXPECT_NE(proto::incomplete_mark(1ULL << 40), proto::incomplete_mark((1ULL << 40) + 4096));
  // Which of two marks names the later message, across the marks' wrap too.
  EXPECT_TRUE(proto::incomplete_mark_is_later(proto::incomplete_mark(2), proto::incomplete_mark(0)));
  EXPECT_FALSE(proto::incomplete_mark_is_later(proto::incomplete_mark(0), proto::incomplete_mark(2)));
  EXPECT_FALSE(proto::incomplete_mark_is_later(proto::incomplete_mark(3), proto::incomplete_mark(3)));
  EXPECT_TRUE(proto::incomplete_mark_is_later(proto::incomplete_mark(0xFFFF'FFFFULL + 1),
                                              proto::incomplete_mark(0xFFFF'FFFEULL)));
  EXPECT_FALSE(proto::incomplete_mark_is_later(0, proto::incomplete_mark(0)));
  EXPECT_FALSE(proto::incomplete_mark_is_later(proto::incomplete_mark(0), 0));
}

// ---------------------------------------------------------------------------------------------------------------
// The exhaustive model.

constexpr std::uint32_t kSlots = 2;
// The bounds: rounds claimed in all, and leaves and deaths in all. 3 and 2 run in a few seconds; 4 and 2 (every
// slot reused once, 848k states) took 17 s of CPU when last run (-DGPUIPC_RING_MODEL_ROUNDS=4).
#ifndef GPUIPC_RING_MODEL_ROUNDS
#define GPUIPC_RING_MODEL_ROUNDS 3
#endif
constexpr unsigned kMaxAcquires = GPUIPC_RING_MODEL_ROUNDS;
constexpr unsigned kMaxExits = 2;

struct StreamOp {
  bool write = false;  // else a wait
  std::uint64_t seq = 0;
  bool freed = false;  // the word: `freed`, else `filled`
  std::uint64_t value = 0;
};

struct ModelMember {
  Role role = Role::None;
  std::uint32_t index = proto::kNoMember;
  std::uint32_t token = 0;
  bool alive = true;
  std::deque<std::uint64_t> held;
  std::deque<StreamOp> stream;
};

struct ModelState {
  std::string ring;
  std::vector<ModelMember> members;
  unsigned acquires = 0;
  unsigned exits = 0;
  std::array<unsigned, kMaxAcquires + kSlots> released{};
  std::array<bool, kMaxAcquires + kSlots> published{};
  std::vector<proto::OwedWrite> owed;  // the broker's: writes dead members' streams still owe
};

class Model {
 public:
  /// `die_with_stream_work`: also let a member die with stream work still queued (the known gaps in
  /// src/shm/channel_ring.hpp); without it, a member dies once its stream ran everything it was given.
  explicit Model(bool die_with_stream_work) : m_die_with_stream_work(die_with_stream_work), m_block(kSlots, 0) {
    const Role roles[] = {Role::Producer, Role::Producer, Role::Consumer, Role::Consumer};
    ModelState s;
    for (std::uint32_t i = 0; i < 4; ++i) {
      ModelMember m;
      m.role = roles[i];
      m.token = 100 + i;
      m.index = m_block.join(m.token, m.role);
      s.members.push_back(m);
    }
    s.ring = m_block.bytes();
    explore(s);
  }
  std::size_t states() const { return m_seen.size(); }
  std::size_t ends() const { return m_ends; }

 private:
  std::uint64_t& word(const StreamOp& op) const {
    return op.freed ? m_block.slot(op.seq).freed : m_block.slot(op.seq).filled;
  }

  /// What identifies a state: the ring's bytes (less the futex words, which only count wakes) and the model's.
  std::string key(const ModelState& s) const {
    std::string k = s.ring;
    auto* h = reinterpret_cast<proto::ChannelHeader*>(k.data());
    h->published_seq = 0;
    h->released_seq = 0;
    for (const auto& m : s.members) {
      k += static_cast<char>(m.alive);
      for (const auto q : m.held) k += static_cast<char>('a' + q);
      k += '|';
      for (const auto& op : m.stream) {
        k += static_cast<char>((op.write ? 1 : 0) | (op.freed ? 2 : 0) | (static_cast<int>(op.seq) << 2));
        k += static_cast<char>(op.value);
      }
      k += '/';
    }
    for (const auto r : s.released) k += static_cast<char>(r);
    for (const auto& w : s.owed) k.append(reinterpret_cast<const char*>(&w), sizeof w);
    return k;
  }

  /// Every action of member `i` in state `s`: applies action `a` and returns whether it was enabled.
  bool act(ModelState& s, std::size_t i, unsigned a) {
    ModelMember& m = s.members[i];
    const Ring& r = m_block.ring();
    std::uint64_t seq = 0;
    PoisonReason gone = PoisonReason::None;
    if (!m.alive && a != 3 && a != 6) return false;  // a member that left cleanly still has its stream running
    switch (a) {
      case 0:  // acquire, or receive
        if (m.held.size() == kSlots) return false;
        if (m.role == Role::Producer) {
          if (s.acquires == kMaxAcquires || !ring_try_acquire(r, m.index, seq, gone)) return false;
          if (gone != PoisonReason::None) return false;  // no change
          ++s.acquires;
          const std::uint64_t mark = seq >= kSlots ? ring_free_mark(r, seq) : 0;
          if (mark != 0 && (m_block.slot(seq).freed & proto::kMaxValue) < mark) {
            m.stream.push_back({false, seq, true, mark});
          }
        } else {
          if (!ring_try_receive(r, m.index, seq, gone) || gone != PoisonReason::None) return false;
          if ((m_block.slot(seq).filled & proto::kMaxValue) < seq + 1) {
            m.stream.push_back({false, seq, false, seq + 1});
          }
        }
        m.held.push_back(seq);
        return true;
      case 1:  // publish, or release
        if (m.held.empty()) return false;
        seq = m.held.front();
        m.held.pop_front();
        if (m.role == Role::Producer) {
          ring_publish(r, seq, m.index, {}, 0, true);
          s.published[seq] = true;
          m.stream.push_back({true, seq, false, seq + 1});
        } else {
          ring_release(r, seq, m.index, true);
          EXPECT_EQ(s.released[seq]++, 0U) << "message " << seq << " released twice: " << m_path;
          m.stream.push_back({true, seq, true, seq + 1});
        }
        return true;
      case 2:  // give back the newest claim (a failed stream-wait enqueue, or send's failed copy)
        if (m.held.empty() || m.role != Role::Producer) return false;
        ring_give_back(r, m.held.back(), m.index);
        m.held.pop_back();
        return true;
      case 3:  // the stream runs its next operation
        return step_stream(m);
      case 4:  // a clean leave, once the member's own stream writes landed (Channel's leave waits for them); the
               // process lives on, and so does whatever its stream still has queued
      case 5:  // death: its queued stream work never runs, then the broker's repair
        if (s.exits == kMaxExits) return false;
        if (a == 5 && !m_die_with_stream_work && !m.stream.empty()) return false;
        if (a == 4 && !ring_member_writes_done(r, m.index)) return false;
        ++s.exits;
        m.held.clear();
        m.alive = false;
        if (a == 4) {
          EXPECT_TRUE(channel_remove_member(r.control, r.geometry, m.index, m.token, m.role, PoisonReason::Closed));
          return true;
        }
        m.stream.clear();
        {  // the broker: what its stream owed, the repair, and the writes whose turn has come
          const auto owed = m_block.die(m.index, m.token, m.role);
          s.owed.insert(s.owed.end(), owed.begin(), owed.end());
        }
        return true;
      case 6: {  // the broker looks at the writes dead members still owe (once per state: member 0's turn)
        if (i != 0 || s.owed.empty()) return false;
        const std::size_t before = s.owed.size();
        s.owed.resize(ring_settle_owed(r, s.owed));
        return s.owed.size() < before;
      }
      default:
        return false;
    }
  }

  /// Runs the stream's next operation as the GPU would: a plain store, or a cyclic 64-bit >= wait.
  bool step_stream(ModelMember& m) const {
    if (m.stream.empty()) return false;
    const StreamOp op = m.stream.front();
    if (op.write) {
      atomic(word(op)).store(op.value);
    } else if (static_cast<std::int64_t>(atomic(word(op)).load() - op.value) < 0) {
      return false;
    }
    m.stream.pop_front();
    return true;
  }

  void check_step(const ModelState& before, const ModelState& after) {
    RingBlock& b = m_block;
    const auto* h0 = reinterpret_cast<const proto::ChannelHeader*>(before.ring.data());
    EXPECT_GE(b.h().head, h0->head);
    EXPECT_GE(b.h().tail, h0->tail);
    for (std::uint64_t i = 0; i < kSlots; ++i) {
      const auto& s0 = *reinterpret_cast<const proto::Slot*>(before.ring.data() + sizeof(proto::ChannelHeader) +
                                                             i * b.ring().geometry.record_bytes);
      const auto& s1 = b.slot(i);
      EXPECT_GE(s1.freed & proto::kMaxValue, s0.freed & proto::kMaxValue) << "freed went backwards: " << m_path;
      EXPECT_GE(s1.filled & proto::kMaxValue, s0.filled & proto::kMaxValue) << "filled went backwards: " << m_path;
      EXPECT_GE(proto::state_seq(s1.state), proto::state_seq(s0.state)) << "state went backwards: " << m_path;
      EXPECT_GE(s1.release_mark, s0.release_mark) << "release_mark went backwards: " << m_path;
    }
    // Every message handed back is within the consumers' reach: counted in `orphans` since their last look.
    unsigned behind = 0;
    for (std::uint64_t i = 0; i < kSlots; ++i) {
      const std::uint64_t st = b.slot(i).state;
      if (proto::state_phase(st) == Phase::Published && proto::state_seq(st) < b.h().tail) ++behind;
    }
    if (behind > 0) {
      EXPECT_NE(b.h().orphans, b.h().orphans_scanned) << "a message handed back out of reach: " << m_path;
    }
    // No producer's GPU work is in a slot while another stream's is: a producer's stream is in it from its wait
    // for the previous release (or its claim, when none was needed) until its `filled` write, a consumer's from
    // its wait for `filled` (or its take) until its `freed` write.
    for (std::uint64_t slot = 0; slot < kSlots; ++slot) {
      unsigned inside = 0;
      bool producer = false;
      for (const auto& m : after.members) {
        for (std::uint64_t q = slot; q < after.published.size(); q += kSlots) {
          if (!in_slot(m, q)) continue;
          ++inside;
          producer = producer || m.role == Role::Producer;
        }
      }
      EXPECT_FALSE(producer && inside > 1)
          << "a producer's stream writes slot " << slot << " while another stream works on it: " << m_path;
    }
  }

  /// Whether member `m`'s stream works on message `q` now: held (or its write still queued), past its wait.
  static bool in_slot(const ModelMember& m, std::uint64_t q) {
    const bool held = std::find(m.held.begin(), m.held.end(), q) != m.held.end();
    bool writes = false;
    for (const auto& op : m.stream) {
      if (op.seq != q) continue;
      if (!op.write) return false;  // still waiting
      writes = true;
    }
    return held || writes;
  }

  void check_end(ModelState s) {
    ++m_ends;
    // Every stream drains: no GPU wait is left for a word nobody will write.
    for (bool progress = true; progress;) {
      progress = false;
      for (auto& m : s.members) progress = step_stream(m) || progress;
      const std::size_t owed = s.owed.size();
      s.owed.resize(ring_settle_owed(m_block.ring(), s.owed));
      progress = progress || s.owed.size() < owed;
    }
    EXPECT_TRUE(s.owed.empty()) << "a dead member's write is never made after " << m_path;
    for (const auto& m : s.members) EXPECT_TRUE(m.stream.empty()) << "a stream waits forever after " << m_path;
    // Every message published and not released is still in its slot (queued or held).
    for (std::uint64_t q = 0; q < s.published.size(); ++q) {
      if (!s.published[q] || s.released[q] != 0) continue;
      const std::uint64_t st = m_block.slot(q).state;
      EXPECT_EQ(proto::state_seq(st), q) << "message " << q << " lost after " << m_path;
    }
  }

  /// Depth first over every state reachable from `start` (an explicit stack: paths are long).
  void explore(ModelState start) {
    std::vector<std::pair<ModelState, std::string>> stack;
    stack.emplace_back(std::move(start), std::string());
    while (!stack.empty() && !::testing::Test::HasFailure()) {
      auto [s, path] = std::move(stack.back());
      stack.pop_back();
      if (!m_seen.insert(std::hash<std::string>{}(key(s))).second) continue;
      m_path = path;
      bool any = false;
      for (std::size_t i = 0; i < s.members.size(); ++i) {
        for (unsigned a = 0; a < 7; ++a) {
          ModelState next = s;
          m_block.restore(s.ring);
          if (!act(next, i, a)) continue;
          any = true;
          m_path = path + (a == 6 ? std::string("b") : std::string(1, static_cast<char>('0' + i)) + "aprsld"[a]) + ' ';
          check_step(s, next);
          next.ring = m_block.bytes();
          stack.emplace_back(std::move(next), m_path);
        }
      }
      if (!any) {
        m_path = path;
        m_block.restore(s.ring);
        check_end(s);
      }
    }
  }

  bool m_die_with_stream_work = false;
  RingBlock m_block;
  std::string m_path;  // the steps to the state being explored: member number, then a(cquire or receive),
                       // p(ublish or release), r(eturn: give or hand back), s(tream step), l(eave), d(ie)
  std::unordered_set<std::size_t> m_seen;  // hashes of the states seen
  std::size_t m_ends = 0;
};

TEST(ShmChannelRingModel, EveryInterleavingOfTwoProducersTwoConsumersAndTheirExits) {
  const Model model(false);
  EXPECT_GT(model.states(), 1000U);
  RecordProperty("states", static_cast<int>(model.states()));
  std::printf("%zu states, %zu ends\n", model.states(), model.ends());
}

// A member that dies with stream work queued, at any point: the broker makes each write its stream owed once the
// wait before it would have passed (src/shm/channel_ring.hpp, "Owed stream writes"). Before the owed tables the
// repair wrote them at once, and only for a slot's current publisher and releaser: this case found a `freed` word
// going back, a producer's stream writing a slot another stream still worked on, and a stream waiting for ever.
TEST(ShmChannelRingModel, DeathWithStreamWorkQueued) {
  const Model model(true);
  EXPECT_GT(model.states(), 1000U);
  RecordProperty("states", static_cast<int>(model.states()));
  std::printf("%zu states, %zu ends\n", model.states(), model.ends());
}

}  // namespace
}  // namespace gpuipc::shm
