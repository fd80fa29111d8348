// A model check of the channel ring: two producers and two consumers on a two-slot host channel, driven by the
// real Channel code, with members "dying" at any step (the broker's repair, src/shm/channel_ring.cpp, run on
// their entry exactly as the broker runs it) and replacements joining. Thousands of random interleavings with
// fixed seeds; after every step the slot words are checked:
// - `freed` never goes backwards, only consumers move it (never a producer's acquire, publish, death or
//   give-back), and `release_mark` never passes `freed` (a producer waits only for a value that was written);
// - a Free slot never asks its producer to wait for a round later than the one before it;
// and at the end every published message has been received exactly once.
#include <gtest/gtest.h>

#include <cstring>
#include <tuple>

#include <map>
#include <optional>
#include <random>
#include <set>

#include "gpuipc/channel.hpp"
#include "gpuipc/segment.hpp"
#include "proto/shm.hpp"
#include "shm/channel_ring.hpp"
#include "support/broker_env.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();
constexpr std::uint32_t kSlots = 2;

struct Member {
  Channel channel;
  ChannelRole role;
  std::uint32_t index = proto::kNoMember;
  std::uint32_t token = 0;
  bool dead = false;
  std::optional<std::uint64_t> writing;  // message id in the acquired slot
};

class Model {
 public:
  explicit Model(unsigned seed) : m_rng(seed), m_name(unique_name("model")) {
    ChannelOptions o;
    o.kind = SegmentKind::Host;
    o.slots = kSlots;
    o.slot_bytes = 64;
    o.header_bytes = 8;
    Member creator;
    creator.role = ChannelRole::Producer;
    creator.channel = Channel::create(m_name, o, ChannelRole::Producer);
    m_view = Segment::open(m_name, {.access = Access::ReadWrite});  // it repairs, as the broker does
    m_geometry = *shm::ring_geometry(m_view.data(), m_view.size());
    std::tie(creator.index, creator.token) = *entries().begin();  // the only member so far
    m_members.push_back(std::move(creator));
    add(ChannelRole::Producer);
    add(ChannelRole::Consumer);
    add(ChannelRole::Consumer);
    m_last_freed.assign(kSlots, 0);
  }
  ~Model() {
    m_members.clear();
    Channel::unlink(m_name);
  }

  void step() {
    auto& m = m_members[m_rng() % m_members.size()];
    const unsigned what = m_rng() % 10;
    const std::vector<std::uint64_t> freed_before = freed_words();
    if (m.dead) {
      if (what < 3) revive(m);
    } else if (what == 0) {
      kill(m);
    } else if (m.role == ChannelRole::Producer) {
      produce(m);
    } else {
      consume(m);
    }
    // Only consumers write `freed` (their releases, or the repair writing what a dead one's release announced):
    // on a device channel a producer's host write could land before an earlier consumer stream write and be
    // undone by it.
    if (m.role == ChannelRole::Producer) {
      ASSERT_EQ(freed_words(), freed_before) << "a producer's acquire, publish, death or return moved `freed`";
    }
    check();
  }

  std::vector<std::uint64_t> freed_words() const {
    std::vector<std::uint64_t> out;
    for (std::uint64_t i = 0; i < m_geometry.slots; ++i) {
      out.push_back(proto::atomic(shm::ring_slot(m_view.data(), m_geometry, i).freed).load());
    }
    return out;
  }

  /// Revives every member, lets producers publish what they hold, and drains.
  void drain() {
    for (auto& m : m_members) {
      if (m.dead) revive(m);
    }
    for (auto& m : m_members) {
      if (m.role == ChannelRole::Producer && m.writing) produce(m);
    }
    for (int i = 0; i < 100; ++i) {
      for (auto& m : m_members) {
        if (m.role == ChannelRole::Consumer) consume(m);
      }
    }
    check();
  }

  const std::set<std::uint64_t>& published() const { return m_published; }
  const std::map<std::uint64_t, int>& received() const { return m_received; }

 private:
  proto::ChannelHeader& header() const { return *static_cast<proto::ChannelHeader*>(m_view.data()); }

  void add(ChannelRole role) {
    Member m;
    m.role = role;
    join(m);
    m_members.push_back(std::move(m));
  }

  /// Opens a handle for m.role and finds the member entry its Join claimed (the one entry that is new).
  void join(Member& m) {
    const auto before = entries();
    m.channel = Channel::open(m_name, m.role);
    for (const auto& e : entries()) {
      if (before.count(e) == 0) std::tie(m.index, m.token) = e;
    }
  }

