#include "gpuipc/channel.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "base/config.hpp"
#include "core/membership.hpp"
#include "core/owed_stream_writes.hpp"
#include "core/segment_internal.hpp"
#include "core/shm_wait.hpp"
#include "core/stream_park.hpp"
#include "cuda/context.hpp"
#include "cuda/device.hpp"
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
/// (GPUIPC_CHANNEL_PACING_AHEAD overrides it): half a ring of 8 or more where the processes share the GPU through
/// MPS (the consumer then reads what the producer wrote recently, from L2: docs/channels.md#pacing), the whole ring
/// where their contexts time-slice (no MPS). There each switch between the processes' contexts leaves the GPU idle
/// for 150-240 us, and a longer lead gives each turn more messages: 16 slots of 8 MiB frames streamed 0.27 (H100)
/// and 0.30 (H200) of one process with the whole ring, 0.23 and 0.25 with half (bench/results/depth-92abd6b-*).
constexpr std::uint64_t default_ahead(std::uint64_t n, bool time_sliced) noexcept {
  return n >= 8 && !time_sliced ? n / 2 : n;
}

/// What a device channel handle's streams may still touch of its control block when it closes
/// (src/core/stream_park.hpp): the `filled` and `freed` writes it owes, and its streams' waits for them.
struct StreamUse final : core::StreamTouches {
  shm::Ring ring{};
  // The stream writes this member owes, as it recorded them (shm::OwnOwed): its room to claim and whether its
  // writes are done are judged from this, not from its table in the control block, which every member can write.
  // Sized for the ring (so ring_member_writes_done reads only this, whatever member it is given).
  shm::OwnOwed owed;
  // Per slot, the highest `filled` (2i) and `freed` (2i + 1) a stream of this handle was told to wait for. Words
  // only grow (a poisoned one is past every value: the wait compares all 64 bits), so a wait has passed once its
  // word is at its value.
  std::vector<std::uint64_t> waited;
  Segment control;  // parked: the control block and the buffers, kept until done()
  Segment data;

  bool done() const noexcept override {
    if (!shm::ring_member_writes_done(ring, 0, &owed)) return false;
    for (std::size_t i = 0; i < waited.size(); ++i) {
      if (waited[i] == 0) continue;
      const proto::Slot& s = ring.slot(i / 2);
      const std::uint64_t& word = i % 2 == 0 ? s.filled : s.freed;
      if (atomic(const_cast<std::uint64_t&>(word)).load(std::memory_order_acquire) < waited[i]) return false;
    }
    return true;
  }
};

}  // namespace

bool MessageView::incomplete() const noexcept {
  return flags != nullptr && atomic(const_cast<std::uint32_t&>(*flags)).load() == proto::incomplete_mark(sequence);
}

