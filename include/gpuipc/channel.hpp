// gpuipc::Channel: a named producer/consumer ring of fixed-size buffers — GPU memory (device) or host memory
// (host) — with an inline user header per message (shape, dtype, ...). Zero-copy and stream-ordered: a producer
// writes a slot with its own kernels and publishes it; a consumer's stream waits for the producer's stream, its
// kernels read the slot, and its release lets the producer's stream reuse the slot. No call waits for its own
// stream; a call watches a peer's GPU progress on the host at most its pacing time (set_pacing). Any number of
// producers and consumers; each message goes to exactly one consumer.
//
// Peer death: when the last producer is gone, consumers drain what was published, then get PeerDied (Closed when
// producers closed cleanly). When a consumer dies holding a message, the message goes back to the queue and
// another consumer receives it (ChannelStats::redelivered counts them). When the last consumer is gone, producers get
// PeerDied. No survivor's GPU stream waits on the dead: the broker writes the words it waits on.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/stream.hpp"

namespace gpuipc {

struct ChannelOptions {
  std::uint32_t slots = 4;             ///< buffers in flight at most (1 to 4096)
  std::size_t slot_bytes = 1 << 20;    ///< capacity of each buffer
  std::uint32_t header_bytes = 256;    ///< inline user header per message (0 to 4096)
  SegmentKind kind = SegmentKind::Device;  ///< Device: slots in GPU memory; Host: host memory and host-side waits
  int device = 0;                      ///< device kind: the GPU the slots live on
  unsigned mode = 0600;                ///< every member needs rw (all update the shared ring); consumers map the
                                       ///< slots themselves read-only
  /// The creator's handle: its pacing time (Channel::set_pacing); nullopt: GPUIPC_CHANNEL_PACING_US (200 us).
  std::optional<std::chrono::nanoseconds> pacing{};
  /// The creator's handle: how far it may run ahead while pacing (Channel::set_pacing_ahead); nullopt:
  /// GPUIPC_CHANNEL_PACING_AHEAD, else the whole ring without MPS, half the ring for 8 slots or more under MPS.
  std::optional<std::uint32_t> pacing_ahead{};
};

enum class ChannelRole : std::uint8_t { Producer, Consumer };

struct ChannelOpenOptions {
  std::chrono::milliseconds wait{0};  ///< wait this long for the channel to be created
  int device = -1;                    ///< device kind: the context that maps the slots (see OpenOptions::device)
  /// This handle's pacing time (Channel::set_pacing); nullopt: GPUIPC_CHANNEL_PACING_US (200 us).
  std::optional<std::chrono::nanoseconds> pacing{};
  /// This handle's lead while pacing (Channel::set_pacing_ahead); nullopt: GPUIPC_CHANNEL_PACING_AHEAD, else the
  /// whole ring without MPS, half the ring for 8 slots or more under MPS.
  std::optional<std::uint32_t> pacing_ahead{};
};

/// A slot a producer acquired: write up to `capacity` bytes at `data` (a device pointer for device channels).
struct SlotView {
  void* data = nullptr;
  std::uint64_t device_pointer = 0;
  std::size_t capacity = 0;
  std::uint64_t sequence = 0;  ///< the message's position in the channel (0, 1, 2, ...)
};

/// A message a consumer received. `data` and `header` stay valid until this consumer releases it.
struct MessageView {
  const void* data = nullptr;
  std::uint64_t device_pointer = 0;
  std::size_t size = 0;
  std::span<const std::byte> header;
  std::uint64_t sequence = 0;
  /// The producer died after publishing but before its stream finished writing: the data may be partial.
  /// Check after this consumer's stream has passed receive (e.g. after a synchronize) — see docs/channels.md. Also
  /// after the message was released (in stream order, its stream then still reading it), while the channel handle
  /// that received it is open.
  bool incomplete() const noexcept;
  const std::uint32_t* flags = nullptr;  ///< internal: the slot's incomplete mark, which incomplete() reads
};

/// Counters of a channel (for monitoring and tests).
struct ChannelStats {
  std::uint64_t head = 0;         ///< messages claimed by producers
  std::uint64_t tail = 0;         ///< messages claimed by consumers
  std::uint32_t producers = 0;    ///< live producers
  std::uint32_t consumers = 0;
  std::uint64_t redelivered = 0;  ///< messages handed to another consumer after theirs died
  std::uint64_t abandoned = 0;    ///< slots a dead producer had claimed but not published
  std::uint32_t free_slots = 0;   ///< slots not holding a message
  std::uint64_t published = 0;    ///< messages published, in total
  std::uint64_t published_bytes = 0;  ///< payload bytes published, in total
  std::uint32_t queued = 0;           ///< messages published and not received yet (the queue's depth)
  std::uint32_t slots = 0;            ///< the ring's size
  std::uint64_t slot_bytes = 0;       ///< capacity of each slot
};

class Channel {
 public:
  /// Creates channel `name` (two segments: `name`, the control block, and `name`.slots, the buffers) and joins it.
  /// Throws Error like Segment::create (InvalidArgument for bad sizes; names up to 122 characters).
  static Channel create(std::string_view name, const ChannelOptions& options, ChannelRole role);
  /// Joins channel `name` as a producer or consumer. Throws Error like Segment::open.
  static Channel open(std::string_view name, ChannelRole role, const ChannelOpenOptions& options = {});
  /// Removes both names; members keep working until they close.
  static void unlink(std::string_view name);
  /// The counters of channel `name` without joining it: maps its control block read-only (no GPU needed), reads
  /// its geometry once and bounds every access by it. Throws Error like Segment::open (read permission needed),
  /// InvalidArgument when `name` is not a channel of this version.
  static ChannelStats stat(std::string_view name);

