#include "gpuipc/pool.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/format.hpp"
#include "base/log.hpp"
#include "core/pool_impl.hpp"
#include "core/segment_internal.hpp"
#include "core/shm_wait.hpp"
#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/trace.hpp"
#include "proto/messages.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc {

using proto::atomic;
using pool_detail::chunk_name;
using pool_detail::kLockTimeout;
using pool_detail::location_of;

namespace {

/// ".chunk.1023"
constexpr std::size_t kChunkSuffix = 11;

void check_pool_name(std::string_view name) {
  if (name.size() + kChunkSuffix > proto::kMaxNameLength) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool name '{}' is longer than {} characters", name, proto::kMaxNameLength - kChunkSuffix),
                "pool");
  }
}


/// The control block's segment kind for chunks of `kind`: host_pinned wherever a stream writes `released`.
SegmentKind control_kind(SegmentKind kind) noexcept {
  return kind == SegmentKind::Host ? SegmentKind::Host : SegmentKind::HostPinned;
}

}  // namespace

namespace {

/// Throws Error(InvalidArgument) unless `control` can be a pool's control block: host memory (a device segment's
/// data() is a device address, which the host must not read), big enough for its header.
void check_host_control(const Segment& control, std::string_view name, const char* call) {
  if (detail::host_readable(control.kind()) && control.size() >= sizeof(shm::PoolHeader)) {
    return;
  }
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("'{}' is not a gpuipc pool: it is a {} segment of {} bytes (a pool's name is its control "
                          "block, host memory; its chunks are NAME.chunk.<k>)",
                          name, to_string(control.kind()), control.size()),
              call);
}

/// Throws Error(InvalidArgument) when the control block is a pool's of another release (another layout version).
void check_release(const Segment& control, std::string_view name, const char* call) {
  if (const auto v = shm::pool_version_of(control.data(), control.size()); v != 0 && v != shm::kPoolVersion) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}' was made by another gpuipc release (its control block is version {}, this "
                            "library reads version {}): use one gpuipc release in every process of a pool, or make "
                            "the pool again with this one",
                            name, v, shm::kPoolVersion),
                call);
  }
}

std::shared_ptr<Pool::Impl> attach(Segment control, const std::string& name, Access access, int device) {
  core::reap_parked();
  auto impl = std::make_shared<Pool::Impl>();
  impl->block = shm::PoolBlock(control.data(), control.size());
  check_release(control, name, "open");
  if (!impl->block.valid()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a gpuipc pool (version {}) or its control block is damaged", name,
                            shm::kPoolVersion),
                "open");
  }
  impl->name = name;
  impl->kind = static_cast<SegmentKind>(impl->block.geometry().kind);
  if (impl->kind != SegmentKind::Host && impl->kind != SegmentKind::HostPinned && impl->kind != SegmentKind::Device) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("pool '{}': unknown chunk kind", name), "open");
  }
  impl->access = access;
  impl->open_device = device;
  impl->bases = std::make_unique<std::atomic<std::byte*>[]>(impl->block.geometry().max_chunks);
  impl->mapped_epoch = std::make_unique<std::atomic<std::uint64_t>[]>(impl->block.geometry().max_chunks);
  for (std::uint32_t c = 0; c < impl->block.geometry().max_chunks; ++c) impl->mapped_epoch[c] = pool_detail::kUnmapped;
  if (impl->stream_ordered()) {
    // A creator's control block is registered; an opener's is registered at its first stream-ordered free. The
    // context is this handle's mapping GPU, never the control mapping's: that mapping is cached per process, and
    // another handle may have registered it for another GPU. A device pool's mapping GPU is chosen here, once, by
    // the rule a chunk's open would apply (the GPU asked for, else the current context's, else the pool's), so
    // that mapping_device() names the GPU every chunk is mapped for even when another context is current at a
    // later resolve or allocate. Older pools without a UUID, and host_pinned pools: the GPU asked for, else 0.
    impl->control_device = control.device_pointer();
    if (impl->gpu_named()) impl->mapper = core::mapping_ordinal(impl->geo().device_uuid, device);
    impl->ctx = cuda::PrimaryContext(impl->mapper >= 0 ? impl->mapper : device < 0 ? 0 : device);
  }
  impl->scratch.reserve(impl->block.geometry().max_records);
  impl->control = std::move(control);
  impl->join();
  return impl;
}