struct Channel::Impl {
  // Declared in acquisition order: the segments outlive everything that points into them.
  Segment control;
  Segment data;
  proto::ChannelHeader* h = nullptr;
  std::uint64_t control_device = 0;  // GPU address of the control block (device channels)
  std::uint64_t n = 0;
  std::uint64_t slot_bytes = 0;
  shm::RingGeometry geometry;  // read once at attach: other members can rewrite the header's words
  cuda::PrimaryContext ctx;  // device channels: made current for stream operations on threads that have none
  ChannelRole role = ChannelRole::Producer;
  SegmentKind kind = SegmentKind::Host;
  std::uint32_t member = proto::kNoMember;
  std::uint32_t token = 0;  // the broker's token in our member entry
  std::uint32_t forks = 0;  // core::forks_so_far() at the join
  // Sequences this member holds (acquired, or received), oldest first: a ring of capacity n.
  std::vector<std::uint64_t> held;
  std::size_t held_first = 0;
  std::size_t held_count = 0;
  // Device channels: what its streams may still touch, among it the writes it owes (StreamUse::owed).
  std::unique_ptr<StreamUse> use = std::make_unique<StreamUse>();
  // Device channels: how long acquire and receive watch a word on the host before they enqueue a stream wait.
  std::chrono::nanoseconds pacing{0};
  // How many messages a pacing producer may run ahead of the consumers' streams (n: the whole ring).
  std::uint64_t ahead = 0;
  // Until when own_write_now takes a stream it found busy to be still busy without asking the driver again: a
  // streaming handle (its stream always busy) then pays one query per window, not one per message.
  std::chrono::steady_clock::time_point assume_busy_until{};

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    // Only a handle that joined, in this process, can have stream work: not a forked child's copy (the streams are
    // the parent's), nor one whose attach failed before its join (its record may be half made: done() would read a
    // null ring).
    const bool ours = member != proto::kNoMember && here();
    leave();
    core::reap_parked();
    if (gpu() && h != nullptr && ours && !use->done()) {
      use->control = std::move(control);
      use->data = std::move(data);
      core::park(std::move(use));
    }
  }

  /// The ring's shared-memory transitions (src/shm/channel_ring.hpp) work on this view.
  shm::Ring ring() const noexcept { return shm::Ring{h, geometry}; }
  proto::Slot& slot(std::uint64_t seq) const noexcept { return shm::ring_slot(h, geometry, seq); }
  CUdeviceptr word_device(std::uint64_t seq, std::size_t offset) const noexcept {
    return control_device + sizeof(proto::ChannelHeader) + (seq % n) * geometry.record_bytes + offset;
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

  /// Whether a write enqueued on `stream` now would land at once (cuda::stream_reached_now: never for the legacy
  /// default stream). A query costs ~1 us; one per message took a one-process stream of 8 MiB frames from 145k to
  /// 103k frames a second on an H200, so a stream seen busy is taken to stay busy for 100 us.
  bool own_write_now(StreamHandle stream) noexcept {
    constexpr auto kBusyWindow = std::chrono::microseconds(100);
    const auto now = std::chrono::steady_clock::now();
    if (now < assume_busy_until) return false;
    if (cuda::stream_reached_now(static_cast<CUstream>(stream))) return true;
    assume_busy_until = now + kBusyWindow;
    return false;
  }

  /// The word at `offset` of slot `seq`'s record reaches `value` once `stream`'s work so far is done. When the stream
  /// has nothing left to run, that is now: the host writes it (no stream operation, and the peer's host sees it at
  /// once, so it enqueues no stream wait either, and a handoff between idle GPUs stays a host round trip).
  CUresult write_after(StreamHandle stream, std::uint64_t seq, std::size_t offset, std::uint64_t value) noexcept {
    if (own_write_now(stream)) {
      shm::raise_to(*reinterpret_cast<std::uint64_t*>(reinterpret_cast<std::byte*>(&slot(seq)) + offset), value);
      return CUDA_SUCCESS;
    }
    return cuda::stream_write_value64(static_cast<CUstream>(stream), word_device(seq, offset), value);
  }
  /// `stream`'s work after this waits until the word at `offset` of slot `seq`'s record reaches `value`.
  /// (After any stream write this process owes: see src/core/owed_stream_writes.hpp.)
  CUresult wait_before(StreamHandle stream, std::uint64_t seq, std::size_t offset, std::uint64_t value) noexcept {
    core::settle_owed_stream_writes();
    const CUresult rc = cuda::stream_wait_value64(static_cast<CUstream>(stream), word_device(seq, offset), value);
    if (rc == CUDA_SUCCESS) {
      std::uint64_t& w = use->waited[(seq % n) * 2 + (offset == offsetof(proto::Slot, freed) ? 1 : 0)];
      w = std::max(w, value);
    }
    return rc;
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
    forks = m.forks;
  }

  /// Clean leave: give up acquired slots, hand back received messages, tell the other side if we were the last.
  /// The same transition as the broker's repair of a dead member (src/shm/channel_ring.cpp), with reason Closed.
  /// While its stream still owes writes, the broker makes the transition (Leave) and takes the writes over: the
  /// stream makes them, or the broker once this process has exited, so none is written ahead of the stream and
  /// close does not wait for it. Without a broker to take them, it waits (bounded, 10 s) for its stream, then writes
  /// what is still owed at once.
  void leave() noexcept {
    if (member == proto::kNoMember || h == nullptr) return;
    if (!here()) {
      forget();  // a forked child's copy of its parent's handle: the entry, its slots and messages are the parent's
      return;
    }
    // Its table as this member recorded it: the broker takes it over, or the removal below writes what is left.
    if (gpu()) shm::ring_restore_owed(ring(), member, use->owed);
    if (gpu() && !shm::ring_member_writes_done(ring(), member, &use->owed) &&
        core::leave_through_broker(control, core::Membership{member, token})) {
      forget();
      return;
    }
    if (gpu()) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!shm::ring_member_writes_done(ring(), member, &use->owed) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    const proto::Role r = role == ChannelRole::Producer ? proto::Role::Producer : proto::Role::Consumer;
    shm::channel_remove_member(h, geometry, member, token, r, proto::PoisonReason::Closed);
    forget();
  }

  /// Whether this process joined (a forked child's copy of its parent's handle may not use the parent's entry).
  bool here() const noexcept { return core::joined_here(core::Membership{member, token, forks}); }

  /// This handle is no longer a member (its entry was cleared).
  void forget() noexcept {
    held_count = 0;
    core::forget_member(core::Membership{member, token});
    member = proto::kNoMember;
    token = 0;
  }

  /// Gives back the newest acquired slot unpublished (its sequence is skipped, like an abandoned one).
  void give_back_front() noexcept {
    const std::uint64_t seq = held[(held_first + held_count - 1) % held.size()];
    --held_count;
    shm::ring_give_back(ring(), seq, member);
  }

  /// A device channel's member claims a slot or a message only with room in its owed table for the stream write
  /// each of its claims will owe (src/shm/channel_ring.hpp). A stream that fell that far behind its host holds the
  /// host back here: it waits, within `timeout` (what is left of it on return; negative: for ever), for its
  /// oldest write to land. (Judged from `owed`: entries another member wrote into the table, which never land,
  /// held this member back for good.)
  Status owed_room(std::chrono::nanoseconds& timeout) noexcept {
    if (!gpu() || shm::ring_owed_room(ring(), member, &use->owed) > held_count) return Status::Ok;
    if (timeout.count() == 0) return Status::WouldBlock;
    const bool forever = timeout.count() < 0;
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      const auto waited = std::chrono::steady_clock::now() - start;
      if (shm::ring_owed_room(ring(), member, &use->owed) > held_count) {
        // What is left, 1 ns at least: a claim given 0 would say WouldBlock, which callers take for "a zero
        // timeout" (the documented loop stops there as if the peer were gone); with 1 ns it tries once, then says
        // Timeout.
        if (!forever)
          timeout =
              std::max(waited < timeout ? timeout - waited : std::chrono::nanoseconds(0), std::chrono::nanoseconds(1));
        return Status::Ok;
      }
      if (!forever && waited >= timeout) return Status::Timeout;
    }
  }

  static Status gone_status(proto::PoisonReason reason) noexcept {
    if (reason == proto::PoisonReason::None) return Status::Ok;
    return reason == proto::PoisonReason::Closed ? Status::Closed : Status::PeerDied;
  }

  /// One attempt to claim the next free slot (a producer) or message (a consumer). Returns true when done
  /// (claimed, or `status` says why not).
  bool try_claim(std::uint64_t& seq, Status& status) const noexcept {
    proto::PoisonReason gone = proto::PoisonReason::None;
    const bool done = role == ChannelRole::Producer ? shm::ring_try_acquire(ring(), member, seq, gone)
                                                    : shm::ring_try_receive(ring(), member, seq, gone);
    if (done) status = gone_status(gone);
    return done;
  }

  /// Claims the next slot or message within `timeout`, sleeping on this side's futex word: Ok with `seq`, or why
  /// not (WouldBlock with a zero timeout, Timeout, Closed, PeerDied).
  Status claim(std::chrono::nanoseconds timeout, std::uint64_t& seq) noexcept {
    Status status = Status::Ok;
    if (try_claim(seq, status)) return status;
    if (timeout.count() == 0) return Status::WouldBlock;
    const bool producer = role == ChannelRole::Producer;
    const Status w = core::wait_on(
        producer ? h->released_seq : h->published_seq, timeout, [&] { return try_claim(seq, status); },
        producer ? &h->released_sleepers : &h->published_sleepers);
    return w != Status::Ok ? w : status;
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
std::uint64_t initial_ahead(const std::optional<std::uint32_t>& ahead, std::uint64_t n, bool time_sliced) {
  const std::uint64_t v =
      ahead ? *ahead : config::env_u64("GPUIPC_CHANNEL_PACING_AHEAD", default_ahead(n, time_sliced));
  return std::clamp<std::uint64_t>(v, 1, n);
}

std::unique_ptr<Channel::Impl> attach(Segment control, Segment data, ChannelRole role,
                                      const std::optional<std::chrono::nanoseconds>& pacing,
                                      const std::optional<std::uint32_t>& ahead) {
  core::reap_parked();
  auto impl = std::make_unique<Channel::Impl>();
  auto* h = static_cast<proto::ChannelHeader*>(control.data());
  const auto g =
      detail::host_readable(control.kind()) ? shm::ring_geometry(control.data(), control.size()) : std::nullopt;
  const std::uint64_t slot_bytes = g ? atomic(h->slot_bytes).load() : 0;
  // The buffers are of the kind the control block was made for, and that kind's control block: host buffers are
  // written with memcpy, a device channel's stream waits and writes go to its host_pinned control block. (A .slots
  // name of another kind had the host write into GPU addresses, or streams wait at address 0.)
  const SegmentKind dk = data.kind();
  const bool kinds_match =
      g && atomic(h->data_kind).load() == static_cast<std::uint32_t>(dk) &&
      (dk == SegmentKind::Host || (dk == SegmentKind::Device && control.kind() == SegmentKind::HostPinned));
  if (!g || slot_bytes == 0 || slot_bytes > data.size() / g->slots || !kinds_match) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a gpuipc channel (version {}) or its buffers ('{}', {}) do not match it",
                            control.name(), proto::kChannelVersion, data.name(), to_string(dk)),
                "open");
  }
  impl->h = h;
  impl->geometry = *g;
  impl->n = g->slots;
  impl->slot_bytes = slot_bytes;
  impl->kind = data.kind();
  impl->role = role;
  if (impl->gpu()) {
    impl->control_device = control.device_pointer();
    impl->ctx = cuda::PrimaryContext(data.device());
    impl->use->ring = impl->ring();
    impl->use->owed.entries.assign(proto::owed_capacity(g->slots), proto::OwedWrite{});
    impl->use->waited.assign(2 * g->slots, 0);
  }
  impl->held.assign(impl->n, 0);
  impl->pacing = initial_pacing(pacing);
  // Time-sliced: the driver says this process's contexts on the slots' GPU are not shared through MPS.
  impl->ahead = initial_ahead(ahead, impl->n, impl->gpu() && cuda::mps_enabled(data.device()) == false);
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
      options.slot_bytes == 0 || (options.kind != SegmentKind::Device && options.kind != SegmentKind::Host)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("channel '{}': slots must be 1..{}, header_bytes 0..{}, slot_bytes > 0, kind device or "
                            "host",
                            name, proto::kMaxSlots, proto::kMaxHeaderBytes),
                "create");
  }
  // (Checked before the rounding and the product below, which would wrap round.)
  if (options.slot_bytes > proto::kMaxSegmentSize / options.slots) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("channel '{}': {} slots of {} bytes are more than the largest segment ({} bytes): fewer "
                            "or smaller slots",
                            name, options.slots, options.slot_bytes, proto::kMaxSegmentSize),
                "create");
  }
  const bool gpu = options.kind == SegmentKind::Device;
  // Buffers first, so that a control block anyone can open always has its buffers. Slots are aligned to 256 bytes.
  const std::size_t slot_bytes = (options.slot_bytes + 255) / 256 * 256;
  const CreateOptions data_options{.kind = options.kind, .device = options.device, .mode = options.mode};
  Segment data;
  try {
    data = detail::create_segment(slots_name(name), slot_bytes * options.slots, data_options, 0);
  } catch (const Error& e) {
    // A creator killed between its two creates leaves the buffers' name with no channel and nobody holding it.
    // Such a leftover is ours to reclaim: same owner, no control block, no reference. Anything else is real.
    if (e.code() != ErrorCode::AlreadyExists || !reclaim_orphan_buffers(name)) throw;
    data = detail::create_segment(slots_name(name), slot_bytes * options.slots, data_options, 0);
  }
  const std::size_t control_bytes = proto::channel_control_bytes(options.slots, options.header_bytes);
  // The control block is filled in before the broker registers its name: an opener never sees it half made, and
  // a creator killed at any point leaves no name that neither opens nor can be created again.
  auto init = [&](void* block) {
    shm::ring_init(block, options.slots, options.header_bytes, slot_bytes, static_cast<std::uint32_t>(options.kind));
  };
  bool control_made = false;
  try {
    Segment control = detail::create_segment(
        name, control_bytes,
        {.kind = gpu ? SegmentKind::HostPinned : SegmentKind::Host, .device = options.device, .mode = options.mode},
        proto::kFlagChannel, init);
    control_made = true;
    return Channel(attach(std::move(control), std::move(data), role, options.pacing, options.pacing_ahead));
  } catch (...) {
    // Neither name stays behind a create that failed (another create of the name would find them taken).
    for (const std::string& made : {std::string(name), slots_name(name)}) {
      if (made == name && !control_made) continue;  // not ours: the control create failed (maybe AlreadyExists)
      try {
        Segment::unlink(made);
      } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
      }
    }
    throw;
  }
}

