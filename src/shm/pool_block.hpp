// The shared state of a pool (gpuipc::Pool) and every transition on it: the layout of its control block (a host
// segment), block allocation and freeing, holds, and the removal of a member (a clean leave in core, or the broker's
// repair when the member's process died). CUDA-free: the broker calls it too.
//
// Robustness rule: every function here takes a control block that any read-write member may have scribbled on. It
// reads the geometry once into locals, checks every index against them, touches shared words only through
// std::atomic_ref, and never loops without a bound: whatever the memory holds, it returns.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpuipc/pool.hpp"
#include "proto/shm.hpp"

namespace gpuipc::shm {

inline constexpr std::uint32_t kPoolMagic = 0x4C504947;  // "GIPL"
/// 2: PoolHeader::record_end bounds every scan of the records (version 1 pools, whose members do not keep it, are
/// refused rather than misread).
inline constexpr std::uint32_t kPoolVersion = 2;
/// Most chunks of one pool.
inline constexpr std::uint32_t kMaxChunks = 1024;
/// Most block records of one pool (the control block stays below the broker's 64 MiB limit).
inline constexpr std::uint32_t kMaxRecords = 1U << 19;
/// The pool-wide lock's owner when the repair (not a member) holds it.
inline constexpr std::uint32_t kRepairOwner = proto::kMaxMembers + 1;

/// How blocks are carved.
enum class PoolMode : std::uint32_t { Variable = 1, Fixed = 2 };

/// BlockRecord::state.
enum class RecordState : std::uint32_t {
  Unused = 0,    ///< free record; its memory range is free
  Claimed = 1,   ///< being filled by the lock holder (only ever seen by a repair that broke a dead owner's lock)
  Live = 2,      ///< allocated; `holders` has a bit per member holding it
  Draining = 3,  ///< no holder left, but the freeing stream has not reached `released` yet: not reusable
};

/// PoolChunk::state.
enum class ChunkState : std::uint32_t { Absent = 0, Creating = 1, Ready = 2 };

/// One block. Its memory is [offset, offset + size) of chunk `chunk`.
struct alignas(64) BlockRecord {
  std::uint32_t state;       ///< RecordState
  std::uint32_t chunk;
  std::uint64_t offset;
  std::uint64_t size;
  std::uint64_t generation;  ///< unique per allocation in the pool (never 0 for a live block)
  std::uint64_t holders;     ///< bit i: member i holds the block (its allocator included, until it frees it)
  std::uint32_t releaser;    ///< member whose stream-ordered free is pending (proto::kNoMember: none)
  std::uint32_t pad0;
  std::uint64_t pad1;
  std::uint64_t released;    ///< GPU-visible: the freeing stream writes `generation` here once past the free
};
static_assert(sizeof(BlockRecord) == 64);
static_assert(offsetof(BlockRecord, released) % 8 == 0);

struct PoolChunk {
  std::uint32_t state;    ///< ChunkState
  std::uint32_t creator;  ///< member creating it (state Creating)
  std::uint64_t bytes;
  std::uint64_t top;      ///< no occupied byte at or above this offset (an upper bound, for bump allocation)
  /// The chunk's segment as the broker registered it (SegmentInfo::created_unix_ns), written by its maker before it
  /// is ready: a member that opens the chunk by name checks that the name still stands for it (after Pool::unlink the
  /// names are anyone's, and a pool made again under the pool's name makes its own chunks under them). 0: not known
  /// (a maker of an earlier release).
  std::uint64_t birth;
};
static_assert(sizeof(PoolChunk) == 32);

/// The control block: this header, then `max_records` BlockRecords. Geometry is written once, before the magic.
struct alignas(64) PoolHeader {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t pool_id;      ///< random, written at creation; every BlockRef carries it
  std::uint32_t mode;         ///< PoolMode
  std::uint32_t kind;         ///< proto::Kind of the chunks
  std::int32_t device;        ///< device kinds: the creator's device ordinal
  std::uint32_t max_chunks;   ///< 1..kMaxChunks
  std::uint64_t chunk_bytes;  ///< bytes of every chunk
  std::uint64_t block_bytes;  ///< fixed mode: bytes of every block (record i is at offset i * block_bytes)
  std::uint32_t max_records;  ///< 1..kMaxRecords
  /// Records at or above it have never been claimed (all Unused): every scan of the records stops there. Raised
  /// under the lock before a record is claimed (a death in between leaves it too high, never too low); find_record
  /// reuses the lowest unused record, so it stays near the most blocks the pool ever had at once.
  std::uint32_t record_end;
  /// device kinds: the UUID of the GPU every chunk lives on (ordinals differ between processes that see the GPUs
  /// in other orders: CUDA_VISIBLE_DEVICES). All zero in pools made before it was kept (use `device` then).
  std::uint8_t device_uuid[16];
  alignas(64) std::uint32_t lock;   ///< 0, or the holder's member index + 1 (kRepairOwner + 1: the repair)
  std::uint32_t wake_seq;           ///< futex word: bumped when memory or a chunk becomes available
  std::uint32_t record_hint;        ///< the lowest record that may be unused: where the search for one starts
  std::uint32_t draining;           ///< a hint: > 0 when some record may be Draining (allocate sweeps them)
  std::uint64_t next_generation;
  std::uint64_t allocations;        ///< counters, for stats
  std::uint64_t frees;
  std::uint64_t deferred;           ///< members whose removal found the lock taken: the next lock holder removes
                                    ///< them and frees their entries
  std::uint32_t pause;              ///< PauseState in bits 0-7, the pausing member in bits 8-15 (kNoPauser: it
                                    ///< left or died while the pool was paused); 0 in pools made before pause
  std::uint32_t pauser_pid;         ///< the pausing process's pid (for messages)
  std::uint64_t epoch;              ///< bumped each time the chunks' memory is released (pause): a mapping made
                                    ///< in an earlier epoch is stale
  alignas(64) proto::Member members[proto::kMaxMembers];
  alignas(64) PoolChunk chunks[kMaxChunks];
};
static_assert(sizeof(PoolHeader) % 64 == 0);
static_assert(offsetof(PoolHeader, members) == 192, "the pause words fill the lock's cache line: layout unchanged");
static_assert(offsetof(PoolHeader, device_uuid) == 56 && offsetof(PoolHeader, lock) == 128,
              "the device UUID took the place of padding: layout unchanged");

/// PoolHeader::pause, bits 0-7. Pools start (and pools of earlier releases read as) Active.
enum class PauseState : std::uint32_t {
  Active = 0,    ///< the chunks have memory
  Pausing = 1,   ///< a member is saving and releasing the chunks' memory: resolve, hold and allocate refuse
  Paused = 2,    ///< the chunks' memory is released (addresses and block records kept)
  Resuming = 3,  ///< a member is backing the chunks with new memory
};
/// PoolHeader::pause, bits 8-15, when no live member paused the pool (it left or died while it was paused).
inline constexpr std::uint32_t kNoPauser = 0xFF;

/// The pause words, read together (lock-free).
struct PauseInfo {
  PauseState state = PauseState::Active;
  std::uint32_t member = kNoPauser;  ///< the pausing member, or kNoPauser
  std::uint32_t pid = 0;
  std::uint64_t epoch = 0;
};

/// Bytes of a control block with `max_records` records.
constexpr std::size_t pool_control_bytes(std::uint32_t max_records) noexcept {
  return sizeof(PoolHeader) + static_cast<std::size_t>(max_records) * sizeof(BlockRecord);
}

/// Geometry, read once from a validated header.
struct PoolGeometry {
  std::uint64_t pool_id = 0;
  PoolMode mode = PoolMode::Variable;
  std::uint32_t kind = 0;
  std::int32_t device = 0;
  std::array<std::uint8_t, 16> device_uuid{};  ///< PoolHeader::device_uuid
  std::uint32_t max_chunks = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t block_bytes = 0;
  std::uint32_t max_records = 0;
};

/// Reads and checks the geometry of the control block at `control` of `size` bytes (magic, version, bounds,
/// the records fitting in `size`). Returns false when it does not validate.
bool read_geometry(const void* control, std::size_t size, PoolGeometry& out) noexcept;
/// The version of a pool control block of any release (PoolHeader::version when the magic is a pool's), or 0.
std::uint32_t pool_version_of(const void* control, std::size_t size) noexcept;

/// Writes the header of a new control block (zeroed memory of pool_control_bytes(g.max_records) bytes), magic
/// last. Chunks start Absent.
void init_pool(void* control, const PoolGeometry& g) noexcept;

/// Outcome of a pool operation.
enum class PoolStatus : std::uint8_t {
  Ok = 0,
  NoSpace,      ///< no free range large enough in the ready chunks, and no chunk left to add
  NeedChunk,    ///< no free range, but chunk `chunk` was reserved for this caller: create it, then chunk_created
  ChunkBusy,    ///< another member is creating a chunk: retry shortly
  NoRecord,     ///< every block record is in use
  Stale,        ///< the block is not live, or has another generation (freed, reused, forged)
  NotHeld,      ///< this member holds no reference to the block
  LockTimeout,  ///< the pool lock stayed taken (a member scribbled on it, or died and is not repaired yet)
  Invalid,      ///< an argument is out of range
  Paused,       ///< the pool is paused (or being paused or resumed): no allocation, hold or pause now
  NotPaused,    ///< resume of a pool that is not paused, or paused by another live member
};

/// An occupied range of a chunk (the allocator's scratch).
struct OccupiedRange {
  std::uint64_t begin;
  std::uint64_t end;
  std::uint32_t chunk;
};

/// Which block a reference names, as seen in shared memory.
struct BlockLocation {
  std::uint32_t chunk = 0;
  std::uint32_t record = 0;
  std::uint64_t offset = 0;
  std::uint64_t size = 0;
  std::uint64_t generation = 0;
};

/// Pool statistics: the public type (include/gpuipc/pool.hpp), filled here from the control block.
using PoolCounts = gpuipc::PoolStats;

/// A process's view of one validated control block: the address and the geometry in locals. Every operation is
/// noexcept and bounded. `member` arguments are member indexes (0..63) of the calling process.
class PoolBlock {
 public:
  PoolBlock() noexcept = default;
  /// Validates (read_geometry); check valid() after.
  PoolBlock(void* control, std::size_t size) noexcept;

