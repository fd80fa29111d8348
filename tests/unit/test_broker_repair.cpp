// The broker's repairs of semaphore and channel control blocks, on blocks built in memory: every slot phase a
// dead member can leave behind, and the counts and poison that follow. Members are named by the broker's tokens:
// a repair touches an entry only while it still holds the token its connection joined with. And, through a Registry
// with its journal, the owed stream writes a killed broker leaves to the next one.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <utility>
#include <variant>
#include <vector>

#include "broker/registry.hpp"
#include "broker/repair.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"
#include "proto/shm.hpp"
#include "shm/channel_ring.hpp"
#include "shm/counting_block.hpp"
#include "shm/pool_block.hpp"
#include "shm/semaphore_block.hpp"
#include "support/support.hpp"

namespace gpuipc::broker {
namespace {

// Removes every member holding `token`, the way the broker does for a connection that joined with it.
int repair(void* block, std::size_t bytes, std::uint32_t flags, std::uint32_t token) {
  ControlBlock b{block, bytes, flags, {}};
  if (!check_control(b).empty()) return 0;
  proto::Member* members = (flags & proto::kFlagChannel) != 0 ? static_cast<proto::ChannelHeader*>(block)->members
                                                             : static_cast<proto::SemaphoreBlock*>(block)->members;
  int removed = 0;
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    if (members[i].token != token) continue;
    removed += remove_member(b, Joined{i, token, static_cast<proto::Role>(members[i].role)}) ? 1 : 0;
  }
  return removed;
}
int repair_channel(void* block, std::size_t bytes, std::uint32_t token) {
  return repair(block, bytes, proto::kFlagChannel, token);
}
int repair_semaphore(void* block, std::size_t bytes, std::uint32_t token) {
  return repair(block, bytes, proto::kFlagSemaphore, token);
}

using proto::Phase;

struct ChannelBlock {
  explicit ChannelBlock(std::uint32_t slots, std::uint32_t header_bytes = 16)
      : bytes(proto::channel_control_bytes(slots, header_bytes)), mem(bytes / 8 + 1, 0) {
    h().magic = proto::kChannelMagic;
    h().version = proto::kChannelVersion;
    h().slots = slots;
    h().header_bytes = header_bytes;
    h().slot_bytes = 4096;
    h().record_bytes = proto::record_bytes(header_bytes);
    for (std::uint32_t i = 0; i < slots; ++i) slot(i).state = proto::pack_state(i, Phase::Free, proto::kNoMember);
  }
  /// From now on the block is the one at `shared` (a mapping of the control block's memfd): a copy of this one.
  void move_to(void* shared) {
    std::memcpy(shared, mem.data(), bytes);
    at = shared;
  }
  void* data() { return at != nullptr ? at : mem.data(); }
  proto::ChannelHeader& h() { return *static_cast<proto::ChannelHeader*>(data()); }
  proto::Slot& slot(std::uint32_t i) {
    auto* base = static_cast<std::byte*>(data()) + sizeof(proto::ChannelHeader);
    return *reinterpret_cast<proto::Slot*>(base + static_cast<std::size_t>(i) * h().record_bytes);
  }
  /// Member `idx` recorded that its stream owes `filled` (or `freed`) of message `seq`, as its publish (release)
  /// does; `after`: the `freed` value its producer's stream waited for first.
  void owe(std::uint32_t idx, std::uint64_t seq, bool freed, std::uint64_t after = 0) {
    const shm::Ring r{data(), *shm::ring_geometry(data(), bytes)};
    auto& t = shm::ring_owed_table(r, idx);
    auto* entries = reinterpret_cast<proto::OwedWrite*>(&t + 1);
    entries[t.end % proto::owed_capacity(h().slots)] = {seq | (freed ? proto::kOwedFreed : 0), after};
    ++t.end;
  }
  void member(std::uint32_t idx, std::uint32_t token, proto::Role role) {
    h().members[idx].token = token;
    h().members[idx].role = static_cast<std::uint32_t>(role);
    if (role == proto::Role::Producer) ++h().producers, h().producers_seen = 1;
    if (role == proto::Role::Consumer) ++h().consumers, h().consumers_seen = 1;
  }
  std::size_t bytes;
  std::vector<std::uint64_t> mem;  // 8-byte aligned
  void* at = nullptr;
};

/// A registry with connections 1 and 2 of this process's uid, and requests sent to it as either.
struct TwoConnections {
  explicit TwoConnections(Quotas quotas = {}) : registry(quotas) {
    registry.add_connection(1, me);
    registry.add_connection(2, me);
  }
  proto::Message ask(ConnId conn, proto::Body body, std::vector<os::UniqueFd> fds = {}) {
    std::vector<Outgoing> out;
    registry.handle(Caller{conn, me}, proto::Message{rid++, std::move(body)}, fds, 0, out);
    return out.empty() ? proto::Message{} : std::move(out.back().msg);
  }
  /// Creates host segment `name` (4096 bytes) as `conn`: its reply.
  proto::Message create(ConnId conn, const char* name, std::uint16_t mode = 0600) {
    std::vector<os::UniqueFd> fds;
    fds.push_back(os::memfd_create(name, 4096));
    return ask(conn, proto::Create{name, proto::Kind::Host, mode, 4096, {}, 0}, std::move(fds));
  }
  os::Credentials me{::getpid(), ::getuid(), ::getgid(), {}};
  Registry registry;
  std::uint32_t rid = 1;
};

TEST(BrokerReferences, OneConnectionsReferencesToASegmentAreCappedAndTheTotalSaturates) {
  // A loop of Opens on one connection wrapped its u32 count (and the total every reply carries) after 2^32.
  TwoConnections b(Quotas{.refs_per_connection = 3});
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(1, "refs").body));
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(
        std::holds_alternative<proto::OpenReply>(b.ask(1, proto::Open{"refs", proto::Access::ReadOnly, 0}).body));
  }
  const auto refused = b.ask(1, proto::Open{"refs", proto::Access::ReadOnly, 0});
  const auto* e = std::get_if<proto::ErrorReply>(&refused.body);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->code, static_cast<std::uint8_t>(ErrorCode::QuotaExceeded));
  EXPECT_NE(e->message.find("holds 3 references"), std::string::npos) << e->message;
  // Another connection has its own.
  const auto other = b.ask(2, proto::Open{"refs", proto::Access::ReadOnly, 0});
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(other.body));
  EXPECT_EQ(std::get<proto::OpenReply>(other.body).info.references, 4U);

  SegmentRecord seg;
  seg.refs = {{1, UINT32_MAX}, {2, 5}};
  EXPECT_EQ(seg.total_refs(), UINT32_MAX);
}

TEST(BrokerReferences, TheSegmentsAUidsConnectionsHoldAreBoundedTogether) {
  // The broker keeps some 300 bytes for each (segment, connection) holding references: one uid's 512 connections
  // opening its 4096 segments made it keep 600 MB (bench/analysis/experiments/broker_holdings_memory.cpp).
  TwoConnections b(Quotas{.opens = 3});
  const auto refused = [](const proto::Message& m) {
    const auto* e = std::get_if<proto::ErrorReply>(&m.body);
    return e != nullptr && e->code == static_cast<std::uint8_t>(ErrorCode::QuotaExceeded) &&
           e->message.find("GPUIPC_QUOTA_OPENS") != std::string::npos;
  };
  const auto open = [&](ConnId conn, const char* name) {
    return b.ask(conn, proto::Open{name, proto::Access::ReadOnly, 0});
  };
  const auto a = std::get<proto::OpenReply>(b.create(1, "a").body).info.id;      // 1: (a, 1)
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(open(2, "a").body));      // 2: (a, 2)
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(1, "b").body));  // 3: (b, 1)
  EXPECT_TRUE(refused(open(2, "b")));
  EXPECT_TRUE(refused(b.create(2, "c"))) << "a Create takes one too";
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(open(2, "a").body)) << "a segment already held costs none";
  // Another uid has its own.
  const os::Credentials other{::getpid(), ::getuid() + 1, ::getgid(), {}};
  b.registry.add_connection(3, other);
  std::vector<os::UniqueFd> fds;
  fds.push_back(os::memfd_create("theirs", 4096));
  std::vector<Outgoing> out;
  b.registry.handle(Caller{3, other},
                    proto::Message{b.rid++, proto::Create{"theirs", proto::Kind::Host, 0600, 4096, {}, 0}}, fds, 0,
                    out);
  ASSERT_EQ(out.size(), 1U);
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(out[0].msg.body));
  // A Close that lets go of a segment gives its place back, and so does a closed connection.
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(2, proto::Close{a}).body));  // 2 references: one left
  EXPECT_TRUE(refused(open(2, "b")));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(2, proto::Close{a}).body));
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(open(2, "b").body));
  EXPECT_TRUE(refused(open(2, "a")));
  b.registry.drop_connection(2);
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(1, "c").body));
  b.registry.add_connection(2, b.me);
  EXPECT_TRUE(refused(open(2, "a"))) << "connection 1 holds a, b and c";
  b.registry.drop_connection(1);
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(open(2, "a").body));
}

TEST(BrokerReferences, TheSegmentsEveryUidsConnectionsHoldAreBoundedTogether) {
  // The per-uid bound multiplies by the uids that connect: one user with subordinate uids has many, each with its
  // own 65536, which let the broker keep gigabytes. Three places in all, here: two uids fill them.
  TwoConnections b(Quotas{.opens = 3, .opens_total = 3});
  const auto refused = [](const proto::Message& m) {
    const auto* e = std::get_if<proto::ErrorReply>(&m.body);
    return e != nullptr && e->code == static_cast<std::uint8_t>(ErrorCode::QuotaExceeded) &&
           e->message.find("GPUIPC_QUOTA_OPENS_TOTAL") != std::string::npos;
  };
  const os::Credentials other{::getpid(), ::getuid() + 1, ::getgid(), {}};
  b.registry.add_connection(3, other);
  const auto ask_as_other = [&](const proto::Body& body) {
    std::vector<os::UniqueFd> fds;
    if (std::holds_alternative<proto::Create>(body)) fds.push_back(os::memfd_create("theirs", 4096));
    std::vector<Outgoing> out;
    b.registry.handle(Caller{3, other}, proto::Message{b.rid++, body}, fds, 0, out);
    return out.at(0).msg;
  };
  const auto a = std::get<proto::OpenReply>(b.create(1, "a", 0644).body).info.id;      // 1: (a, 1)
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(1, "b", 0644).body));  // 2: (b, 1)
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
      ask_as_other(proto::Create{"theirs", proto::Kind::Host, 0600, 4096, {}, 0}).body));  // 3: (theirs, 3)
  EXPECT_TRUE(refused(ask_as_other(proto::Open{"a", proto::Access::ReadOnly, 0})))
      << "its uid holds one of its three: the broker's three are taken";
  EXPECT_TRUE(refused(b.ask(2, proto::Open{"a", proto::Access::ReadOnly, 0})));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(1, proto::Close{a}).body));  // a place back
  EXPECT_TRUE(
      std::holds_alternative<proto::OpenReply>(ask_as_other(proto::Open{"b", proto::Access::ReadOnly, 0}).body));
  b.registry.drop_connection(3);  // and its two
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(b.ask(2, proto::Open{"b", proto::Access::ReadOnly, 0}).body));
}

