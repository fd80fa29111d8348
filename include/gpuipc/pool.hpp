// gpuipc::Pool: a named pool of shareable memory — GPU memory (device), pageable host memory (host) or pinned host
// memory (host_pinned) — that hands out blocks between processes. A block travels as a BlockRef (40 bytes,
// trivially copyable: put it in a channel header or any message); another process resolves it to a pointer. The
// pool grows by chunks (segments NAME.chunk.<i>, each exported once); a process maps a chunk the first time it
// resolves a block in it, and keeps it mapped.
//
// Pause and resume (torch_memory_saver's semantics): pause() releases the chunks' memory but keeps the pool's
// name, its blocks and the addresses they have in every process; resume() backs them with memory again (with
// their bytes, when pause was asked to keep them). See docs/pools.md, "Pause and resume".
//
// Lifetimes: a block's memory is never reused while any process holds it. The allocator holds its Block until it
// frees it (the Block's destructor frees it too); another process that resolved a BlockRef takes a hold with hold()
// and gives it back with release(). When a process dies, the broker releases its holds. See docs/pools.md.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/stream.hpp"

namespace gpuipc {

/// How a pool carves its memory.
enum class PoolMode : std::uint8_t {
  Variable = 1,  ///< any size: first fit over the chunks, freed neighbours coalesce; chunks added on demand
  Fixed = 2,     ///< block_count blocks of block_bytes in one chunk (the seed's IPCMemoryPool)
};

/// Options of Pool::create.
struct PoolOptions {
  SegmentKind kind = SegmentKind::Host;  ///< where the blocks live
  int device = 0;                        ///< device kinds: the GPU the chunks live on
  unsigned mode = 0600;                  ///< permission bits of the control block and the chunks (members need rw)
  PoolMode pool_mode = PoolMode::Variable;
  std::size_t chunk_bytes = 64ULL << 20;  ///< variable mode: bytes of each chunk (the largest block possible)
  std::size_t max_bytes = 1ULL << 30;     ///< variable mode: the pool grows up to this many bytes of chunks
                                          ///< (at most 1024 chunks: more is refused)
  std::uint32_t max_blocks = 16384;       ///< variable mode: most blocks live at once (1 to 524288)
  std::size_t block_bytes = 0;            ///< fixed mode: bytes of each block (rounded up to 256)
  std::uint32_t block_count = 0;          ///< fixed mode: number of blocks
};

/// A reference to a block of a pool, valid in any process: pool id, chunk, offset, size, generation (which makes a
/// reference to a freed or reused block detectable) and the block's record index. Trivially copyable.
struct BlockRef {
  std::uint64_t pool = 0;        ///< the pool's id (random, fixed at creation)
  std::uint64_t generation = 0;  ///< unique per allocation in the pool; 0 never names a block
  std::uint64_t offset = 0;      ///< bytes into the chunk
  std::uint64_t size = 0;        ///< bytes asked for
  std::uint32_t chunk = 0;
  std::uint32_t index = 0;       ///< the block's record in the pool's control block
  friend bool operator==(const BlockRef&, const BlockRef&) = default;
};
static_assert(std::is_trivially_copyable_v<BlockRef>);
static_assert(sizeof(BlockRef) == 40);

/// Bytes of an encoded BlockRef.
inline constexpr std::size_t kBlockRefBytes = 40;
/// The little-endian encoding of `ref` (fields in declaration order), for messages between machines of any byte
/// order or languages that do not share the struct.
std::array<std::byte, kBlockRefBytes> encode_block_ref(const BlockRef& ref) noexcept;
/// Decodes an encoded BlockRef. Throws Error(InvalidArgument) naming what is wrong: a length other than 40 bytes,
/// pool id or generation 0, size 0, chunk or index out of range, offset + size past the largest chunk.
BlockRef decode_block_ref(std::span<const std::byte> bytes);

/// Whether a pool's chunks have memory (Pool::pause, Pool::resume).
enum class PoolState : std::uint8_t {
  Active = 0,    ///< the chunks have memory
  Pausing = 1,   ///< a member is saving and releasing the chunks' memory
  Paused = 2,    ///< the chunks' memory is released; addresses, names and blocks are kept
  Resuming = 3,  ///< a member is backing the chunks with new memory
};
/// "active", "pausing", "paused", "resuming".
std::string_view to_string(PoolState state) noexcept;

/// Options of Pool::pause.
struct PauseOptions {
  /// Save the bytes of every live block in this process's host memory (pinned where the driver gives it, for
  /// device pools) and restore them on resume. Without it, the blocks' bytes after resume are undefined (zeros for
  /// host pools).
  bool keep_contents = false;
  /// With keep_contents: resume keeps the host buffer the contents were saved in (pinned, for device pools) instead
  /// of freeing it, and this handle's next pause with keep_contents reuses it when it is large enough. Pinning host
  /// memory is most of a pause's time (seconds for 16 GiB; the copy is a fraction of one): for a pool paused and
  /// resumed again and again (an RL step). The buffer stays this process's memory until the handle goes or a
  /// resume after a pause without keep_buffer.
  bool keep_buffer = false;
};

/// Statistics of a pool (Pool::stats, Pool::stat, `gpuipc stat`).
struct PoolStats {
  std::uint64_t used_bytes = 0;          ///< bytes of live blocks and of freed ones whose stream is not done yet
  std::uint64_t free_bytes = 0;          ///< bytes of the existing chunks not used
  std::uint64_t capacity_bytes = 0;      ///< bytes of the existing chunks
  std::uint64_t max_bytes = 0;           ///< the most the pool may grow to
  std::uint64_t largest_free_block = 0;  ///< the largest block allocate can return without a new chunk
  std::uint32_t chunks = 0;              ///< chunks created
  std::uint32_t max_chunks = 0;
  std::uint32_t live_blocks = 0;
  std::uint32_t draining_blocks = 0;     ///< freed on a stream that has not reached the free yet
  std::uint32_t members = 0;             ///< processes (Pool handles) joined
  std::uint64_t allocations = 0;         ///< since creation
  std::uint64_t frees = 0;
  PoolState state = PoolState::Active;  ///< paused or not (Pool::pause)
  std::uint32_t paused_by_pid = 0;      ///< the process that paused (or is pausing, resuming) it; 0 when active
  bool pauser_gone = false;             ///< paused, and that process left or died: any writer may resume it
  std::uint64_t epoch = 0;              ///< how many times its memory was released (pause)
};

class Block;

/// A handle to a joined pool. Copies share it. Each process that opens a pool joins it as a member (at most 64 at
/// once); the last handle of this process (Blocks included) leaves it.
class Pool {
 public:
  /// Creates pool `name` (a control segment `name` and chunk segments `name`.chunk.<i>) with its first chunk, and
  /// joins it. Throws Error like Segment::create, and InvalidArgument for bad options (names up to 117 characters).
  static Pool create(std::string_view name, const PoolOptions& options = {});
  /// Opens and joins pool `name`; chunks are mapped with `options.access` as blocks in them are resolved. Device
  /// pools: the GPU that maps them (mapping_device()) is chosen here, once, as Segment::open chooses
  /// (`options.device`, else the current context's GPU, else the pool's). Throws Error like Segment::open (NoDevice,
  /// Unsupported for that choice); InvalidArgument when `name` is not a pool; QuotaExceeded with 64 members.
  static Pool open(std::string_view name, const OpenOptions& options = {});
  /// Unlinks the control segment and every chunk. Throws Error(NotFound, PermissionDenied).
  static void unlink(std::string_view name);
  /// The statistics of pool `name`, read from its control block without joining (needs read permission).
  /// Throws Error(NotFound, PermissionDenied, InvalidArgument when it is not a pool).
  static PoolStats stat(std::string_view name);

