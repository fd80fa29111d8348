// The kill storm (issue 16, point 5), shared by the host-channel test (tests/integration/test_kill_storm.cpp) and
// the device-channel test (tests/gpu/test_kill_storm_device.cpp): 4 producer and 4 consumer processes on one channel
// while a supervisor SIGKILLs a random one every 50-200 ms and restarts it. At the end every published message was
// received exactly once, every claimed-but-unpublished message is accounted as abandoned, every survivor ended
// within `stop_within` of being told to stop, and the broker holds no more names, references or fds than before.
//
// The accounting is exact because each process says, in memory shared with the supervisor, where it is in its
// loop, and the supervisor settles each death before the next kill, from the channel's own counters:
// - a producer writes pending = i + 1 after acquire and before publish, published = i + 1 after publish. Dead
//   with pending > published, message i was either published or abandoned: the broker's repair counts it in
//   ChannelStats::abandoned (a delta of 1) exactly when it was not published.
// - a consumer writes held = (id, 1) after receive and before release, (id, 2) after release and before logging,
//   then logs the id (one atomic add on the message's delivery counter) and writes (id, 3). Dead in phase 1, the
//   message was either released (consumed: the supervisor logs it for the dead) or goes back to the queue: the
//   repair counts it in ChannelStats::redelivered (a delta of 1) exactly then. Dead in phase 2, it was released
//   and maybe logged: the supervisor logs it unless the counter already says so.
// Device channels add incomplete messages (docs/channels.md, "Peer death"): a producer killed after its publish
// but before its stream got there leaves the message in the queue, flagged. Such a message is delivered once like
// any other; a consumer logs it with the incomplete mark (its content is not checked), and at the end every
// incomplete message must be one whose producer died between publish and the end of its stream's work.
//
// The supervisor (the test process) never initialises CUDA, so it can keep forking: for device channels a child
// creates the channel and holds the supervisor's producer membership, and the supervisor reads the counters
// through a host mapping of the control block that it never registers with the GPU.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "gpuipc/channel.hpp"

namespace gpuipc::test::storm {

inline constexpr std::uint32_t kProducers = 4;
inline constexpr std::uint32_t kConsumers = 4;
/// Message indices per producer slot: a lazily touched shared mapping of one byte per message (about 700k messages
/// a second on 2 cores on a host channel: a 10-minute soak touches ~400 MiB of it).
inline constexpr std::uint64_t kCapacity = 1ULL << 30;

/// A message's inline header.
struct Header {
  std::uint32_t producer;  // producer slot (0..3): restarts continue its index sequence
  std::uint32_t index;
};

/// The id of message `index` of producer slot `producer` (the DeliveryLog's index; unique per message).
constexpr std::uint64_t message_id(std::uint32_t producer, std::uint64_t index) { return producer * kCapacity + index; }

/// A consumer's `held` word: message `id`, whether it was incomplete, and the phase (1: received, not yet
/// released; 2: released, maybe logged; 3: logged).
constexpr std::uint64_t held_word(std::uint64_t id, bool incomplete, std::uint64_t phase) {
  return id << 3 | (incomplete ? 4U : 0U) | phase;
}
constexpr std::uint64_t held_id(std::uint64_t held) { return held >> 3; }
constexpr bool held_incomplete(std::uint64_t held) { return (held & 4U) != 0; }
constexpr std::uint64_t held_phase(std::uint64_t held) { return held & 3U; }

/// What one child process (one of the 8 slots) tells the supervisor.
struct Record {
  std::atomic<std::uint32_t> joined;      // set once the channel is open
  std::atomic<std::uint32_t> stop;        // set by the supervisor at the end
  std::atomic<std::uint64_t> pending;     // producers: i + 1 after acquire of message i
  std::atomic<std::uint64_t> published;   // producers: i + 1 after publish of message i
  std::atomic<std::uint64_t> held;        // consumers: held_word(id, incomplete, phase)
  std::atomic<std::uint64_t> received;    // consumers: messages logged by this slot's processes
  std::atomic<std::uint64_t> incomplete;  // consumers: incomplete messages among them
};

/// One byte per message id, shared with the children: how many times it was received and released (logged), and
/// whether a consumer found it incomplete (bit 7).
class DeliveryLog {
 public:
  /// Maps kProducers * kCapacity bytes (MAP_NORESERVE: touched lazily). Throws std::runtime_error.
  DeliveryLog();
  ~DeliveryLog();
  DeliveryLog(const DeliveryLog&) = delete;
  DeliveryLog& operator=(const DeliveryLog&) = delete;

  /// Records one delivery of `id` (one atomic add, so a death leaves it logged or not).
  void log(std::uint64_t id, bool incomplete) const noexcept {
    cell(id).fetch_add(static_cast<std::uint8_t>(incomplete ? 0x81 : 0x01));
  }
  /// Deliveries of `id` logged so far.
  unsigned count(std::uint64_t id) const noexcept { return cell(id).load() & 0x7FU; }
  /// Whether a delivery of `id` was logged as incomplete.
  bool incomplete(std::uint64_t id) const noexcept { return (cell(id).load() & 0x80U) != 0; }

 private:
  std::atomic_ref<std::uint8_t> cell(std::uint64_t id) const noexcept {
    return std::atomic_ref<std::uint8_t>(m_bytes[id]);
  }
  std::uint8_t* m_bytes;
};

/// What a producer child gets: it opens channel `name` as a producer, sets rec->joined, then sends messages
/// index = start, start + 1, ... with Header{slot, index}, keeping rec->pending and rec->published as the file
/// comment says, until rec->stop; then it returns 0 (its Channel leaves cleanly).
struct ProducerArgs {
  std::string name;
  std::uint32_t slot;
  std::uint64_t start;
  Record* rec;
};

/// What a consumer child gets: it opens channel `name` as a consumer, sets rec->joined, then receives, checks,
/// releases and logs messages, keeping rec->held as the file comment says, until receive says Closed; then 0.
struct ConsumerArgs {
  std::string name;
  const DeliveryLog* log;
  Record* rec;
};

struct StormOptions {
  /// The channel: kind (Host or Device), slots, slot_bytes, header_bytes (at least sizeof(Header)), device.
  ChannelOptions channel;
  /// The bodies of the children (each runs in a fresh forked process; return 0, or 1 via GPUIPC_CHILD_CHECK).
  std::function<int(const ProducerArgs&)> producer;
  std::function<int(const ConsumerArgs&)> consumer;
  /// How long survivors have to end once told to stop (all of them together).
  std::chrono::milliseconds stop_within{10000};
};

/// GPUIPC_STORM_SECONDS (default 20).
std::chrono::seconds storm_duration();

/// Runs the storm for storm_duration() inside the calling gtest test: failures are the test's (gtest assertions);
/// a fatal one returns early, killing every child. GPUIPC_STORM_SEED=<n> replays a seed. Throws std::runtime_error
/// when a device channel's holder child does not create the channel within 60 s.
void run_kill_storm(const StormOptions& options);

}  // namespace gpuipc::test::storm