shm::PoolGeometry geometry_for(std::string_view name, const PoolOptions& o) {
  shm::PoolGeometry g;
  g.kind = static_cast<std::uint32_t>(o.kind);
  g.device = o.device;
  auto bad = [&](const std::string& why) {
    return Error(ErrorCode::InvalidArgument, fmt::format("pool '{}': {}", name, why), "create");
  };
  if (o.kind != SegmentKind::Device && o.kind != SegmentKind::Host && o.kind != SegmentKind::HostPinned) {
    throw bad(fmt::format("kind {} is not a pool kind (Device, Host or HostPinned)", static_cast<unsigned>(o.kind)));
  }
  if (o.pool_mode == PoolMode::Fixed) {
    if (o.block_bytes == 0 || o.block_count == 0 || o.block_count > shm::kMaxRecords ||
        o.block_bytes > (std::uint64_t{1} << 40) / o.block_count) {
      throw bad(fmt::format("a fixed pool needs block_bytes > 0 and block_count 1..{}, at most 1 TiB in all",
                            shm::kMaxRecords));
    }
    g.mode = shm::PoolMode::Fixed;
    g.block_bytes = (o.block_bytes + 255) / 256 * 256;
    g.max_records = o.block_count;
    g.max_chunks = 1;
    g.chunk_bytes = g.block_bytes * o.block_count;
  } else if (o.pool_mode == PoolMode::Variable) {
    if (o.chunk_bytes == 0 || o.chunk_bytes > (std::uint64_t{1} << 40) || o.max_bytes < o.chunk_bytes ||
        o.max_blocks == 0 || o.max_blocks > shm::kMaxRecords) {
      throw bad(fmt::format("a variable pool needs 0 < chunk_bytes <= 1 TiB, max_bytes >= chunk_bytes and "
                            "max_blocks 1..{}",
                            shm::kMaxRecords));
    }
    g.mode = shm::PoolMode::Variable;
    g.chunk_bytes = (o.chunk_bytes + 4095) / 4096 * 4096;
    // max_bytes is honoured or refused, never cut: the pool grows whole chunks (of chunk_bytes rounded up to
    // 4096), at most kMaxChunks of them.
    const std::uint64_t chunks = o.max_bytes / g.chunk_bytes;
    if (chunks == 0 || chunks > shm::kMaxChunks) {
      const std::uint64_t least = ((o.max_bytes + shm::kMaxChunks - 1) / shm::kMaxChunks + 4095) / 4096 * 4096;
      throw bad(chunks == 0
                    ? fmt::format("max_bytes {} is less than one chunk ({} bytes: chunk_bytes rounded up to 4096)",
                                  o.max_bytes, g.chunk_bytes)
                    : fmt::format("max_bytes {} is {} chunks of {} bytes, and a pool holds at most {}: raise "
                                  "chunk_bytes to at least {} or lower max_bytes to at most {}",
                                  o.max_bytes, chunks, g.chunk_bytes, shm::kMaxChunks, least,
                                  g.chunk_bytes * shm::kMaxChunks));
    }
    g.max_chunks = static_cast<std::uint32_t>(chunks);
    g.max_records = o.max_blocks;
  } else {
    throw bad("unknown pool_mode");
  }
  // Chunks made later, by any member, go to this GPU: named by UUID, the same in every process.
  if (o.kind == SegmentKind::Device) g.device_uuid = cuda::query_device(o.device, false).uuid;
  std::random_device rd;
  while (g.pool_id == 0) g.pool_id = (std::uint64_t{rd()} << 32) ^ rd();
  return g;
}

}  // namespace

std::string_view to_string(PoolState state) noexcept {
  switch (state) {
    case PoolState::Active:
      return "active";
    case PoolState::Pausing:
      return "pausing";
    case PoolState::Paused:
      return "paused";
    case PoolState::Resuming:
      return "resuming";
  }
  return "?";
}

Pool::Pool() noexcept = default;
Pool::Pool(std::shared_ptr<Impl> impl) noexcept : m_impl(std::move(impl)) {}
Pool::~Pool() = default;
Pool::Pool(const Pool&) noexcept = default;
Pool& Pool::operator=(const Pool&) noexcept = default;
Pool::Pool(Pool&&) noexcept = default;
Pool& Pool::operator=(Pool&&) noexcept = default;