TEST(BrokerReferences, AnAnnounceOfANameGivenBackIsBoundedAsAnOpenIs) {
  // Announce took a reference with no check: one memfd re-announced from many connections, or many times, grew the
  // broker's per-(segment, connection) state past the bounds the quotas set (and the u32 count could wrap).
  const auto refused = [](const proto::Message& m, const char* says) {
    const auto* e = std::get_if<proto::ErrorReply>(&m.body);
    return e != nullptr && e->code == static_cast<std::uint8_t>(ErrorCode::QuotaExceeded) &&
           e->message.find(says) != std::string::npos;
  };
  os::UniqueFd memory;
  const auto announce = [&](TwoConnections& b, ConnId conn) {
    std::vector<os::UniqueFd> fds;
    fds.push_back(os::dup_fd(memory.get()));
    return b.ask(conn, proto::Announce{"ann", proto::Access::ReadWrite, 4096}, std::move(fds));
  };
  const auto create = [&](TwoConnections& b) {
    memory = os::memfd_create("announced", 4096);  // (a fresh one: Create seals what it takes)
    std::vector<os::UniqueFd> fds;
    fds.push_back(os::dup_fd(memory.get()));
    return b.ask(1, proto::Create{"ann", proto::Kind::Host, 0600, 4096, {}, 0}, std::move(fds));
  };
  {
    TwoConnections b(Quotas{.refs_per_connection = 2});
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(create(b).body));
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(announce(b, 1).body));
    EXPECT_TRUE(refused(announce(b, 1), "holds 2 references"));
  }
  {
    TwoConnections b(Quotas{.opens = 1});
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(create(b).body));
    EXPECT_TRUE(refused(announce(b, 2), "GPUIPC_QUOTA_OPENS"));  // this uid's connections hold one segment already
  }
}

TEST(BrokerReferences, AClosingConnectionDropsWhatItHeldAndWatchedOnly) {
  // A close looks at the segments the connection held or watched (an index), not at every segment; a connection
  // the registry was not told of (no index) is still dropped everywhere.
  TwoConnections b;
  auto& registry = b.registry;
  const auto ask = [&](ConnId conn, proto::Body body) { return b.ask(conn, std::move(body)); };
  const auto create = [&](ConnId conn, const char* name) {
    return std::get<proto::OpenReply>(b.create(conn, name).body).info.id;
  };
  const auto references = [&](const char* name) {
    const auto r = ask(1, proto::Stat{name});
    return std::holds_alternative<proto::StatReply>(r.body) ? std::get<proto::StatReply>(r.body).info.references : 0U;
  };
  const auto a = create(1, "a");
  create(1, "b");
  create(9, "c");  // connection 9: never added
  for (int i = 0; i < 3; ++i)
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(ask(2, proto::Open{"a", proto::Access::ReadOnly, 0}).body));
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(ask(2, proto::Open{"b", proto::Access::ReadOnly, 0}).body));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(2, proto::Close{a}).body));  // 2 of its 3 left on "a"
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(ask(9, proto::Open{"a", proto::Access::ReadOnly, 0}).body));
  EXPECT_EQ(references("a"), 4U);
  EXPECT_EQ(references("b"), 2U);
  registry.drop_connection(2);
  EXPECT_EQ(references("a"), 2U);
  EXPECT_EQ(references("b"), 1U);
  EXPECT_EQ(references("c"), 1U);
  registry.drop_connection(9);
  EXPECT_EQ(references("a"), 1U);
  EXPECT_EQ(references("c"), 0U);  // gone with connection 9, found without an index
  EXPECT_TRUE(std::holds_alternative<proto::StatReply>(ask(1, proto::Stat{"c"}).body));  // the name keeps it
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(1, proto::Unlink{"c"}).body));
  EXPECT_EQ(registry.total_references(), 2U);  // "a" and "b", connection 1's
}

TEST(BrokerHeartbeats, DeadlinesAreKeptInOrderAndForgottenWithTheirHeartbeat) {
  Registry registry(Quotas{});
  const auto creds = [](pid_t pid) { return os::Credentials{pid, ::getuid(), ::getgid(), {}}; };
  for (ConnId c = 1; c <= 3; ++c) registry.add_connection(c, creds(static_cast<pid_t>(1000 + c)));
  std::uint32_t rid = 1;
  std::vector<Outgoing> out;
  const auto ask = [&](ConnId conn, proto::Body body, std::int64_t now_ns, std::vector<os::UniqueFd> fds = {}) {
    out.clear();
    registry.handle(Caller{conn, creds(static_cast<pid_t>(1000 + conn))}, proto::Message{rid++, std::move(body)}, fds,
                    now_ns, out);
    return out.empty() ? proto::Message{} : out.back().msg;
  };
  const auto hung = [&](std::int64_t now_ns) {
    out.clear();
    registry.expire(now_ns, out);
    std::vector<std::uint32_t> pids;
    for (const auto& o : out) {
      const auto* e = std::get_if<proto::Event>(&o.msg.body);
      if (e != nullptr && e->kind == static_cast<std::uint8_t>(proto::EventKind::Hung)) pids.push_back(e->holder.pid);
    }
    return pids;
  };
  constexpr std::int64_t ms = 1'000'000;
  std::vector<os::UniqueFd> fds;
  fds.push_back(os::memfd_create("beats", 4096));
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
      ask(1, proto::Create{"beats", proto::Kind::Host, 0600, 4096, {}, 0}, 0, std::move(fds)).body));
  ASSERT_TRUE(
      std::holds_alternative<proto::OpenReply>(ask(2, proto::Open{"beats", proto::Access::ReadOnly, 0}, 0).body));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(3, proto::Watch{"beats"}, 0).body));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(1, proto::Heartbeat{"beats", 10}, 0).body));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(2, proto::Heartbeat{"beats", 20}, 0).body));
  EXPECT_EQ(registry.next_deadline(), 10 * ms);
  // A beat moves its deadline: the old one is gone.
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(1, proto::Heartbeat{"beats", 100}, 5 * ms).body));
  EXPECT_EQ(registry.next_deadline(), 20 * ms);
  EXPECT_TRUE(hung(15 * ms).empty());
  EXPECT_EQ(hung(25 * ms), std::vector<std::uint32_t>{1002});
  EXPECT_EQ(registry.next_deadline(), 105 * ms);
  EXPECT_TRUE(hung(30 * ms).empty()) << "told twice";
  // Beating again after hung: a deadline again. Stopping, or closing, forgets it.
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(2, proto::Heartbeat{"beats", 50}, 30 * ms).body));
  EXPECT_EQ(registry.next_deadline(), 80 * ms);
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(2, proto::Heartbeat{"beats", 0}, 31 * ms).body));
  EXPECT_EQ(registry.next_deadline(), 105 * ms);
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(2, proto::Heartbeat{"beats", 50}, 32 * ms).body));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(2, proto::Close{1}, 33 * ms).body));
  EXPECT_EQ(registry.next_deadline(), 105 * ms);
  // Unlinking forgets every heartbeat of the name.
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(ask(1, proto::Unlink{"beats"}, 34 * ms).body));
  EXPECT_EQ(registry.next_deadline(), std::nullopt);
  EXPECT_TRUE(hung(200 * ms).empty());
}

TEST(RepairChannel, ProducerDeadWhileWritingAbandonsTheSlot) {
  ChannelBlock b(4);
  b.member(0, 100, proto::Role::Producer);
  b.member(1, 200, proto::Role::Producer);
  b.member(2, 300, proto::Role::Consumer);
  b.slot(1).state = proto::pack_state(1, Phase::Writing, 0);
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 100), 1);
  EXPECT_EQ(b.slot(1).state, proto::pack_state(5, Phase::Free, proto::kNoMember));
  EXPECT_EQ(b.slot(1).freed, 0U);  // an abandoned round writes no `freed`: the next producer waits for release_mark
  EXPECT_EQ(b.slot(1).release_mark, 0U);
  EXPECT_EQ(b.h().abandoned, 1U);
  EXPECT_EQ(b.h().producers, 1U);
  EXPECT_EQ(b.h().producers_gone, 0U);  // another producer lives
  EXPECT_EQ(b.h().members[0].token, 0U);
}

TEST(RepairChannel, LastProducerDeadFlagsUnfinishedMessagesAndSaysPeerDied) {
  ChannelBlock b(4);
  b.member(0, 100, proto::Role::Producer);
  b.member(1, 300, proto::Role::Consumer);
  // Message 0: published and its stream finished. Message 1: published, stream never got there.
  // Message 2: already held by the consumer, stream never got there either.
  b.slot(0).state = proto::pack_state(0, Phase::Published, 0);
  b.owe(0, 0, false);
  b.slot(0).filled = 1;
  b.slot(1).state = proto::pack_state(1, Phase::Published, 0);
  b.owe(0, 1, false);
  b.slot(2).state = proto::pack_state(2, Phase::Reading, 1);
  b.owe(0, 2, false);
  b.owe(0, 3, false);  // recorded, but it died before its publish: the claim is abandoned and nothing is owed
  b.slot(3).state = proto::pack_state(3, Phase::Writing, 0);
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 100), 1);
  EXPECT_EQ(b.slot(0).filled, 1U);
  EXPECT_EQ(b.slot(0).incomplete, 0U);
  EXPECT_EQ(b.slot(1).filled, 2U);
  EXPECT_EQ(b.slot(1).incomplete, proto::incomplete_mark(1));
  EXPECT_EQ(b.slot(2).filled, 3U);
  EXPECT_EQ(b.slot(2).incomplete, proto::incomplete_mark(2));
  EXPECT_EQ(b.slot(3).filled, 0U);
  EXPECT_EQ(b.slot(3).state, proto::pack_state(7, Phase::Free, proto::kNoMember));
  EXPECT_EQ(proto::state_phase(b.slot(1).state), Phase::Published);  // still delivered (drained), flagged
  EXPECT_EQ(proto::state_phase(b.slot(2).state), Phase::Reading);    // the live consumer keeps it
  EXPECT_EQ(b.h().producers, 0U);
  EXPECT_EQ(b.h().producers_gone, static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
}

TEST(RepairChannel, ConsumerDeadHoldingAMessageRedeliversItAndWritesItsFreedWords) {
  ChannelBlock b(2);
  b.member(0, 100, proto::Role::Producer);
  b.member(1, 300, proto::Role::Consumer);
  b.member(2, 301, proto::Role::Consumer);
  b.slot(0).state = proto::pack_state(4, Phase::Reading, 1);  // holds message 4
  b.owe(1, 4, true);  // recorded, but it died before its release: the message is handed back, nothing is owed
  b.slot(1).state = proto::pack_state(5, Phase::Free, proto::kNoMember);  // released message 3 ...
  b.owe(1, 1, true);                                                      // (message 1's write landed)
  b.owe(1, 3, true);                                                      // ... on the host, stream pending
  b.slot(1).release_mark = 4;
  b.slot(1).freed = 2;
  b.slot(1).filled = 4;  // the producer's stream wrote message 3, so the consumer's stream was past its wait
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 300), 1);
  EXPECT_EQ(b.slot(0).state, proto::pack_state(4, Phase::Published, proto::kNoMember));
  EXPECT_EQ(b.slot(0).freed, 0U);
  EXPECT_EQ(b.h().orphans, 1U);
  EXPECT_EQ(b.h().redelivered, 1U);
  EXPECT_EQ(b.slot(1).freed, 4U);  // message 3's release, written for the dead stream
  EXPECT_EQ(b.h().consumers, 1U);
  EXPECT_EQ(b.h().consumers_gone, 0U);
}