  Channel() noexcept;
  Channel(Channel&&) noexcept;
  Channel& operator=(Channel&&) noexcept;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;
  /// Leaves: acquired slots are given up, received messages go back to the queue, and the last producer (or consumer)
  /// leaving tells the other side (Closed). In a forked child, a copy of its parent's handle leaves nothing: the entry,
  /// its slots and messages stay the parent's. A slot is given up at once, whatever its stream still has queued: a
  /// kernel still filling it can write over the slot's next message. Publish what you acquired first (an aborted array
  /// header, on the stream that fills it, for a message consumers should skip: docs/channels.md).
  ~Channel();

  // Producer. -----------------------------------------------------------------------------------------------
  /// Claims the next free slot, waiting on the host up to `timeout` while every slot is in flight (a negative
  /// timeout waits forever; zero returns WouldBlock at once). For device channels, work enqueued on `stream` after
  /// this waits until the consumer's stream has released the slot; on the host it also waits, within `timeout`,
  /// while this handle's stream is 64 or more messages behind its host (4 per slot over 16 slots: docs/channels.md,
  /// "Owed stream writes"). Returns Ok, Timeout, WouldBlock, PeerDied or Closed (no consumer left), InvalidState (not
  /// a producer; too many acquired; a handle a forked child got from its parent, whose entry it may not use: open
  /// the channel again in the child). No allocation, no exception.
  Status acquire(StreamHandle stream, std::chrono::nanoseconds timeout, SlotView& slot) noexcept;
  /// Publishes the oldest acquired slot with `bytes` of payload and `header` (at most header_bytes), in stream
  /// order: consumers' streams see the data once `stream` has reached this point.
  Status publish(StreamHandle stream, std::span<const std::byte> header, std::size_t bytes) noexcept;
  /// acquire + a copy of `bytes` from `source` into the slot + publish, in one call and in `stream` order.
  /// Device channels: cuMemcpyAsync on `stream` (source in device or host memory: unified addresses; a pageable
  /// host source may be reused when this returns); nothing waits for the GPU. Host channels: memcpy from host
  /// memory. `sequence` receives the message's position. Returns what acquire returns, InvalidState when `bytes`
  /// or `header` is too big or slots taken with acquire are unpublished, DriverError when the driver refuses the
  /// copy (the slot is given back; nothing is published).
  Status send(StreamHandle stream, const void* source, std::size_t bytes, std::span<const std::byte> header,
              std::chrono::nanoseconds timeout, std::uint64_t& sequence) noexcept;