Channel Channel::open(std::string_view name, ChannelRole role, const ChannelOpenOptions& options) {
  GPUIPC_TRACE("gpuipc::Channel::open");
  check_channel_name(name);
  OpenOptions co{.access = Access::ReadWrite, .wait = options.wait, .device = options.device};
  Segment control = Segment::open(name, co);
  // Another kind of object (a semaphore, a pool) has no NAME.slots: say what it is not, not that NAME.slots is missing.
  if (detail::control_magic(control) != proto::kChannelMagic) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a channel (another kind of object, or a plain segment)", name), "open");
  }
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
  const Segment control = detail::look_at_segment(name);
  const auto g =
      detail::host_readable(control.kind()) ? shm::ring_geometry(control.data(), control.size()) : std::nullopt;
  if (!g) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a gpuipc channel (version {})", name, proto::kChannelVersion), "stat");
  }
  return read_stats(control.data(), *g);
}

void Channel::unlink(std::string_view name) {
  check_channel_name(name);
  // Its slots may be there without it: a creator killed after it made them and before its control block (no other
  // name may end in .slots, and `gpuipc rm` of that name alone is refused).
  const std::optional<Error> missing = detail::unlink_control(name, proto::kChannelMagic, "channel");
  try {
    Segment::unlink(slots_name(name));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
    if (missing) throw *missing;
  }
}