Pool Pool::create(std::string_view name, const PoolOptions& options) {
  GPUIPC_TRACE("gpuipc::Pool::create");
  check_pool_name(name);
  const shm::PoolGeometry g = geometry_for(name, options);
  // The first chunk first, then the control block, filled in before the broker registers its name: a pool
  // anyone can open always has one chunk (and `gpuipc ls` finds pools by it), and nobody sees it half made.
  // Device pools map every chunk at an address of their own (a VaSlot), kept across pause and resume.
  std::optional<cuda::PrimaryContext> ctx;  // retained until the pool holds its own
  core::VaSlot slot0;
  if (options.kind == SegmentKind::Device) {
    ctx.emplace(options.device);
    cuda::ScopedContext scope(ctx->get());
    slot0 = core::VaSlot(g.chunk_bytes, options.device);
  }
  Segment first = detail::create_segment(chunk_name(name, 0), g.chunk_bytes,
                                         {.kind = options.kind, .device = options.device, .mode = options.mode}, 0, {},
                                         slot0.address());
  Segment control;
  try {
    control = detail::create_segment(
        name, shm::pool_control_bytes(g.max_records),
        {.kind = control_kind(options.kind), .device = options.device, .mode = options.mode}, proto::kFlagPool,
        [&](void* block) {
          auto* h = static_cast<shm::PoolHeader*>(block);
          h->chunks[0].bytes = g.chunk_bytes;
          h->chunks[0].birth = detail::SegmentAccess::mapping(first)->created_unix_ns;  // PoolChunk::birth
          atomic(h->chunks[0].state).store(static_cast<std::uint32_t>(shm::ChunkState::Ready));
          shm::init_pool(block, g);
        });
  } catch (...) {
    try {
      (void)detail::unlink_if_still_named(first);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
    }
    throw;
  }
  std::shared_ptr<Pool::Impl> impl;
  try {
    impl = attach(control, std::string(name), Access::ReadWrite, options.device);
  } catch (...) {
    // Joining failed (the broker went away, a quota): nobody can use the pool, so neither name may stay, keeping
    // the next create from it until `gpuipc rm`.
    try {
      (void)detail::unlink_if_still_named(control);
      (void)detail::unlink_if_still_named(first);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the first error is the one to report
    }
    throw;
  }
  {
    std::lock_guard lock(impl->chunks_mutex);
    if (slot0) {
      impl->slots.resize(1);
      impl->slots[0] = std::move(slot0);
    }
    impl->install(0, std::move(first), 0);
  }
  return Pool(std::move(impl));
}

Pool Pool::open(std::string_view name, const OpenOptions& options) {
  GPUIPC_TRACE("gpuipc::Pool::open");
  check_pool_name(name);
  // Members update the control block (holds), whatever access they map the chunks with.
  // Unregistered: pinning the control block costs about 1 ms (4 MiB for 65536 blocks) that a member pays only when
  // it first frees with a stream (Impl::control_gpu).
  Segment control = detail::open_segment(
      name, {.access = Access::ReadWrite, .wait = options.wait, .device = options.device}, false);
  check_host_control(control, name, "open");
  for (int i = 0; i < 1000 && atomic(static_cast<shm::PoolHeader*>(control.data())->magic).load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));  // the creator is filling it in
  }
  return Pool(attach(std::move(control), std::string(name), options.access, options.device));
}

void Pool::unlink(std::string_view name) {
  check_pool_name(name);
  // Its chunks may outlive it (a `gpuipc rm` of the control block alone): still swept.
  const std::optional<Error> missing = detail::unlink_control(name, shm::kPoolMagic, "pool");
  // Every chunk, including one a dead creator made but never marked ready.
  const std::string prefix = std::string(name) + ".chunk.";
  bool swept = false;
  for (const auto& info : Segment::list()) {
    if (info.name.rfind(prefix, 0) != 0 || info.name.size() == prefix.size()) continue;
    if (info.name.find_first_not_of("0123456789", prefix.size()) != std::string::npos) continue;
    pool_detail::unlink_if_present(info.name);
    swept = true;
  }
  if (missing && !swept) throw *missing;
}

PoolStats Pool::stat(std::string_view name) {
  check_pool_name(name);
  Segment control = detail::look_at_segment(name);
  check_host_control(control, name, "stat");
  shm::PoolBlock b(control.data(), control.size());
  check_release(control, name, "stat");
  if (!b.valid()) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("'{}' is not a gpuipc pool", name), "stat");
  }
  return b.counts();
}

