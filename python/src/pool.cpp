// gpuipc._gpuipc.Pool and Block: gpuipc::Pool with Python argument conventions. BlockRefs cross this boundary as
// tuples (pool, generation, offset, size, chunk, index), the fields of gpuipc::BlockRef in declaration order.
// python/gpuipc/pool.py wraps both.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "gpuipc/pool.hpp"

#include "common.hpp"
#include "views.hpp"

namespace gpuipc::py {

using namespace nb::literals;

namespace {

using RefTuple = std::tuple<std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint32_t, std::uint32_t>;

BlockRef to_ref(const RefTuple& t) {
  return BlockRef{.pool = std::get<0>(t), .generation = std::get<1>(t), .offset = std::get<2>(t),
                  .size = std::get<3>(t), .chunk = std::get<4>(t), .index = std::get<5>(t)};
}

RefTuple from_ref(const BlockRef& r) { return {r.pool, r.generation, r.offset, r.size, r.chunk, r.index}; }

struct PyPool {
  explicit PyPool(Pool p) : pool(shared_without_gil(std::move(p))) {}
  /// Shared with the blocks, holds and views made from it: the last of them (or this handle, freed without
  /// close()) leaves the pool without the GIL (common.hpp).
  std::shared_ptr<Pool> pool;
  LiveCount<Live::Pool> counted;

  /// The handle, shared: a method that releases the GIL keeps the pool joined while another thread closes this one.
  std::shared_ptr<Pool> get() const {
    if (!pool) raise_closed("pool");
    return pool;
  }
};

/// A Block shared by its Python object and the views made from it (their owner): collecting the object while a
/// view lives (`pool.allocate(n).numpy()`) must not free memory the view still uses (it did, and the next
/// allocations reused it). The last of them frees it, at once, as collection does; free() frees it whatever views
/// are left. Its pool's shared handle stays with it: the pool stays joined (and its chunks mapped) for the views.
struct SharedBlock {
  std::shared_ptr<Pool> pool;
  Block block;
};

/// An allocated block (gpuipc.Block's handle).
struct PyBlock {
  std::shared_ptr<Pool> pool;
  std::shared_ptr<SharedBlock> shared;
  LiveCount<Live::Block> counted;