Status Channel::acquire(StreamHandle stream, std::chrono::nanoseconds timeout, SlotView& out) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::acquire");
  if (!m_impl || !m_impl->here() || m_impl->role != ChannelRole::Producer || m_impl->held_count == m_impl->n)
    return Status::InvalidState;
  auto& im = *m_impl;
  const cuda::StreamContextScope context(im.gpu() ? im.ctx.get() : nullptr, static_cast<CUstream>(stream),
                                         cuda::StreamTarget::GpuMemory);
  if (!context.ok()) return Status::DriverError;
  if (const Status st = im.owed_room(timeout); st != Status::Ok) return st;
  std::uint64_t seq = 0;
  if (const Status st = im.claim(timeout, seq); st != Status::Ok) return st;
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
      (void)im.reached(im.slot(near).freed, std::min(near + 1, shm::ring_free_mark(im.ring(), near)), pace);
    }
  }
  const std::uint64_t mark = im.gpu() && seq >= im.n ? shm::ring_free_mark(im.ring(), seq) : 0;
  if (mark != 0 && !im.reached(im.slot(seq).freed, mark, pace)) {
    // The slot's last message: the consumer released it on the host; its stream may still be reading.
    // (When the host sees `freed` within the pacing time, that stream is past it and no wait is needed.)
    if (im.wait_before(stream, seq, offsetof(proto::Slot, freed), mark) != CUDA_SUCCESS) {
      // Give the slot up rather than keep a claim nobody will publish (no `freed` write is owed for it).
      shm::ring_give_back(im.ring(), seq, im.member);
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
  if (!m_impl || !m_impl->here() || m_impl->role != ChannelRole::Producer || m_impl->held_count == 0)
    return Status::InvalidState;
  auto& im = *m_impl;
  const cuda::StreamContextScope context(im.gpu() ? im.ctx.get() : nullptr, static_cast<CUstream>(stream),
                                         cuda::StreamTarget::GpuMemory);
  if (!context.ok()) return Status::DriverError;
  if (header.size() > im.geometry.header_bytes || bytes > im.slot_bytes) return Status::InvalidState;
  const std::uint64_t seq = im.front_held();
  const core::OwedStreamWrite owed(im.gpu());
  // The host-visible publish goes first: a consumer can claim the message (and enqueue its stream wait) while
  // this thread is still in the driver call below, which keeps that call off the handoff's critical path. The
  // consumer's stream cannot run ahead: it waits for `filled`, which only our stream writes.
  if (!shm::ring_publish(im.ring(), seq, im.member, header, bytes, im.gpu(), &im.use->owed)) {
    // The broker took this process for gone (its connection closed, and it neither rejoined nor exited in time) and
    // abandoned the claim: the slot is not ours to publish, nor to have our stream write.
    im.pop_held();
    return Status::InvalidState;
  }
  im.pop_held();
  if (im.gpu() && im.write_after(stream, seq, offsetof(proto::Slot, filled), seq + 1) != CUDA_SUCCESS) {
    // The stream will never write it: release the consumer's stream from the host and flag the message.
    shm::ring_mark_incomplete(im.slot(seq), seq);
    return Status::DriverError;
  }
  return Status::Ok;
}

Status Channel::send(StreamHandle stream, const void* source, std::size_t bytes, std::span<const std::byte> header,
                     std::chrono::nanoseconds timeout, std::uint64_t& sequence) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::send");
  // The slot sent is the one acquired here: with older acquired slots still held, publish would take those.
  if (!m_impl || !m_impl->here() || m_impl->role != ChannelRole::Producer || m_impl->held_count != 0)
    return Status::InvalidState;
  auto& im = *m_impl;
  if (header.size() > im.geometry.header_bytes || bytes > im.slot_bytes) return Status::InvalidState;
  // The copy too: on the legacy default stream it runs in the channel's context, whose GPU maps the slot.
  const cuda::StreamContextScope context(im.gpu() ? im.ctx.get() : nullptr, static_cast<CUstream>(stream),
                                         cuda::StreamTarget::GpuMemory);
  if (!context.ok()) return Status::DriverError;
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
  if (!m_impl || !m_impl->here() || m_impl->role != ChannelRole::Consumer || m_impl->held_count == m_impl->n)
    return Status::InvalidState;
  auto& im = *m_impl;
  const cuda::StreamContextScope context(im.gpu() ? im.ctx.get() : nullptr, static_cast<CUstream>(stream),
                                         cuda::StreamTarget::GpuMemory);
  if (!context.ok()) return Status::DriverError;
  if (const Status st = im.owed_room(timeout); st != Status::Ok) return st;
  std::uint64_t seq = 0;
  if (const Status st = im.claim(timeout, seq); st != Status::Ok) return st;
  auto& s = im.slot(seq);
  // The producer's stream may not have written the slot yet; when the host sees `filled` within the pacing
  // time, it has.
  if (im.gpu() && !im.reached(s.filled, seq + 1, im.pace_once(stream))) {
    if (im.wait_before(stream, seq, offsetof(proto::Slot, filled), seq + 1) != CUDA_SUCCESS) {
      shm::ring_hand_back(im.ring(), seq, im.member);
      return Status::DriverError;
    }
  }
  im.push_held(seq);
  const std::uint64_t offset = im.data_offset(seq);
  // Sizes as the producer wrote them, bounded by this process's copy of the geometry (a member may write anything).
  out.size = std::min<std::uint64_t>(atomic(s.size).load(), im.slot_bytes);
  out.sequence = seq;
  out.header = std::span<const std::byte>(im.ring().user_header(seq),
                                          std::min<std::size_t>(atomic(s.header_size).load(), im.geometry.header_bytes));
  out.device_pointer = im.gpu() ? im.data.device_pointer() + offset : 0;
  out.data = static_cast<const std::byte*>(im.data.data()) + offset;
  out.flags = &s.incomplete;
  return Status::Ok;
}