// A consumer dies after its release on the host while its stream still waits for the message's `filled`: the
// producer's stream may still be writing the slot. Its `freed` is written only once that `filled` lands, as its
// stream would have: written at once, the slot's next producer would write over the data still being written, and
// the late `filled` would land over the next round's.
TEST(RepairChannel, ADeadConsumersFreedWaitsForTheFilledItsStreamWaitedFor) {
  ChannelBlock b(2);
  b.member(0, 100, proto::Role::Producer);
  b.member(1, 300, proto::Role::Consumer);
  b.slot(0).state = proto::pack_state(2, Phase::Free, proto::kNoMember);  // message 0 released on the host
  b.slot(0).release_mark = 1;
  b.owe(1, 0, true);
  ControlBlock cb{b.mem.data(), b.bytes, proto::kFlagChannel, {}};
  ASSERT_EQ(check_control(cb), "");
  EXPECT_TRUE(remove_member(cb, Joined{1, 300, proto::Role::Consumer}));
  EXPECT_EQ(b.slot(0).freed, 0U);
  ASSERT_EQ(cb.owed.size(), 1U);
  EXPECT_TRUE(settle_owed(cb));  // still waiting
  EXPECT_EQ(b.slot(0).freed, 0U);
  b.slot(0).filled = 1;  // the producer's stream wrote message 0
  EXPECT_FALSE(settle_owed(cb));
  EXPECT_EQ(b.slot(0).freed, 1U);
}

// A dead producer's `filled` waits for the release its stream waited for before it wrote the slot: written at once,
// the message's consumer could release it and the next producer write the slot while the previous round's
// consumer's stream still reads it.
TEST(RepairChannel, ADeadProducersFilledWaitsForTheReleaseItsStreamWaitedFor) {
  ChannelBlock b(2);
  b.member(0, 100, proto::Role::Producer);
  b.member(1, 300, proto::Role::Consumer);
  b.slot(0).state = proto::pack_state(2, Phase::Published, 0);  // message 2, after message 0's release
  b.slot(0).release_mark = 1;
  b.slot(0).filled = 1;
  b.owe(0, 2, false, 1);
  ControlBlock cb{b.mem.data(), b.bytes, proto::kFlagChannel, {}};
  ASSERT_EQ(check_control(cb), "");
  EXPECT_TRUE(remove_member(cb, Joined{0, 100, proto::Role::Producer}));
  EXPECT_EQ(b.slot(0).filled, 1U);
  EXPECT_EQ(b.slot(0).incomplete, 0U);
  b.slot(0).freed = 1;  // message 0's consumer's stream is done with the slot
  EXPECT_FALSE(settle_owed(cb));
  EXPECT_EQ(b.slot(0).filled, 3U);
  EXPECT_EQ(b.slot(0).incomplete, proto::incomplete_mark(2));
}

/// A process that lives until kill() (for a dead member's process that has not exited yet).
struct LiveChild {
  LiveChild() {
    EXPECT_EQ(::pipe(fds), 0);
    pid = ::fork();
    if (pid == 0) {  // lives until the pipe closes
      ::close(fds[1]);
      char c = 0;
      (void)!::read(fds[0], &c, 1);
      ::_exit(0);
    }
    ::close(fds[0]);
  }
  void kill() {
    if (fds[1] < 0) return;
    ::close(std::exchange(fds[1], -1));
    int status = 0;
    EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  }
  ~LiveChild() { kill(); }
  int fds[2] = {-1, -1};
  pid_t pid = 0;
};

// A killed process's GPU work runs on until its exit has torn its contexts down: the broker makes its owed writes
// only once the process has exited (a stream write of it landing after the broker's, and after the ring moved on,
// would take the word back).
/// A producer (member 0, token 100) and consumer 1 (token 300), which released message 0 on the host while its
/// stream has not written `freed` yet, though `filled` has landed: the slot is free for round 2.
ChannelBlock a_release_owed() {
  ChannelBlock b(2);
  b.member(0, 100, proto::Role::Producer);
  b.member(1, 300, proto::Role::Consumer);
  b.slot(0).state = proto::pack_state(2, Phase::Free, proto::kNoMember);
  b.slot(0).release_mark = 1;
  b.slot(0).filled = 1;
  b.owe(1, 0, true);
  return b;
}

TEST(RepairChannel, OwedWritesWaitForTheProcessToExit) {
  ChannelBlock b = a_release_owed();
  LiveChild child;
  ControlBlock cb{b.mem.data(), b.bytes, proto::kFlagChannel, {}};
  ASSERT_EQ(check_control(cb), "");
  ExitWatch exits;
  EXPECT_TRUE(remove_member(cb, Joined{1, 300, proto::Role::Consumer}, exits.watch(child.pid, 0, ::getuid(), 1)));
  EXPECT_EQ(b.slot(0).freed, 0U);  // its turn has come, but the process lives
  EXPECT_TRUE(settle_owed(cb));
  EXPECT_EQ(b.slot(0).freed, 0U);
  child.kill();
  EXPECT_FALSE(settle_owed(cb));
  EXPECT_EQ(b.slot(0).freed, 1U);
}

/// Consumer 1 of a_release_owed leaves (Leave): `freed` is not written ahead of its stream. `process_exits`: the process exits before its
/// stream writes it (the broker writes it then); else the stream writes it (the broker drops it).
void leave_owing_a_release(bool process_exits) {
  ChannelBlock b = a_release_owed();
  LiveChild child;
  ControlBlock cb{b.mem.data(), b.bytes, proto::kFlagChannel, {}};
  ASSERT_EQ(check_control(cb), "");
  ExitWatch exits;
  const ProcessWatch process = exits.watch(child.pid, 0, ::getuid(), 1);
  EXPECT_FALSE(leave_member(cb, Joined{1, 999, proto::Role::Consumer}, process));  // not its token
  EXPECT_TRUE(leave_member(cb, Joined{1, 300, proto::Role::Consumer}, process));
  EXPECT_EQ(b.h().members[1].token, 0U);
  EXPECT_EQ(b.h().consumers_gone, static_cast<std::uint32_t>(proto::PoisonReason::Closed));
  EXPECT_EQ(b.slot(0).freed, 0U) << "written ahead of the stream";
  EXPECT_TRUE(settle_owed(cb));
  EXPECT_EQ(b.slot(0).freed, 0U);
  if (process_exits) {
    child.kill();
  } else {
    b.slot(0).freed = 1;  // its stream got there
  }
  EXPECT_FALSE(settle_owed(cb));
  EXPECT_EQ(b.slot(0).freed, 1U);
  EXPECT_TRUE(cb.leavers.empty());
  EXPECT_TRUE(cb.owed.empty());
}

// A member that leaves while its stream still owes writes hands them to the broker (Leave), which makes none ahead
// of that stream. Before, a clean leave waited up to 10 s for the stream and then wrote them itself, and a stream
// still running after that could write a slot a survivor had been given.
TEST(RepairChannel, ALeaversOwedWritesAreLeftToItsStream) { leave_owing_a_release(false); }
TEST(RepairChannel, ALeaversOwedWritesAreMadeOnceItsProcessHasExited) { leave_owing_a_release(true); }

/// A broker (a Registry with its journal, as the server runs it) with a producer's connection (1, from `producer`)
/// and a consumer's (2, from this process), of this uid. A connection dropped stands for its process's death, though
/// the process lives on (this one, or a LiveChild killed later): no grace to rejoin, unless a test gives one.
struct JournaledBroker {
  JournaledBroker(const std::string& journal, pid_t producer) : registry(Quotas{}) {
    registry.open_journal(journal, os::monotonic_ns(), 10'000'000'000);
    registry.set_rejoin_grace(0);
    registry.add_connection(1, creds(producer));
    registry.add_connection(2, creds(::getpid()));
  }
  static os::Credentials creds(pid_t pid) { return os::Credentials{pid, ::getuid(), ::getgid(), {}}; }
  proto::Message ask(ConnId conn, pid_t pid, proto::Body body, int fd = -1) {
    std::vector<os::UniqueFd> fds;
    if (fd >= 0) fds.push_back(os::dup_fd(fd));
    std::vector<Outgoing> out;
    registry.handle(Caller{conn, creds(pid)}, proto::Message{rid++, std::move(body)}, fds, 0, out);
    EXPECT_EQ(out.size(), 1U);
    return out.empty() ? proto::Message{} : std::move(out.back().msg);
  }
  /// Runs the broker's timers as they would run a second after the last time (owed writes are looked at again).
  void tick() {
    std::vector<Outgoing> out;
    clock_ns = std::max(clock_ns, os::monotonic_ns()) + 1'000'000'000;
    registry.expire(clock_ns, out);
  }
  Registry registry;
  std::uint32_t rid = 1;
  std::int64_t clock_ns = 0;
};

/// A channel "owed" whose producer (member of a process that lives until killed) died owing its stream's `filled`
/// of message 2, which waits for message 0's `freed`; the broker that repaired it is killed before it made it.
class OwedAcrossABrokerKill : public ::testing::Test {
 protected:
  OwedAcrossABrokerKill() : memfd(os::memfd_create("channel-control", b.bytes)) {
    shared = os::Mapping::map(memfd.get(), b.bytes, true);
    b.move_to(shared.data());
  }
  /// The first broker: the producer joins, publishes message 2 into slot 0 after message 0's release (its stream
  /// owes `filled` after it waits for that release's `freed`, which the consumer's stream has not written yet), and
  /// its connection closes; the consumer's stream then writes `freed`, but the producer's process has not exited.
  /// `before_kill` runs last, with that broker.
  void owe_then_kill_the_broker(const std::function<void(JournaledBroker&)>& before_kill = {}) {
    const pid_t ppid = producer_process.pid;
    auto broker = std::make_unique<JournaledBroker>(journal, ppid);
    const auto created = broker->ask(
        1, ppid, proto::Create{"owed", proto::Kind::Host, 0600, b.bytes, {}, proto::kFlagChannel}, memfd.get());
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(created.body));
    const std::uint64_t id = std::get<proto::OpenReply>(created.body).info.id;
    const auto joined = broker->ask(1, ppid, proto::Join{id, static_cast<std::uint8_t>(proto::Role::Producer)});
    ASSERT_TRUE(std::holds_alternative<proto::JoinReply>(joined.body));
    const std::uint32_t producer = std::get<proto::JoinReply>(joined.body).member;
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
        broker->ask(2, ::getpid(), proto::Open{"owed", proto::Access::ReadWrite, 0}).body));
    ASSERT_TRUE(std::holds_alternative<proto::JoinReply>(
        broker->ask(2, ::getpid(), proto::Join{id, static_cast<std::uint8_t>(proto::Role::Consumer)}).body));
    b.slot(0).state = proto::pack_state(2, Phase::Published, producer);
    b.slot(0).release_mark = 1;
    b.slot(0).filled = 1;
    b.owe(producer, 2, false, 1);
    broker->registry.drop_connection(1);  // killed
    b.slot(0).freed = 1;                  // the consumer's stream is done with message 0
    broker->tick();
    EXPECT_EQ(b.slot(0).filled, 1U) << "made before the producer's process exited";
    if (before_kill) before_kill(*broker);
  }  // the broker is killed
  /// The next broker, which the consumer gives the channel back (by the name it opened it by): under `as`.
  void announce(JournaledBroker& next, const std::string& as = "owed") {
    const auto back = next.ask(2, ::getpid(), proto::Announce{"owed", proto::Access::ReadWrite, b.bytes}, memfd.get());
    const auto* r = std::get_if<proto::OpenReply>(&back.body);
    ASSERT_NE(r, nullptr) << (std::holds_alternative<proto::ErrorReply>(back.body)
                                  ? std::get<proto::ErrorReply>(back.body).message
                                  : std::string("another reply"));
    EXPECT_EQ(r->info.name, as);
    next.tick();
  }
  bool made() { return b.slot(0).filled == 3 && b.slot(0).incomplete == proto::incomplete_mark(2); }

  test::TempDir dir;
  const std::string journal = dir.file("names.journal");
  LiveChild producer_process;  // the producer's process: killed, not yet exited
  ChannelBlock b{2};
  os::UniqueFd memfd;
  os::Mapping shared;
};