  Pool() noexcept;
  ~Pool();
  Pool(const Pool&) noexcept;
  Pool& operator=(const Pool&) noexcept;
  Pool(Pool&&) noexcept;
  Pool& operator=(Pool&&) noexcept;

  /// Allocates `bytes` aligned to `alignment` (a power of two up to 4096), adding a chunk when needed. Throws
  /// Error: QuotaExceeded (with used and max bytes) when the pool is full, InvalidArgument for a size above the
  /// chunk (or block) size or a bad alignment, InvalidState while the pool is paused or in a forked child for its
  /// parent's handle (its blocks are the parent's: open the pool again), Timeout when the pool lock stays taken, and
  /// what creating a chunk throws.
  Block allocate(std::size_t bytes, std::size_t alignment = 256);
  /// allocate without exceptions: Ok; WouldBlock when the pool is full; InvalidState for bad arguments, a closed
  /// handle, a paused pool or a forked child's copy of its parent's handle; Timeout when the pool lock stays taken;
  /// DriverError when a new chunk could not be created.
  Status try_allocate(std::size_t bytes, std::size_t alignment, Block& out) noexcept;
  /// Frees `block`. For device and host_pinned pools the memory is reused only after `stream` has passed this
  /// point (like cudaFreeAsync); host pools free at once. `stream` nullptr: the legacy default stream of the calling
  /// thread's current context (on a thread with none, this handle's GPU's: mapping_device() for device pools, the
  /// `device` asked for, else 0, for host_pinned ones). Memory that other processes still hold is reused after they
  /// release it. A block allocated through another handle of the same pool is freed as that handle's. Throws
  /// Error(InvalidArgument) for an empty (already freed, moved-from) block or one of another pool; InvalidState in a
  /// forked child for a block of its parent's handle (the parent's: the child keeps the Block); Cuda when the
  /// stream write fails (the block is then freed when the call returns).
  void free(Block&& block, StreamHandle stream = nullptr);