  bool freed() const noexcept { return !shared || !shared->block; }
  const Block& get() const {
    if (freed()) throw Error(ErrorCode::InvalidArgument, "the block was freed", "block");
    return shared->block;
  }
  /// The block, moved out for a free (InvalidArgument when it was freed already).
  Block take() {
    if (freed()) throw Error(ErrorCode::InvalidArgument, "the block was freed already (a double free?)", "free");
    return std::move(shared->block);
  }
};

bool is_gpu(SegmentKind kind) noexcept { return kind == SegmentKind::Device || kind == SegmentKind::DeviceIpc; }

/// A hold on a block that views own: taken by the constructor, given back when the last view (or DLPack export) of
/// it goes, on whatever thread that happens (DLPack deleters may run without the GIL: no Python here). Made with
/// make_shared, the memory comes first, so a failed allocation leaves no hold behind.
struct HeldBlock {
  std::shared_ptr<Pool> pool;
  BlockRef ref;
  HeldBlock(std::shared_ptr<Pool> p, const BlockRef& r) : pool(std::move(p)), ref(r) { pool->hold(ref); }
  HeldBlock(const HeldBlock&) = delete;
  HeldBlock& operator=(const HeldBlock&) = delete;
  ~HeldBlock() {
    try {
      pool->release(ref);
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the broker releases what a process leaves
    }
  }
};

/// An element type as tensors_of_index takes it: DLPack (code, bits, lanes) and the array-interface typestr.
using Dtype = std::tuple<std::tuple<int, int, int>, std::string>;

/// Holds on several blocks of one pool, given back together (spans_of).
struct HeldBlocks {
  std::shared_ptr<Pool> pool;
  std::vector<BlockRef> refs;
  explicit HeldBlocks(std::shared_ptr<Pool> p) : pool(std::move(p)) {}
  HeldBlocks(const HeldBlocks&) = delete;
  HeldBlocks& operator=(const HeldBlocks&) = delete;
  void hold(const BlockRef& r) {
    pool->hold(r);
    try {
      refs.push_back(r);
    } catch (...) {  // out of memory: give the hold back, or it would never be
      pool->release(r);
      throw;
    }
  }
  ~HeldBlocks() {
    for (const BlockRef& r : refs) {
      try {
        pool->release(r);
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the broker releases what a process leaves
      }
    }
  }
};

/// How many 40-byte BlockRefs `raw` holds; InvalidArgument when it is not a whole number of them.
std::size_t ref_count(const nb::bytes& raw, const char* call) {
  if (raw.size() % kBlockRefBytes != 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} bytes are not a whole number of {}-byte BlockRefs", raw.size(), kBlockRefBytes), call);
  }
  return raw.size() / kBlockRefBytes;
}

/// A bytes view of [address, address + size) of `pool`'s memory that keeps `owner` (the pool, or a hold) alive.
ArrayView block_view(const Pool& pool, std::shared_ptr<const void> owner, std::uintptr_t address, std::size_t size,
                     bool readonly) {
  int device_type = kDLCPU;
  int device_id = 0;
  if (is_gpu(pool.kind())) {
    device_type = kDLCUDA;
    device_id = pool.mapping_device();  // a peer mapping is used from the GPU that mapped it, not the owner's
  }
  return ArrayView::bytes(std::move(owner), address, size, readonly || pool.access() == Access::ReadOnly, device_type,
                         device_id);
}

/// Bytes views of the blocks that `raw` (concatenated BlockRefs) names, each resolved and (with `hold`) held.
/// Releases the GIL while it works.
std::vector<ArrayView> held_views(const std::shared_ptr<Pool>& pool, const std::byte* data, std::size_t n,
                                  bool readonly, bool hold) {
  readonly = readonly || pool->access() == Access::ReadOnly;  // a read-only mapping never gives a writable view
  std::vector<ArrayView> views;
  views.reserve(n);
  GilReleased unlocked;
  for (std::size_t i = 0; i < n; ++i) {
    const BlockRef r = decode_block_ref(std::span(data + i * kBlockRefBytes, kBlockRefBytes));
    std::shared_ptr<const void> owner = pool;
    if (hold) owner = std::make_shared<const HeldBlock>(pool, r);
    const auto address = reinterpret_cast<std::uintptr_t>(pool->resolve(r));
    views.push_back(block_view(*pool, std::move(owner), address, r.size, readonly));
  }
  return views;
}

std::vector<ArrayView> held_views(const std::shared_ptr<Pool>& pool, const nb::bytes& raw, bool readonly, bool hold,
                                  const char* call) {
  return held_views(pool, static_cast<const std::byte*>(raw.data()), ref_count(raw, call), readonly, hold);
}

/// Little-endian int64 words of `b` (a column of a tensor index); InvalidArgument when its size is not whole words.
std::vector<std::int64_t> int64_words(const nb::bytes& b) {
  if (b.size() % 8 != 0) {
    throw Error(ErrorCode::InvalidArgument, "malformed tensor index: a column of partial words", "tensors_of_index");
  }
  static_assert(std::endian::native == std::endian::little, "the index's columns are little-endian");
  std::vector<std::int64_t> out(b.size() / 8);
  if (!out.empty()) std::memcpy(out.data(), b.data(), b.size());
  return out;
}

/// One tensor of a tensor index (gpuipc/_index.py) that is alone on its storage, at its start: it becomes one
/// DLPack capsule whose memory is the storage's.
struct IndexTensor {
  std::size_t tensor;   // its position in the index
  std::size_t storage;  // its storage, relative to the first storage of the call
  std::size_t dtype;
  std::span<const std::int64_t> shape, strides;  // in the tensors column
};

/// The tensors of `flat` (the index's "tensors" column: storage, dtype, framework, offset, ndim, shape, strides per
/// tensor) that tensors_of_index makes: those alone on a storage in [first, first + count), at offset 0, of a dtype
/// with a layout. Their shapes and strides point into `flat`. InvalidArgument for a malformed column (a reader never
/// trusts the index).
std::vector<IndexTensor> index_tensors(const std::vector<std::int64_t>& flat, const std::vector<std::int64_t>& sflat,
                                       std::size_t first, std::size_t count, std::size_t dtypes) {
  const auto bad = [](const std::string& why) {
    return Error(ErrorCode::InvalidArgument, "malformed tensor index: " + why, "tensors_of_index");
  };
  const std::size_t storages = sflat.size() / 4;
  if (sflat.size() % 4 != 0 || first + count > storages) throw bad("storage column");
  std::vector<std::int64_t> users(storages, 0);
  std::vector<std::size_t> alone(storages, SIZE_MAX);  // the tensor each storage holds, when it holds one
  std::vector<IndexTensor> out;
  for (std::size_t k = 0, i = 0; k < flat.size(); ++i) {
    if (flat.size() - k < 5) throw bad("tensor " + std::to_string(i));
    const std::int64_t s = flat[k], d = flat[k + 1], offset = flat[k + 3], nd = flat[k + 4];
    if (s < -1 || s >= static_cast<std::int64_t>(storages) || d < 0 || d >= static_cast<std::int64_t>(dtypes) ||
        offset < 0 || nd < 0 || nd > 64 || static_cast<std::size_t>(2 * nd) > flat.size() - k - 5) {
      throw bad("tensor " + std::to_string(i));
    }
    if (s >= 0 && ++users[s] == 1 && offset == 0) alone[s] = out.size();
    if (s >= 0 && static_cast<std::size_t>(s) >= first && static_cast<std::size_t>(s) < first + count) {
      const auto n = static_cast<std::size_t>(nd);
      const std::span<const std::int64_t> dims(flat.data() + k + 5, 2 * n);
      out.push_back({i, static_cast<std::size_t>(s) - first, static_cast<std::size_t>(d), dims.first(n), dims.last(n)});
    } else if (s >= 0) {
      alone[s] = SIZE_MAX;
    }
    k += 5 + static_cast<std::size_t>(2 * nd);
  }
  std::vector<IndexTensor> fast;
  for (std::size_t j = 0; j < out.size(); ++j) {
    const std::size_t s = out[j].storage + first;
    if (users[s] == 1 && alone[s] == j) fast.push_back(out[j]);
  }
  return fast;
}

nb::dict stats_dict(const PoolStats& s) {
  nb::dict d;
  d["used_bytes"] = s.used_bytes;
  d["free_bytes"] = s.free_bytes;
  d["capacity_bytes"] = s.capacity_bytes;
  d["max_bytes"] = s.max_bytes;
  d["largest_free_block"] = s.largest_free_block;
  d["chunks"] = s.chunks;
  d["max_chunks"] = s.max_chunks;
  d["live_blocks"] = s.live_blocks;
  d["draining_blocks"] = s.draining_blocks;
  d["members"] = s.members;
  d["allocations"] = s.allocations;
  d["frees"] = s.frees;
  d["state"] = std::string(to_string(s.state));
  d["paused_by_pid"] = s.paused_by_pid;
  d["pauser_gone"] = s.pauser_gone;
  d["epoch"] = s.epoch;
  return d;
}

}  // namespace

