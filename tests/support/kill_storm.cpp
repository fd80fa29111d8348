#include "support/kill_storm.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <random>
#include <set>
#include <stdexcept>

#include "core/segment_internal.hpp"  // detail::open_segment
#include "cuda/context.hpp"
#include "gpuipc/segment.hpp"
#include "os/child.hpp"
#include "proto/shm.hpp"
#include "shm/channel_ring.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test::storm {

DeliveryLog::DeliveryLog() {
  constexpr std::size_t kBytes = kProducers * kCapacity;
  void* p = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap of the delivery log");
  m_bytes = static_cast<std::uint8_t*>(p);
}

DeliveryLog::~DeliveryLog() { ::munmap(m_bytes, kProducers * kCapacity); }

std::chrono::seconds storm_duration() {
  const char* s = std::getenv("GPUIPC_STORM_SECONDS");
  return std::chrono::seconds(s != nullptr && *s != '\0' ? std::strtoul(s, nullptr, 10) : 20);
}

namespace {

/// A forked child that dies with its parent (the storm's children and the holder must not outlive a killed test).
/// Returns 2 without running `body` when the parent is already gone.
pid_t start_tied_child(const std::function<int()>& body) {
  const pid_t parent = ::getpid();
  return start_child([&body, parent] { return os::tie_to_parent(parent) ? body() : 2; });
}

/// The supervisor's producer membership (it publishes nothing; it keeps the channel open for restarted producers
/// until every producer has stopped) and its view of the channel's counters. Host channels: a Channel of this
/// process. Device channels: creating or opening one initialises CUDA (the slots are device memory, the control
/// block host_pinned memory registered with the GPU), so a child creates it and holds the membership, and this
/// process maps the control block as plain host memory (never registered) to read the counters.
class Holder {
 public:
  Holder(const std::string& name, const ChannelOptions& options) {
    if (options.kind == SegmentKind::Host) {
      m_channel = Channel::create(name, options, ChannelRole::Producer);
      return;
    }
    State* state = m_state.get();
    m_child = start_tied_child([&name, &options, state] {
      cuda::PrimaryContext ctx(options.device);
      ctx.make_current();
      auto channel = Channel::create(name, options, ChannelRole::Producer);
      state->ready.store(1);
      while (state->stop.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return 0;  // `channel` leaves cleanly: the last producer, so consumers drain and get Closed
    });
    if (!wait_until([&] { return state->ready.load() != 0; }, 60s, 10ms)) {
      end_child(1s);
      throw std::runtime_error("the holder child did not create device channel '" + name + "' within 60 s");
    }
    m_control = detail::open_segment(name, {.access = Access::ReadOnly, .wait = {}, .device = -1}, false);
    if (!shm::ring_geometry(m_control.data(), m_control.size())) {
      end_child(1s);
      throw std::runtime_error("'" + name + "' is not a channel control block");
    }
  }
  ~Holder() { end_child(10s); }
  Holder(const Holder&) = delete;
  Holder& operator=(const Holder&) = delete;

  ChannelStats stats() const {
    if (m_channel) return m_channel.stats();
    ChannelStats st;
    auto& h = *static_cast<proto::ChannelHeader*>(m_control.data());
    st.head = proto::atomic(h.head).load();
    st.tail = proto::atomic(h.tail).load();
    st.producers = proto::atomic(h.producers).load();
    st.consumers = proto::atomic(h.consumers).load();
    st.redelivered = proto::atomic(h.redelivered).load();
    st.abandoned = proto::atomic(h.abandoned).load();
    return st;
  }

  /// Ends the membership: the supervisor leaves, as the last producer. stats() may not be called after this.
  void leave() {
    m_channel = Channel();
    m_control = Segment();
    if (m_child > 0) m_state[0].stop.store(1);
  }

  /// After leave(): waits for the holder child (device channels) and returns its exit code; 0 for host channels.
  int wait(std::chrono::milliseconds timeout) {
    if (m_child <= 0) return 0;
    const int code = wait_child(m_child, timeout);
    m_child = 0;
    return code;
  }

 private:
  struct State {
    std::atomic<std::uint32_t> ready;
    std::atomic<std::uint32_t> stop;
  };

  void end_child(std::chrono::milliseconds timeout) noexcept {
    if (m_child <= 0) return;
    m_state[0].stop.store(1);
    (void)wait_child(m_child, timeout);  // SIGKILLs it when the time runs out
    m_child = 0;
  }

  Channel m_channel;
  Shared<State> m_state;
  pid_t m_child = 0;
  Segment m_control;
};

}  // namespace

void run_kill_storm(const StormOptions& options) {
  const char* seed_text = std::getenv("GPUIPC_STORM_SEED");
  const std::uint64_t seed = seed_text != nullptr ? std::strtoull(seed_text, nullptr, 10) : std::random_device{}();
  const auto duration = storm_duration();
  SCOPED_TRACE("GPUIPC_STORM_SEED=" + std::to_string(seed) +
               " GPUIPC_STORM_SECONDS=" + std::to_string(duration.count()));
  std::mt19937_64 rng(seed);

  const auto name = unique_name("storm");
  const int fds_before = BrokerEnvironment::broker_fd_baseline();
  const std::uint64_t refs_before = BrokerEnvironment::broker_references();
  DeliveryLog log;
  Shared<Record> recs(kProducers + kConsumers);
  Holder holder(name, options.channel);
  std::array<std::uint64_t, kProducers> next_index{};  // where a restarted producer of each slot goes on
  std::array<pid_t, kProducers + kConsumers> pids{};
  struct KillLeftovers {  // on a failed assertion: no child outlives the test
    std::array<pid_t, kProducers + kConsumers>& pids;
    ~KillLeftovers() {
      for (pid_t& p : pids) {
        if (p > 0) {
          ::kill(p, SIGKILL);
          wait_child(p, 10s);
        }
      }
    }
  } leftovers{pids};
  auto start = [&](std::size_t k) {
    Record* rec = &recs[k];
    rec->joined.store(0);
    rec->pending.store(next_index[k % kProducers]);
    rec->published.store(next_index[k % kProducers]);
    rec->held.store(0);
    if (k < kProducers) {
      const ProducerArgs args{name, static_cast<std::uint32_t>(k), next_index[k], rec};
      pids[k] = start_tied_child([&, args] { return options.producer(args); });
    } else {
      const ConsumerArgs args{name, &log, rec};
      pids[k] = start_tied_child([&, args] { return options.consumer(args); });
    }
  };
  for (std::size_t k = 0; k < pids.size(); ++k) start(k);

  std::set<std::uint64_t> abandoned_ids;  // messages a dead producer claimed and never published
  std::set<std::uint64_t> in_flight_ids;  // messages a dead producer published before its stream got there (maybe)
  std::uint64_t kills = 0, abandoned_unnamed = 0, redelivered = 0, consumed_by_dead = 0;
  ChannelStats last = holder.stats();
  auto members_settled = [&] {
    std::uint32_t producers = 1, consumers = 0;
    for (std::size_t k = 0; k < pids.size(); ++k) {
      if (pids[k] > 0 && recs[k].joined.load() != 0) ++(k < kProducers ? producers : consumers);
    }
    const auto s = holder.stats();
    return s.producers == producers && s.consumers == consumers;
  };
  const auto end = std::chrono::steady_clock::now() + duration;
  while (std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 151));
    const std::size_t k = rng() % pids.size();
    if (recs[k].joined.load() == 0) continue;  // still starting: a member or not, its count is unknown
    ::kill(pids[k], SIGKILL);
    ASSERT_EQ(wait_child(pids[k], 10s), 128 + SIGKILL) << "slot " << k << " ended before the kill";
    pids[k] = 0;
    ++kills;
    // The broker's repair counts abandoned and redelivered messages before it removes the member.
    ASSERT_TRUE(wait_until(members_settled, 10s)) << "the broker did not remove the dead member of slot " << k;
    const ChannelStats now = holder.stats();
    const std::uint64_t d_abandoned = now.abandoned - last.abandoned;
    const std::uint64_t d_redelivered = now.redelivered - last.redelivered;
    last = now;
    const Record& r = recs[k];
    if (k < kProducers) {
      ASSERT_EQ(d_redelivered, 0U);
      ASSERT_LE(d_abandoned, 1U) << "a producer holds one claim at a time";
      const std::uint64_t pending = r.pending.load(), published = r.published.load();
      if (pending > published) {  // message `published` was acquired; published or abandoned, the delta says
        const std::uint64_t id = message_id(static_cast<std::uint32_t>(k), published);
        (d_abandoned == 1 ? abandoned_ids : in_flight_ids).insert(id);
      } else {
        abandoned_unnamed += d_abandoned;  // killed inside acquire, after the claim: no message index yet
      }
      next_index[k] = pending;
    } else {
      ASSERT_EQ(d_abandoned, 0U);
      ASSERT_LE(d_redelivered, 1U) << "a consumer holds one message at a time";
      redelivered += d_redelivered;
      const std::uint64_t held = r.held.load();
      const std::uint64_t id = held_id(held);
      if (held_phase(held) == 1 && d_redelivered == 0) {
        log.log(id, held_incomplete(held));  // released before it died: consumed, by the dead
        ++consumed_by_dead;
      } else if (held_phase(held) == 2) {
        ASSERT_EQ(d_redelivered, 0U) << "a released message came back";
        if (log.count(id) == 0) {
          log.log(id, held_incomplete(held));
          ++consumed_by_dead;
        }
      }
    }
    start(k);
  }

  // Stop: producers end (leaving cleanly), then the supervisor leaves; consumers drain and get Closed.
  const auto told = std::chrono::steady_clock::now();
  for (std::size_t k = 0; k < pids.size(); ++k) recs[k].stop.store(1);
  auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(told + options.stop_within -
                                                                          std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(1));
  };
  for (std::size_t k = 0; k < kProducers; ++k) {
    EXPECT_EQ(wait_child(pids[k], left()), 0) << "producer " << k;
    pids[k] = 0;
    next_index[k] = recs[k].published.load();
  }
  holder.leave();
  for (std::size_t k = kProducers; k < pids.size(); ++k) {
    EXPECT_EQ(wait_child(pids[k], left()), 0) << "consumer " << k;
    pids[k] = 0;
  }
  EXPECT_EQ(holder.wait(left()), 0) << "the holder child";

  // Every message: delivered once, or abandoned and never delivered. Nothing past the last published index. Only
  // a message whose producer died between publish and the end of its stream's work may be incomplete.
  std::uint64_t published = 0, wrong = 0, shown = 0, incomplete = 0;
  for (std::uint32_t p = 0; p < kProducers; ++p) {
    for (std::uint64_t i = 0; i < next_index[p] + 64 && i < kCapacity; ++i) {
      const std::uint64_t id = message_id(p, i);
      const bool expected = i < next_index[p] && abandoned_ids.count(id) == 0;
      published += expected ? 1 : 0;
      const unsigned got = log.count(id);
      if (got != (expected ? 1U : 0U)) {
        ++wrong;
        if (shown++ < 10) ADD_FAILURE() << "message " << p << "/" << i << " delivered " << got << " times";
      }
      if (log.incomplete(id)) {
        ++incomplete;
        if (in_flight_ids.count(id) == 0) {
          ++wrong;
          if (shown++ < 10) {
            ADD_FAILURE() << "message " << p << "/" << i << " was flagged incomplete, but its producer's stream "
                          << "had passed the publish point";
          }
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0U);
  const auto stats_abandoned = last.abandoned;
  EXPECT_EQ(abandoned_ids.size() + abandoned_unnamed, stats_abandoned);
  std::cout << "storm (" << gpuipc::to_string(options.channel.kind) << " channel): " << duration.count() << " s, seed "
            << seed << ", " << kills << " kills, " << published << " messages published and received once ("
            << incomplete << " of them incomplete), " << abandoned_ids.size() + abandoned_unnamed << " abandoned, "
            << redelivered << " redelivered, " << consumed_by_dead
            << " released by a consumer that died before logging\n";
  EXPECT_GT(kills, 0U);
  EXPECT_GT(published, 0U);

  Channel::unlink(name);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == refs_before; }, 5s))
      << BrokerEnvironment::broker_references() << " references, " << refs_before << " before";
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds_before; }, 5s))
      << BrokerEnvironment::broker_fd_count() << " broker fds, " << fds_before << " before";
  for (const auto& s : Segment::list()) EXPECT_EQ(s.name.find(name), std::string::npos) << s.name << " is left";
}

}  // namespace gpuipc::test::storm
