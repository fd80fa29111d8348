// Kill storm (issue 16, point 5) on a device channel: 4 producer and 4 consumer processes, each with its own CUDA
// context and stream, while a supervisor SIGKILLs a random one every 50-200 ms and restarts it; the same supervisor
// and exact accounting as the host-channel storm (tests/support/kill_storm.hpp). Kills land while stream work is
// in flight: a producer's fill kernel and its `filled` write, a consumer's stream wait, check kernel and `freed`
// write. A producer killed between its publish and its stream's `filled` write leaves the message flagged
// incomplete: delivered once like any other, its content not checked. Every other message is checked on the GPU.
// The test process stays CUDA-free: a child creates the channel and holds the supervisor's membership.
// GPUIPC_STORM_SECONDS sets the duration (default 20; `make soak` runs 600), GPUIPC_STORM_SEED the seed.
#include <gtest/gtest.h>

#include <cstring>

#include "cuda/stream_ops.hpp"
#include "gpuipc/channel.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/gpu_worker.hpp"
#include "support/kill_storm.hpp"
#include "support/support.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

/// 256 KiB a message: a fill kernel long enough that some kills land between publish and the `filled` write.
constexpr std::size_t kPayload = 256 << 10;
constexpr std::size_t kWords = kPayload / 4;

/// The pattern seed of a message: its id, unique per message.
std::uint64_t seed_of(const storm::Header& h) { return storm::message_id(h.producer, h.index); }

// The stream is synchronized after acquire (before `pending`) and after publish (before `published`), so the
// supervisor's accounting stays exact; kills still land while the stream works in between.
int producer_body(const storm::ProducerArgs& a) {
  Gpu g;
  auto ch = Channel::open(a.name, ChannelRole::Producer);
  a.rec->joined.store(1);
  std::uint64_t i = a.start;
  while (a.rec->stop.load() == 0 && i < storm::kCapacity) {
    SlotView s;
    const Status st = ch.acquire(g.stream.get(), std::chrono::milliseconds(100), s);
    if (st == Status::Timeout) continue;
    if (st == Status::PeerDied) {
      // Every consumer was killed before one restarted (a device consumer takes a few hundred ms to start):
      // nothing was claimed, and the next consumer to join clears it.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    GPUIPC_CHILD_CHECK(st == Status::Ok);
    g.stream.synchronize();  // past the stream wait for the slot's last release
    a.rec->pending.store(i + 1);
    const auto index = static_cast<std::uint32_t>(i);
    const storm::Header h{a.slot, index};
    g.k.fill_pattern(g.stream.get(), s.device_pointer, kWords, seed_of(h));
    GPUIPC_CHILD_CHECK(ch.publish(g.stream.get(), std::as_bytes(std::span(&h, 1)), kPayload) == Status::Ok);
    g.stream.synchronize();  // the slot is written and `filled` with it: this message can no longer be incomplete
    a.rec->published.store(++i);
  }
  while (a.rec->stop.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));  // out of indices
  return 0;
}

// Each message: receive, synchronize (past the wait for the producer's stream, so incomplete() is final), check
// on the GPU into one device counter, release, synchronize (the check has run, `freed` is written), read the
// counter (8 bytes), then the phases of `held` and the log.
int consumer_body(const storm::ConsumerArgs& a) {
  Gpu g;
  auto ch = Channel::open(a.name, ChannelRole::Consumer);
  auto mismatches = cuda::DeviceBuffer::allocate(sizeof(std::uint64_t));
  cuda::memset_d8(mismatches.get(), 0, sizeof(std::uint64_t));
  a.rec->joined.store(1);
  for (;;) {
    MessageView m;
    const Status st = ch.receive(g.stream.get(), std::chrono::milliseconds(100), m);
    if (st == Status::Closed) break;
    if (st == Status::Timeout) continue;
    GPUIPC_CHILD_CHECK(st == Status::Ok);
    GPUIPC_CHILD_CHECK(m.size == kPayload && m.header.size() == sizeof(storm::Header));
    storm::Header h{};
    std::memcpy(&h, m.header.data(), sizeof h);
    GPUIPC_CHILD_CHECK(h.producer < storm::kProducers);
    g.stream.synchronize();
    const bool incomplete = m.incomplete();
    if (!incomplete) g.k.verify_pattern(g.stream.get(), m.device_pointer, kWords, seed_of(h), mismatches.get());
    const std::uint64_t id = storm::message_id(h.producer, h.index);
    a.rec->held.store(storm::held_word(id, incomplete, 1));
    GPUIPC_CHILD_CHECK(ch.release(g.stream.get()) == Status::Ok);
    g.stream.synchronize();
    std::uint64_t bad = 0;
    cuda::copy_to_host(&bad, mismatches.get(), sizeof bad);
    GPUIPC_CHILD_CHECK(bad == 0);
    a.rec->held.store(storm::held_word(id, incomplete, 2));
    a.log->log(id, incomplete);
    a.rec->held.store(storm::held_word(id, incomplete, 3));
    a.rec->received.fetch_add(1);
    if (incomplete) a.rec->incomplete.fetch_add(1);
  }
  g.stream.synchronize();
  return 0;
}

TEST(KillStormDevice, RandomSigkillsLoseNothingPublishedAndDuplicateNothing) {
  GPUIPC_REQUIRE_GPU();
  storm::run_kill_storm({
      .channel = {.slots = 16,
                  .slot_bytes = kPayload,
                  .header_bytes = sizeof(storm::Header),
                  .kind = SegmentKind::Device,
                  .device = 0,
                  .mode = 0600},
      .producer = producer_body,
      .consumer = consumer_body,
      // Each survivor's exit tears down a CUDA context.
      .stop_within = std::chrono::milliseconds(20000),
  });
}

}  // namespace
}  // namespace gpuipc::test
