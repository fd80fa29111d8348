// gpuipc::Pool: a named pool of shareable memory — GPU memory (device), pageable host memory (host) or pinned host
// memory (host_pinned) — that hands out blocks between processes. A block travels as a BlockRef (40 bytes,
// trivially copyable: put it in a channel header or any message); another process resolves it to a pointer. The
// pool grows by chunks (segments NAME.chunk.<i>, each exported once); a process maps a chunk the first time it
// resolves a block in it, and keeps it mapped.
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
};

class Block;

/// A handle to a joined pool. Copies share it. Each process that opens a pool joins it as a member (at most 64 at
/// once); the last handle of this process (Blocks included) leaves it.
class Pool {
 public:
  /// Creates pool `name` (a control segment `name` and chunk segments `name`.chunk.<i>) with its first chunk, and
  /// joins it. Throws Error like Segment::create, and InvalidArgument for bad options (names up to 117 characters).
  static Pool create(std::string_view name, const PoolOptions& options = {});
  /// Opens and joins pool `name`; chunks are mapped with `options.access` as blocks in them are resolved.
  /// Throws Error like Segment::open; InvalidArgument when `name` is not a pool; QuotaExceeded with 64 members.
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
  /// chunk (or block) size or a bad alignment, Timeout when the pool lock stays taken, and what creating a chunk
  /// throws.
  Block allocate(std::size_t bytes, std::size_t alignment = 256);
  /// allocate without exceptions: Ok; WouldBlock when the pool is full; InvalidState for bad arguments or a
  /// closed handle; Timeout when the pool lock stays taken; DriverError when a new chunk could not be created.
  Status try_allocate(std::size_t bytes, std::size_t alignment, Block& out) noexcept;
  /// Frees `block`. For device and host_pinned pools the memory is reused only after `stream` has passed this
  /// point (like cudaFreeAsync); host pools free at once. Memory that other processes still hold is reused after
  /// they release it. Throws Error(InvalidArgument) for an empty (already freed, moved-from) block or one of another
  /// pool; Cuda when the stream write fails (the block is then freed when the call returns).
  void free(Block&& block, StreamHandle stream = nullptr);

  /// The address of the block `ref` names (host kinds: host address; device: device address), mapping its chunk the
  /// first time (later calls: no system call, < 1 us). Throws Error(InvalidArgument) naming what is wrong: another
  /// pool, chunk, index or range out of bounds, a generation that is not live (freed, reused or forged).
  void* resolve(const BlockRef& ref) const;
  /// Takes a hold on the block: its memory is not reused until this process releases it (or dies). Holds of one
  /// process are counted. Throws Error(InvalidArgument) like resolve; Timeout when the pool lock stays taken.
  void hold(const BlockRef& ref);
  /// Gives back one hold. Throws Error(InvalidArgument) when this process holds no reference to the block.
  void release(const BlockRef& ref);

  /// Current statistics (a snapshot).
  PoolStats stats() const noexcept;
  const std::string& name() const noexcept;
  SegmentKind kind() const noexcept;
  /// The pool's id (BlockRef::pool).
  std::uint64_t id() const noexcept;
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