// A name given back with a read-only description of its memory, though announced read-write: the broker kept that
// description as the segment's memory, and every later read-write opener got one it could not map writable.
TEST(BrokerRestoreMemory, ANameGivenBackKeepsAWritableDescriptionWhateverTheAnnouncerSent) {
  test::TempDir dir;
  const std::string journal = dir.file("names.journal");
  auto memory = os::memfd_create("given-back", 4096);
  {
    JournaledBroker first(journal, ::getpid());
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
        first.ask(1, ::getpid(), proto::Create{"back", proto::Kind::Host, 0600, 4096, {}, 0}, memory.get()).body));
  }  // killed
  JournaledBroker next(journal, ::getpid());
  const auto read_only = os::reopen_readonly(memory.get());
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
      next.ask(1, ::getpid(), proto::Announce{"back", proto::Access::ReadWrite, 4096}, read_only.get()).body));
  std::vector<os::UniqueFd> none;
  std::vector<Outgoing> out;
  next.registry.handle(Caller{2, JournaledBroker::creds(::getpid())},
                       proto::Message{99, proto::Open{"back", proto::Access::ReadWrite, 0}}, none, 0, out);
  ASSERT_EQ(out.size(), 1U);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(out[0].msg.body));
  ASSERT_TRUE(out[0].fd);
  EXPECT_NO_THROW(os::Mapping::map(out[0].fd.get(), 4096, true));
}

// An entry the journal names the process of is taken back by that process only. Any read-write holder can read its
// token from the block; one that rejoined it kept its owner from rejoining, and the owner's death from repair.
TEST_F(OwedAcrossABrokerKill, AnEntryFromTheJournalIsRejoinedOnlyByItsProcess) {
  ASSERT_NO_FATAL_FAILURE(owe_then_kill_the_broker());
  JournaledBroker next(journal, producer_process.pid);
  ASSERT_NO_FATAL_FAILURE(announce(next));
  std::uint32_t consumer = proto::kNoMember;
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    if (b.h().members[i].token != 0 && b.h().members[i].role == static_cast<std::uint32_t>(proto::Role::Consumer)) {
      consumer = i;
    }
  }
  ASSERT_NE(consumer, proto::kNoMember);
  const proto::Rejoin rejoin{
      std::get<proto::OpenReply>(
          next.ask(1, producer_process.pid, proto::Announce{"owed", proto::Access::ReadWrite, b.bytes}, memfd.get())
              .body)
          .info.id,
      consumer, b.h().members[consumer].token, static_cast<std::uint8_t>(proto::Role::Consumer)};
  const auto taken = next.ask(1, producer_process.pid, rejoin);  // another process's connection
  const auto* e = std::get_if<proto::ErrorReply>(&taken.body);
  ASSERT_NE(e, nullptr);
  EXPECT_NE(e->message.find("the journal gives that entry to another process"), std::string::npos) << e->message;
  EXPECT_TRUE(std::holds_alternative<proto::OkReply>(next.ask(2, ::getpid(), rejoin).body));  // its own
}

// The next broker makes the write from its journal once the channel comes back, and still not before the producer's
// process has exited. Before, the write was lost with the broker, and a consumer's stream waiting for the message
// waited until it was destroyed.
TEST_F(OwedAcrossABrokerKill, TheNextBrokerMakesTheWritesOnceTheirProcessHasExited) {
  ASSERT_NO_FATAL_FAILURE(owe_then_kill_the_broker());
  JournaledBroker next(journal, producer_process.pid);
  ASSERT_NO_FATAL_FAILURE(announce(next));
  EXPECT_EQ(b.slot(0).filled, 1U) << "made before the producer's process exited";
  producer_process.kill();
  next.tick();
  EXPECT_TRUE(made()) << "filled " << b.slot(0).filled << ", incomplete " << b.slot(0).incomplete;
}

// A channel unlinked while its members use it (a common way: unlink once everyone has opened it, so that no name
// outlives them), its name then taken by another segment. The journal keeps the channel under its memory's identity,
// and the next broker takes it back from a holder's fd, under no name, with what its dead members owed; twice over.
// Before, the next broker knew nothing of it: the write was never made (a consumer's stream waiting for that message
// waited until it was destroyed), and no death among its members was repaired again.
TEST_F(OwedAcrossABrokerKill, AChannelUnlinkedWhileHeldComesBackByItsMemory) {
  auto other = os::memfd_create("the-name-now", 4096);
  ASSERT_NO_FATAL_FAILURE(owe_then_kill_the_broker([&](JournaledBroker& broker) {
    ASSERT_TRUE(std::holds_alternative<proto::OkReply>(broker.ask(2, ::getpid(), proto::Unlink{"owed"}).body));
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
        broker.ask(2, ::getpid(), proto::Create{"owed", proto::Kind::Host, 0600, 4096, {}, 0}, other.get()).body));
  }));
  {
    JournaledBroker next(journal, producer_process.pid);
    ASSERT_NO_FATAL_FAILURE(announce(next, ""));
    EXPECT_EQ(b.slot(0).filled, 1U) << "made before the producer's process exited";
    // The name is the other segment's, as it was.
    const auto back = next.ask(2, ::getpid(), proto::Announce{"owed", proto::Access::ReadWrite, 4096}, other.get());
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(back.body));
    EXPECT_EQ(std::get<proto::OpenReply>(back.body).info.name, "owed");
    EXPECT_EQ(std::get<proto::OpenReply>(back.body).info.size, 4096U);
  }  // killed too
  JournaledBroker third(journal, producer_process.pid);
  ASSERT_NO_FATAL_FAILURE(announce(third, ""));
  producer_process.kill();
  third.tick();
  EXPECT_TRUE(made()) << "filled " << b.slot(0).filled << ", incomplete " << b.slot(0).incomplete;
}

// Its owner unlinks the channel after a broker restart, before any holder gave it back: it waits on under its
// memory's identity, as a channel unlinked while the last broker ran.
TEST_F(OwedAcrossABrokerKill, AChannelUnlinkedBeforeAnyHolderGaveItBackStillComesBack) {
  ASSERT_NO_FATAL_FAILURE(owe_then_kill_the_broker());
  JournaledBroker next(journal, producer_process.pid);
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(next.ask(2, ::getpid(), proto::Unlink{"owed"}).body));
  const auto opened = next.ask(2, ::getpid(), proto::Open{"owed", proto::Access::ReadWrite, 0});
  ASSERT_TRUE(std::holds_alternative<proto::ErrorReply>(opened.body));
  EXPECT_EQ(std::get<proto::ErrorReply>(opened.body).code, static_cast<std::uint8_t>(ErrorCode::NotFound));
  ASSERT_NO_FATAL_FAILURE(announce(next, ""));
  producer_process.kill();
  next.tick();
  EXPECT_TRUE(made()) << "filled " << b.slot(0).filled << ", incomplete " << b.slot(0).incomplete;
}

// A process the journal names without its start time could be another one by now, holding the writes back for as
// long as it runs: the next broker does not wait for it.
TEST_F(OwedAcrossABrokerKill, AProcessWhoseStartWasNotKnownIsNotWaitedFor) {
  ASSERT_NO_FATAL_FAILURE(owe_then_kill_the_broker());
  const std::string x = fmt::format("X owed {} ", producer_process.pid);
  std::string text = test::read_file(journal).value_or("");
  const auto at = text.find(x);
  ASSERT_NE(at, std::string::npos) << text;
  const auto end = text.find('\n', at);
  text.replace(at, end - at, x + "0");
  test::write_file(journal, text);
  JournaledBroker next(journal, producer_process.pid);
  ASSERT_NO_FATAL_FAILURE(announce(next));
  EXPECT_TRUE(made()) << "filled " << b.slot(0).filled << ", incomplete " << b.slot(0).incomplete;
}

/// A two-slot channel "ch" registered with a JournaledBroker: connection 2 (this process) created it and joined as
/// a consumer; connection 1 (process `producer`) opens it and joins as a producer (`member`, `token`).
struct ChannelOverABroker {
  explicit ChannelOverABroker(pid_t producer)
      : memfd(os::memfd_create("channel-control", b.bytes)),
        shared(os::Mapping::map(memfd.get(), b.bytes, true)),
        broker((b.move_to(shared.data()), dir.file("names.journal")), producer) {
    const auto created = broker.ask(
        2, ::getpid(), proto::Create{"ch", proto::Kind::Host, 0600, b.bytes, {}, proto::kFlagChannel}, memfd.get());
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(created.body));
    if (const auto* r = std::get_if<proto::OpenReply>(&created.body)) id = r->info.id;
    EXPECT_TRUE(std::holds_alternative<proto::JoinReply>(
        broker.ask(2, ::getpid(), proto::Join{id, static_cast<std::uint8_t>(proto::Role::Consumer)}).body));
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(
        broker.ask(1, producer, proto::Open{"ch", proto::Access::ReadWrite, 0}).body));
    const auto joined = broker.ask(1, producer, proto::Join{id, static_cast<std::uint8_t>(proto::Role::Producer)});
    EXPECT_TRUE(std::holds_alternative<proto::JoinReply>(joined.body));
    if (const auto* r = std::get_if<proto::JoinReply>(&joined.body)) {
      member = r->member;
      token = r->token;
    }
  }
  test::TempDir dir;
  ChannelBlock b{2};
  os::UniqueFd memfd;
  os::Mapping shared;
  JournaledBroker broker;
  std::uint64_t id = 0;
  std::uint32_t member = proto::kNoMember;
  std::uint32_t token = 0;
};