Status Channel::release(StreamHandle stream) noexcept {
  GPUIPC_TRACE("gpuipc::Channel::release");
  if (!m_impl || !m_impl->here() || m_impl->role != ChannelRole::Consumer || m_impl->held_count == 0)
    return Status::InvalidState;
  auto& im = *m_impl;
  const cuda::StreamContextScope context(im.gpu() ? im.ctx.get() : nullptr, static_cast<CUstream>(stream),
                                         cuda::StreamTarget::GpuMemory);
  if (!context.ok()) return Status::DriverError;
  const std::uint64_t seq = im.front_held();
  const core::OwedStreamWrite owed(im.gpu());
  // As in publish: the host-visible release first, the stream write after. A producer that reclaims the slot at
  // once makes its own stream wait for `freed`, which only our stream writes, after its reads.
  if (!shm::ring_release(im.ring(), seq, im.member, im.gpu(), &im.use->owed)) {
    // Handed to another consumer by the broker's repair of this member (as in publish): not ours to release.
    im.pop_held();
    return Status::InvalidState;
  }
  im.pop_held();
  // (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER would do for `freed`, but the v2 memop API we call rejects it with
  // CUDA_ERROR_INVALID_VALUE, as its documentation says.)
  if (im.gpu() && im.write_after(stream, seq, offsetof(proto::Slot, freed), seq + 1) != CUDA_SUCCESS) {
    shm::raise_to(im.slot(seq).freed, seq + 1);  // never leave the producer's stream waiting
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
  MessageView message;
  message.sequence = sequence;
  message.flags = &m_impl->slot(sequence).incomplete;
  return message.incomplete();
}

Segment Channel::slots_segment() const noexcept { return m_impl ? m_impl->data : Segment(); }

}  // namespace gpuipc