Status Pool::try_allocate(std::size_t bytes, std::size_t alignment, Block& out) noexcept {
  GPUIPC_TRACE("gpuipc::Pool::try_allocate");
  if (!m_impl || alignment > 4096 || !m_impl->here()) return Status::InvalidState;
  try {
    shm::BlockLocation loc;
    std::string error;
    switch (m_impl->allocate(bytes, alignment, loc, error)) {
      case shm::PoolStatus::Ok: out = m_impl->make_block(m_impl, loc); return Status::Ok;
      case shm::PoolStatus::NoSpace:
      case shm::PoolStatus::NoRecord: return Status::WouldBlock;
      case shm::PoolStatus::LockTimeout: return Status::Timeout;
      case shm::PoolStatus::NeedChunk: return Status::DriverError;
      case shm::PoolStatus::Paused:
        return Status::InvalidState;
      default: return Status::InvalidState;
    }
  } catch (...) {
    return Status::DriverError;
  }
}

Block Pool::allocate(std::size_t bytes, std::size_t alignment) {
  GPUIPC_TRACE("gpuipc::Pool::allocate");
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "allocate on an empty Pool handle", "allocate");
  auto& im = *m_impl;
  im.check_here("allocate");
  const auto& g = im.geo();
  if (alignment == 0 || alignment > 4096 || (alignment & (alignment - 1)) != 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}': alignment {} is not a power of two up to 4096", im.name, alignment), "allocate");
  }
  const std::uint64_t limit = g.mode == shm::PoolMode::Fixed ? g.block_bytes : g.chunk_bytes;
  if (g.mode == shm::PoolMode::Fixed && g.block_bytes % alignment != 0) {
    // (It said only "cannot allocate N bytes aligned to A".)
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}': its fixed blocks are {} bytes apart, so they are not aligned to {}; create it "
                            "with a block_bytes that is a multiple of {}",
                            im.name, g.block_bytes, alignment, alignment),
                "allocate");
  }
  if (bytes == 0 || bytes > limit) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}': cannot allocate {} bytes: blocks are 1 to {} bytes ({}); create a pool with "
                            "larger {}",
                            im.name, bytes, limit, g.mode == shm::PoolMode::Fixed ? "the block size" : "the chunk size",
                            g.mode == shm::PoolMode::Fixed ? "block_bytes" : "chunk_bytes"),
                "allocate");
  }
  shm::BlockLocation loc;
  std::string error;
  switch (im.allocate(bytes, alignment, loc, error)) {
    case shm::PoolStatus::Ok: return im.make_block(m_impl, loc);
    case shm::PoolStatus::NoSpace:
    case shm::PoolStatus::NoRecord: {
      const auto c = im.block.counts();
      throw Error(ErrorCode::QuotaExceeded,
                  fmt::format("pool '{}' is exhausted: cannot allocate {}; used {} of max {} ({} of {} chunks, {} of "
                              "{} blocks live, largest free block {}); free blocks, or create the pool with a larger "
                              "max_bytes or max_blocks",
                              im.name, human_bytes(bytes), human_bytes(c.used_bytes), human_bytes(c.max_bytes),
                              c.chunks, c.max_chunks, c.live_blocks + c.draining_blocks, g.max_records,
                              human_bytes(c.largest_free_block)),
                  "allocate");
    }
    case shm::PoolStatus::LockTimeout:
      throw Error(ErrorCode::Timeout,
                  fmt::format("pool '{}': the pool lock or a chunk being created by another process stayed busy",
                              im.name),
                  "allocate");
    case shm::PoolStatus::NeedChunk:
      throw Error(ErrorCode::System, fmt::format("pool '{}': cannot add a chunk: {}", im.name, error), "allocate");
    case shm::PoolStatus::Paused:
      throw im.paused_error("allocate");
    default:
      throw Error(ErrorCode::InvalidArgument, fmt::format("pool '{}': cannot allocate {} bytes aligned to {}", im.name,
                                                          bytes, alignment),
                  "allocate");
  }
}