  // Consumer. -----------------------------------------------------------------------------------------------
  /// Takes the next message, waiting on the host up to `timeout` for one to be published. For device channels,
  /// work enqueued on `stream` after this waits for the producer's stream; on the host it also waits while this
  /// handle's stream is as far behind as acquire says. Returns Ok, Timeout, WouldBlock, PeerDied or Closed (no
  /// producer left and nothing left to drain), InvalidState (not a consumer; too many held; a forked child's copy of
  /// its parent's handle, as for acquire).
  Status receive(StreamHandle stream, std::chrono::nanoseconds timeout, MessageView& message) noexcept;
  /// Releases the oldest received message in stream order: its slot is reused once `stream` has reached this.
  Status release(StreamHandle stream) noexcept;

  const std::string& name() const noexcept;
  ChannelRole role() const noexcept;
  SegmentKind kind() const noexcept;
  std::uint32_t slots() const noexcept;
  std::size_t slot_bytes() const noexcept;
  std::uint32_t header_bytes() const noexcept;
  /// The device ordinal whose context maps the slots (device channels), else -1.
  int device() const noexcept;

  /// Device channels: before acquire or receive enqueue a stream wait for the peer's stream, they watch the word
  /// that wait is for on the host, at most `pacing`; when the peer's stream gets there in that time, no stream wait
  /// is enqueued (each costs the stream 1 to 2 us of GPU time between kernels). That keeps a streaming pipeline of
  /// short kernels in step and costs a call at most `pacing` of host time when the peer's stream is further
  /// behind. Zero: only a look. The default is GPUIPC_CHANNEL_PACING_US (200 us). Per handle; not thread-safe
  /// against this handle's other calls.
  void set_pacing(std::chrono::nanoseconds pacing) noexcept;
  std::chrono::nanoseconds pacing() const noexcept;
  /// While pacing, a producer also watches for the release of the message `messages` back to reach the GPU, so
  /// it stays at most that far ahead of the consumers' streams (docs/channels.md#pacing). Clamped to 1..slots();
  /// slots() lets it fill the ring. The default is GPUIPC_CHANNEL_PACING_AHEAD, else slots() where the GPU's
  /// contexts time-slice (no MPS), else slots()/2 for rings of 8 or more. Per handle; not thread-safe against this
  /// handle's other calls.
  void set_pacing_ahead(std::uint32_t messages) noexcept;
  std::uint32_t pacing_ahead() const noexcept;
  ChannelStats stats() const noexcept;
  explicit operator bool() const noexcept { return m_impl != nullptr; }

  // What this handle holds (bindings read it here instead of keeping a copy). -----------------------------------
  /// How many slots this producer acquired and has not published, or messages this consumer received and has not
  /// released (0 for an empty handle).
  std::uint32_t held() const noexcept;
  /// The sequence of the `index`-th oldest of them (0: the one the next publish or release takes); 0 when
  /// `index` >= held().
  std::uint64_t held_sequence(std::uint32_t index) const noexcept;
  /// Consumer: whether message `sequence` may be partial (MessageView::incomplete), held or already released;
  /// false for a message not flagged (yet), or not published. nullopt for a producer or an empty handle. A
  /// released message's flag is kept until a later message in its slot is flagged (at least `slots` messages on).
  std::optional<bool> incomplete(std::uint64_t sequence) const noexcept;
  /// The buffers' segment (`name`.slots) as this member mapped it (read-only for consumers): a second handle on
  /// the same mapping, so views of slots can outlive this channel handle. Empty for an empty handle.
  Segment slots_segment() const noexcept;

  struct Impl;

 private:
  explicit Channel(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> m_impl;
};

}  // namespace gpuipc
