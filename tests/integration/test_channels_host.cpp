// Host-kind channels across real processes: order and exactly-once delivery for 1:1, 4:1, 1:4 and 4:4 over
// 100k messages, back-pressure, timeouts, and SIGKILL of producers and consumers at chosen points.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <csignal>
#include <cstring>
#include <utility>

#include "core/membership.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/segment.hpp"
#include "os/process.hpp"
#include "proto/shm.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

struct Header {
  std::uint32_t producer;
  std::uint32_t index;
};

std::uint8_t pattern(std::uint32_t producer, std::uint32_t index, std::size_t i) {
  return static_cast<std::uint8_t>(producer * 131 + index * 7 + i);
}

constexpr std::size_t kPayload = 64;
constexpr auto kLong = std::chrono::seconds(30);

int producer_body(const std::string& name, std::uint32_t id, std::uint32_t count, std::atomic<std::uint32_t>* joined) {
  auto ch = Channel::open(name, ChannelRole::Producer);
  joined->fetch_add(1);
  for (std::uint32_t i = 0; i < count; ++i) {
    SlotView slot;
    const Status st = ch.acquire(nullptr, kLong, slot);
    GPUIPC_CHILD_CHECK(st == Status::Ok);
    auto* p = static_cast<std::uint8_t*>(slot.data);
    for (std::size_t b = 0; b < kPayload; ++b) p[b] = pattern(id, i, b);
    Header h{id, i};
    GPUIPC_CHILD_CHECK(ch.publish(nullptr, std::as_bytes(std::span(&h, 1)), kPayload) == Status::Ok);
  }
  return 0;
}

/// Receives until the producers are gone; checks payloads and per-producer order; counts deliveries.
int consumer_body(const std::string& name, std::uint32_t producers, std::uint32_t per_producer,
                  std::atomic<std::uint8_t>* seen, std::atomic<std::uint64_t>* total) {
  auto ch = Channel::open(name, ChannelRole::Consumer);
  std::vector<std::int64_t> last(producers, -1);
  for (;;) {
    MessageView m;
    const Status st = ch.receive(nullptr, kLong, m);
    if (st == Status::Closed) break;
    GPUIPC_CHILD_CHECK(st == Status::Ok);
    GPUIPC_CHILD_CHECK(m.size == kPayload && m.header.size() == sizeof(Header));
    Header h{};
    std::memcpy(&h, m.header.data(), sizeof h);
    GPUIPC_CHILD_CHECK(h.producer < producers && h.index < per_producer);
    GPUIPC_CHILD_CHECK(static_cast<std::int64_t>(h.index) > last[h.producer]);  // per-producer FIFO
    last[h.producer] = h.index;
    const auto* p = static_cast<const std::uint8_t*>(m.data);
    for (std::size_t b = 0; b < kPayload; ++b) GPUIPC_CHILD_CHECK(p[b] == pattern(h.producer, h.index, b));
    seen[static_cast<std::size_t>(h.producer) * per_producer + h.index].fetch_add(1);
    total->fetch_add(1);
    GPUIPC_CHILD_CHECK(ch.release(nullptr) == Status::Ok);
  }
  return 0;
}

void run_mpmc(std::uint32_t producers, std::uint32_t consumers, std::uint32_t messages) {
  const auto name = unique_name("ch");
  const std::uint32_t per = messages / producers;
  Shared<std::atomic<std::uint8_t>> seen(static_cast<std::size_t>(per) * producers);
  Shared<std::atomic<std::uint64_t>> total;
  Shared<std::atomic<std::uint32_t>> joined;
  // The parent holds a producer membership until every child producer has joined, so consumers cannot see
  // "no producers left" before the producers start.
  auto holder = Channel::create(name, {.slots = 16, .slot_bytes = kPayload, .header_bytes = sizeof(Header),
                                       .kind = SegmentKind::Host}, ChannelRole::Producer);
  std::vector<pid_t> kids;
  for (std::uint32_t c = 0; c < consumers; ++c) {
    kids.push_back(start_child([&] { return consumer_body(name, producers, per, seen.get(), total.get()); }));
  }
  for (std::uint32_t p = 0; p < producers; ++p) {
    kids.push_back(start_child([&, p] { return producer_body(name, p, per, joined.get()); }));
  }
  ASSERT_TRUE(wait_until([&] { return joined[0].load() == producers; }, 30s));
  holder = Channel();  // leave
  for (auto pid : kids) EXPECT_EQ(wait_child(pid, 120s), 0);
  EXPECT_EQ(total[0].load(), static_cast<std::uint64_t>(per) * producers);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(per) * producers; ++i) wrong += seen[i].load() != 1;
  EXPECT_EQ(wrong, 0U) << "messages not delivered exactly once";
  Channel::unlink(name);
}