// Leave removes an entry only for the connection that joined it, with its token, once; the entry's connection
// closing afterwards repairs nothing more.
TEST(BrokerLeave, OnlyTheConnectionThatJoinedAnEntryLeavesIt) {
  ChannelOverABroker c(::getpid());
  ASSERT_NE(c.member, proto::kNoMember);
  auto& b = c.b;
  auto refused = [&](ConnId conn, proto::Leave req) {
    const auto r = c.broker.ask(conn, ::getpid(), req);
    const auto* e = std::get_if<proto::ErrorReply>(&r.body);
    return e != nullptr && e->message.find("Leave of member") != std::string::npos;
  };
  EXPECT_TRUE(refused(2, proto::Leave{c.id, c.member, c.token}));      // another connection's entry
  EXPECT_TRUE(refused(1, proto::Leave{c.id, c.member, c.token + 1}));  // not its token
  EXPECT_TRUE(refused(1, proto::Leave{c.id + 1, c.member, c.token}));  // no such channel
  EXPECT_EQ(b.h().members[c.member].token, c.token);
  EXPECT_TRUE(std::holds_alternative<proto::OkReply>(
      c.broker.ask(1, ::getpid(), proto::Leave{c.id, c.member, c.token}).body));
  EXPECT_EQ(b.h().members[c.member].token, 0U);
  EXPECT_EQ(b.h().producers_gone, static_cast<std::uint32_t>(proto::PoisonReason::Closed));
  EXPECT_TRUE(refused(1, proto::Leave{c.id, c.member, c.token}));  // left already
  c.broker.registry.drop_connection(1);
  EXPECT_EQ(b.h().producers_gone, static_cast<std::uint32_t>(proto::PoisonReason::Closed));  // not PeerDied
  EXPECT_EQ(b.h().consumers, 1U);
}

/// A counting semaphore "cs" (initial 1 of 3) registered with a JournaledBroker by connection 2, which has not
/// joined it yet.
struct CountingOverABroker {
  CountingOverABroker()
      : memfd(os::memfd_create("counting-control", sizeof(proto::CountingBlock))),
        shared(os::Mapping::map(memfd.get(), sizeof(proto::CountingBlock), true)),
        broker(dir.file("names.journal"), ::getpid()) {
    auto& b = block();
    b.version = proto::kCountingVersion;
    b.max_count = 3;
    b.initial = 1;
    b.state = 1;
    b.magic = proto::kCountingMagic;
    const auto created =
        broker.ask(2, ::getpid(),
                   proto::Create{"cs", proto::Kind::Host, 0600, sizeof(proto::CountingBlock), {}, proto::kFlagCounting},
                   memfd.get());
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(created.body));
    if (const auto* r = std::get_if<proto::OpenReply>(&created.body)) id = r->info.id;
  }
  proto::CountingBlock& block() { return *static_cast<proto::CountingBlock*>(shared.data()); }
  test::TempDir dir;
  os::UniqueFd memfd;
  os::Mapping shared;
  JournaledBroker broker;
  std::uint64_t id = 0;
};

// The answer to a counting semaphore's Join that the library gave up on is undone with Leave, as for the other
// objects (it was refused: the entry stayed, holding the creator's grant, until the process's last Close).
TEST(BrokerLeave, ACountingSemaphoresMemberLeavesGivingBackWhatItHolds) {
  CountingOverABroker c;
  const auto joined = c.broker.ask(2, ::getpid(), proto::Join{c.id, static_cast<std::uint8_t>(proto::Role::Holder)});
  const auto* j = std::get_if<proto::JoinReply>(&joined.body);
  ASSERT_NE(j, nullptr);
  EXPECT_EQ(shm::counting_held(c.block(), j->member), 2U);  // the creator's grant
  const auto left = c.broker.ask(2, ::getpid(), proto::Leave{c.id, j->member, j->token});
  EXPECT_TRUE(std::holds_alternative<proto::OkReply>(left.body))
      << (std::holds_alternative<proto::ErrorReply>(left.body) ? std::get<proto::ErrorReply>(left.body).message : "");
  EXPECT_EQ(shm::counting_members(c.block()), 0U);
  EXPECT_EQ(shm::counting_available(c.block()), 3U);
}

// A member whose connection closes while its process runs keeps its entry (and what it holds) while that process
// reconnects: its Rejoin takes the entry back, on a new connection, past the grace. Once the process has exited,
// no Rejoin takes it, even one from its pid (another process's by then, as far as the broker can tell): it is
// repaired at the next look.
TEST(BrokerRepair, AMemberWhoseConnectionClosesWhileItRunsRejoinsAndOnlyItsRunningProcessMay) {
  LiveChild process;
  CountingOverABroker c;
  c.broker.registry.set_rejoin_grace(5'000'000'000);
  // Connection `conn` of the child (the process this test stands for) opens the semaphore read-write.
  auto open_as_child = [&](ConnId conn) {
    c.broker.registry.add_connection(conn, JournaledBroker::creds(process.pid));
    return std::holds_alternative<proto::OpenReply>(
        c.broker.ask(conn, process.pid, proto::Open{"cs", proto::Access::ReadWrite, 0}).body);
  };
  ASSERT_TRUE(open_as_child(3));
  const auto joined = c.broker.ask(3, process.pid, proto::Join{c.id, static_cast<std::uint8_t>(proto::Role::Holder)});
  const auto* j = std::get_if<proto::JoinReply>(&joined.body);
  ASSERT_NE(j, nullptr);
  ASSERT_EQ(shm::counting_apply(c.block(), j->member, false, 1, 3), shm::CountingResult::Done);
  ASSERT_EQ(shm::counting_available(c.block()), 0U);
  const proto::Rejoin rejoin{c.id, j->member, j->token, static_cast<std::uint8_t>(proto::Role::Holder)};

  c.broker.registry.drop_connection(3);
  for (int i = 0; i < 6; ++i) c.broker.tick();  // past the grace: it had not rejoined yet, but its process runs
  EXPECT_EQ(shm::counting_available(c.block()), 1U) << "not repaired after the grace";

  // Again, rejoining this time.
  ASSERT_TRUE(open_as_child(4));
  EXPECT_TRUE(std::holds_alternative<proto::ErrorReply>(c.broker.ask(4, process.pid, rejoin).body))
      << "an entry repaired after the grace was taken back";
  const auto joined_again =
      c.broker.ask(4, process.pid, proto::Join{c.id, static_cast<std::uint8_t>(proto::Role::Holder)});
  const auto* k = std::get_if<proto::JoinReply>(&joined_again.body);
  ASSERT_NE(k, nullptr);
  ASSERT_EQ(shm::counting_apply(c.block(), k->member, false, 1, 3), shm::CountingResult::Done);
  const proto::Rejoin back{c.id, k->member, k->token, static_cast<std::uint8_t>(proto::Role::Holder)};
  c.broker.registry.drop_connection(4);
  const auto stolen = c.broker.ask(2, ::getpid(), back);  // connection 2 holds it read-write too
  ASSERT_TRUE(std::holds_alternative<proto::ErrorReply>(stolen.body)) << "another process took the entry";
  ASSERT_TRUE(open_as_child(5));
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(c.broker.ask(5, process.pid, back).body));
  for (int i = 0; i < 6; ++i) c.broker.tick();
  EXPECT_EQ(shm::counting_available(c.block()), 0U) << "repaired though it rejoined";

  // Its process exits with the connection closed: its pid no longer takes the entry back.
  c.broker.registry.drop_connection(5);
  process.kill();
  ASSERT_TRUE(open_as_child(6));
  const auto late = c.broker.ask(6, process.pid, back);
  EXPECT_TRUE(std::holds_alternative<proto::ErrorReply>(late.body)) << "an exited process's entry was taken back";
  c.broker.tick();
  EXPECT_EQ(shm::counting_available(c.block()), 1U);
}

// Create and the creator's Join are two requests: a creator whose connection goes between them leaves its grant
// available, not held by nobody.
TEST(BrokerRepair, ACountingSemaphoresCreatorThatGoesBeforeJoiningLeavesItsGrantAvailable) {
  for (const bool closes : {false, true}) {
    CountingOverABroker c;
    if (closes) {
      EXPECT_TRUE(std::holds_alternative<proto::OkReply>(c.broker.ask(2, ::getpid(), proto::Close{c.id}).body));
    } else {
      c.broker.registry.drop_connection(2);
    }
    EXPECT_EQ(shm::counting_available(c.block()), 3U) << (closes ? "closed" : "dropped");
  }
  // A creator that joined has its grant already: its going gives back what it holds, no more.
  CountingOverABroker c;
  const auto joined = c.broker.ask(2, ::getpid(), proto::Join{c.id, static_cast<std::uint8_t>(proto::Role::Holder)});
  ASSERT_TRUE(std::holds_alternative<proto::JoinReply>(joined.body));
  ASSERT_EQ(shm::counting_apply(c.block(), std::get<proto::JoinReply>(joined.body).member, false, 1, 3),
            shm::CountingResult::Done);
  c.broker.registry.drop_connection(2);
  EXPECT_EQ(shm::counting_available(c.block()), 3U);
}

// A producer whose connection closes while it holds a slot it claimed is repaired only once its process has exited:
// its stream may still be filling the slot (a storm of such kills on an H200 saw a later message overwritten,
// ChannelsDevice.ProducersKilledWhileTheirStreamsFillClaimedSlotsCorruptNoLaterMessage).
TEST(BrokerRepairWaits, AProducerHoldingAClaimIsRepairedOnceItsProcessHasExited) {
  LiveChild producer_process;
  ChannelOverABroker c(producer_process.pid);
  ASSERT_NE(c.member, proto::kNoMember);
  auto& b = c.b;
  b.slot(0).state = proto::pack_state(0, Phase::Writing, c.member);  // claimed; its stream may be filling it
  c.broker.registry.drop_connection(1);                                // its connection closed
  c.broker.tick();
  EXPECT_EQ(b.h().members[c.member].token, c.token) << "repaired before the process exited";
  EXPECT_EQ(b.slot(0).state, proto::pack_state(0, Phase::Writing, c.member));
  producer_process.kill();
  c.broker.tick();
  EXPECT_EQ(b.h().members[c.member].token, 0U);
  EXPECT_EQ(b.slot(0).state, proto::pack_state(2, Phase::Free, proto::kNoMember));
  EXPECT_EQ(b.h().abandoned, 1U);
  EXPECT_EQ(b.h().producers_gone, static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
}

/// A pool "pool" (one ready 1 MiB chunk) registered with a JournaledBroker: connection 2 (this process) created it;
/// connection 1 (process `holder`) opens it and joins as a holder (`member`, `token`).
struct PoolOverABroker {
  explicit PoolOverABroker(pid_t holder)
      : memfd(os::memfd_create("pool-control", bytes)),
        shared(os::Mapping::map(memfd.get(), bytes, true)),
        broker(dir.file("names.journal"), holder) {
    shm::PoolGeometry g;
    g.pool_id = 0x1234;
    g.mode = shm::PoolMode::Variable;
    g.kind = static_cast<std::uint32_t>(proto::Kind::Host);
    g.max_chunks = 1;
    g.chunk_bytes = 1 << 20;
    g.max_records = 16;
    auto& h = *static_cast<shm::PoolHeader*>(shared.data());
    h.chunks[0].state = static_cast<std::uint32_t>(shm::ChunkState::Ready);
    h.chunks[0].bytes = g.chunk_bytes;
    shm::init_pool(shared.data(), g);
    block = shm::PoolBlock(shared.data(), bytes);
    const auto created = broker.ask(
        2, ::getpid(), proto::Create{"pool", proto::Kind::Host, 0600, bytes, {}, proto::kFlagPool}, memfd.get());
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(created.body));
    if (const auto* r = std::get_if<proto::OpenReply>(&created.body)) id = r->info.id;
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(
        broker.ask(1, holder, proto::Open{"pool", proto::Access::ReadWrite, 0}).body));
    const auto joined = broker.ask(1, holder, proto::Join{id, static_cast<std::uint8_t>(proto::Role::Holder)});
    EXPECT_TRUE(std::holds_alternative<proto::JoinReply>(joined.body));
    if (const auto* r = std::get_if<proto::JoinReply>(&joined.body)) {
      member = r->member;
      token = r->token;
    }
  }
  shm::PoolStatus allocate(shm::BlockLocation& loc) {
    std::vector<shm::OccupiedRange> scratch;
    scratch.reserve(16);
    return block.allocate(member, 4096, 256, loc, scratch, std::chrono::seconds(1));
  }
  /// A block allocated and freed on a stream that has not written its `released` yet, then the member's own leave
  /// that keeps that free pending: what the library's close does before it sends Leave.
  shm::BlockLocation owe_a_free_and_leave_locally() {
    shm::BlockLocation loc;
    EXPECT_EQ(allocate(loc), shm::PoolStatus::Ok);
    EXPECT_EQ(block.release(member, loc, true, std::chrono::seconds(1)), shm::PoolStatus::Ok);
    EXPECT_EQ(shm::pool_remove_member(shared.data(), bytes, member, true), 0);
    return loc;
  }
  shm::RecordState state(const shm::BlockLocation& loc) {
    return static_cast<shm::RecordState>(block.record(loc.record).state);
  }
  test::TempDir dir;
  std::size_t bytes = shm::pool_control_bytes(16);
  os::UniqueFd memfd;
  os::Mapping shared;
  JournaledBroker broker;
  shm::PoolBlock block;
  std::uint64_t id = 0;
  std::uint32_t member = proto::kNoMember;
  std::uint32_t token = 0;
};