  /// The address of the block `ref` names (host kinds: host address; device: device address), mapping its chunk the
  /// first time (later calls: no system call, < 1 us). Throws Error(InvalidArgument) naming what is wrong: another
  /// pool, chunk, index or range out of bounds, a generation that is not live (freed, reused or forged);
  /// Error(InvalidState) while the pool is paused, or when this process mapped the chunk before a pause and has not
  /// called refresh() since.
  void* resolve(const BlockRef& ref) const;
  /// Maps the chunks that the blocks `refs` lie in and that this process has not mapped, asking the broker for all
  /// of them in one round trip: before resolving many blocks of a pool met for the first time (a state dict), where
  /// resolve alone would take one round trip per chunk. Refs of another pool, or naming no chunk of it, are
  /// skipped (resolve says what is wrong with them). Throws the Error of the first chunk that could not be mapped,
  /// after mapping the others; resolve tries it again.
  void map_chunks(std::span<const BlockRef> refs) const;
  /// Takes a hold on the block: its memory is not reused until this process releases it (or dies). Holds of one
  /// process are counted. Throws Error(InvalidArgument) like resolve; InvalidState while the pool is paused, or as
  /// allocate in a forked child; Timeout when the pool lock stays taken.
  void hold(const BlockRef& ref);
  /// Gives back one hold. Throws Error(InvalidArgument) when this process holds no reference to the block.
  void release(const BlockRef& ref);