void Pool::free(Block&& block, StreamHandle stream) {
  GPUIPC_TRACE("gpuipc::Pool::free");
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "free on an empty Pool handle", "free");
  if (!block) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}': free of an empty Block (already freed, or moved from): a double free?",
                            m_impl->name),
                "free");
  }
  if (block.m_pool != m_impl && block.m_ref.pool != m_impl->geo().pool_id) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}': free of a block of pool '{}' (id {:#x}); free it through its own pool",
                            m_impl->name, block.m_pool->name, block.m_ref.pool),
                "free");
  }
  // A block allocated through another handle of this pool (another open in this process) is that handle's: its
  // membership holds the block, so its handle frees it. The Block keeps that handle's state alive.
  const std::shared_ptr<Impl> owner = block.m_pool;
  auto& im = *owner;
  im.check_here("free");  // a forked child's copy of a parent's Block: the parent's, which this free would not touch
  const BlockRef ref = block.m_ref;
  // A member registers the control block at its first stream-ordered free. When that fails, the free fails and the
  // caller keeps the Block: freeing it at once could hand its memory out while the stream still uses it.
  const std::uint64_t base = im.stream_ordered() ? im.control_gpu() : 0;
  void* const data = block.m_data;
  block.m_pool.reset();
  block.m_data = nullptr;
  const auto loc = location_of(ref);
  bool pending = false;
  CUresult rc = CUDA_SUCCESS;
  if (im.stream_ordered()) {
    // The memory is reused once the stream has written the block's generation to its `released` word. That word is
    // on the control page, registered portable and device-mapped in ctx: with unified addressing its GPU address is
    // valid in every context (cuMemHostRegister), so stream 0 is the caller's legacy stream, behind the work that
    // used the block there.
    const std::uint64_t word = base + shm::pool_control_bytes(0) +
                               static_cast<std::uint64_t>(ref.index) * sizeof(shm::BlockRecord) +
                               offsetof(shm::BlockRecord, released);
    const cuda::StreamContextScope context(im.ctx.get(), static_cast<CUstream>(stream), cuda::StreamTarget::HostWords);
    rc = context.ok() ? cuda::stream_write_value64(static_cast<CUstream>(stream), word, ref.generation)
                      : CUDA_ERROR_INVALID_CONTEXT;
    pending = rc == CUDA_SUCCESS;
  }
  const shm::PoolStatus st = im.drop_local(loc, true, pending);
  if (st == shm::PoolStatus::LockTimeout) {
    // Nothing was freed: the caller keeps the Block, and may free it again.
    block.m_pool = owner;
    block.m_data = data;
    throw im.lock_busy_error("free");
  }
  if (rc != CUDA_SUCCESS) {
    throw Error(ErrorCode::Cuda,
                fmt::format("pool '{}': cuStreamWriteValue64 for the stream-ordered free failed; the block was freed "
                            "at once",
                            im.name),
                "free", 0, static_cast<int>(rc));
  }
  if (st != shm::PoolStatus::Ok) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("pool '{}': free of block {} (generation {}) failed: {}", im.name, ref.index,
                            ref.generation, st == shm::PoolStatus::LockTimeout ? "the pool lock stayed busy"
                                                                               : "it is no longer live"),
                "free");
  }
}

void* Pool::resolve(const BlockRef& ref) const {
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "resolve on an empty Pool handle", "resolve");
  auto& im = *m_impl;
  if (std::string why = im.check_ref(ref); !why.empty()) im.throw_bad_ref(ref, "resolve", why);
  const auto p = im.block.pause_info();
  if (p.state != shm::PauseState::Active) throw im.paused_error("resolve");
  std::byte* base = im.chunk_base(ref.chunk);
  if (im.mapped_epoch[ref.chunk].load(std::memory_order_acquire) != p.epoch) {
    throw Error(ErrorCode::InvalidState,
                fmt::format("pool '{}': resolve refused: this process mapped chunk {} before the pool was paused and "
                            "resumed (epoch {}, now {}); call refresh() once no kernel of this process uses the "
                            "pool, then resolve again (the block keeps its address)",
                            im.name, ref.chunk, im.mapped_epoch[ref.chunk].load(), p.epoch),
                "resolve");
  }
  return base + ref.offset;
}

