#include "gpuipc/channel.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "base/config.hpp"
#include "core/membership.hpp"
#include "core/segment_internal.hpp"
#include "core/shm_wait.hpp"
#include "cuda/context.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/trace.hpp"
#include "os/identity.hpp"
#include "proto/messages.hpp"
#include "shm/channel_ring.hpp"

namespace gpuipc {

using proto::atomic;
using proto::Phase;

namespace {

/// GPUIPC_CHANNEL_PACING_US when unset (docs/env/GPUIPC_CHANNEL_PACING_US.md says why this value).
constexpr std::uint64_t kDefaultPacingUs = 200;
/// How many messages pacing lets a producer run ahead of the consumers' streams by default, for a ring of n
/// (GPUIPC_CHANNEL_PACING_AHEAD overrides it).
constexpr std::uint64_t default_ahead(std::uint64_t n) noexcept { return n >= 8 ? n / 2 : n; }

/// Stream writes this process owes: publish and release make a message (or a free slot) visible on the host first
/// and enqueue the stream write of `filled` (or `freed`) after, which keeps that driver call off the handoff's
/// critical path. A peer that sees the host-visible state at once may enqueue its stream wait for the word before
/// the write is enqueued. Across processes that is harmless; within one process it deadlocks the GPU when the wait
/// and the write land on streams that are ordered with each other: one stream shared by two threads (the legacy
/// default stream of the examples' `nullptr`), or the legacy stream and a blocking stream. The write would then
/// queue behind the wait it is meant to release, and no timeout reaches a stream wait. So a call about to enqueue a
/// stream wait first lets every publish or release of this process that is between its two steps finish them.
/// Every wait then comes after, in this process's enqueue order, every write it can depend on, directly or through
/// other processes (the chain of host-visible states that let it claim the word carries the count's increment),
/// and implicit stream order only ever points from a later enqueue to an earlier one: no cycle. The window is one
/// driver call (~0.7 us, bench/results/channels-*.json memop_write_enqueue_us); a process with no such window open
/// pays one atomic load.
std::atomic<std::uint32_t> g_owed_stream_writes{0};  // NOLINT: process-wide by nature

/// Held from before the host-visible store until the stream write is enqueued (or given up).
class OwedStreamWrite {
 public:
  explicit OwedStreamWrite(bool gpu) noexcept : m_gpu(gpu) {
    if (m_gpu) g_owed_stream_writes.fetch_add(1, std::memory_order_seq_cst);
  }
  ~OwedStreamWrite() {
    if (m_gpu) g_owed_stream_writes.fetch_sub(1, std::memory_order_release);
  }
  OwedStreamWrite(const OwedStreamWrite&) = delete;
  OwedStreamWrite& operator=(const OwedStreamWrite&) = delete;