  /// Releases the memory of every chunk, keeping the pool's name, its blocks (Blocks and BlockRefs stay valid) and
  /// the chunks' addresses in this process, then marks the pool paused: until resume(), allocate, hold and resolve
  /// in every member throw Error(InvalidState) naming this process. First waits for this process's work on the
  /// pool's device (cuCtxSynchronize); the caller makes sure no other process still uses the memory. With
  /// `keep_contents`, the bytes of the live blocks are saved in this process's host memory first. Device pools:
  /// the memory of a chunk is returned to the GPU once no other process maps it any more (others let go with
  /// refresh()). Throws Error: PermissionDenied when this handle maps the chunks read-only; InvalidState when the
  /// pool is paused already; Unsupported for host_pinned pools (their pages are pinned in every member: they
  /// cannot be released); Timeout when the pool lock stays taken; what saving or releasing the memory throws (the
  /// pool is then paused, or active again when nothing was released yet).
  void pause(const PauseOptions& options = {});
  /// Backs every chunk with memory again, at the same addresses in this process, and restores the contents pause saved.
  /// Allowed to the handle that paused the pool (another handle, of this process too, is another member), or to any
  /// member with write access once that one is gone (the contents it saved are then lost). Other members call refresh()
  /// before they resolve blocks in chunks they had mapped. Throws Error: InvalidState when the pool is not paused or
  /// another live member paused it; PermissionDenied for a read-only handle; what creating or mapping memory throws
  /// (the pool stays paused).
  void resume();
  /// Whether the pool is paused (or being paused or resumed) now.
  bool paused() const noexcept;
  /// Drops this process's mappings of chunk memory that a pause released (device pools: the GPU memory is freed
  /// once every process let go of it), and, when the pool is active again, maps the new memory at the same
  /// addresses: pointers this process resolved before the pause point at the block's (restored) bytes again.
  /// Call it once no kernel of this process uses the pool. Without it, resolve throws InvalidState for blocks
  /// of a chunk mapped before a pause. Throws Error like resolve's mapping of a chunk.
  void refresh();

  /// Current statistics (a snapshot).
  PoolStats stats() const noexcept;
  const std::string& name() const noexcept;
  SegmentKind kind() const noexcept;
  /// Device pools: the GPU (ordinal in this process) whose context maps the chunks here, the one that can use the
  /// pool's addresses (for memory of another GPU, a peer mapping): chosen when the handle was made
  /// (PoolOptions::device; OpenOptions::device, else the context current at open, else the pool's GPU) and the
  /// same for every chunk whatever context is current when it is mapped. -1 for host kinds.
  int mapping_device() const noexcept;
  /// How this handle maps the chunks: ReadOnly for a pool opened read-only (its memory must not be written).
  Access access() const noexcept;
  /// The pool's id (BlockRef::pool).
  std::uint64_t id() const noexcept;
  /// The owner's uid and gid and the permission bits of the pool's control block (Segment::owner_uid), which
  /// joining it is checked against.
  std::uint32_t owner_uid() const noexcept;
  std::uint32_t owner_gid() const noexcept;
  unsigned mode() const noexcept;
  PoolMode pool_mode() const noexcept;
  /// Bytes of each chunk (variable mode) or of each block (fixed mode).
  std::size_t chunk_bytes() const noexcept;
  std::size_t block_bytes() const noexcept;
  explicit operator bool() const noexcept { return m_impl != nullptr; }

  struct Impl;

 private:
  explicit Pool(std::shared_ptr<Impl> impl) noexcept;
  std::shared_ptr<Impl> m_impl;
};

/// An allocated block, owned by the process that allocated it: move-only; the destructor frees it (at once, not
/// stream-ordered: use Pool::free(std::move(block), stream) when a stream still uses it). Keeps its pool open.
class Block {
 public:
  Block() noexcept;
  Block(Block&& other) noexcept;
  Block& operator=(Block&& other) noexcept;
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block();

  /// Host kinds: the host address. Device: the device address (a CUdeviceptr as a pointer).
  void* data() const noexcept { return m_data; }
  std::size_t size() const noexcept { return m_ref.size; }
  /// What to send to another process.
  const BlockRef& ref() const noexcept { return m_ref; }
  explicit operator bool() const noexcept { return m_pool != nullptr; }

 private:
  friend class Pool;
  std::shared_ptr<Pool::Impl> m_pool;
  BlockRef m_ref;
  void* m_data = nullptr;
};

}  // namespace gpuipc