void bind_pool(nb::module_& m) {
  nb::class_<PyBlock>(m, "Block", "An allocated block of a pool (low level; see gpuipc.Block).")
      .def_prop_ro(
          "ref", [](const PyBlock& b) { return from_ref(b.get().ref()); },
          "(pool, generation, offset, size, chunk, index).")
      .def_prop_ro("address", [](const PyBlock& b) { return reinterpret_cast<std::uintptr_t>(b.get().data()); })
      .def_prop_ro("size", [](const PyBlock& b) { return b.get().size(); })
      .def_prop_ro("freed", [](const PyBlock& b) { return b.freed(); })
      .def_prop_ro("pool_name", [](const PyBlock& b) { return b.pool->name(); })
      .def(
          "free",
          [](PyBlock& b, std::uintptr_t stream) {
            Block gone = b.take();
            // The block's own share of its pool's handle: usable after the Python Pool it came from closed.
            const std::shared_ptr<Pool> pool = b.pool;
            GilReleased unlocked;
            pool->free(std::move(gone), to_stream(stream));
          },
          "stream"_a = 0,
          "Frees the block through its own handle on its pool (stream-ordered for device and "
          "host_pinned pools).")
      .def(
          "view",
          [](const PyBlock& b) {
            const Block& blk = b.get();
            return block_view(*b.pool, b.shared, reinterpret_cast<std::uintptr_t>(blk.data()), blk.size(), false);
          },
          "The block as bytes; keeps the block (and its pool) until the view goes, unless free() frees it first.");

  nb::class_<PyPool>(m, "Pool", "A joined gpuipc pool (low level; see gpuipc.Pool).")
      .def_static(
          "create",
          [](std::string_view name, std::string_view kind, int device, unsigned mode, std::size_t chunk_bytes,
             std::size_t max_bytes, std::uint32_t max_blocks, std::size_t block_bytes, std::uint32_t block_count) {
            PoolOptions o{.kind = parse_kind(kind), .device = device, .mode = mode};
            if (block_bytes != 0 || block_count != 0) {
              o.pool_mode = PoolMode::Fixed;
              o.block_bytes = block_bytes;
              o.block_count = block_count;
            } else {
              o.chunk_bytes = chunk_bytes;
              o.max_bytes = max_bytes;
              o.max_blocks = max_blocks;
            }
            GilReleased unlocked;
            return PyPool(Pool::create(name, o));
          },
          "name"_a, nb::kw_only(), "kind"_a = "host", "device"_a = 0, "mode"_a = 0600, "chunk_bytes"_a = 64ULL << 20,
          "max_bytes"_a = 1ULL << 30, "max_blocks"_a = 16384, "block_bytes"_a = 0, "block_count"_a = 0,
          "Creates and joins pool ``name``; block_bytes/block_count make a fixed-block pool.")
      .def_static(
          "open",
          [](std::string_view name, bool readonly, std::optional<double> wait, std::optional<int> device) {
            return open_in_slices(wait, "pool '" + std::string(name) + "'", [&](std::chrono::milliseconds slice) {
              OpenOptions o{.access = readonly ? Access::ReadOnly : Access::ReadWrite, .wait = slice,
                            .device = device.value_or(-1)};
              return PyPool(Pool::open(name, o));
            });
          },
          "name"_a, nb::kw_only(), "readonly"_a = false, "wait"_a = nb::none(), "device"_a = nb::none(),
          "Opens and joins pool ``name``; chunks are mapped read-only when ``readonly``.")
      .def_static(
          "unlink",
          [](std::string_view name) {
            GilReleased unlocked;
            Pool::unlink(name);
          },
          "name"_a, "Removes the names of the pool's control segment and chunks.")
      .def_static(
          "stat",
          [](std::string_view name) {
            PoolStats s;
            {
              GilReleased unlocked;
              s = Pool::stat(name);
            }
            return stats_dict(s);
          },
          "name"_a, "Statistics of pool ``name`` without joining it, as a dict.")
      .def(
          "allocate",
          [](PyPool& p, std::size_t nbytes, std::size_t alignment) {
            const std::shared_ptr<Pool> pool = p.get();
            PyBlock b{.pool = pool, .shared = std::make_shared<SharedBlock>(), .counted = {}};
            b.shared->pool = pool;
            {
              GilReleased unlocked;
              b.shared->block = pool->allocate(nbytes, alignment);
            }
            return b;
          },
          "nbytes"_a, "alignment"_a = 256, "Allocates a block of ``nbytes``.")
      .def(
          "free",
          [](PyPool& p, PyBlock& b, std::uintptr_t stream) {
            const std::shared_ptr<Pool> pool = p.get();
            Block gone = b.take();
            GilReleased unlocked;
            pool->free(std::move(gone), to_stream(stream));
          },
          "block"_a, "stream"_a = 0, "Frees ``block`` (stream-ordered for device and host_pinned pools).")
      .def(
          "resolve",
          [](PyPool& p, const RefTuple& ref) {
            const std::shared_ptr<Pool> pool = p.get();
            GilReleased unlocked;
            return reinterpret_cast<std::uintptr_t>(pool->resolve(to_ref(ref)));
          },
          "ref"_a, "The address of the block ``ref`` names (maps its chunk the first time).")
      .def(
          "view",
          [](PyPool& p, const RefTuple& ref, bool readonly, bool hold) {
            const std::shared_ptr<Pool> pool = p.get();
            const BlockRef r = to_ref(ref);
            std::shared_ptr<const void> owner;
            std::uintptr_t address = 0;
            {
              GilReleased unlocked;
              owner = pool;
              if (hold) owner = std::make_shared<const HeldBlock>(pool, r);
              address = reinterpret_cast<std::uintptr_t>(pool->resolve(r));
            }
            return block_view(*pool, std::move(owner), address, r.size, readonly);
          },
          "ref"_a, "readonly"_a, "hold"_a = false,
          "The block ``ref`` names as bytes (resolving it). ``hold``: take a hold that the view (and every array\n"
          "or DLPack export made from it) keeps, given back when the last of them goes.")
      .def(
          "views_of",
          [](PyPool& p, nb::bytes raw, bool readonly, bool hold, bool dlpack) {
            // One call for a whole index: decodes the 40-byte refs, holds and resolves each, and makes its view
            // (or, with dlpack, its legacy DLPack capsule) on the pool's mapping GPU (Pool::mapping_device).
            const std::shared_ptr<Pool> pool = p.get();
            const std::vector<ArrayView> views = held_views(pool, raw, readonly, hold, "views_of");
            nb::list out;
            for (const ArrayView& v : views) {
              if (dlpack) {
                out.append(dlpack_export(v, nb::none(), std::nullopt, std::nullopt, std::nullopt));
              } else {
                out.append(nb::cast(v));
              }
            }
            return out;
          },
          "raw"_a, "readonly"_a, "hold"_a, "dlpack"_a,
          "Views of the blocks that ``raw`` (concatenated 40-byte BlockRefs) names, in order, each with a hold when\n"
          "``hold`` (given back when the view and everything made from it go); with ``dlpack``, a DLPack capsule\n"
          "of each instead of a view. Raises InvalidArgument at the first stale or forged ref (holds taken so far\n"
          "are given back).")
      .def(
          "map_chunks",
          [](PyPool& p, nb::bytes raw) {
            const std::shared_ptr<Pool> pool = p.get();
            const auto* data = static_cast<const std::byte*>(raw.data());
            std::vector<BlockRef> refs(ref_count(raw, "map_chunks"));
            for (std::size_t i = 0; i < refs.size(); ++i) {
              refs[i] = decode_block_ref(std::span(data + i * kBlockRefBytes, kBlockRefBytes));
            }
            GilReleased unlocked;
            pool->map_chunks(refs);
          },
          "raw"_a,
          "Maps the chunks that the blocks ``raw`` (concatenated 40-byte BlockRefs) lie in, one broker round trip\n"
          "for all (Pool::map_chunks). Raises the first chunk's error after mapping the others.")
      .def(
          "tensors_of_index",
          [](PyPool& p, nb::bytes raw, std::size_t first, nb::bytes flat_bytes, nb::bytes sflat_bytes,
             const std::vector<std::optional<Dtype>>& dtypes, bool readonly, bool hold) {
            // A typed DLPack capsule per tensor of a tensor index (gpuipc/_index.py), without a Python loop: the
            // tensors alone on a storage of `raw` (the refs of storages first, first + 1, ...), at its start, as
            // (position in the index, typed DLPack capsule over the storage's range of its block). A state dict's open
            // makes one per tensor, so each costs one hold, one export and its capsule: no intermediate views.
            const std::size_t count = ref_count(raw, "tensors_of_index");
            const std::vector<std::int64_t> flat = int64_words(flat_bytes), sflat = int64_words(sflat_bytes);
            std::vector<IndexTensor> fast = index_tensors(flat, sflat, first, count, dtypes.size());
            std::erase_if(fast, [&](const IndexTensor& t) { return !dtypes[t.dtype].has_value(); });
            const std::shared_ptr<Pool> pool = p.get();
            const bool ro = readonly || pool->access() == Access::ReadOnly;
            const int device_type = is_gpu(pool->kind()) ? kDLCUDA : kDLCPU;
            const int device_id = is_gpu(pool->kind()) ? pool->mapping_device() : 0;
            const auto bad = [](const char* why) {
              return Error(ErrorCode::InvalidArgument, std::string("malformed tensor index: ") + why,
                           "tensors_of_index");
            };
            struct Made {
              std::shared_ptr<const void> owner;  // the hold (or the pool) the capsule keeps
              std::uintptr_t address;
              ElementType element;
            };
            std::vector<Made> made;
            made.reserve(fast.size());
            {
              GilReleased unlocked;
              // Without holds, one handle on the pool keeps it joined for every capsule.
              const std::shared_ptr<const void> joined = hold ? nullptr : std::shared_ptr<const void>(pool);
              const auto* data = static_cast<const std::byte*>(raw.data());
              for (const IndexTensor& t : fast) {
                const BlockRef r = decode_block_ref(std::span(data + t.storage * kBlockRefBytes, kBlockRefBytes));
                std::shared_ptr<const void> owner = hold ? std::make_shared<const HeldBlock>(pool, r) : joined;
                const auto address = reinterpret_cast<std::uintptr_t>(pool->resolve(r));
                const auto nbytes = static_cast<std::uint64_t>(sflat[4 * (first + t.storage) + 1]);
                const auto offset = static_cast<std::uint64_t>(sflat[4 * (first + t.storage) + 2]);
                if (offset > r.size || nbytes > r.size - offset) throw bad("a storage outside its block");
                const ElementType element = element_type(std::get<0>(*dtypes[t.dtype]));
                if (offset % element.itemsize() != 0) throw bad("a storage not aligned to its elements");
                if (strided_span(t.shape, t.strides, element.itemsize()) > nbytes)
                  throw bad("a tensor outside its storage");
                made.push_back({std::move(owner), address + offset, element});
              }
            }
            nb::list out;
            for (std::size_t j = 0; j < fast.size(); ++j) {
              const IndexTensor& t = fast[j];
              Made& m = made[j];
              out.append(nb::make_tuple(t.tensor, dlpack_capsule(std::move(m.owner), m.address, device_type, device_id,
                                                                 m.element, t.shape, t.strides, ro, false)));
            }
            return out;
          },
          "raw"_a, "first"_a, "flat"_a, "sflat"_a, "dtypes"_a, "readonly"_a, "hold"_a,
          "The tensors of a tensor index (gpuipc/_index.py) that lie alone at the start of a storage named in\n"
          "``raw`` (the 40-byte refs of storages ``first``, ``first + 1``, ...): [(tensor position, DLPack capsule)].\n"
          "flat, sflat: the index's tensor and storage columns (little-endian int64); dtypes[i]: ((code, bits, lanes), "
          "typestr) of the\n"
          "index's dtype i, or None (those tensors are left out). Raises InvalidArgument for a malformed index or a\n"
          "stale ref (holds taken so far are given back).")
      .def(
          "spans_of",
          [](PyPool& p, nb::bytes raw, bool readonly, bool hold, bool dlpack) {
            // views_of for many blocks at once: one view per chunk (from the first block's start to the last one's
            // end, rounded up to 256 bytes within the chunk) instead of one per block, so that a framework makes
            // one tensor per chunk and cheap views of it. The holds of a chunk's blocks are given back together
            // when the chunk's view (and everything made from it) goes.
            const std::shared_ptr<Pool> pool = p.get();
            const auto* data = static_cast<const std::byte*>(raw.data());
            const std::size_t n = ref_count(raw, "spans_of");
            struct Span {
              std::uint32_t chunk;
              std::uintptr_t base;  // the chunk's address in this process
              std::uint64_t begin, end;
              std::shared_ptr<HeldBlocks> held;
            };
            std::vector<Span> spans;
            std::vector<std::pair<std::size_t, std::uint64_t>> where(n);  // block -> (span, offset into the chunk)
            {
              GilReleased unlocked;
              for (std::size_t i = 0; i < n; ++i) {
                const BlockRef r = decode_block_ref(std::span(data + i * kBlockRefBytes, kBlockRefBytes));
                auto it = std::find_if(spans.begin(), spans.end(), [&](const Span& s) { return s.chunk == r.chunk; });
                if (it == spans.end()) {
                  spans.push_back(Span{r.chunk, 0, r.offset, r.offset + r.size, std::make_shared<HeldBlocks>(pool)});
                  it = spans.end() - 1;
                }
                if (hold) it->held->hold(r);  // a stale ref throws here: the holds taken so far go with `spans`
                it->base = reinterpret_cast<std::uintptr_t>(pool->resolve(r)) - r.offset;
                it->begin = std::min(it->begin, r.offset);
                it->end = std::max(it->end, r.offset + r.size);
                where[i] = {static_cast<std::size_t>(it - spans.begin()), r.offset};
              }
            }
            nb::list views;
            for (const Span& s : spans) {
              const std::uint64_t end = std::min<std::uint64_t>((s.end + 255) / 256 * 256, pool->chunk_bytes());
              std::shared_ptr<const void> owner = s.held;
              ArrayView v =
                  block_view(*pool, std::move(owner), s.base + s.begin, std::max(end, s.end) - s.begin, readonly);
              views.append(dlpack ? dlpack_export(v, nb::none(), std::nullopt, std::nullopt, std::nullopt) : nb::cast(v));
            }
            nb::list span_of;
            nb::list offset_of;
            for (const auto& [k, offset] : where) {
              span_of.append(k);
              offset_of.append(offset - spans[k].begin);
            }
            return nb::make_tuple(views, span_of, offset_of);
          },
          "raw"_a, "readonly"_a, "hold"_a, "dlpack"_a,
          "Like views_of, but one view per chunk: returns (views, span, offset), where block i lies at byte\n"
          "offset[i] of views[span[i]]. Holds (with ``hold``) are given back when the chunk's view and everything\n"
          "made from it go. Raises InvalidArgument at the first stale or forged ref (holds taken so far are given\n"
          "back).")
      .def(
          "hold",
          [](PyPool& p, const RefTuple& ref) {
            const std::shared_ptr<Pool> pool = p.get();
            GilReleased unlocked;
            pool->hold(to_ref(ref));
          },
          "ref"_a, "Takes a hold on the block: its memory is not reused until released.")
      .def(
          "release",
          [](PyPool& p, const RefTuple& ref) {
            const std::shared_ptr<Pool> pool = p.get();
            GilReleased unlocked;
            pool->release(to_ref(ref));
          },
          "ref"_a, "Gives back one hold.")
      .def(
          "pause",
          [](PyPool& p, bool keep_contents, bool keep_buffer) {
            const std::shared_ptr<Pool> pool = p.get();
            GilReleased unlocked;
            pool->pause({.keep_contents = keep_contents, .keep_buffer = keep_buffer});
          },
          nb::kw_only(), "keep_contents"_a = false, "keep_buffer"_a = false,
          "Releases the memory of every chunk, keeping names, blocks and addresses (see gpuipc.Pool.pause).")
      .def(
          "resume",
          [](PyPool& p) {
            const std::shared_ptr<Pool> pool = p.get();
            GilReleased unlocked;
            pool->resume();
          },
          "Backs the chunks with memory again at the same addresses, restoring kept contents.")
      .def(
          "refresh",
          [](PyPool& p) {
            const std::shared_ptr<Pool> pool = p.get();
            GilReleased unlocked;
            pool->refresh();
          },
          "Drops mappings of memory a pause released; maps the new memory at the same addresses once resumed.")
      .def_prop_ro("paused", [](PyPool& p) { return p.get()->paused(); })
      .def(
          "stats", [](PyPool& p) { return stats_dict(p.get()->stats()); }, "Current statistics as a dict.")
      .def_prop_ro("name", [](PyPool& p) { return p.get()->name(); })
      .def_prop_ro("kind", [](PyPool& p) { return std::string(to_string(p.get()->kind())); })
      .def_prop_ro("id", [](PyPool& p) { return p.get()->id(); })
      .def_prop_ro("owner_uid", [](PyPool& p) { return p.get()->owner_uid(); })
      .def_prop_ro("owner_gid", [](PyPool& p) { return p.get()->owner_gid(); })
      .def_prop_ro("mode", [](PyPool& p) { return p.get()->mode(); })
      .def_prop_ro("fixed", [](PyPool& p) { return p.get()->pool_mode() == PoolMode::Fixed; })
      .def_prop_ro("chunk_bytes", [](PyPool& p) { return p.get()->chunk_bytes(); })
      .def_prop_ro("block_bytes", [](PyPool& p) { return p.get()->block_bytes(); })
      .def_prop_ro("closed", [](PyPool& p) { return !p.pool; })
      .def(
          "close",
          [](PyPool& p) {
            p.pool.reset();  // leaves the pool (without the GIL) unless blocks or views keep it
          },
          "Drops this handle; blocks and views keep the pool joined until they go.");

  m.def(
      "_encode_block_ref",
      [](const RefTuple& ref) {
        const auto bytes = encode_block_ref(to_ref(ref));
        return nb::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      },
      "ref"_a, "The 40-byte little-endian encoding of a BlockRef tuple.");
  m.def(
      "_decode_block_ref",
      [](nb::bytes data) {
        return from_ref(decode_block_ref(
            std::span<const std::byte>(reinterpret_cast<const std::byte*>(data.c_str()), data.size())));
      },
      "data"_a, "Decodes 40 bytes into a BlockRef tuple; InvalidArgument naming what is wrong.");
}

}  // namespace gpuipc::py