 private:
  bool m_gpu;
};

/// Before a stream wait is enqueued: every owed write of this process is enqueued. Each window is one driver call,
/// so this spins briefly, then yields (threads publishing back to back can keep the count up for a while).
void settle_owed_stream_writes() noexcept {
  for (unsigned i = 1; g_owed_stream_writes.load(std::memory_order_acquire) != 0; ++i) {
    if (i < 4096) {
      core::cpu_relax();
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace

bool MessageView::incomplete() const noexcept {
  return flags != nullptr && (atomic(const_cast<std::uint32_t&>(*flags)).load() & proto::kSlotIncomplete) != 0;
}

struct Channel::Impl {
  // Declared in acquisition order: the segments outlive everything that points into them.
  Segment control;
  Segment data;
  proto::ChannelHeader* h = nullptr;
  std::byte* records = nullptr;
  std::uint64_t control_device = 0;  // GPU address of the control block (device channels)
  std::uint64_t n = 0;
  std::uint32_t record_bytes = 0;
  std::uint64_t slot_bytes = 0;
  shm::RingGeometry geometry;  // read once at attach: other members can rewrite the header's words
  cuda::PrimaryContext ctx;  // device channels: made current for stream operations on threads that have none
  ChannelRole role = ChannelRole::Producer;
  SegmentKind kind = SegmentKind::Host;
  std::uint32_t member = proto::kNoMember;
  std::uint32_t token = 0;  // the broker's token in our member entry
  // Sequences this member holds (acquired, or received), oldest first: a ring of capacity n.
  std::vector<std::uint64_t> held;
  std::size_t held_first = 0;
  std::size_t held_count = 0;
  // Device channels: how long acquire and receive watch a word on the host before they enqueue a stream wait.
  std::chrono::nanoseconds pacing{0};
  // How many messages a pacing producer may run ahead of the consumers' streams (n: the whole ring).
  std::uint64_t ahead = 0;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() { leave(); }

  proto::Slot& slot(std::uint64_t seq) const noexcept {
    return *reinterpret_cast<proto::Slot*>(records + (seq % n) * record_bytes);  // NOLINT: layout of shm.hpp
  }
  std::byte* header_of(std::uint64_t seq) const noexcept {
    return records + (seq % n) * record_bytes + sizeof(proto::Slot);
  }
  CUdeviceptr word_device(std::uint64_t seq, std::size_t offset) const noexcept {
    return control_device + sizeof(proto::ChannelHeader) + (seq % n) * record_bytes + offset;
  }
  std::uint64_t data_offset(std::uint64_t seq) const noexcept { return (seq % n) * slot_bytes; }
  bool gpu() const noexcept { return kind == SegmentKind::Device; }

  /// Whether the word (bit 62, a poison mark, ignored) has reached `value`, or reaches it within `pacing` watched
  /// on the host when `pace()` says to: then the peer's stream is past the point a stream wait would wait for, and
  /// none is needed.
  template <typename Pace>
  bool reached(const std::uint64_t& word, std::uint64_t value, Pace&& pace) const noexcept {
    auto w = atomic(const_cast<std::uint64_t&>(word));
    if ((w.load(std::memory_order_acquire) & proto::kMaxValue) >= value) return true;
    if (!pace()) return false;
    const auto deadline = std::chrono::steady_clock::now() + pacing;
    for (unsigned i = 1;; ++i) {
      core::cpu_relax();
      if ((w.load(std::memory_order_acquire) & proto::kMaxValue) >= value) return true;
      if (i % 32 == 0 && std::chrono::steady_clock::now() >= deadline) return false;
    }
  }

  /// Whether to watch a word on the host before enqueueing a stream wait on `stream`: only while `stream` still
  /// has work queued. Then the stream is busy anyway and the wait on the host costs it nothing, while a stream
  /// wait would cost it GPU time between its kernels. On an idle stream a stream wait costs nothing and the call
  /// returns at once (a handoff between idle GPUs stays a host round trip).
  bool pace(CUstream stream) const noexcept { return pacing.count() > 0 && cuda::stream_busy(stream); }

  /// pace(stream), asked at most once (a driver call) and only when first needed.
  auto pace_once(StreamHandle stream) const noexcept {
    return [this, stream, known = -1]() mutable {
      if (known < 0) known = pace(static_cast<CUstream>(stream)) ? 1 : 0;
      return known == 1;
    };
  }

  /// The word at `offset` of slot `seq`'s record reaches `value` once `stream`'s work so far is done.
  CUresult write_after(StreamHandle stream, std::uint64_t seq, std::size_t offset, std::uint64_t value) noexcept {
    return cuda::stream_write_value64(static_cast<CUstream>(stream), word_device(seq, offset), value);
  }
  /// `stream`'s work after this waits until the word at `offset` of slot `seq`'s record reaches `value`.
  /// (After any stream write this process owes: see g_owed_stream_writes.)
  CUresult wait_before(StreamHandle stream, std::uint64_t seq, std::size_t offset, std::uint64_t value) noexcept {
    settle_owed_stream_writes();
    return cuda::stream_wait_value64(static_cast<CUstream>(stream), word_device(seq, offset), value);
  }

  void push_held(std::uint64_t seq) noexcept {
    held[(held_first + held_count) % held.size()] = seq;
    ++held_count;
  }
  std::uint64_t front_held() const noexcept { return held[held_first]; }
  void pop_held() noexcept {
    held_first = (held_first + 1) % held.size();
    --held_count;
  }

  void join() {
    const auto m = core::join_member(control, role == ChannelRole::Producer ? proto::Role::Producer
                                                                           : proto::Role::Consumer);
    member = m.index;
    token = m.token;
  }

  /// Whether this member's stream has written every `filled` (its publications) and `freed` (its releases) word
  /// it was asked to: until then, leaving would let the process exit with those writes still queued, and a
  /// survivor's stream would wait for them forever.
  bool own_stream_writes_done() const noexcept {
    for (std::uint64_t i = 0; i < n; ++i) {
      auto& sl = slot(i);
      const std::uint64_t st = atomic(sl.state).load(std::memory_order_acquire);
      const std::uint64_t seq = proto::state_seq(st);
      const Phase phase = proto::state_phase(st);
      if (atomic(sl.publisher).load() == member) {
        const bool current = phase == Phase::Published || phase == Phase::Reading;
        const std::uint64_t published = current ? seq : seq - n;  // a later round holds the slot now
        if ((current || seq >= n) && (atomic(sl.filled).load() & proto::kMaxValue) < published + 1) return false;
      }
      if (atomic(sl.releaser).load() == member &&
          (atomic(sl.freed).load() & proto::kMaxValue) < atomic(sl.release_mark).load()) {
        return false;
      }
    }
    return true;
  }

  /// Clean leave: give up acquired slots, hand back received messages, tell the other side if we were the last.
  /// The same transition as the broker's repair of a dead member (src/shm/channel_ring.cpp), with reason Closed.
  void leave() noexcept {
    if (member == proto::kNoMember || h == nullptr) return;
    if (gpu()) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!own_stream_writes_done() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    const proto::Role r = role == ChannelRole::Producer ? proto::Role::Producer : proto::Role::Consumer;
    shm::channel_remove_member(h, geometry, member, token, r, proto::PoisonReason::Closed);
    held_count = 0;
    core::forget_member(core::Membership{member, token});
    member = proto::kNoMember;
    token = 0;
  }

  /// Gives back the newest acquired slot unpublished (its sequence is skipped, like an abandoned one). Nothing
  /// is written to `freed`: the slot's next producer waits for the last consumer's release (release_mark),
  /// which an abandoned round does not move.
  void give_back_front() noexcept {
    const std::uint64_t seq = held[(held_first + held_count - 1) % held.size()];
    --held_count;
    abandon(seq);
  }

  /// Frees claimed slot `seq` for the next round without a message.
  void abandon(std::uint64_t seq) noexcept {
    atomic(slot(seq).state).store(proto::pack_state(seq + n, Phase::Free, proto::kNoMember), std::memory_order_release);
    atomic(h->abandoned).fetch_add(1);
    core::bump_and_wake(h->released_seq, &h->released_sleepers);
  }

  /// The `freed` value the producer of `seq` waits for: the last consumer release of its slot (0: none).
  std::uint64_t free_mark(std::uint64_t seq) const noexcept {
    return atomic(slot(seq).release_mark).load(std::memory_order_acquire) & proto::kMaxValue;
  }

  /// Moves a ring index from `from` to `from + 1` unless someone already did. (Not compare_exchange on `from`
  /// itself: a failed exchange overwrites its expected value, and callers still need `from`.)
  static void advance(std::atomic_ref<std::uint64_t> index, std::uint64_t from) noexcept {
    std::uint64_t expected = from;
    index.compare_exchange_strong(expected, from + 1, std::memory_order_acq_rel);
  }

  static Status gone_status(std::uint32_t reason) noexcept {
    return reason == static_cast<std::uint32_t>(proto::PoisonReason::Closed) ? Status::Closed : Status::PeerDied;
  }

  /// One attempt to claim the next free slot. Returns true when done (claimed, or `status` says why not).
  bool try_acquire(std::uint64_t& claimed, Status& status) noexcept {
    for (;;) {
      if (atomic(h->consumers).load() == 0) {
        if (const auto gone = atomic(h->consumers_gone).load(); gone != 0) {
          status = gone_status(gone);
          return true;
        }
      }
      auto head = atomic(h->head);
      std::uint64_t pos = head.load(std::memory_order_acquire);
      auto st = atomic(slot(pos).state);
      std::uint64_t s = st.load(std::memory_order_acquire);
      const std::uint64_t seq = proto::state_seq(s);
      if (seq == pos && proto::state_phase(s) == Phase::Free) {
        if (st.compare_exchange_strong(s, proto::pack_state(pos, Phase::Writing, member), std::memory_order_acq_rel)) {
          advance(head, pos);
          claimed = pos;
          status = Status::Ok;
          return true;
        }
        continue;
      }
      if (seq >= pos) {  // claimed by another producer (or abandoned) but head not moved yet: help it along
        advance(head, pos);
        continue;
      }
      return false;  // the slot still holds message pos - n: every slot is in flight
    }
  }

  /// One attempt to take the next message.
  bool try_receive(std::uint64_t& claimed, Status& status) noexcept {
    if (const std::uint32_t orphans = atomic(h->orphans).load(std::memory_order_acquire); orphans > 0) {
      // Messages a dead (or leaving) consumer held: behind the tail, back in the Published phase.
      const std::uint64_t tail = atomic(h->tail).load(std::memory_order_acquire);
      for (std::uint64_t i = 0; i < n; ++i) {
        auto st = atomic(slot(i).state);
        std::uint64_t s = st.load(std::memory_order_acquire);
        if (proto::state_phase(s) != Phase::Published || proto::state_seq(s) >= tail) continue;
        const std::uint64_t seq = proto::state_seq(s);
        if (st.compare_exchange_strong(s, proto::pack_state(seq, Phase::Reading, member), std::memory_order_acq_rel)) {
          atomic(h->orphans).fetch_sub(1);
          claimed = seq;
          status = Status::Ok;
          return true;
        }
      }
      std::uint32_t seen = orphans;
      atomic(h->orphans).compare_exchange_strong(seen, 0U);  // all taken already
    }
    for (;;) {
      auto tail = atomic(h->tail);
      std::uint64_t pos = tail.load(std::memory_order_acquire);
      auto st = atomic(slot(pos).state);
      std::uint64_t s = st.load(std::memory_order_acquire);
      const std::uint64_t seq = proto::state_seq(s);
      const Phase phase = proto::state_phase(s);
      if (seq == pos && phase == Phase::Published) {
        if (st.compare_exchange_strong(s, proto::pack_state(pos, Phase::Reading, member), std::memory_order_acq_rel)) {
          advance(tail, pos);
          claimed = pos;
          status = Status::Ok;
          return true;
        }
        continue;
      }
      if (seq > pos || (seq == pos && phase == Phase::Reading)) {
        // Taken by another consumer, or abandoned by a dead producer: move the tail past it.
        advance(tail, pos);
        continue;
      }
      if (atomic(h->producers).load() == 0) {
        if (const auto gone = atomic(h->producers_gone).load(); gone != 0) {
          status = gone_status(gone);
          return true;
        }
      }
      return false;
    }
  }
};

namespace {

std::string slots_name(std::string_view name) { return std::string(name) + ".slots"; }

/// Unlinks `name`.slots when it is a leftover of a killed create: no channel `name`, the caller owns it, and
/// nobody holds it. Returns whether it did.
bool reclaim_orphan_buffers(std::string_view name) {
  try {
    (void)Segment::stat(name);
    return false;  // the channel exists: the buffers are its
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) return false;
  }
  const SegmentInfo info = Segment::stat(slots_name(name));
  if (info.references != 0 || info.owner_uid != os::current_uid()) return false;
  Segment::unlink(slots_name(name));
  return true;
}


void check_channel_name(std::string_view name) {
  if (name.size() + 6 > proto::kMaxNameLength) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("channel name '{}' is longer than {} characters", name, proto::kMaxNameLength - 6),
                "channel");
  }
}

/// The counters of the ring at `control` whose geometry `g` was checked: every slot access is bounded by `g`.
ChannelStats read_stats(const void* control, const shm::RingGeometry& g) noexcept {
  auto& h = *static_cast<proto::ChannelHeader*>(const_cast<void*>(control));
  ChannelStats st;
  st.head = atomic(h.head).load();
  st.tail = atomic(h.tail).load();
  st.producers = atomic(h.producers).load();
  st.consumers = atomic(h.consumers).load();
  st.redelivered = atomic(h.redelivered).load();
  st.abandoned = atomic(h.abandoned).load();
  st.published = atomic(h.published).load();
  st.published_bytes = atomic(h.published_bytes).load();
  st.slots = g.slots;
  st.slot_bytes = atomic(h.slot_bytes).load();
  for (std::uint64_t i = 0; i < g.slots; ++i) {
    const std::uint64_t s = atomic(shm::ring_slot(const_cast<void*>(control), g, i).state).load();
    if (proto::state_phase(s) == Phase::Free) ++st.free_slots;
    if (proto::state_phase(s) == Phase::Published) ++st.queued;
  }
  return st;
}

/// A handle's pacing settings: the options' where given, else the environment's (docs/env).
std::chrono::nanoseconds initial_pacing(const std::optional<std::chrono::nanoseconds>& pacing) {
  if (pacing) return std::max(*pacing, std::chrono::nanoseconds(0));
  return std::chrono::microseconds(config::env_u64("GPUIPC_CHANNEL_PACING_US", kDefaultPacingUs));
}
std::uint64_t initial_ahead(const std::optional<std::uint32_t>& ahead, std::uint64_t n) {
  const std::uint64_t v = ahead ? *ahead : config::env_u64("GPUIPC_CHANNEL_PACING_AHEAD", default_ahead(n));
  return std::clamp<std::uint64_t>(v, 1, n);
}

std::unique_ptr<Channel::Impl> attach(Segment control, Segment data, ChannelRole role,
                                      const std::optional<std::chrono::nanoseconds>& pacing,
                                      const std::optional<std::uint32_t>& ahead) {
  auto impl = std::make_unique<Channel::Impl>();
  auto* h = static_cast<proto::ChannelHeader*>(control.data());
  const auto g = shm::ring_geometry(control.data(), control.size());
  const std::uint64_t slot_bytes = g ? atomic(h->slot_bytes).load() : 0;
  if (!g || slot_bytes == 0 || slot_bytes > data.size() / g->slots) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a gpuipc channel (version {}) or its buffers do not match it", control.name(),
                            proto::kChannelVersion),
                "open");
  }
  impl->h = h;
  impl->records = static_cast<std::byte*>(control.data()) + sizeof(proto::ChannelHeader);
  impl->geometry = *g;
  impl->n = g->slots;
  impl->record_bytes = g->record_bytes;
  impl->slot_bytes = slot_bytes;
  impl->kind = data.kind();
  impl->role = role;
  if (impl->gpu()) {
    impl->control_device = control.device_pointer();
    impl->ctx = cuda::PrimaryContext(data.device());
  }
  impl->held.assign(impl->n, 0);
  impl->pacing = initial_pacing(pacing);
  impl->ahead = initial_ahead(ahead, impl->n);
  impl->control = std::move(control);
  impl->data = std::move(data);
  impl->join();
  return impl;
}

}  // namespace