  bool valid() const noexcept { return m_header != nullptr; }
  const PoolGeometry& geometry() const noexcept { return m_geo; }
  PoolHeader& header() const noexcept { return *m_header; }
  BlockRecord& record(std::uint32_t i) const noexcept { return m_records[i]; }
  /// Lock-free: records at or above this index are Unused (PoolHeader::record_end, at most max_records).
  std::uint32_t record_end() const noexcept;

  /// Allocates `bytes` aligned to `alignment` (a power of two) for `member`, which becomes its first holder.
  /// NeedChunk: chunk `out.chunk` is reserved for the caller, who creates its memory and calls chunk_created.
  /// `scratch` is reused between calls (variable mode sorts occupied ranges in it).
  PoolStatus allocate(std::uint32_t member, std::uint64_t bytes, std::uint64_t alignment, BlockLocation& out,
                      std::vector<OccupiedRange>& scratch, std::chrono::nanoseconds lock_timeout) noexcept;
  /// The memory of a chunk reserved for `member` exists (`ok`: Creating -> Ready), or could not be made (-> Absent).
  void chunk_created(std::uint32_t member, std::uint32_t chunk, bool ok) noexcept;

  /// Adds `member` to the holders of the live block `loc` names (Stale when it is not live or not that block).
  PoolStatus hold(std::uint32_t member, const BlockLocation& loc, std::chrono::nanoseconds lock_timeout) noexcept;
  /// Removes `member` from its holders. With `pending_stream`, the member's stream writes `released` later: the
  /// block's memory is not reused before that. The last holder gone, the block's range is free again.
  PoolStatus release(std::uint32_t member, const BlockLocation& loc, bool pending_stream,
                     std::chrono::nanoseconds lock_timeout) noexcept;