// A pool member whose connection closes while it holds a block, or while its stream-ordered free of one is pending,
// is repaired only once its process has exited: the killed process's kernels may still write that memory, which
// the repair would give to the next allocation. One that holds nothing is repaired at once.
TEST(BrokerRepairWaits, APoolMemberUsingBlocksIsRepairedOnceItsProcessHasExited) {
  for (const bool pending_free : {false, true}) {
    SCOPED_TRACE(pending_free ? "a stream-ordered free pending" : "a block held");
    LiveChild holder_process;
    PoolOverABroker p(holder_process.pid);
    ASSERT_NE(p.member, proto::kNoMember);
    shm::BlockLocation loc;
    ASSERT_EQ(p.allocate(loc), shm::PoolStatus::Ok);
    if (pending_free) {
      ASSERT_EQ(p.block.release(p.member, loc, true, std::chrono::seconds(1)), shm::PoolStatus::Ok);
    }
    const auto used = pending_free ? shm::RecordState::Draining : shm::RecordState::Live;
    ASSERT_EQ(p.state(loc), used);
    p.broker.registry.drop_connection(1);  // its connection closed
    p.broker.tick();
    EXPECT_EQ(p.block.header().members[p.member].token, p.token) << "repaired before the process exited";
    EXPECT_EQ(p.state(loc), used);
    holder_process.kill();
    p.broker.tick();
    EXPECT_EQ(p.block.header().members[p.member].token, 0U);
    EXPECT_EQ(p.state(loc), shm::RecordState::Unused);
  }
  LiveChild idle_process;
  PoolOverABroker p(idle_process.pid);
  ASSERT_NE(p.member, proto::kNoMember);
  p.broker.registry.drop_connection(1);
  EXPECT_EQ(p.block.header().members[p.member].token, 0U) << "a member holding nothing waited for its exit";
}

// A pool member leaving while its stream has not reached a free hands its leave to the broker (Leave), which removes
// the entry once the free has landed, or once its process has exited, whichever comes first. Until then the block
// stays draining: nothing reuses it ahead of the stream.
TEST(BrokerLeave, APoolMemberOwingAStreamFreeIsRemovedOnceItLandsOrItsProcessExits) {
  for (const bool exits : {false, true}) {
    SCOPED_TRACE(exits ? "the process exits" : "the free lands");
    LiveChild holder_process;
    PoolOverABroker p(holder_process.pid);
    ASSERT_NE(p.member, proto::kNoMember);
    const shm::BlockLocation loc = p.owe_a_free_and_leave_locally();
    const auto r = p.broker.ask(1, holder_process.pid, proto::Leave{p.id, p.member, p.token});
    ASSERT_TRUE(std::holds_alternative<proto::OkReply>(r.body));
    p.broker.tick();
    EXPECT_EQ(p.block.header().members[p.member].token, p.token) << "removed before the free landed";
    EXPECT_EQ(p.state(loc), shm::RecordState::Draining);
    p.broker.registry.drop_connection(1);  // its connection closing changes nothing
    p.broker.tick();
    EXPECT_EQ(p.block.header().members[p.member].token, p.token);
    if (exits) {
      holder_process.kill();
    } else {
      proto::atomic(p.block.record(loc.record).released).store(loc.generation);  // what the stream writes
    }
    p.broker.tick();
    EXPECT_EQ(p.block.header().members[p.member].token, 0U);
    EXPECT_EQ(p.state(loc), shm::RecordState::Unused);
  }
}

// The journal kept a member that left owing a stream free as joined: a broker started after this one died took it
// for a member that had not rejoined yet, and kept its entry and the draining block until its process exited,
// however long after the free had landed.
TEST(BrokerLeave, APoolMemberThatLeftOwingAFreeIsRemovedOnceItLandsAfterABrokerRestart) {
  for (const bool compacted : {false, true}) {
    SCOPED_TRACE(compacted ? "the journal compacted before the kill" : "the journal as appended");
    LiveChild holder_process;
    PoolOverABroker p(holder_process.pid);
    ASSERT_NE(p.member, proto::kNoMember);
    const shm::BlockLocation loc = p.owe_a_free_and_leave_locally();
    ASSERT_TRUE(std::holds_alternative<proto::OkReply>(
        p.broker.ask(1, holder_process.pid, proto::Leave{p.id, p.member, p.token}).body));
    if (compacted) {  // the next broker replays this one's compacted lines first
      JournaledBroker middle(p.dir.file("names.journal"), holder_process.pid);
      ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
          middle.ask(2, ::getpid(), proto::Announce{"pool", proto::Access::ReadWrite, p.bytes}, p.memfd.get()).body));
    }
    JournaledBroker next(p.dir.file("names.journal"), holder_process.pid);  // p.broker was killed
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
        next.ask(2, ::getpid(), proto::Announce{"pool", proto::Access::ReadWrite, p.bytes}, p.memfd.get()).body));
    next.tick();
    EXPECT_EQ(p.block.header().members[p.member].token, p.token) << "removed before the free landed";
    EXPECT_EQ(p.state(loc), shm::RecordState::Draining);
    proto::atomic(p.block.record(loc.record).released).store(loc.generation);  // what the stream writes
    next.tick();
    EXPECT_EQ(p.block.header().members[p.member].token, 0U) << "kept while its process ran, the free landed";
    EXPECT_EQ(p.state(loc), shm::RecordState::Unused);
  }
}

/// A control block of a channel of two slots in a memfd, and the test's view of it (`b`).
struct ChannelMemory {
  ChannelMemory()
      : memfd(os::memfd_create("channel-control", b.bytes)), shared(os::Mapping::map(memfd.get(), b.bytes, true)) {
    b.move_to(shared.data());
  }
  ChannelBlock b{2};
  os::UniqueFd memfd;
  os::Mapping shared;
};

/// A JournaledBroker (its journal in a temporary directory) and a channel "ch" of two slots that process `pid`
/// created on connection 1: the test's view of its control block is `b`.
struct ChannelOfAProcess {
  explicit ChannelOfAProcess(pid_t pid) : broker(dir.file("names.journal"), pid), id(create("ch", first, pid)) {}
  /// Has connection 1 of process `pid` create channel `name` over `memory`; returns its id.
  std::uint64_t create(const std::string& name, const ChannelMemory& memory, pid_t pid) {
    const auto created =
        broker.ask(1, pid, proto::Create{name, proto::Kind::Host, 0600, memory.b.bytes, {}, proto::kFlagChannel},
                   memory.memfd.get());
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(created.body));
    const auto* r = std::get_if<proto::OpenReply>(&created.body);
    return r != nullptr ? r->info.id : 0;
  }
  /// A new connection `conn` of process `pid` opens channel `name` (id `channel`; 0: "ch") and joins it as a producer.
  proto::JoinReply join_on_new_connection(ConnId conn, pid_t pid, const std::string& name = "ch",
                                          std::uint64_t channel = 0) {
    broker.registry.add_connection(conn, JournaledBroker::creds(pid));
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(
        broker.ask(conn, pid, proto::Open{name, proto::Access::ReadWrite, 0}).body));
    return join(conn, pid, channel);
  }
  /// Connection `conn` of process `pid` joins channel `channel` (0: "ch") as a producer.
  proto::JoinReply join(ConnId conn, pid_t pid, std::uint64_t channel = 0) {
    const auto joined = broker.ask(
        conn, pid, proto::Join{channel != 0 ? channel : id, static_cast<std::uint8_t>(proto::Role::Producer)});
    EXPECT_TRUE(std::holds_alternative<proto::JoinReply>(joined.body));
    const auto* r = std::get_if<proto::JoinReply>(&joined.body);
    return r != nullptr ? *r : proto::JoinReply{proto::kNoMember, 0};
  }
  test::TempDir dir;
  ChannelMemory first;
  ChannelBlock& b = first.b;
  JournaledBroker broker;
  std::uint64_t id = 0;
};

// Join and Leave in a loop, each time owing a stream write that never lands: the broker kept a leaver (a pidfd, the
// writes, a journal line of all of them) for each, without end. It keeps kMaxMembers; past that a member is told to
// leave on its own (its library then waits, bounded, for its stream).
TEST(BrokerLeave, TheBrokerKeepsABoundedNumberOfChannelMembersThatLeftOwingWrites) {
  LiveChild process;
  ChannelOfAProcess c(process.pid);
  std::size_t left = 0;
  for (; left < proto::kMaxMembers + 5; ++left) {
    const auto m = c.join(1, process.pid);
    ASSERT_NE(m.member, proto::kNoMember) << left;
    c.b.owe(m.member, 1000 + left, false, 1U << 30);  // waits for a `freed` that never comes
    const auto r = c.broker.ask(1, process.pid, proto::Leave{c.id, m.member, m.token});
    if (const auto* e = std::get_if<proto::ErrorReply>(&r.body)) {
      EXPECT_NE(e->message.find("leave without the broker"), std::string::npos) << e->message;
      break;
    }
  }
  EXPECT_EQ(left, proto::kMaxMembers);
}

/// How many fds this process has open (the registry under test runs in it).
std::size_t open_fd_count() {
  std::error_code ec;
  std::size_t n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec); !ec && it != std::filesystem::end(it);
       it.increment(ec)) {
    ++n;
  }
  return n;
}

// A connection that joins a channel, owes a stream write that never lands, and closes, while its process lives on:
// the broker repairs the entry and waits for the process's exit before it makes the write (a pidfd, the writes). In
// a loop the entry is free again each time, and the broker kept a pidfd for each repair without end, until its fds
// ran out for every user. It keeps one per process.
TEST(BrokerRepairWaits, ConnectionsClosedOwingWritesCostTheBrokerOneFdPerProcess) {
  LiveChild process;
  ChannelOfAProcess c(process.pid);
  const std::size_t fds_before = open_fd_count();
  constexpr int kRounds = 300;
  for (int i = 0; i < kRounds; ++i) {
    const ConnId conn = 10 + static_cast<ConnId>(i);
    const auto m = c.join_on_new_connection(conn, process.pid);
    ASSERT_NE(m.member, proto::kNoMember) << i;
    c.b.owe(m.member, 1000 + static_cast<std::uint64_t>(i), false, 1U << 30);  // waits for a `freed` that never comes
    c.broker.registry.drop_connection(conn);
  }
  c.broker.tick();
  EXPECT_LE(open_fd_count(), fds_before + 1) << test::describe_open_fds();
  // Once the process has exited nothing waits for it.
  process.kill();
  c.broker.tick();
  EXPECT_LE(open_fd_count(), fds_before);
}