Channel::Channel() noexcept = default;
Channel::Channel(std::unique_ptr<Impl> impl) noexcept : m_impl(std::move(impl)) {}
Channel::Channel(Channel&&) noexcept = default;
Channel& Channel::operator=(Channel&&) noexcept = default;
Channel::~Channel() = default;

Channel Channel::create(std::string_view name, const ChannelOptions& options, ChannelRole role) {
  GPUIPC_TRACE("gpuipc::Channel::create");
  check_channel_name(name);
  if (options.slots == 0 || options.slots > proto::kMaxSlots || options.header_bytes > proto::kMaxHeaderBytes ||
      options.slot_bytes == 0 || options.kind == SegmentKind::HostPinned) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("channel '{}': slots must be 1..{}, header_bytes 0..{}, slot_bytes > 0, kind device or "
                            "host",
                            name, proto::kMaxSlots, proto::kMaxHeaderBytes),
                "create");
  }
  const bool gpu = options.kind == SegmentKind::Device;
  // Buffers first, so that a control block anyone can open always has its buffers. Slots are aligned to 256 bytes.
  const std::size_t slot_bytes = (options.slot_bytes + 255) / 256 * 256;
  const CreateOptions data_options{.kind = options.kind, .device = options.device, .mode = options.mode};
  Segment data;
  try {
    data = Segment::create(slots_name(name), slot_bytes * options.slots, data_options);
  } catch (const Error& e) {
    // A creator killed between its two creates leaves the buffers' name with no channel and nobody holding it.
    // Such a leftover is ours to reclaim: same owner, no control block, no reference. Anything else is real.
    if (e.code() != ErrorCode::AlreadyExists || !reclaim_orphan_buffers(name)) throw;
    data = Segment::create(slots_name(name), slot_bytes * options.slots, data_options);
  }
  const std::size_t control_bytes = proto::channel_control_bytes(options.slots, options.header_bytes);
  // The control block is filled in before the broker registers its name: an opener never sees it half made, and
  // a creator killed at any point leaves no name that neither opens nor can be created again.
  auto init = [&](void* block) {
    auto* h = static_cast<proto::ChannelHeader*>(block);
    h->slots = options.slots;
    h->header_bytes = options.header_bytes;
    h->slot_bytes = slot_bytes;
    h->data_kind = static_cast<std::uint32_t>(options.kind);
    h->record_bytes = proto::record_bytes(options.header_bytes);
    auto* records = static_cast<std::byte*>(block) + sizeof(proto::ChannelHeader);
    for (std::uint32_t i = 0; i < options.slots; ++i) {
      auto& s = *reinterpret_cast<proto::Slot*>(records + static_cast<std::size_t>(i) * h->record_bytes);  // NOLINT
      s.state = proto::pack_state(i, Phase::Free, proto::kNoMember);
      s.releaser = proto::kNoMember;
      s.publisher = proto::kNoMember;
    }
    h->version = proto::kChannelVersion;
    atomic(h->magic).store(proto::kChannelMagic, std::memory_order_release);
  };
  Segment control;
  try {
    control = detail::create_segment(
        name, control_bytes,
        {.kind = gpu ? SegmentKind::HostPinned : SegmentKind::Host, .device = options.device, .mode = options.mode},
        proto::kFlagChannel, init);
  } catch (...) {
    try {
      Segment::unlink(slots_name(name));
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
    }
    throw;
  }
  return Channel(attach(std::move(control), std::move(data), role, options.pacing, options.pacing_ahead));
}