  /// Lock-free: the pause state, its member and pid, and the epoch.
  PauseInfo pause_info() const noexcept;
  /// Active -> Pausing for `member` (process `pid`). Paused when the pool is not Active.
  PoolStatus begin_pause(std::uint32_t member, std::uint32_t pid, std::chrono::nanoseconds lock_timeout) noexcept;
  /// Pausing -> Paused (`released`: the memory is gone, the epoch moves on) or back to Active (nothing was
  /// released: a failed pause). No-op unless `member` is pausing.
  void end_pause(std::uint32_t member, bool released) noexcept;
  /// Paused -> Resuming for `member`, when it paused the pool or the pauser is gone (kNoPauser). NotPaused when
  /// the pool is not paused or another live member paused it.
  PoolStatus begin_resume(std::uint32_t member, std::uint32_t pid, std::chrono::nanoseconds lock_timeout) noexcept;
  /// Resuming -> Active (`ok`), or back to Paused (a failed resume; the pool stays paused by `member`).
  void end_resume(std::uint32_t member, bool ok) noexcept;
  /// The occupied ranges (live and draining blocks) sorted by chunk and offset, overlaps merged; false when
  /// `scratch` has too little capacity (reserve max_records).
  bool occupied(std::vector<OccupiedRange>& scratch) const noexcept;