// The broker's watches of processes: one per process however many waits share it, charged to a uid while held,
// and none past what the uid is allowed (its repairs then wait for nothing, as for a process it cannot see).
TEST(ExitWatch, OneWatchPerProcessWithinTheUidsShare) {
  ExitWatch exits;
  LiveChild b;
  LiveChild a;  // forked after b: no process but this one holds its pipe, so it exits at a.kill()
  const uid_t uid = ::getuid();
  ProcessWatch first = exits.watch(a.pid, 0, uid, 1);
  ASSERT_TRUE(first);
  EXPECT_EQ(exits.watch(a.pid, 0, uid, 1), first) << "a second pidfd for the same process";
  EXPECT_EQ(exits.watch(a.pid, first->start, uid, 1), first);
  EXPECT_FALSE(exits.watch(a.pid, first->start + 1, uid, 1)) << "another start is another process, gone";
  EXPECT_EQ(exits.watched(uid), 1U);
  EXPECT_FALSE(exits.watch(b.pid, 0, uid, 1)) << "past the uid's share";
  EXPECT_TRUE(exits.watch(b.pid, 0, uid + 1, 1)) << "another uid's share";
  EXPECT_FALSE(exits.watch(0, 0, uid, 1));
  EXPECT_FALSE(exited(first));
  a.kill();
  EXPECT_TRUE(exited(first));
  EXPECT_FALSE(exits.watch(a.pid, 0, uid, 2)) << "a process that has exited";
  first.reset();
  EXPECT_EQ(exits.watched(uid), 0U);
  EXPECT_TRUE(exits.watch(b.pid, 0, uid, 1));
  EXPECT_TRUE(exited(ProcessWatch{}));
}

TEST(ExitWatch, AProcessSeenExitedButNotReapedTakesNoSecondPidfd) {
  // A zombie's pid is still there: pidfd_open succeeds, and its start is the same. Asked for again (a later repair of
  // the same connection's entries), the watch seen exited is the answer, not a new pidfd charged to the uid.
  ExitWatch exits;
  const uid_t uid = ::getuid();
  int fds[2] = {-1, -1};
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[1]);
    char c = 0;
    (void)!::read(fds[0], &c, 1);
    ::_exit(0);
  }
  ::close(fds[0]);
  const ProcessWatch first = exits.watch(pid, 0, uid, 4);
  ASSERT_TRUE(first);
  ::close(fds[1]);  // it exits, and stays a zombie until the waitpid below
  ASSERT_TRUE(test::wait_until([&] { return exited(first); }, std::chrono::seconds(5)));
  const int open_before = os::count_open_fds();
  const ProcessWatch again = exits.watch(pid, first->start, uid, 4);
  EXPECT_FALSE(again) << "a second watch of a process that has exited";
  EXPECT_EQ(os::count_open_fds(), open_before);
  EXPECT_EQ(exits.watched(uid), 1U);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
}

// A channel whose members write writes into their owed tables that never come due (a turn that never comes), then
// die, in a loop: the broker kept every write, without end. It keeps as many as the members' tables hold, and
// writes the rest at once.
TEST(RepairChannel, TheOwedWritesKeptForAChannelAreBoundedByItsTables) {
  ChannelBlock b(2);
  ControlBlock cb{b.mem.data(), b.bytes, proto::kFlagChannel, {}};
  ASSERT_EQ(check_control(cb), "");
  const std::uint32_t per_member = proto::owed_capacity(2);
  const std::size_t most = max_owed_writes(2);
  ASSERT_EQ(most, std::size_t{proto::kMaxMembers} * per_member);
  // Later rounds owe lower sequences, so a write made at once never lands one the broker kept.
  std::uint64_t seq = 10'000'000;
  for (std::uint32_t round = 0; round < proto::kMaxMembers + 1; ++round) {
    b.member(0, 100 + round, proto::Role::Producer);
    for (std::uint32_t k = 0; k < per_member; ++k) b.owe(0, --seq, false, 1U << 30);
    ASSERT_TRUE(remove_member(cb, Joined{0, 100 + round, proto::Role::Producer})) << round;
    EXPECT_LE(cb.owed.size(), most) << round;
  }
  EXPECT_EQ(cb.owed.size(), most);
  // The last round's writes were made: each slot's `filled` has reached the highest of them for that slot.
  const std::uint64_t highest = seq + per_member - 1;
  EXPECT_EQ(b.slot(highest % 2).filled, highest + 1);
  EXPECT_EQ(b.slot((highest - 1) % 2).filled, highest);
}

// Each process the broker waits for takes one of its fds (a pidfd), from the same share of them as the uid's
// segments: a uid cannot take the others' fds by making the broker wait for its processes.
TEST(BrokerRepairWaits, ProcessesWaitedForTakeTheirUidsShareOfTheBrokersFds) {
  LiveChild process;
  ChannelOfAProcess c(process.pid);
  Quotas quotas;
  quotas.fds = 4;  // two a uid
  c.broker.registry.set_quotas(quotas);
  const auto m = c.join(1, process.pid);
  ASSERT_NE(m.member, proto::kNoMember);
  c.b.slot(0).state = proto::pack_state(0, Phase::Writing, m.member);  // a claim its stream may still be filling
  c.broker.registry.drop_connection(1);                                // repaired once the process has exited
  const auto data = os::memfd_create("data", 4096);
  const proto::Create another{"another", proto::Kind::Host, 0600, 4096, {}, 0};
  const auto refused = c.broker.ask(2, ::getpid(), another, data.get());
  const auto* e = std::get_if<proto::ErrorReply>(&refused.body);
  ASSERT_NE(e, nullptr) << "a third fd for the uid";
  EXPECT_EQ(e->code, static_cast<std::uint8_t>(ErrorCode::QuotaExceeded));
  EXPECT_NE(e->message.find("1 of its processes are waited for"), std::string::npos) << e->message;
  process.kill();
  c.broker.tick();
  EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(c.broker.ask(2, ::getpid(), another, data.get()).body));
}

// Each repair of a member owing writes journaled every write the channel owed, not only the member's: with a
// channel owing many (members that died owing writes that do not come due), one cheap join and close cost the broker
// megabytes of journal lines. It journals what the member added.
TEST(BrokerRepairWaits, ARepairJournalsOnlyTheWritesItsMemberOwed) {
  LiveChild process;
  ChannelOfAProcess c(process.pid);
  const std::string journal = c.dir.file("names.journal");
  const std::uint32_t per_member = proto::owed_capacity(2);
  std::uint64_t seq = 10'000'000;
  std::uintmax_t grown = 0;
  for (int round = 0; round < 16; ++round) {
    const ConnId conn = 10 + static_cast<ConnId>(round);
    const auto m = c.join_on_new_connection(conn, process.pid);
    ASSERT_NE(m.member, proto::kNoMember) << round;
    for (std::uint32_t k = 0; k < per_member; ++k) c.b.owe(m.member, --seq, false, 1U << 30);
    const std::uintmax_t before = std::filesystem::file_size(journal);
    c.broker.registry.drop_connection(conn);
    grown = std::filesystem::file_size(journal) - before;
  }
  // The last round added 64 writes (about 20 bytes each) to the 960 the channel owed already.
  EXPECT_LT(grown, 64U * 48U) << "bytes of journal for one repair";
}

// The owed writes the broker keeps for one uid's channels together are bounded (Quotas::owed_writes): the bound of
// each channel, times a uid's channels, was up to a billion writes, and every pass of the broker's timer looks at
// each (bench/analysis/experiments/owed_settle_pass.cpp: 1.7 ms a pass for one channel's bound). Past the share, a
// dying member's writes are made at once; the share comes back as the kept writes are made.
TEST(BrokerRepairWaits, TheOwedWritesKeptForAUidsChannelsAreBoundedTogether) {
  LiveChild process;
  ChannelOfAProcess c(process.pid);
  ChannelMemory second;
  const std::uint64_t second_id = c.create("ch2", second, process.pid);
  Quotas quotas;
  quotas.owed_writes = 100;
  c.broker.registry.set_quotas(quotas);
  const std::uint32_t per_member = proto::owed_capacity(2);  // 64
  // Each member owes a full table, the later ones lower sequences (so a write made at once lands none kept), each
  // waiting for a `freed` that has not come (1 << 30).
  std::uint64_t seq = 10'000'000;
  auto die_owing_a_table = [&](ConnId conn, pid_t pid, ChannelBlock& b, const std::string& name, std::uint64_t id) {
    const auto m = c.join_on_new_connection(conn, pid, name, id);
    ASSERT_NE(m.member, proto::kNoMember);
    for (std::uint32_t k = 0; k < per_member; ++k) b.owe(m.member, --seq, false, 1U << 30);
    c.broker.registry.drop_connection(conn);
  };
  die_owing_a_table(10, process.pid, c.b, "ch", c.id);
  EXPECT_EQ(c.b.slot(0).filled, 0U) << "written though the share had room";
  EXPECT_EQ(c.b.slot(1).filled, 0U);
  die_owing_a_table(11, process.pid, c.b, "ch", c.id);
  // 36 kept, and the 28 lowest (the last ones it recorded) made at once.
  const std::uint64_t highest_made = seq + 27;
  EXPECT_EQ(c.b.slot(highest_made % 2).filled, highest_made + 1);
  EXPECT_EQ(c.b.slot((highest_made - 1) % 2).filled, highest_made);
  // Their turns come and the process exits: the broker makes the 100 it kept, and the uid's share is free again.
  c.b.slot(0).freed = c.b.slot(1).freed = 1U << 31;
  process.kill();
  c.broker.tick();
  EXPECT_EQ(c.b.slot(1).filled, 10'000'000U) << "the highest kept write, 9999999, not made";
  EXPECT_EQ(c.b.slot(0).filled, 9'999'999U);
  // So the uid's other channel keeps a dying member's writes (this process's: they wait for its exit).
  die_owing_a_table(12, ::getpid(), second.b, "ch2", second_id);
  EXPECT_EQ(second.b.slot(0).filled, 0U) << "written at once though the share had room again";
  EXPECT_EQ(second.b.slot(1).filled, 0U);
}