Channel Channel::open(std::string_view name, ChannelRole role, const ChannelOpenOptions& options) {
  GPUIPC_TRACE("gpuipc::Channel::open");
  check_channel_name(name);
  OpenOptions co{.access = Access::ReadWrite, .wait = options.wait, .device = options.device};
  Segment control = Segment::open(name, co);
  // Consumers only read the buffers: they map them read-only, so a stray write faults in the consumer.
  OpenOptions dopt{.access = role == ChannelRole::Consumer ? Access::ReadOnly : Access::ReadWrite,
                   .wait = std::chrono::milliseconds(0),
                   .device = options.device};
  Segment data = Segment::open(slots_name(name), dopt);
  return Channel(attach(std::move(control), std::move(data), role, options.pacing, options.pacing_ahead));
}

ChannelStats Channel::stat(std::string_view name) {
  check_channel_name(name);
  // A CUDA-free read-only look: the host_pinned control block of a device channel is mapped without registering it.
  const Segment control = detail::open_segment(name, {.access = Access::ReadOnly, .wait = {}, .device = -1}, false);
  const auto g = shm::ring_geometry(control.data(), control.size());
  if (!g) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a gpuipc channel (version {})", name, proto::kChannelVersion), "stat");
  }
  return read_stats(control.data(), *g);
}