  /// Lock-free: whether `loc` names a live block whose chunk is ready (the check resolve makes).
  PoolStatus check_live(const BlockLocation& loc) const noexcept;

  /// Statistics (read without the lock: a snapshot that may be slightly inconsistent under concurrent changes).
  PoolCounts counts() const noexcept;
  /// Largest free range of any ready chunk, from the occupied ranges collected in `scratch` (sorted in place).
  std::uint64_t largest_free(std::vector<OccupiedRange>& scratch) const noexcept;

 private:
  friend int pool_remove_member(void* control, std::size_t size, std::uint32_t member_index, bool keep_pending_frees,
                                std::chrono::nanoseconds lock_wait) noexcept;
  bool lock(std::uint32_t owner, std::chrono::nanoseconds timeout, std::uint32_t breakable = proto::kNoMember) noexcept;
  void unlock() noexcept;
  /// Frees or drains a record that just lost its last holder (under the lock).
  void retire(BlockRecord& r) noexcept;
  /// Draining records whose stream has reached `released` become Unused (under the lock).
  void sweep_drained() noexcept;
  /// Claims the lowest Unused record from the hint on (then from 0), raising record_end first (under the lock).
  bool find_record(std::uint32_t& index) noexcept;
  /// Record `r` -> Unused, and the search hint lowered to it (under the lock).
  void set_unused(BlockRecord& r) noexcept;
  /// Releases every hold of the members whose bits are set in `members`, their pending stream frees (unless
  /// `keep_pending_frees`), chunks they were creating and a pause they made, in one pass (under the lock). Returns
  /// the records that lost a hold.
  int remove_locked(std::uint64_t members, bool keep_pending_frees = false) noexcept;
  /// Finishes the removals recorded in `deferred` (under the lock).
  void remove_deferred() noexcept;
  PoolStatus allocate_fixed(std::uint32_t member, std::uint64_t bytes, BlockLocation& out) noexcept;
  PoolStatus allocate_variable(std::uint32_t member, std::uint64_t bytes, std::uint64_t alignment, BlockLocation& out,
                               std::vector<OccupiedRange>& scratch) noexcept;
  /// Collects the occupied ranges of every record into `scratch`, sorted by chunk and offset; false when
  /// `scratch` has too little capacity (reserve max_records).
  bool collect(std::vector<OccupiedRange>& scratch) const noexcept;
  void commit(std::uint32_t member, std::uint32_t index, std::uint32_t chunk, std::uint64_t offset,
              std::uint64_t bytes, BlockLocation& out) noexcept;