void Pool::map_chunks(std::span<const BlockRef> refs) const {
  GPUIPC_TRACE("gpuipc::Pool::map_chunks");
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "map_chunks on an empty Pool handle", "map_chunks");
  auto& im = *m_impl;
  std::vector<std::uint32_t> chunks;
  for (const BlockRef& r : refs) {
    if (r.pool != im.geo().pool_id || r.chunk >= im.geo().max_chunks || !im.unmapped(r.chunk)) continue;
    if (std::find(chunks.begin(), chunks.end(), r.chunk) == chunks.end()) chunks.push_back(r.chunk);
  }
  if (chunks.empty()) return;
  std::lock_guard lock(im.chunks_mutex);
  auto failed = im.map_chunks_locked(chunks);
  if (!failed.empty()) throw std::move(failed.front().second);
}

void Pool::hold(const BlockRef& ref) {
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "hold on an empty Pool handle", "hold");
  auto& im = *m_impl;
  im.check_here("hold");
  if (std::string why = im.check_ref(ref); !why.empty()) im.throw_bad_ref(ref, "hold", why);
  const auto loc = location_of(ref);
  if (im.block.pause_info().state != shm::PauseState::Active) throw im.paused_error("hold");
  const shm::PoolStatus st = im.add_hold(loc, [&] { return im.block.hold(im.member, loc, kLockTimeout); });
  if (st == shm::PoolStatus::LockTimeout) {
    throw im.lock_busy_error("hold");
  }
  if (st == shm::PoolStatus::Paused) throw im.paused_error("hold");
  if (st != shm::PoolStatus::Ok) im.throw_bad_ref(ref, "hold", im.check_ref(ref) + " (freed meanwhile)");
}

void Pool::release(const BlockRef& ref) {
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "release on an empty Pool handle", "release");
  auto& im = *m_impl;
  if (ref.pool != im.geo().pool_id) im.throw_bad_ref(ref, "release", im.check_ref(ref));
  const shm::PoolStatus st = im.drop_local(location_of(ref), false, false);
  if (st == shm::PoolStatus::NotHeld) {
    im.throw_bad_ref(ref, "release", "this process holds no reference to it (a release without hold, or twice)");
  }
  if (st == shm::PoolStatus::LockTimeout) {
    throw im.lock_busy_error("release");
  }
  if (st != shm::PoolStatus::Ok) im.throw_bad_ref(ref, "release", im.check_ref(ref));
}

PoolStats Pool::stats() const noexcept { return m_impl ? m_impl->block.counts() : PoolStats{}; }
const std::string& Pool::name() const noexcept {
  static const std::string kEmpty;
  return m_impl ? m_impl->name : kEmpty;
}
SegmentKind Pool::kind() const noexcept { return m_impl ? m_impl->kind : SegmentKind::Host; }
int Pool::mapping_device() const noexcept {
  return m_impl && m_impl->kind == SegmentKind::Device ? m_impl->ctx.ordinal() : -1;
}
Access Pool::access() const noexcept { return m_impl ? m_impl->access : Access::ReadOnly; }
std::uint64_t Pool::id() const noexcept { return m_impl ? m_impl->geo().pool_id : 0; }
std::uint32_t Pool::owner_uid() const noexcept { return m_impl ? m_impl->control.owner_uid() : 0; }
std::uint32_t Pool::owner_gid() const noexcept { return m_impl ? m_impl->control.owner_gid() : 0; }
unsigned Pool::mode() const noexcept { return m_impl ? m_impl->control.mode() : 0; }
PoolMode Pool::pool_mode() const noexcept {
  return m_impl && m_impl->geo().mode == shm::PoolMode::Fixed ? PoolMode::Fixed : PoolMode::Variable;
}
std::size_t Pool::chunk_bytes() const noexcept { return m_impl ? m_impl->geo().chunk_bytes : 0; }
std::size_t Pool::block_bytes() const noexcept { return m_impl ? m_impl->geo().block_bytes : 0; }

Block::Block() noexcept = default;
Block::Block(Block&& other) noexcept
    : m_pool(std::move(other.m_pool)), m_ref(other.m_ref), m_data(std::exchange(other.m_data, nullptr)) {}
Block& Block::operator=(Block&& other) noexcept {
  if (this != &other) {
    Block old(std::move(*this));
    m_pool = std::move(other.m_pool);
    m_ref = other.m_ref;
    m_data = std::exchange(other.m_data, nullptr);
  }
  return *this;
}
Block::~Block() {
  if (m_pool) m_pool->drop_local(location_of(m_ref), true, false);
}

}  // namespace gpuipc