void Channel::unlink(std::string_view name) {
  check_channel_name(name);
  Segment::unlink(name);
  try {
    Segment::unlink(slots_name(name));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
  }
}

Status Channel::acquire(StreamHandle stream, std::chrono::nanoseconds timeout, SlotView& out) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::acquire");
  if (!m_impl || m_impl->role != ChannelRole::Producer || m_impl->held_count == m_impl->n) return Status::InvalidState;
  auto& im = *m_impl;
  if (im.gpu() && !cuda::ensure_current(im.ctx.get())) return Status::DriverError;
  std::uint64_t seq = 0;
  Status status = Status::Ok;
  if (!im.try_acquire(seq, status)) {
    if (timeout.count() == 0) return Status::WouldBlock;
    const Status w = core::wait_on(
        im.h->released_seq, timeout, [&] { return im.try_acquire(seq, status); }, &im.h->released_sleepers);
    if (w != Status::Ok) return w;
  }
  if (status != Status::Ok) return status;
  auto pace = im.pace_once(stream);
  if (im.gpu() && seq >= im.n && im.ahead < im.n && im.pacing.count() > 0) {
    // Pacing also keeps this producer within `ahead` messages (half the ring by default) of the consumers'
    // streams: it watches (within the pacing time) for the release of the message `ahead` back to reach the GPU,
    // when a consumer has already released it on the host (one still holding it is not waited for). Running further ahead gains no
    // throughput when the consumer is the slower side, but makes each message wait longer in the ring and the
    // consumer read it after the producer wrote up to a ring's worth since: with 8 slots of 8 MiB that is more than
    // an H100's L2, and reads come from memory (the ordering suite's host_paced_words_lag* rows).
    const std::uint64_t near = seq - im.ahead;
    if (proto::state_seq(atomic(im.slot(near).state).load(std::memory_order_acquire)) > near) {
      // (An abandoned message `near` was never released: then wait for no more than the slot's last release.)
      (void)im.reached(im.slot(near).freed, std::min(near + 1, im.free_mark(near)), pace);
    }
  }
  const std::uint64_t mark = im.gpu() && seq >= im.n ? im.free_mark(seq) : 0;
  if (mark != 0 && !im.reached(im.slot(seq).freed, mark, pace)) {
    // The slot's last message: the consumer released it on the host; its stream may still be reading.
    // (When the host sees `freed` within the pacing time, that stream is past it and no wait is needed.)
    if (im.wait_before(stream, seq, offsetof(proto::Slot, freed), mark) != CUDA_SUCCESS) {
      // Give the slot up rather than keep a claim nobody will publish (no `freed` write is owed for it).
      im.abandon(seq);
      return Status::DriverError;
    }
  }
  im.push_held(seq);
  const std::uint64_t offset = im.data_offset(seq);
  out.capacity = im.slot_bytes;
  out.sequence = seq;
  out.device_pointer = im.gpu() ? im.data.device_pointer() + offset : 0;
  out.data = static_cast<std::byte*>(im.data.data()) + offset;
  return Status::Ok;
}