// The library's Leave round trip against a real broker (what a device channel's close sends while its stream still
// owes writes): the entry is removed as a clean leave, once, and only for the process that joined it.
TEST(ChannelsHost, AMemberLeavesThroughTheBroker) {
  const auto name = unique_name("leave");
  auto keeper = Channel::create(name, {.slots = 2, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                                ChannelRole::Producer);
  const Segment control = Segment::open(name, {.access = Access::ReadWrite});
  const core::Membership m = core::join_member(control, proto::Role::Consumer);
  EXPECT_EQ(keeper.stats().consumers, 1U);
  EXPECT_EQ(run_child([&] { return core::leave_through_broker(control, m) ? 1 : 0; }), 0);  // not its entry
  EXPECT_TRUE(core::leave_through_broker(control, m));
  EXPECT_EQ(keeper.stats().consumers, 0U);
  EXPECT_FALSE(core::leave_through_broker(control, m));  // left already
  core::forget_member(m);
  Channel::unlink(name);
}

// slots x slot_bytes above the largest segment is refused before the product wraps round, and no failed create leaves
// a name behind. Before, 4 slots of 2^62 + 256 bytes made a 0-byte buffer segment whose attach failed, leaving both
// names, so that the next create of the channel found them taken.
TEST(ChannelsHost, SlotsTooBigAreRefusedAndLeaveNoName) {
  const auto name = unique_name("big");
  for (const auto& [slots, bytes] :
       {std::pair<std::uint32_t, std::uint64_t>{4, (1ULL << 62) + 256}, {1, ~0ULL}, {2, (1ULL << 40) / 2 + 1}}) {
    try {
      (void)Channel::create(name, {.slots = slots, .slot_bytes = bytes, .kind = SegmentKind::Host},
                            ChannelRole::Producer);
      ADD_FAILURE() << slots << " x " << bytes << " was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("largest segment"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)Segment::stat(name), Error);
    EXPECT_THROW((void)Segment::stat(name + ".slots"), Error);
  }
  auto ok = Channel::create(name, {.slots = 2, .slot_bytes = 64, .kind = SegmentKind::Host}, ChannelRole::Producer);
  Channel::unlink(name);
}

TEST(ChannelsHost, OneToOneInOrderExactlyOnce100k) { run_mpmc(1, 1, 100000); }
TEST(ChannelsHost, FourToOneExactlyOnce100k) { run_mpmc(4, 1, 100000); }
TEST(ChannelsHost, OneToFourExactlyOnce100k) { run_mpmc(1, 4, 100000); }
TEST(ChannelsHost, FourToFourExactlyOnce100k) { run_mpmc(4, 4, 100000); }

TEST(ChannelsHost, BackPressureAndTimeouts) {
  const auto name = unique_name("bp");
  auto prod = Channel::create(name, {.slots = 4, .slot_bytes = 128, .header_bytes = 0, .kind = SegmentKind::Host},
                              ChannelRole::Producer);
  auto cons = Channel::open(name, ChannelRole::Consumer);
  MessageView m;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(cons.receive(nullptr, std::chrono::milliseconds(100), m), Status::Timeout);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, 95ms);
  EXPECT_LT(waited, 2s);
  EXPECT_EQ(cons.receive(nullptr, 0ns, m), Status::WouldBlock);
  for (int i = 0; i < 4; ++i) {
    SlotView s;
    ASSERT_EQ(prod.acquire(nullptr, 1s, s), Status::Ok);
    static_cast<int*>(s.data)[0] = i;
    ASSERT_EQ(prod.publish(nullptr, {}, sizeof(int)), Status::Ok);
  }
  SlotView s;
  EXPECT_EQ(prod.acquire(nullptr, 0ns, s), Status::WouldBlock);  // every slot in flight
  EXPECT_EQ(prod.acquire(nullptr, std::chrono::milliseconds(50), s), Status::Timeout);
  // A consumer in another process frees one: the blocked producer proceeds.
  const pid_t child = start_child([&] {
    std::this_thread::sleep_for(50ms);
    auto c = Channel::open(name, ChannelRole::Consumer);
    MessageView mm;
    GPUIPC_CHILD_CHECK(c.receive(nullptr, 5s, mm) == Status::Ok);
    GPUIPC_CHILD_CHECK(static_cast<const int*>(mm.data)[0] == 0);
    GPUIPC_CHILD_CHECK(c.release(nullptr) == Status::Ok);
    return 0;
  });
  EXPECT_EQ(prod.acquire(nullptr, 10s, s), Status::Ok);
  EXPECT_EQ(wait_child(child), 0);
  EXPECT_EQ(s.sequence, 4U);
  // Misuse is a status, not a crash.
  EXPECT_EQ(cons.release(nullptr), Status::InvalidState);
  EXPECT_EQ(prod.receive(nullptr, 0ns, m), Status::InvalidState);
  Channel::unlink(name);
}

TEST(ChannelsHost, SendCopiesAndPublishesInOneCall) {
  const auto name = unique_name("send");
  auto prod = Channel::create(name, {.slots = 2, .slot_bytes = 64, .header_bytes = 8, .kind = SegmentKind::Host},
                              ChannelRole::Producer);
  auto cons = Channel::open(name, ChannelRole::Consumer);
  const std::uint64_t tag = 0x1122334455667788ULL;
  const auto header = std::as_bytes(std::span(&tag, 1));
  std::uint64_t seq = 99;
  for (std::uint8_t round = 0; round < 5; ++round) {  // more rounds than slots: every slot is reused
    std::array<std::uint8_t, 40> payload{};
    for (std::size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::uint8_t>(round * 3 + i);
    ASSERT_EQ(prod.send(nullptr, payload.data(), payload.size(), header, 1s, seq), Status::Ok);
    EXPECT_EQ(seq, round);
    payload.fill(0);  // the copy is made: the caller's buffer is free again
    MessageView m;
    ASSERT_EQ(cons.receive(nullptr, 1s, m), Status::Ok);
    EXPECT_EQ(m.sequence, round);
    ASSERT_EQ(m.size, payload.size());
    ASSERT_EQ(m.header.size(), sizeof tag);
    EXPECT_EQ(std::memcmp(m.header.data(), &tag, sizeof tag), 0);
    const auto* got = static_cast<const std::uint8_t*>(m.data);
    for (std::size_t i = 0; i < m.size; ++i) ASSERT_EQ(got[i], static_cast<std::uint8_t>(round * 3 + i)) << i;
    ASSERT_EQ(cons.release(nullptr), Status::Ok);
  }
  std::array<std::uint8_t, 257> big{};  // slot_bytes rounds up to 256
  EXPECT_EQ(prod.send(nullptr, big.data(), big.size(), {}, 1s, seq), Status::InvalidState);  // over the slot
  std::array<std::byte, 9> long_header{};
  EXPECT_EQ(prod.send(nullptr, big.data(), 1, long_header, 1s, seq), Status::InvalidState);  // over header_bytes
  SlotView s;  // a slot taken with acquire and not published: send would publish it in its place
  ASSERT_EQ(prod.acquire(nullptr, 1s, s), Status::Ok);
  EXPECT_EQ(prod.send(nullptr, big.data(), 1, {}, 1s, seq), Status::InvalidState);
  ASSERT_EQ(prod.publish(nullptr, {}, 0), Status::Ok);
  ASSERT_EQ(prod.send(nullptr, big.data(), 1, {}, 1s, seq), Status::Ok);
  EXPECT_EQ(prod.send(nullptr, big.data(), 1, {}, 0ns, seq), Status::WouldBlock);  // both slots in flight
  EXPECT_EQ(prod.send(nullptr, big.data(), 1, {}, 20ms, seq), Status::Timeout);
  EXPECT_EQ(cons.send(nullptr, big.data(), 1, {}, 1s, seq), Status::InvalidState);  // not a producer
  Channel::unlink(name);
}

std::int64_t now_ns() { return os::monotonic_ns(); }

TEST(ChannelsHost, ProducerKilledConsumerDrainsThenPeerDiedWithin100ms) {
  const auto name = unique_name("pk");
  Shared<std::atomic<std::int64_t>> at;  // [0]: when the consumer saw PeerDied
  auto cons = Channel::create(name, {.slots = 8, .slot_bytes = 64, .header_bytes = 8, .kind = SegmentKind::Host},
                              ChannelRole::Consumer);
  SyncPipe published;
  const pid_t prod = start_child([&] {
    auto p = Channel::open(name, ChannelRole::Producer);
    for (std::uint32_t i = 0; i < 5; ++i) {
      SlotView s;
      GPUIPC_CHILD_CHECK(p.acquire(nullptr, 5s, s) == Status::Ok);
      static_cast<std::uint32_t*>(s.data)[0] = i;
      GPUIPC_CHILD_CHECK(p.publish(nullptr, {}, 4) == Status::Ok);
    }
    published.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(published.wait(10s));
  const std::int64_t killed = now_ns();
  ::kill(prod, SIGKILL);
  EXPECT_EQ(wait_child(prod), 128 + SIGKILL);
  for (std::uint32_t i = 0; i < 5; ++i) {
    MessageView m;
    ASSERT_EQ(cons.receive(nullptr, 5s, m), Status::Ok) << "message " << i << " must be drained";
    EXPECT_EQ(static_cast<const std::uint32_t*>(m.data)[0], i);
    ASSERT_EQ(cons.release(nullptr), Status::Ok);
  }
  MessageView m;
  EXPECT_EQ(cons.receive(nullptr, 5s, m), Status::PeerDied);
  EXPECT_LT(now_ns() - killed, 100'000'000) << "PeerDied must reach the survivor within 100 ms";
  EXPECT_EQ(cons.stats().free_slots, 8U) << "no slot leaked";
  Channel::unlink(name);
}

TEST(ChannelsHost, ConsumerKilledHoldingAMessageItIsRedelivered) {
  const auto name = unique_name("ck");
  auto prod = Channel::create(name, {.slots = 4, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                              ChannelRole::Producer);
  SyncPipe holding;
  const pid_t victim = start_child([&] {
    auto c = Channel::open(name, ChannelRole::Consumer);
    MessageView m;
    GPUIPC_CHILD_CHECK(c.receive(nullptr, 5s, m) == Status::Ok);
    GPUIPC_CHILD_CHECK(static_cast<const int*>(m.data)[0] == 100);
    holding.notify();
    ::pause();  // holds message 0 and never releases it
    return 0;
  });
  for (int i = 0; i < 3; ++i) {
    SlotView s;
    ASSERT_EQ(prod.acquire(nullptr, 5s, s), Status::Ok);
    static_cast<int*>(s.data)[0] = 100 + i;
    ASSERT_EQ(prod.publish(nullptr, {}, 4), Status::Ok);
  }
  ASSERT_TRUE(holding.wait(10s));
  auto other = Channel::open(name, ChannelRole::Consumer);
  MessageView m;
  ASSERT_EQ(other.receive(nullptr, 5s, m), Status::Ok);
  EXPECT_EQ(static_cast<const int*>(m.data)[0], 101);
  ASSERT_EQ(other.release(nullptr), Status::Ok);
  ::kill(victim, SIGKILL);
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  // Message 100 comes back, exactly once, to the surviving consumer; then 102.
  std::vector<int> got;
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(other.receive(nullptr, 5s, m), Status::Ok);
    got.push_back(static_cast<const int*>(m.data)[0]);
    ASSERT_EQ(other.release(nullptr), Status::Ok);
  }
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<int>{100, 102}));
  EXPECT_EQ(other.receive(nullptr, 0ns, m), Status::WouldBlock);
  EXPECT_EQ(other.stats().redelivered, 1U);
  EXPECT_EQ(other.stats().free_slots, 4U);
  Channel::unlink(name);
}

/// Publishes into both slots of a two-slot channel nobody has read yet: the next acquire waits for a release.
void fill_two_slots(Channel& prod) {
  for (int i = 0; i < 2; ++i) {
    SlotView s;
    ASSERT_EQ(prod.acquire(nullptr, 5s, s), Status::Ok);
    ASSERT_EQ(prod.publish(nullptr, {}, 0), Status::Ok);
  }
}

TEST(ChannelsHost, LastConsumerKilledReleasesABlockedProducerWithin100ms) {
  const auto name = unique_name("lc");
  auto prod = Channel::create(name, {.slots = 2, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                              ChannelRole::Producer);
  SyncPipe joined;
  const pid_t cons = start_child([&] {
    auto c = Channel::open(name, ChannelRole::Consumer);
    joined.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(joined.wait(10s));
  fill_two_slots(prod);
  Shared<std::atomic<std::int64_t>> killed_at;
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);
    killed_at[0] = now_ns();
    ::kill(cons, SIGKILL);
  });
  SlotView s;
  EXPECT_EQ(prod.acquire(nullptr, 10s, s), Status::PeerDied);  // blocked on a full ring until the kill
  const std::int64_t seen = now_ns();
  killer.join();
  EXPECT_LT(seen - killed_at[0].load(), 100'000'000);
  EXPECT_EQ(wait_child(cons), 128 + SIGKILL);
  Channel::unlink(name);
}

TEST(ChannelsHost, AConsumerKilledWhileItsForkedChildLivesOnIsRepaired) {
  // A child forked after the consumer joined, which never calls the library, must not keep the consumer's broker
  // connection (or the connection watcher's copy of it) open: the broker would not see the consumer die.
  const auto name = unique_name("fork");
  auto prod = Channel::create(name, {.slots = 2, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                              ChannelRole::Producer);
  SyncPipe joined;
  Shared<std::atomic<pid_t>> grandchild;
  const pid_t cons = start_child([&] {
    auto c = Channel::open(name, ChannelRole::Consumer);
    const pid_t kid = ::fork();
    if (kid == 0) {
      ::pause();  // lives on, holding whatever fds it inherited
      ::_exit(0);
    }
    grandchild[0] = kid;
    joined.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(joined.wait(10s));
  fill_two_slots(prod);
  ::kill(cons, SIGKILL);
  EXPECT_EQ(wait_child(cons), 128 + SIGKILL);
  SlotView s;
  EXPECT_EQ(prod.acquire(nullptr, 10s, s), Status::PeerDied);
  ::kill(grandchild[0].load(), SIGKILL);  // reparented: reaped by init (or the subreaper)
  Channel::unlink(name);
}

TEST(ChannelsHost, ProducerKilledInTheMiddleOfPublishIsSkipped) {
  const auto name = unique_name("mid");
  auto cons = Channel::create(name, {.slots = 4, .slot_bytes = 64, .header_bytes = 0, .kind = SegmentKind::Host},
                              ChannelRole::Consumer);
  auto keep = Channel::open(name, ChannelRole::Producer);  // a second producer keeps the channel alive
  SyncPipe claimed;
  const pid_t victim = start_child([&] {
    auto p = Channel::open(name, ChannelRole::Producer);
    SlotView s;
    GPUIPC_CHILD_CHECK(p.acquire(nullptr, 5s, s) == Status::Ok);  // claims message 0 ...
    claimed.notify();
    ::pause();  // ... and dies before publishing it
    return 0;
  });
  ASSERT_TRUE(claimed.wait(10s));
  SlotView s;
  ASSERT_EQ(keep.acquire(nullptr, 5s, s), Status::Ok);  // message 1
  static_cast<int*>(s.data)[0] = 7;
  ASSERT_EQ(keep.publish(nullptr, {}, 4), Status::Ok);
  MessageView m;
  EXPECT_EQ(cons.receive(nullptr, 50ms, m), Status::Timeout);  // head-of-line: message 0 is being written
  ::kill(victim, SIGKILL);
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  ASSERT_EQ(cons.receive(nullptr, 5s, m), Status::Ok);  // message 0 abandoned, skipped
  EXPECT_EQ(m.sequence, 1U);
  EXPECT_EQ(static_cast<const int*>(m.data)[0], 7);
  ASSERT_EQ(cons.release(nullptr), Status::Ok);
  EXPECT_EQ(cons.stats().abandoned, 1U);
  EXPECT_EQ(cons.stats().free_slots, 4U);
  Channel::unlink(name);
}

TEST(ChannelsHost, RandomKillsDuringAPublishLoopLoseNothingPublished) {
  const auto name = unique_name("rk");
  constexpr std::uint32_t kRounds = 6;
  auto cons = Channel::create(name, {.slots = 8, .slot_bytes = 64, .header_bytes = sizeof(Header),
                                     .kind = SegmentKind::Host}, ChannelRole::Consumer);
  Shared<std::atomic<std::uint32_t>> published(kRounds);  // per producer: messages it finished publishing
  std::uint64_t received = 0;
  for (std::uint32_t r = 0; r < kRounds; ++r) {
    const pid_t p = start_child([&, r] {
      auto ch = Channel::open(name, ChannelRole::Producer);
      for (std::uint32_t i = 0;; ++i) {
        SlotView s;
        if (ch.acquire(nullptr, 5s, s) != Status::Ok) return 3;
        Header h{r, i};
        if (ch.publish(nullptr, std::as_bytes(std::span(&h, 1)), 8) != Status::Ok) return 4;
        published[r].store(i + 1);
      }
    });
    std::int64_t last = -1;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(30 + 7 * r);
    while (std::chrono::steady_clock::now() < deadline) {
      MessageView m;
      if (cons.receive(nullptr, 10ms, m) != Status::Ok) continue;
      Header h{};
      std::memcpy(&h, m.header.data(), sizeof h);
      EXPECT_EQ(h.producer, r);
      EXPECT_EQ(static_cast<std::int64_t>(h.index), last + 1);
      last = h.index;
      ++received;
      ASSERT_EQ(cons.release(nullptr), Status::Ok);
    }
    ::kill(p, SIGKILL);
    EXPECT_EQ(wait_child(p), 128 + SIGKILL);
    // Drain: everything it published arrives, in order, then PeerDied.
    for (;;) {
      MessageView m;
      const Status st = cons.receive(nullptr, 5s, m);
      if (st == Status::PeerDied) break;
      ASSERT_EQ(st, Status::Ok);
      Header h{};
      std::memcpy(&h, m.header.data(), sizeof h);
      EXPECT_EQ(static_cast<std::int64_t>(h.index), last + 1);
      last = h.index;
      ++received;
      ASSERT_EQ(cons.release(nullptr), Status::Ok);
    }
    // It may have died after publishing but before counting it: at most one more than counted.
    EXPECT_GE(last + 1, static_cast<std::int64_t>(published[r].load()));
    EXPECT_LE(last + 1, static_cast<std::int64_t>(published[r].load()) + 1);
    EXPECT_EQ(cons.stats().free_slots, 8U);
  }
  EXPECT_GT(received, 0U);
  Channel::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
