// Kill storm (issue 16, point 5) on a host channel: 4 producer and 4 consumer processes while a supervisor SIGKILLs
// a random one every 50-200 ms and restarts it; exact accounting of every message (the supervisor and the
// accounting are in tests/support/kill_storm.hpp, shared with the device-channel storm of
// tests/gpu/test_kill_storm_device.cpp). GPUIPC_STORM_SECONDS sets the duration (default 20; `make soak` runs 600),
// GPUIPC_STORM_SEED the seed.
#include <gtest/gtest.h>

#include <cstring>

#include "gpuipc/channel.hpp"
#include "support/broker_env.hpp"
#include "support/kill_storm.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kPayload = 64;

std::uint8_t pattern(std::uint32_t producer, std::uint32_t index, std::size_t i) {
  return static_cast<std::uint8_t>(producer * 131 + index * 7 + i);
}

int producer_body(const storm::ProducerArgs& a) {
  auto ch = Channel::open(a.name, ChannelRole::Producer);
  a.rec->joined.store(1);
  std::uint64_t i = a.start;
  while (a.rec->stop.load() == 0 && i < storm::kCapacity) {
    SlotView s;
    const Status st = ch.acquire(nullptr, std::chrono::milliseconds(100), s);
    if (st == Status::Timeout) continue;
    GPUIPC_CHILD_CHECK(st == Status::Ok);
    a.rec->pending.store(i + 1);
    auto* p = static_cast<std::uint8_t*>(s.data);
    const auto index = static_cast<std::uint32_t>(i);
    for (std::size_t b = 0; b < kPayload; ++b) p[b] = pattern(a.slot, index, b);
    const storm::Header h{a.slot, index};
    GPUIPC_CHILD_CHECK(ch.publish(nullptr, std::as_bytes(std::span(&h, 1)), kPayload) == Status::Ok);
    a.rec->published.store(++i);
  }
  while (a.rec->stop.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // out of indices
  return 0;
}

int consumer_body(const storm::ConsumerArgs& a) {
  auto ch = Channel::open(a.name, ChannelRole::Consumer);
  a.rec->joined.store(1);
  for (;;) {
    MessageView m;
    const Status st = ch.receive(nullptr, std::chrono::milliseconds(100), m);
    if (st == Status::Closed) return 0;
    if (st == Status::Timeout) continue;
    GPUIPC_CHILD_CHECK(st == Status::Ok);
    GPUIPC_CHILD_CHECK(m.size == kPayload && m.header.size() == sizeof(storm::Header) && !m.incomplete());
    storm::Header h{};
    std::memcpy(&h, m.header.data(), sizeof h);
    GPUIPC_CHILD_CHECK(h.producer < storm::kProducers);
    const auto* p = static_cast<const std::uint8_t*>(m.data);
    for (std::size_t b = 0; b < kPayload; ++b) GPUIPC_CHILD_CHECK(p[b] == pattern(h.producer, h.index, b));
    const std::uint64_t id = storm::message_id(h.producer, h.index);
    a.rec->held.store(storm::held_word(id, false, 1));
    GPUIPC_CHILD_CHECK(ch.release(nullptr) == Status::Ok);
    a.rec->held.store(storm::held_word(id, false, 2));
    a.log->log(id, false);
    a.rec->held.store(storm::held_word(id, false, 3));
    a.rec->received.fetch_add(1);
  }
}

TEST(KillStorm, RandomSigkillsLoseNothingPublishedAndDuplicateNothing) {
  storm::run_kill_storm({
      .channel =
          {.slots = 16, .slot_bytes = kPayload, .header_bytes = sizeof(storm::Header), .kind = SegmentKind::Host},
      .producer = producer_body,
      .consumer = consumer_body,
  });
}

}  // namespace
}  // namespace gpuipc::test