Status Channel::publish(StreamHandle stream, std::span<const std::byte> header, std::size_t bytes) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::publish");
  if (!m_impl || m_impl->role != ChannelRole::Producer || m_impl->held_count == 0) return Status::InvalidState;
  auto& im = *m_impl;
  if (im.gpu() && !cuda::ensure_current(im.ctx.get())) return Status::DriverError;
  if (header.size() > im.geometry.header_bytes || bytes > im.slot_bytes) return Status::InvalidState;
  const std::uint64_t seq = im.front_held();
  auto& s = im.slot(seq);
  if (!header.empty()) std::memcpy(im.header_of(seq), header.data(), header.size());
  s.header_size = static_cast<std::uint32_t>(header.size());
  s.size = bytes;
  atomic(s.flags).store(0);
  atomic(s.publisher).store(im.member);
  if (!im.gpu()) atomic(s.filled).store(seq + 1, std::memory_order_release);
  const OwedStreamWrite owed(im.gpu());
  // The host-visible publish goes first: a consumer can claim the message (and enqueue its stream wait) while
  // this thread is still in the driver call below, which keeps that call off the handoff's critical path. The
  // consumer's stream cannot run ahead: it waits for `filled`, which only our stream writes.
  atomic(s.state).store(proto::pack_state(seq, Phase::Published, im.member), std::memory_order_release);
  im.pop_held();
  atomic(im.h->published).fetch_add(1, std::memory_order_relaxed);
  atomic(im.h->published_bytes).fetch_add(bytes, std::memory_order_relaxed);
  core::bump_and_wake(im.h->published_seq, &im.h->published_sleepers);
  if (im.gpu() && im.write_after(stream, seq, offsetof(proto::Slot, filled), seq + 1) != CUDA_SUCCESS) {
    // The stream will never write it: release the consumer's stream from the host and flag the message.
    atomic(s.flags).fetch_or(proto::kSlotIncomplete);
    atomic(s.filled).store(proto::kPoisonBit | (seq + 1), std::memory_order_release);
    return Status::DriverError;
  }
  return Status::Ok;
}