  std::set<std::pair<std::uint32_t, std::uint32_t>> entries() const {
    std::set<std::pair<std::uint32_t, std::uint32_t>> out;
    for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
      const std::uint32_t t = proto::atomic(header().members[i].token).load();
      if (t != 0) out.emplace(i, t);
    }
    return out;
  }

  void produce(Member& m) {
    if (!m.writing) {
      SlotView slot;
      if (m.channel.acquire(nullptr, std::chrono::nanoseconds(0), slot) != Status::Ok) return;
      m.writing = m_next_id++;
      std::memcpy(slot.data, &*m.writing, sizeof(std::uint64_t));
      return;
    }
    const std::uint64_t id = *m.writing;
    std::byte header[8];
    std::memcpy(header, &id, sizeof id);
    ASSERT_EQ(m.channel.publish(nullptr, header, sizeof id), Status::Ok);
    m_published.insert(id);
    m.writing.reset();
  }

  void consume(Member& m) {
    MessageView msg;
    if (m.channel.receive(nullptr, std::chrono::nanoseconds(0), msg) != Status::Ok) return;
    std::uint64_t id = 0;
    std::uint64_t in_header = 0;
    std::memcpy(&id, msg.data, sizeof id);
    std::memcpy(&in_header, msg.header.data(), sizeof in_header);
    EXPECT_EQ(id, in_header) << "a slot's data and header disagree";
    ++m_received[id];
    ASSERT_EQ(m.channel.release(nullptr), Status::Ok);
  }

  void kill(Member& m) {
    const proto::Role role = m.role == ChannelRole::Producer ? proto::Role::Producer : proto::Role::Consumer;
    EXPECT_TRUE(shm::channel_remove_member(m_view.data(), m_geometry, m.index, m.token, role,
                                           proto::PoisonReason::PeerDied));
    m.dead = true;
    m.writing.reset();  // an acquired, unpublished message is abandoned with its producer
  }

  void revive(Member& m) {
    m.channel = Channel();  // the dead handle's clean leave finds its entry gone and does nothing
    join(m);
    m.dead = false;
  }

  void check() {
    const std::uint64_t n = m_geometry.slots;
    for (std::uint64_t i = 0; i < n; ++i) {
      auto& s = shm::ring_slot(m_view.data(), m_geometry, i);
      const std::uint64_t freed = proto::atomic(s.freed).load();
      const std::uint64_t mark = proto::atomic(s.release_mark).load();
      const std::uint64_t st = proto::atomic(s.state).load();
      ASSERT_GE(freed, m_last_freed[i]) << "freed went backwards in slot " << i;
      m_last_freed[i] = freed;
      ASSERT_LE(mark, freed) << "slot " << i << " asks for a release nobody wrote";
      if (proto::state_phase(st) == proto::Phase::Free && proto::state_seq(st) >= n) {
        ASSERT_LE(mark, proto::state_seq(st) - n + 1) << "slot " << i << " waits for a later round";
      }
    }
    ASSERT_LE(proto::atomic(header().producers).load(), 2U);
    ASSERT_LE(proto::atomic(header().consumers).load(), 2U);
  }

  std::mt19937 m_rng;
  std::string m_name;
  Segment m_view;
  shm::RingGeometry m_geometry;
  std::vector<Member> m_members;
  std::vector<std::uint64_t> m_last_freed;
  std::set<std::uint64_t> m_published;
  std::map<std::uint64_t, int> m_received;
  std::uint64_t m_next_id = 1;
};

TEST(ChannelModel, RandomInterleavingsWithDeathsKeepTheSlotWordsAndExactlyOnce) {
  std::uint64_t total = 0;
  for (unsigned seed = 1; seed <= 200; ++seed) {
    Model model(seed);
    for (int i = 0; i < 150; ++i) {
      ASSERT_NO_FATAL_FAILURE(model.step()) << "seed " << seed << " step " << i;
    }
    ASSERT_NO_FATAL_FAILURE(model.drain()) << "seed " << seed;
    for (auto id : model.published()) {
      auto it = model.received().find(id);
      ASSERT_TRUE(it != model.received().end()) << "seed " << seed << ": message " << id << " was lost";
      ASSERT_EQ(it->second, 1) << "seed " << seed << ": message " << id << " was received " << it->second << " times";
    }
    ASSERT_EQ(model.received().size(), model.published().size()) << "seed " << seed << ": a message nobody published";
    total += model.published().size();
  }
  EXPECT_GT(total, 1000U);
}

}  // namespace
}  // namespace gpuipc::test
