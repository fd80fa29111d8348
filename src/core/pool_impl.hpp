// Pool::Impl: one process's membership of a pool — the control block, the chunks it mapped, and the references
// (Blocks and holds) it has — shared by src/core/pool.cpp and src/core/pool_pause.cpp.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "base/log.hpp"
#include "core/gpu_memory.hpp"
#include "core/membership.hpp"
#include "core/segment_internal.hpp"
#include "core/shm_wait.hpp"
#include "core/stream_park.hpp"
#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/host_registration.hpp"
#include "gpuipc/pool.hpp"
#include "os/identity.hpp"
#include "os/memfd.hpp"
#include "shm/members.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc {
namespace pool_detail {

/// How long a call waits for the pool lock (held for microseconds by a live member; a dead member's lock is broken
/// by the broker's repair within milliseconds).
inline constexpr auto kLockTimeout = std::chrono::seconds(5);
/// How long allocate waits for another member to finish creating a chunk.
inline constexpr auto kChunkWait = std::chrono::seconds(30);
inline std::string chunk_name(std::string_view pool, std::uint32_t chunk) { return fmt::format("{}.chunk.{}", pool, chunk); }

/// Pool::Impl::mapped_epoch of a chunk this process does not map (or whose memory a pause released).
inline constexpr std::uint64_t kUnmapped = UINT64_MAX;

inline shm::BlockLocation location_of(const BlockRef& r) noexcept {
  return shm::BlockLocation{r.chunk, r.index, r.offset, r.size, r.generation};
}

/// Segment::unlink(name), where a name already gone is no error (a pause, a failed resume, or Pool::unlink after
/// another member or an earlier attempt removed it).
inline void unlink_if_present(const std::string& name) {
  try {
    Segment::unlink(name);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
  }
}

/// What a closed pool handle's streams may still touch (core/stream_park.hpp): the `released` words of the blocks
/// it freed on a stream whose writes have not landed, and the chunks those blocks are in (the stream's work before
/// the free may still use them). Parked, it owns the control block and the chunks.
struct StreamUse final : core::StreamTouches {
  std::vector<shm::PendingFree> frees;
  // The control block's mapping, read by done(): the handle's `control` until it parks, then this one's (the same
  // mapping, moved). (done() read `control` itself, empty before the move: it said done, and nothing was parked.)
  void* block = nullptr;
  std::size_t block_size = 0;
  Segment control;
  std::vector<core::VaSlot> slots;  // (before `chunks`: unmapped after them, as in Pool::Impl)
  std::vector<Segment> chunks;

  bool done() const noexcept override { return shm::pool_frees_landed(block, block_size, frees); }
};

}  // namespace pool_detail

struct Pool::Impl {
  // Declared in acquisition order: the control segment outlives the chunks' cache and the membership.
  Segment control;
  shm::PoolBlock block;
  std::string name;
  SegmentKind kind = SegmentKind::Host;
  Access access = Access::ReadWrite;
  int open_device = -1;  // OpenOptions::device (PoolOptions::device for the creator)
  // Device pools with a UUID: the GPU of this process that maps the chunks, chosen once when the handle is made
  // (core::mapping_ordinal: open_device, else the current context's GPU, else the chunks'), so that every chunk is
  // mapped for the GPU mapping_device() names, whatever context is current later. -1 otherwise.
  int mapper = -1;
  // GPU address of the control block (device, host_pinned); 0 until the first stream-ordered free of a member that
  // opened the pool (control_gpu registers it then: readers that never free with a stream never pin it).
  std::atomic<std::uint64_t> control_device{0};
  // The mapping GPU's context (`mapper`; else open_device, else 0): stream writes of `released` on threads without
  // a current context, the registration of the control block, and the VaSlots, pause and resume of device pools.
  cuda::PrimaryContext ctx;
  std::uint32_t member = proto::kNoMember;
  std::uint32_t token = 0;  // the broker's token in our member entry
  std::uint32_t forks = 0;  // core::forks_so_far() at the join