Status Channel::send(StreamHandle stream, const void* source, std::size_t bytes, std::span<const std::byte> header,
                     std::chrono::nanoseconds timeout, std::uint64_t& sequence) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::send");
  // The slot sent is the one acquired here: with older acquired slots still held, publish would take those.
  if (!m_impl || m_impl->role != ChannelRole::Producer || m_impl->held_count != 0) return Status::InvalidState;
  auto& im = *m_impl;
  if (header.size() > im.geometry.header_bytes || bytes > im.slot_bytes) return Status::InvalidState;
  SlotView slot;
  if (const Status st = acquire(stream, timeout, slot); st != Status::Ok) return st;
  if (bytes > 0) {
    if (!im.gpu()) {
      std::memcpy(slot.data, source, bytes);
    } else if (cuda::copy_async(slot.device_pointer, reinterpret_cast<CUdeviceptr>(source), bytes,
                                static_cast<CUstream>(stream)) != CUDA_SUCCESS) {
      im.give_back_front();
      return Status::DriverError;
    }
  }
  sequence = slot.sequence;
  return publish(stream, header, bytes);
}

Status Channel::receive(StreamHandle stream, std::chrono::nanoseconds timeout, MessageView& out) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::receive");
  if (!m_impl || m_impl->role != ChannelRole::Consumer || m_impl->held_count == m_impl->n) return Status::InvalidState;
  auto& im = *m_impl;
  if (im.gpu() && !cuda::ensure_current(im.ctx.get())) return Status::DriverError;
  std::uint64_t seq = 0;
  Status status = Status::Ok;
  if (!im.try_receive(seq, status)) {
    if (timeout.count() == 0) return Status::WouldBlock;
    const Status w = core::wait_on(
        im.h->published_seq, timeout, [&] { return im.try_receive(seq, status); }, &im.h->published_sleepers);
    if (w != Status::Ok) return w;
  }
  if (status != Status::Ok) return status;
  auto& s = im.slot(seq);
  // The producer's stream may not have written the slot yet; when the host sees `filled` within the pacing
  // time, it has.
  if (im.gpu() && !im.reached(s.filled, seq + 1, im.pace_once(stream))) {
    if (im.wait_before(stream, seq, offsetof(proto::Slot, filled), seq + 1) != CUDA_SUCCESS) {
      atomic(s.state).store(proto::pack_state(seq, Phase::Published, proto::kNoMember));
      atomic(im.h->orphans).fetch_add(1);
      core::bump_and_wake(im.h->published_seq);
      return Status::DriverError;
    }
  }
  im.push_held(seq);
  const std::uint64_t offset = im.data_offset(seq);
  // Sizes as the producer wrote them, bounded by this process's copy of the geometry (a member may write anything).
  out.size = std::min<std::uint64_t>(atomic(s.size).load(), im.slot_bytes);
  out.sequence = seq;
  out.header = std::span<const std::byte>(im.header_of(seq),
                                          std::min<std::size_t>(atomic(s.header_size).load(), im.geometry.header_bytes));
  out.device_pointer = im.gpu() ? im.data.device_pointer() + offset : 0;
  out.data = static_cast<const std::byte*>(im.data.data()) + offset;
  out.flags = &s.flags;
  return Status::Ok;
}