// Repairs that wait for one process look at it once a pass of the broker's timer, however many there are: each
// polled its own pidfd, every millisecond, so a uid's thousands of entries waiting for one live process kept the
// broker busy.
TEST(BrokerRepairWaits, APassLooksAtEachProcessOnceHoweverManyRepairsWaitForIt) {
  LiveChild process;
  ChannelOfAProcess c(process.pid);
  std::vector<proto::JoinReply> members;
  for (const ConnId conn : {ConnId{10}, ConnId{11}}) {
    members.push_back(c.join_on_new_connection(conn, process.pid));
    ASSERT_NE(members.back().member, proto::kNoMember);
    const std::uint64_t seq = conn - 10;  // each holds a claim its stream may still be filling
    c.b.slot(static_cast<std::uint32_t>(seq)).state = proto::pack_state(seq, Phase::Writing, members.back().member);
  }
  c.broker.registry.drop_connection(10);
  c.broker.registry.drop_connection(11);
  const std::uint64_t before = c.broker.registry.exit_looks();
  c.broker.tick();
  EXPECT_EQ(c.broker.registry.exit_looks() - before, 1U) << "polls of one process in one pass";
  for (const auto& m : members) EXPECT_EQ(c.b.h().members[m.member].token, m.token) << "repaired while it runs";
  process.kill();
  c.broker.tick();
  for (const auto& m : members) EXPECT_EQ(c.b.h().members[m.member].token, 0U) << "not repaired once it exited";
}
// A pool member that left owing a free waits in the broker for it (or its exit). Rejoined by its own process, it is
// that connection's member again and waits no more (Leave and Rejoin in a loop added a wait each time); another
// process cannot take it.
TEST(BrokerLeave, APoolMemberThatLeftOwingAFreeComesBackOnlyToItsOwnProcess) {
  LiveChild holder_process;
  PoolOverABroker p(holder_process.pid);
  ASSERT_NE(p.member, proto::kNoMember);
  const shm::BlockLocation loc = p.owe_a_free_and_leave_locally();
  const proto::Leave leave{p.id, p.member, p.token};
  const proto::Rejoin rejoin{p.id, p.member, p.token, static_cast<std::uint8_t>(proto::Role::Holder)};
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(std::holds_alternative<proto::OkReply>(p.broker.ask(1, holder_process.pid, leave).body)) << round;
    const auto stolen = p.broker.ask(2, ::getpid(), rejoin);  // connection 2 holds the pool read-write too
    const auto* e = std::get_if<proto::ErrorReply>(&stolen.body);
    ASSERT_NE(e, nullptr) << "another process took the entry";
    EXPECT_NE(e->message.find("another process's"), std::string::npos) << e->message;
    ASSERT_TRUE(std::holds_alternative<proto::OkReply>(p.broker.ask(1, holder_process.pid, rejoin).body)) << round;
    const auto twice = p.broker.ask(1, holder_process.pid, rejoin);
    ASSERT_TRUE(std::holds_alternative<proto::ErrorReply>(twice.body)) << "rejoined twice";
  }
  // Joined again, it no longer waits for the free: its landing does not remove the member.
  proto::atomic(p.block.record(loc.record).released).store(loc.generation);
  p.broker.tick();
  EXPECT_EQ(p.block.header().members[p.member].token, p.token) << "removed though it rejoined";
  // Its connection's close repairs it as any member's.
  p.broker.registry.drop_connection(1);
  holder_process.kill();
  p.broker.tick();
  EXPECT_EQ(p.block.header().members[p.member].token, 0U);
}

// A dead consumer's stream a round or more behind in a slot whose later rounds other members published and
// released since: its writes are still made (the slot's last releaser is someone else).
TEST(RepairChannel, AStreamRoundsBehindIsWrittenFor) {
  ChannelBlock b(2);
  b.member(0, 100, proto::Role::Producer);
  b.member(1, 300, proto::Role::Consumer);
  b.member(2, 301, proto::Role::Consumer);
  // Slot 1: message 1 released by consumer 1 (stream pending), message 3 by consumer 2 (stream pending too).
  b.slot(1).state = proto::pack_state(5, Phase::Free, proto::kNoMember);
  b.slot(1).release_mark = 4;
  b.slot(1).filled = 2;  // message 1 written; message 3's producer stream waits for message 1's `freed`
  b.owe(1, 1, true);
  b.owe(2, 3, true);
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 300), 1);
  EXPECT_EQ(b.slot(1).freed, 2U);  // the producer's stream can go on
}

TEST(RepairChannel, LastConsumerDeadTellsProducersAndOthersAreUntouched) {
  ChannelBlock b(2);
  b.member(0, 100, proto::Role::Producer);
  b.member(5, 300, proto::Role::Consumer);
  b.slot(0).state = proto::pack_state(0, Phase::Writing, 0);  // the live producer's
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 999), 0);   // nobody with that token
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 300), 1);
  EXPECT_EQ(b.h().consumers_gone, static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  EXPECT_EQ(b.slot(0).state, proto::pack_state(0, Phase::Writing, 0));
}

TEST(RepairChannel, MalformedBlocksAreIgnored) {
  ChannelBlock b(4);
  b.member(0, 100, proto::Role::Producer);
  b.h().slots = 1000000;  // claims more slots than the block holds
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 100), 0);
  b.h().slots = 4;
  b.h().magic = 0;
  EXPECT_EQ(repair_channel(b.mem.data(), b.bytes, 100), 0);
  EXPECT_EQ(repair_channel(b.mem.data(), 16, 100), 0);
}

TEST(RepairSemaphore, PoisonsOnlyWhenTheLastSignallerGoes) {
  proto::SemaphoreBlock s{};
  s.magic = proto::kSemaphoreMagic;
  s.version = proto::kSemaphoreVersion;
  s.value = 7;
  s.members[0] = {100, static_cast<std::uint32_t>(proto::Role::Signaller)};
  s.members[1] = {200, static_cast<std::uint32_t>(proto::Role::Signaller)};
  s.signallers = 2;
  s.signallers_seen = 1;
  EXPECT_EQ(repair_semaphore(&s, sizeof s, 100), 1);
  EXPECT_EQ(s.value, 7U);
  EXPECT_EQ(repair_semaphore(&s, sizeof s, 200), 1);
  EXPECT_EQ(s.value, proto::kPoisonBit | 7U);
  EXPECT_EQ(s.poison_reason, static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  EXPECT_EQ(s.wake_seq, 1U);
  // Every value below 2^62 counts as reached for a cyclic 64-bit GEQ wait.
  for (std::uint64_t v : {std::uint64_t{0}, std::uint64_t{8}, std::uint64_t{1} << 40, proto::kMaxValue}) {
    EXPECT_GE(static_cast<std::int64_t>(s.value - v), 0) << v;
  }
}

// A signaller that wrote a value with the top bit set and died: poisoning or'ed the poison bit into it, and the word
// stayed cyclically below every value, so the streams waiting on it (a reader of another uid among them) stayed
// blocked for good. Before that, the host raise took the garbage for a value already reached and did nothing.
TEST(RepairSemaphore, PoisonReleasesEveryStreamWaitWhateverTheDeadSignallerWrote) {
  for (const std::uint64_t garbage :
       {std::uint64_t{0xBFFF'FFFF'FFFF'FFFF}, std::uint64_t{1} << 63, ~std::uint64_t{0}}) {
    proto::SemaphoreBlock s{};
    s.magic = proto::kSemaphoreMagic;
    s.version = proto::kSemaphoreVersion;
    s.members[0] = {100, static_cast<std::uint32_t>(proto::Role::Signaller)};
    s.signallers = 1;
    s.signallers_seen = 1;
    s.value = garbage;
    if ((garbage & proto::kPoisonBit) == 0) {  // (with the poison bit it reads as poisoned, as any such write does)
      EXPECT_EQ(shm::semaphore_raise(s, 5), proto::PoisonReason::None);  // an honest signal replaces it
      EXPECT_EQ(s.value, 5U);
    }
    s.value = garbage;
    EXPECT_EQ(repair_semaphore(&s, sizeof s, 100), 1);
    EXPECT_EQ(s.value & proto::kPoisonBit, proto::kPoisonBit);
    for (std::uint64_t v : {std::uint64_t{0}, std::uint64_t{8}, std::uint64_t{1} << 40, proto::kMaxValue}) {
      EXPECT_GE(static_cast<std::int64_t>(s.value - v), 0) << std::hex << garbage << " waiting for " << v;
    }
  }
}

TEST(RepairChannel, OnlyTheJoinedTokenCountsAndCountsNeverWrap) {
  ChannelBlock b(4);
  b.member(3, 42, proto::Role::Producer);
  ControlBlock cb{b.mem.data(), b.bytes, proto::kFlagChannel, {}};
  ASSERT_EQ(check_control(cb), "");
  // A free entry (token 0) and a wrong token are nobody's to remove: a Hello with pid 0 or a forged pid once
  // drove `producers` to 4294967294 this way.
  EXPECT_FALSE(remove_member(cb, Joined{0, 0, proto::Role::Producer}));
  EXPECT_FALSE(remove_member(cb, Joined{3, 41, proto::Role::Producer}));
  EXPECT_EQ(b.h().producers, 1U);
  b.h().producers = 0;  // another member scribbled over the count
  EXPECT_TRUE(remove_member(cb, Joined{3, 42, proto::Role::Producer}));
  EXPECT_EQ(b.h().producers, 0U);
  EXPECT_FALSE(remove_member(cb, Joined{3, 42, proto::Role::Producer}));  // once only
}

TEST(RepairChannel, UsesTheGeometryReadAtCreateNotWhatMembersWriteLater) {
  ChannelBlock b(4);
  b.member(0, 7, proto::Role::Consumer);
  proto::Slot& held = b.slot(2);
  held.state = proto::pack_state(2, Phase::Reading, 0);
  ControlBlock cb{b.mem.data(), b.bytes, proto::kFlagChannel, {}};
  ASSERT_EQ(check_control(cb), "");
  // A member rewrites the geometry between the broker's reads: once it crashed gpuipcd. The broker's copy holds.
  b.h().slots = proto::kMaxSlots;
  b.h().record_bytes = 1U << 30;
  b.h().header_bytes = 0xFFFFFFFF;
  EXPECT_TRUE(remove_member(cb, Joined{0, 7, proto::Role::Consumer}));
  EXPECT_EQ(proto::state_phase(held.state), Phase::Published);  // handed back, found through the broker's copy
}

TEST(RepairChannel, CreateRefusesABlockNotFilledIn) {
  std::vector<std::uint64_t> mem(proto::channel_control_bytes(4, 16) / 8 + 1, 0);
  ControlBlock cb{mem.data(), mem.size() * 8, proto::kFlagChannel, {}};
  EXPECT_NE(check_control(cb).find("fill it in before Create"), std::string::npos);
}

TEST(Permissions, SupplementaryGroupsCount) {
  os::Credentials c{1, 1001, 1001, {5, 1000}};
  EXPECT_EQ(permission_bits(c, 0640, 1000, 1000), 4U);
  c.groups = {5};
  EXPECT_EQ(permission_bits(c, 0640, 1000, 1000), 0U);
}

TEST(Permissions, LikeFilesOwnerGroupOtherAndRoot) {
  const std::uint16_t mode = 0640;
  EXPECT_EQ(permission_bits({1, 1000, 1000, {}}, mode, 1000, 1000), 6U);
  EXPECT_EQ(permission_bits({1, 1001, 1000, {}}, mode, 1000, 1000), 4U);
  EXPECT_EQ(permission_bits({1, 1001, 1001, {}}, mode, 1000, 1000), 0U);
  EXPECT_EQ(permission_bits({1, 0, 0, {}}, 0, 1000, 1000), 7U);
  // The owner's bits apply even when the group's are wider (as for files).
  EXPECT_EQ(permission_bits({1, 1000, 1000, {}}, 0060, 1000, 1000), 0U);
}

}  // namespace
}  // namespace gpuipc::broker