  PoolHeader* m_header = nullptr;
  BlockRecord* m_records = nullptr;
  PoolGeometry m_geo;
};

/// How long a member's removal waits for the pool lock: a process leaving its pool, and the broker repairing a dead
/// member (single-threaded: every other client waits meanwhile). A live member holds the lock for microseconds.
inline constexpr std::chrono::microseconds kLeaveLockWait{5000};
inline constexpr std::chrono::microseconds kRepairLockWait{50};

/// Releases every hold of member `member_index` (a block it was the last holder of is freed, or drained when its
/// stream-ordered free is still pending: a dead process's stream will never write it, so the block is freed), resets
/// a chunk it was creating and, when it died holding the pool lock, breaks the lock and undoes its half-made
/// allocation. The member entry itself is left to the caller (core's release, or the broker's repair). Safe on any
/// memory contents; returns the number of holds released, or -1 when the block does not validate or the lock could
/// not be taken within `lock_wait`: then the removal is recorded in the header and whoever takes the lock next
/// finishes it and frees the member's entry (the caller must leave the entry alone). A removal that finds another
/// recorded already does not wait for the lock at all: it did not come free for that one either (the broker
/// removing a connection's many entries must not wait for each while a member keeps the lock word taken).
///
/// `keep_pending_frees`: the member lives on and leaves while its stream has not reached some of its frees (a close
/// that hands its leave to the broker, which removes it once they have landed or its process has exited): those
/// blocks stay draining, reused only once the stream writes `released`, and the member entry must stay. When the
/// lock stays taken, nothing is recorded and -1 is returned.
int pool_remove_member(void* control, std::size_t size, std::uint32_t member_index, bool keep_pending_frees = false,
                       std::chrono::nanoseconds lock_wait = kLeaveLockWait) noexcept;

/// Lock-free: whether member `member_index` freed blocks on a stream that has not written their `released` yet.
bool pool_member_frees_pending(void* control, std::size_t size, std::uint32_t member_index) noexcept;

/// A stream-ordered free whose stream has not written `released` yet: record `index`, for block `generation`.
struct PendingFree {
  std::uint32_t index = 0;
  std::uint64_t generation = 0;
};

/// Lock-free: the frees of member `member_index` whose stream has not written their `released` yet (a handle that
/// closes with these keeps the control block and the chunks mapped until they have: core/stream_park.hpp). Throws
/// std::bad_alloc.
std::vector<PendingFree> pool_member_pending_frees(void* control, std::size_t size, std::uint32_t member_index);

/// Lock-free: whether the streams of every one of `frees` wrote their `released` (it only grows: a record is used
/// again only after).
bool pool_frees_landed(void* control, std::size_t size, const std::vector<PendingFree>& frees) noexcept;

/// Lock-free: the members (bit i: member i) that freed blocks on a stream that has not written their `released`
/// yet, in one pass over the records.
std::uint64_t pool_members_with_frees_pending(void* control, std::size_t size) noexcept;

/// Lock-free: whether member `member_index` holds a live block or has a stream-ordered free pending, memory its
/// process's GPU work may still be using. False when the block does not validate. The broker asks before it repairs
/// a dead member: a killed process's kernels run on until its exit has torn its contexts down.
bool pool_member_uses_memory(void* control, std::size_t size, std::uint32_t member_index) noexcept;

}  // namespace gpuipc::shm