Status Channel::release(StreamHandle stream) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::release");
  if (!m_impl || m_impl->role != ChannelRole::Consumer || m_impl->held_count == 0) return Status::InvalidState;
  auto& im = *m_impl;
  if (im.gpu() && !cuda::ensure_current(im.ctx.get())) return Status::DriverError;
  const std::uint64_t seq = im.front_held();
  auto& s = im.slot(seq);
  if (!im.gpu()) shm::raise_to(s.freed, seq + 1);
  atomic(s.releaser).store(im.member);
  const OwedStreamWrite owed(im.gpu());
  atomic(s.release_mark).store(seq + 1, std::memory_order_release);  // before the slot is Free for the next round
  // As in publish: the host-visible release first, the stream write after. A producer that reclaims the slot at
  // once makes its own stream wait for `freed`, which only our stream writes, after its reads.
  atomic(s.state).store(proto::pack_state(seq + im.n, Phase::Free, proto::kNoMember), std::memory_order_release);
  im.pop_held();
  core::bump_and_wake(im.h->released_seq, &im.h->released_sleepers);
  // (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER would do for `freed`, but the v2 memop API we call rejects it with
  // CUDA_ERROR_INVALID_VALUE, as its documentation says.)
  if (im.gpu() && im.write_after(stream, seq, offsetof(proto::Slot, freed), seq + 1) != CUDA_SUCCESS) {
    shm::raise_to(s.freed, seq + 1);  // never leave the producer's stream waiting
    return Status::DriverError;
  }
  return Status::Ok;
}

const std::string& Channel::name() const noexcept {
  static const std::string kEmpty;
  return m_impl ? m_impl->control.name() : kEmpty;
}
ChannelRole Channel::role() const noexcept { return m_impl ? m_impl->role : ChannelRole::Producer; }
SegmentKind Channel::kind() const noexcept { return m_impl ? m_impl->kind : SegmentKind::Host; }
std::uint32_t Channel::slots() const noexcept { return m_impl ? static_cast<std::uint32_t>(m_impl->n) : 0; }
std::size_t Channel::slot_bytes() const noexcept { return m_impl ? m_impl->slot_bytes : 0; }
std::uint32_t Channel::header_bytes() const noexcept { return m_impl ? m_impl->geometry.header_bytes : 0; }
void Channel::set_pacing(std::chrono::nanoseconds pacing) noexcept {
  if (m_impl) m_impl->pacing = std::max(pacing, std::chrono::nanoseconds(0));
}

std::chrono::nanoseconds Channel::pacing() const noexcept { return m_impl ? m_impl->pacing : std::chrono::nanoseconds(0); }
void Channel::set_pacing_ahead(std::uint32_t messages) noexcept {
  if (m_impl) m_impl->ahead = std::clamp<std::uint64_t>(messages, 1, m_impl->n);
}
std::uint32_t Channel::pacing_ahead() const noexcept { return m_impl ? static_cast<std::uint32_t>(m_impl->ahead) : 0; }

int Channel::device() const noexcept { return m_impl && m_impl->gpu() ? m_impl->data.device() : -1; }

ChannelStats Channel::stats() const noexcept {
  return m_impl ? read_stats(m_impl->h, m_impl->geometry) : ChannelStats{};
}

// What this handle holds, for the bindings (python/src/channel.cpp): read where the state lives. ------------------
std::uint32_t Channel::held() const noexcept { return m_impl ? static_cast<std::uint32_t>(m_impl->held_count) : 0; }

std::uint64_t Channel::held_sequence(std::uint32_t index) const noexcept {
  if (index >= held()) return 0;
  return m_impl->held[(m_impl->held_first + index) % m_impl->held.size()];
}

std::optional<bool> Channel::incomplete(std::uint64_t sequence) const noexcept {
  if (!m_impl || m_impl->role != ChannelRole::Consumer) return std::nullopt;
  for (std::uint32_t i = 0; i < held(); ++i) {
    if (held_sequence(i) == sequence) {
      MessageView message;
      message.flags = &m_impl->slot(sequence).flags;
      return message.incomplete();
    }
  }
  return std::nullopt;
}

Segment Channel::slots_segment() const noexcept { return m_impl ? m_impl->data : Segment(); }

}  // namespace gpuipc