  std::mutex chunks_mutex;
  std::vector<core::VaSlot> slots;                           // device pools, by index: where chunk i is mapped,
                                                             // kept across pause and resume (before `chunks`:
                                                             // unmapped first)
  std::vector<Segment> chunks;                               // by index: mapped chunks
  std::unique_ptr<std::atomic<std::byte*>[]> bases;          // lock-free view of chunks[i].data()
  std::unique_ptr<std::atomic<std::uint64_t>[]> mapped_epoch;  // the pool epoch chunk i was mapped (or last
                                                               // refreshed) in; kUnmapped: none
  std::mutex holds_mutex;
  std::atomic<bool> stream_released{false};  ///< this member released a block with a stream (leave waits for those)
  struct Local {
    std::uint64_t generation = 0;
    std::uint32_t holds = 0;  // hold() calls not yet released
    bool owned = false;       // a Block of this process
    bool pending = false;     // its Block was freed on a stream: the last release must wait for that stream
  };
  std::unordered_map<std::uint32_t, Local> holds;  // by record: this process's references (Blocks and holds)
  std::mutex alloc_mutex;
  std::vector<shm::OccupiedRange> scratch;  // the allocator's, under alloc_mutex

  // Pause and resume (pool.cpp), under pause_mutex: the contents this process saved, in `saved_pinned` (device
  // pools, when the driver gives pinned memory) or `saved_host`.
  std::mutex pause_mutex;
  struct SavedRange {
    std::uint32_t chunk = 0;
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
    std::uint64_t at = 0;  // bytes into the saved buffer
  };
  std::vector<SavedRange> saved;
  os::Mapping saved_host;
  std::unique_ptr<cuda::PinnedHostBuffer> saved_pinned;
  bool keep_saved_buffer = false;  // the last pause's PauseOptions::keep_buffer: resume keeps the buffer
  std::byte* saved_data() const noexcept {
    return saved_pinned ? static_cast<std::byte*>(saved_pinned->get()) : static_cast<std::byte*>(saved_host.data());
  }
  /// Bytes of the buffer the contents are saved in (0: none).
  std::size_t saved_capacity() const noexcept { return saved_pinned ? saved_pinned->size() : saved_host.size(); }
  /// Frees the saved contents and their buffer.
  void drop_saved() noexcept {
    saved.clear();
    drop_saved_buffer();
  }
  /// Frees the buffer the contents are saved in (cuMemFreeHost wants the context that allocated it current).
  void drop_saved_buffer() noexcept {
    saved_host = os::Mapping();
    if (saved_pinned) {
      try {
        cuda::ScopedContext scope(ctx.get());
        saved_pinned.reset();
      } catch (...) {  // NOLINT(bugprone-empty-catch): no context: the buffer is freed without one
        saved_pinned.reset();
      }
    }
  }

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    // Read before the leave, while the records still name this member.
    std::unique_ptr<pool_detail::StreamUse> use = pending_stream_use();
    leave();
    drop_saved();
    core::reap_parked();
    if (use && !use->done()) {
      use->control = std::move(control);
      use->slots = std::move(slots);
      use->chunks = std::move(chunks);
      core::park(std::move(use));
    }
  }

  /// The frees this member made on a stream that has not reached them yet (null: none, or no memory to say).
  std::unique_ptr<pool_detail::StreamUse> pending_stream_use() const noexcept {
    if (!stream_ordered() || !stream_released.load(std::memory_order_relaxed) || member == proto::kNoMember ||
        !block.valid() || !here()) {
      return nullptr;
    }
    try {
      auto use = std::make_unique<pool_detail::StreamUse>();
      use->block = control.data();
      use->block_size = control.size();
      use->frees = shm::pool_member_pending_frees(control.data(), control.size(), member);
      return use->frees.empty() ? nullptr : std::move(use);
    } catch (const std::bad_alloc&) {
      return nullptr;  // the close unmaps under the stream, as before this record
    }
  }

  const shm::PoolGeometry& geo() const noexcept { return block.geometry(); }
  /// Whether this is a device pool whose control block names its GPU by UUID (every pool made since the UUID was
  /// kept).
  bool gpu_named() const noexcept {
    const auto& uuid = geo().device_uuid;
    return kind == SegmentKind::Device && std::any_of(uuid.begin(), uuid.end(), [](auto b) { return b != 0; });
  }
  bool stream_ordered() const noexcept { return kind != SegmentKind::Host; }

  /// The control block's GPU address, registering it with the pool's GPU the first time (stream_ordered pools).
  std::uint64_t control_gpu() {
    std::uint64_t v = control_device.load(std::memory_order_acquire);
    if (v == 0) {
      v = detail::register_pinned_later(control, ctx.ordinal());
      control_device.store(v, std::memory_order_release);
    }
    return v;
  }

  // Membership: the broker claims the entry (src/core/membership.hpp) and removes it when this process goes.
  void join() {
    const auto m = core::join_member(control, proto::Role::Holder);
    member = m.index;
    token = m.token;
    forks = m.forks;
  }

  /// Whether this process may use the member entry: it joined it, or there is none (a forked child's copy of its
  /// parent's handle holds the parent's entry and blocks).
  bool here() const noexcept {
    return member == proto::kNoMember || core::joined_here(core::Membership{member, token, forks});
  }
  /// Throws InvalidState for `call` where here() is false.
  void check_here(std::string_view call) const {
    if (here()) return;
    throw Error(ErrorCode::InvalidState,
                fmt::format("pool '{}': {} refused: this handle was opened by the process this one was forked from, "
                            "and its blocks are that process's; open the pool again in this process (Pool::open)",
                            name, call),
                std::string(call));
  }

  /// Clean leave: release every hold this member has (the same function the broker runs when the process dies) and
  /// the member entry. While its stream has not reached some of its stream-ordered frees, it releases its holds, and
  /// the broker (Leave) removes the entry once those frees have landed, or once this process has exited: their
  /// blocks are not reused ahead of the stream, however late it is. Without a broker to take it, it waits (bounded,
  /// 10 s) for the stream, then frees them. (Releasing the mappings afterwards waits for the process's GPU work.)
  void leave() noexcept {
    if (member == proto::kNoMember || !block.valid()) return;
    if (!core::joined_here(core::Membership{member, token, forks})) {
      // A forked child's copy of its parent's handle: the entry and the blocks it holds are the parent's.
      core::forget_member(core::Membership{member, token});
      member = proto::kNoMember;
      token = 0;
      return;
    }
    // Only a member that released with a stream has frees to wait for. The look reads every record of the control
    // block (4 MiB for 65536 blocks), most of which a reader never touched: a reader's whole close, which reads them
    // twice with this look, took 0.54-0.70 ms on an H200 machine (experiments/open-parts-25eb9cd-h200-20261127.log).
    if (stream_ordered() && stream_released.load(std::memory_order_relaxed) && pending_stream_frees()) {
      if (shm::holds_token(block.header().members, member, token)) {
        (void)shm::pool_remove_member(control.data(), control.size(), member, /*keep_pending_frees=*/true);
      }
      if (core::leave_through_broker(control, core::Membership{member, token})) {
        core::forget_member(core::Membership{member, token});
        member = proto::kNoMember;
        token = 0;
        return;
      }
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (pending_stream_frees() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    // -1: the lock stayed taken and the removal was deferred to its next holder, which frees the entry too.
    if (shm::holds_token(block.header().members, member, token) &&
        shm::pool_remove_member(control.data(), control.size(), member) >= 0) {
      shm::clear_member(block.header().members, member, token);
    }
    core::forget_member(core::Membership{member, token});
    member = proto::kNoMember;
    token = 0;
  }

  bool pending_stream_frees() const noexcept {
    return shm::pool_member_frees_pending(control.data(), control.size(), member);
  }

  /// The base address of chunk `c`, mapping it on first use (device pools: at its VaSlot, the same address before
  /// and after a pause). Throws Error.
  std::byte* chunk_base(std::uint32_t c) {
    if (std::byte* b = bases[c].load(std::memory_order_acquire);
        b != nullptr && mapped_epoch[c].load(std::memory_order_acquire) != pool_detail::kUnmapped) {
      return b;
    }
    std::lock_guard lock(chunks_mutex);
    return map_chunk_locked(c);
  }

  /// Whether chunk `c` needs chunk_base's slow path.
  bool unmapped(std::uint32_t c) const noexcept {
    return bases[c].load(std::memory_order_acquire) == nullptr ||
           mapped_epoch[c].load(std::memory_order_acquire) == pool_detail::kUnmapped;
  }

  /// chunk_base's slow path, under chunks_mutex.
  std::byte* map_chunk_locked(std::uint32_t c) {
    // The epoch is read before the chunk is opened: a pause that releases the memory we open moves it on after,
    // and resolve then sees this mapping stale.
    const std::uint64_t epoch = block.pause_info().epoch;
    if (std::byte* b = reuse_locked(c, epoch)) return b;
    return install_chunk(
        c, detail::open_segment(pool_detail::chunk_name(name, c), chunk_open_options(), true, slot_address(c)), epoch);
  }

  /// Maps the chunks of `wanted` that chunk_base would map (unmapped ones; out-of-range ones are skipped), opening
  /// them with one broker round trip: a first open of a pool's tensors pays one instead of one per chunk. Returns
  /// the error of each chunk that could not be mapped (a later chunk_base tries it again). Under chunks_mutex.
  std::vector<std::pair<std::uint32_t, Error>> map_chunks_locked(std::span<const std::uint32_t> wanted) {
    const std::uint64_t epoch = block.pause_info().epoch;  // before the opens, as in map_chunk_locked
    std::vector<std::uint32_t> todo;
    std::vector<detail::SegmentOpen> opens;
    for (const std::uint32_t c : wanted) {
      if (c >= geo().max_chunks || !unmapped(c) || std::find(todo.begin(), todo.end(), c) != todo.end()) continue;
      if (reuse_locked(c, epoch) != nullptr) continue;
      todo.push_back(c);
      opens.push_back({pool_detail::chunk_name(name, c), chunk_open_options(), true, slot_address(c)});
    }
    std::vector<std::pair<std::uint32_t, Error>> failed;
    if (todo.empty()) return failed;
    auto got = detail::open_segments(opens);
    for (std::size_t i = 0; i < todo.size(); ++i) {
      try {
        if (auto* e = std::get_if<Error>(&got[i])) throw std::move(*e);
        install_chunk(todo[i], std::move(std::get<Segment>(got[i])), epoch);
      } catch (const Error& e) {
        failed.emplace_back(todo[i], e);
      }
    }
    return failed;
  }

  /// map_chunk_locked before the open: chunk `c`'s base when its mapping is still good (host pools keep theirs
  /// across a pause: the memfd stays, only its pages went), else nullptr, with a device mapping of memory a pause
  /// released dropped so that the chunk's memory of now is mapped instead.
  std::byte* reuse_locked(std::uint32_t c, std::uint64_t epoch) {
    std::byte* b = bases[c].load(std::memory_order_acquire);
    if (b == nullptr) return nullptr;
    if (kind != SegmentKind::Device || mapped_epoch[c].load(std::memory_order_acquire) == epoch) {
      mapped_epoch[c].store(epoch, std::memory_order_release);
      return b;
    }
    unmap_chunk_locked(c);
    return nullptr;
  }

  /// How a chunk is opened: this handle's access, on its mapping GPU.
  OpenOptions chunk_open_options() const noexcept {
    return {.access = access, .wait = {}, .device = mapping_request()};
  }

  /// Where chunk `c`'s maker records which segment it is (PoolChunk::birth). `c` < max_chunks.
  std::atomic_ref<std::uint64_t> birth(std::uint32_t c) const noexcept {
    return std::atomic_ref<std::uint64_t>(block.header().chunks[c].birth);
  }

  /// Installs `seg`, opened by the name of chunk `c`, after checking that it is that chunk: its size and kind, and
  /// the segment its maker recorded (a pool unlinked while in use has no names any more: one made again under its
  /// name has its own chunks under them). Throws InvalidArgument.
  std::byte* install_chunk(std::uint32_t c, Segment seg, std::uint64_t epoch) {
    if (seg.size() < geo().chunk_bytes || seg.kind() != kind) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("pool '{}': segment '{}' is not a chunk of it ({} of {} bytes)", name, seg.name(),
                              to_string(seg.kind()), seg.size()),
                  "resolve");
    }
    const std::uint64_t made = birth(c).load(std::memory_order_acquire);
    if (const auto& map = detail::SegmentAccess::mapping(seg); made != 0 && map->created_unix_ns != made) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("pool '{}': segment '{}' is not its chunk {} but a later segment of that name (the pool "
                              "was unlinked, and its names are anyone's: another pool of its name?); this process "
                              "cannot map that chunk, which its maker's processes still map",
                              name, seg.name(), c),
                  "resolve");
    }
    return install(c, std::move(seg), epoch);
  }

  /// Device pools: the address chunk `c` is mapped at in this process, reserved on first use (under chunks_mutex);
  /// 0 for host kinds.
  std::uint64_t slot_address(std::uint32_t c) {
    if (kind != SegmentKind::Device) return 0;
    if (slots.size() <= c) slots.resize(c + 1);
    if (!slots[c]) {
      cuda::ScopedContext scope(ctx.get());
      slots[c] = core::VaSlot(geo().chunk_bytes, ctx.ordinal());
    }
    return slots[c].address();
  }

  std::byte* install(std::uint32_t c, Segment seg, std::uint64_t epoch) {
    auto* base = static_cast<std::byte*>(seg.data());
    if (chunks.size() <= c) chunks.resize(c + 1);
    chunks[c] = std::move(seg);
    mapped_epoch[c].store(epoch, std::memory_order_release);
    bases[c].store(base, std::memory_order_release);
    return base;
  }

  /// Unmaps chunk `c` in this process (device pools; under chunks_mutex): its VaSlot stays reserved.
  void unmap_chunk_locked(std::uint32_t c) noexcept {
    bases[c].store(nullptr, std::memory_order_release);
    mapped_epoch[c].store(pool_detail::kUnmapped, std::memory_order_release);
    if (c < chunks.size()) chunks[c] = Segment();
  }

  /// The ordinal, in this process, of the GPU a new chunk is made on: device pools find it by the UUID the creator
  /// wrote (ordinals differ between processes that see the GPUs in other orders: CUDA_VISIBLE_DEVICES); pools made
  /// before the UUID was kept use the creator's ordinal; host_pinned ones the ordinal this handle opened with.
  /// Throws Error(NoDevice) when this process does not see that GPU.
  int chunk_device() const {
    // host_pinned: registered (portable) in this process's own context, as its opens register them; the creator's
    // ordinal may name another GPU here, or none.
    if (kind == SegmentKind::HostPinned) return open_device < 0 ? 0 : open_device;
    const auto& uuid = geo().device_uuid;
    if (!gpu_named()) return geo().device;
    if (const auto ordinal = cuda::find_device(uuid)) return *ordinal;
    throw Error(ErrorCode::NoDevice,
                fmt::format("pool '{}' lives on {}, which this process does not see (CUDA_VISIBLE_DEVICES): it "
                            "cannot add memory to it; make that GPU visible",
                            name, cuda::format_uuid(uuid)),
                "allocate");
  }

  /// Device pools: the GPU of this process that maps chunks (`mapper`, chosen at open as opening a chunk would
  /// choose: open_device, else the current context's, else the chunks' GPU); a chunk this member creates is mapped
  /// for it as well as for the GPU it lives on. -1 for host kinds and pools made before the UUID was kept.
  int chunk_mapper() const noexcept { return mapper; }

  /// OpenOptions::device for opening a chunk: the mapping GPU where it was chosen at open, else open_device (host
  /// kinds; device pools made before the UUID was kept, whose chunks name their GPU themselves).
  int mapping_request() const noexcept { return mapper >= 0 ? mapper : open_device; }

  /// Creates (exports) chunk `c`, reserved for this member by the allocator (or backing it again on resume). A
  /// chunk segment left behind by a creator that died after creating it is adopted. Under chunks_mutex.
  std::byte* create_chunk_locked(std::uint32_t c, std::uint64_t epoch) {
    const std::string n = pool_detail::chunk_name(name, c);
    const std::uint64_t at = slot_address(c);
    const std::optional<SegmentInfo> linked = linked_control();
    Segment seg;
    try {
      seg = detail::create_segment(n, geo().chunk_bytes,
                                   {.kind = kind, .device = chunk_device(), .mode = linked ? linked->mode : 0600U}, 0,
                                   {}, at, chunk_mapper());
    } catch (const Error& e) {
      if (e.code() != ErrorCode::AlreadyExists) throw;
      if (!linked) {
        // The pool's names are anyone's now: what is there is not its chunk (another pool of its name made it?).
        throw Error(ErrorCode::AlreadyExists,
                    fmt::format("pool '{}' was unlinked, and segment '{}' is another's (a pool made again under its "
                                "name?): this pool cannot add chunk {}; it has the memory it has",
                                name, n, c),
                    "allocate");
      }
      seg = detail::open_segment(n, {.access = Access::ReadWrite, .wait = {}, .device = mapping_request()}, true, at);
      if (seg.size() < geo().chunk_bytes || seg.kind() != kind) throw;
      check_adoptable(seg);
    }
    birth(c).store(detail::SegmentAccess::mapping(seg)->created_unix_ns, std::memory_order_release);
    const Segment made = seg;
    std::byte* base = install(c, std::move(seg), epoch);
    // After Pool::unlink the pool's names are gone, its chunks' included: a chunk made now (growing, resuming) must
    // not be the one name left, keeping its memory registered after every member has gone. Members that map it
    // keep it, as with the chunks that were unlinked. Asked after the chunk is made: an unlink in between would not
    // have found its name. (By its id: the name may stand for another segment by then.)
    if (!linked_control()) {
      try {
        (void)detail::unlink_if_still_named(made);
      } catch (const Error& e) {
        GPUIPC_LOG_WARN("pool '{}' was unlinked: its new chunk's name '{}' stays ({}); gpuipc rm {}", name, n, e.what(),
                        n);
      }
    }
    return base;
  }

  /// A chunk's segment found made already (the pool's name still names this pool) is adopted only when one of the
  /// pool's members made it and died before it was ready: nobody else maps it, and its owner is this process's uid or
  /// the pool's owner. The broker lets only members make the chunk names of a pool that exists; but a member of an
  /// earlier pool of this name (unlinked, still in use) makes names of its own for a moment, and another user's
  /// segment made before the pool would get the pool's data. Throws AlreadyExists.
  void check_adoptable(const Segment& seg) const {
    const SegmentInfo made = Segment::stat(seg.name());
    if (made.id == seg.id() && made.mapper_count > 1) {
      throw Error(ErrorCode::AlreadyExists,
                  fmt::format("pool '{}': segment '{}' exists and another process maps it, so it is no leftover of "
                              "this pool's (a member of an earlier pool of this name, unlinked, made it?); retry",
                              name, seg.name()),
                  "allocate");
    }
    bool ours = made.id == seg.id() && made.owner_uid == os::current_uid();
    if (!ours && made.id == seg.id()) {
      try {
        const SegmentInfo pool = Segment::stat(name);
        ours = pool.id == control.id() && pool.owner_uid == made.owner_uid;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::NotFound) throw;
      }
    }
    if (ours) return;
    throw Error(ErrorCode::AlreadyExists,
                fmt::format("pool '{}': segment '{}' exists, owned by uid {}, neither this process's nor the pool "
                            "owner's, so it is no chunk of this pool and the pool cannot grow into it; remove it "
                            "(gpuipc rm {}, as uid {} or root)",
                            name, seg.name(), made.owner_uid, seg.name(), made.owner_uid),
                "allocate");
  }

  void create_chunk(std::uint32_t c) {
    std::lock_guard lock(chunks_mutex);
    const std::uint64_t epoch = block.pause_info().epoch;
    create_chunk_locked(c, epoch);
  }

  /// The Timeout error of `call` when the pool lock stayed busy for kLockTimeout.
  Error lock_busy_error(std::string_view call) const {
    return Error(ErrorCode::Timeout, fmt::format("pool '{}': the pool lock stayed busy", name), std::string(call));
  }

  /// The InvalidState error of `call` on a pool that is not active now.
  Error paused_error(std::string_view call) const {
    const auto p = block.pause_info();
    const char* what = p.state == shm::PauseState::Pausing    ? "being paused"
                       : p.state == shm::PauseState::Resuming ? "being resumed"
                                                              : "paused";
    if (p.member == shm::kNoPauser) {
      return Error(ErrorCode::InvalidState,
                   fmt::format("pool '{}': {} refused: the pool is paused and the process that paused it (pid {}) is "
                               "gone, with any contents it saved; call resume() from a member with write access to "
                               "back it with new memory (the blocks' bytes are lost)",
                               name, call, p.pid),
                   std::string(call));
    }
    return Error(ErrorCode::InvalidState,
                 fmt::format("pool '{}': {} refused: the pool is {} by pid {}; wait until that process resumes it "
                             "(Pool::resume), then call refresh() in processes that mapped it before the pause",
                             name, call, what, p.pid),
                 std::string(call));
  }

  /// What the broker says of the pool's name while it still names this pool's control block; nullopt once the
  /// name is gone (Pool::unlink) or names another object.
  std::optional<SegmentInfo> linked_control() const {
    try {
      SegmentInfo info = Segment::stat(name);
      if (info.id == control.id()) return info;
    } catch (const Error&) {
    }
    return std::nullopt;
  }

  /// Counts a hold of this process on the block at `loc`; the first reference takes the shared hold (`take` runs
  /// the shared-memory part). Returns the shared-memory status.
  template <typename Take>
  shm::PoolStatus add_hold(const shm::BlockLocation& loc, Take&& take) {
    std::lock_guard lock(holds_mutex);
    auto it = holds.find(loc.record);
    if (it != holds.end() && it->second.generation == loc.generation) {
      ++it->second.holds;
      return shm::PoolStatus::Ok;
    }
    const shm::PoolStatus st = take();
    if (st == shm::PoolStatus::Ok) holds[loc.record] = Local{loc.generation, 1, false, false};
    return st;
  }

  /// Drops a hold (`owned`: the Block's reference instead); the last reference of this process releases the
  /// shared hold. NotHeld when there is no such reference.
  shm::PoolStatus drop_local(const shm::BlockLocation& loc, bool owned, bool pending_stream) noexcept {
    std::lock_guard lock(holds_mutex);
    auto it = holds.find(loc.record);
    if (it == holds.end() || it->second.generation != loc.generation || (owned ? !it->second.owned : it->second.holds == 0)) {
      return shm::PoolStatus::NotHeld;
    }
    if (owned) {
      it->second.owned = false;
      it->second.pending = pending_stream;
    } else {
      --it->second.holds;
    }
    if (it->second.owned || it->second.holds > 0) return shm::PoolStatus::Ok;
    const bool pending = it->second.pending;
    if (!here()) {  // a forked child's copy: the parent's hold stays the parent's
      holds.erase(it);
      return shm::PoolStatus::Ok;
    }
    const shm::PoolStatus st = block.release(member, loc, pending, pool_detail::kLockTimeout);
    if (st == shm::PoolStatus::LockTimeout) {
      // The shared hold stays, so the local one does too: the call can be made again. (It was dropped: a retry then
      // said "holds no reference", and the block stayed held until the handle closed.)
      if (owned) {
        it->second.owned = true;
        it->second.pending = false;
      } else {
        ++it->second.holds;
      }
      return st;
    }
    if (pending) stream_released.store(true, std::memory_order_relaxed);
    holds.erase(it);
    return st;
  }

  /// What is wrong with `ref` for this pool, or empty.
  std::string check_ref(const BlockRef& ref) const {
    const auto& g = geo();
    if (ref.pool != g.pool_id) {
      return fmt::format("it belongs to pool id {:#x}, not to pool '{}' (id {:#x})", ref.pool, name, g.pool_id);
    }
    if (ref.chunk >= g.max_chunks) return fmt::format("chunk {} is out of range (the pool has {} at most)", ref.chunk, g.max_chunks);
    if (ref.index >= g.max_records) {
      return fmt::format("block index {} is out of range (the pool has {} blocks at most)", ref.index, g.max_records);
    }
    if (ref.size == 0 || ref.offset > g.chunk_bytes || ref.size > g.chunk_bytes - ref.offset) {
      return fmt::format("offset {} and size {} are out of range (chunks are {} bytes)", ref.offset, ref.size,
                         g.chunk_bytes);
    }
    switch (block.check_live(pool_detail::location_of(ref))) {
      case shm::PoolStatus::Ok: return {};
      case shm::PoolStatus::Stale: {
        const auto& r = block.record(ref.index);
        return fmt::format("generation {} of block {} is not live (freed, reused or forged; the block now has "
                           "generation {}, state {})",
                           ref.generation, ref.index, proto::atomic(r.generation).load(), proto::atomic(r.state).load());
      }
      default: return fmt::format("chunk {} does not exist or the reference is malformed", ref.chunk);
    }
  }

  [[noreturn]] void throw_bad_ref(const BlockRef& ref, std::string_view call, const std::string& why) const {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}': {} of BlockRef (chunk {}, offset {}, size {}, generation {}): {}", name, call,
                            ref.chunk, ref.offset, ref.size, ref.generation, why),
                std::string(call));
  }

  /// One allocation attempt loop: Ok with `out` filled, or the status that ended it (`error` says why).
  shm::PoolStatus allocate(std::uint64_t bytes, std::uint64_t alignment, shm::BlockLocation& out, std::string& error) {
    const auto deadline = std::chrono::steady_clock::now() + pool_detail::kChunkWait;
    for (;;) {
      shm::PoolStatus st;
      {
        std::lock_guard lock(alloc_mutex);
        st = block.allocate(member, bytes, alignment, out, scratch, pool_detail::kLockTimeout);
      }
      if (st == shm::PoolStatus::NeedChunk) {
        try {
          create_chunk(out.chunk);
        } catch (const Error& e) {
          block.chunk_created(member, out.chunk, false);
          error = e.what();
          return st;
        }
        block.chunk_created(member, out.chunk, true);
      } else if (st != shm::PoolStatus::ChunkBusy) {
        return st;
      }
      // Also after a chunk made: a pool runs out of chunks to add long before this, unless a member keeps setting
      // chunks back to absent (then this process would make chunks for good).
      if (std::chrono::steady_clock::now() >= deadline) return shm::PoolStatus::LockTimeout;
      if (st == shm::PoolStatus::NeedChunk) continue;
      const std::uint32_t seen = proto::atomic(block.header().wake_seq).load();
      core::futex_sleep(block.header().wake_seq, seen, std::chrono::milliseconds(1));
    }
  }

  /// Wraps an allocated location in a Block; on failure to map the chunk, frees it again.
  Block make_block(const std::shared_ptr<Impl>& self, const shm::BlockLocation& loc) {
    Block b;
    b.m_ref = BlockRef{geo().pool_id, loc.generation, loc.offset, loc.size, loc.chunk, loc.record};
    {
      std::lock_guard lock(holds_mutex);
      holds[loc.record] = Local{loc.generation, 0, true, false};
    }
    try {
      b.m_data = chunk_base(loc.chunk) + loc.offset;
      if (mapped_epoch[loc.chunk].load(std::memory_order_acquire) != block.pause_info().epoch) {
        throw Error(ErrorCode::InvalidState,
                    fmt::format("pool '{}': allocate refused: this process mapped chunk {} before the pool was paused "
                                "and resumed; call refresh() once no kernel of this process uses the pool",
                                name, loc.chunk),
                    "allocate");
      }
    } catch (...) {
      drop_local(loc, true, false);
      throw;
    }
    b.m_pool = self;
    return b;
  }
};

}  // namespace gpuipc
