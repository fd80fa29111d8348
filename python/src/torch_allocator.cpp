// A PyTorch pluggable allocator over a gpuipc Pool (gpuipc.torch.MemPool): torch loads this extension's shared
// object again by path (torch.cuda.memory.CUDAPluggableAllocator), which gives back the same loaded module, and
// calls the two C functions below for every allocation made under `torch.cuda.use_mem_pool(pool)`. So every
// parameter and buffer built there lives in a named, shareable pool, born shareable: another process resolves
// its BlockRef with no copy.
//
// The C functions get no context but the device, so there is one active pool per device and process.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "gpuipc/pool.hpp"

#include "common.hpp"
#include "views.hpp"

namespace gpuipc::py {
namespace {

constexpr int kMaxDevices = 64;

/// Blocks that must not be freed at once (DevicePool::unfreed): let go of by leaking them, never by ~Block, which
/// frees at once. The process's exit gives them back (the broker releases what a process leaves).
struct KeptBlocks {
  std::vector<Block> blocks;
  KeptBlocks() = default;
  KeptBlocks(const KeptBlocks&) = delete;
  KeptBlocks& operator=(const KeptBlocks&) = delete;
  KeptBlocks(KeptBlocks&& other) noexcept : blocks(std::move(other.blocks)) { other.blocks.clear(); }
  KeptBlocks& operator=(KeptBlocks&& other) noexcept {
    leak();
    blocks = std::move(other.blocks);
    other.blocks.clear();
    return *this;
  }
  ~KeptBlocks() { leak(); }
  void leak() noexcept {
    for (Block& b : blocks) (void)new (std::nothrow) Block(std::move(b));
    blocks.clear();
  }
};

/// One device's pool and the blocks torch holds in it, by address (ordered: a tensor's storage is found by the
/// block that contains its address).
struct DevicePool {
  Pool pool;
  std::map<std::uintptr_t, Block> blocks;
  std::size_t failures = 0;  // allocations refused (torch then reports out of memory)
  // Blocks torch gave back that the pool refused to free (its lock stayed taken): kept allocated for the process's
  // life, since freeing them at once could hand their memory out while torch's stream still uses it (and the stream
  // may be gone by the time a retry could name it).
  KeptBlocks unfreed;
};

std::mutex& pools_mutex() {
  static std::mutex m;
  return m;
}

std::map<int, DevicePool>& pools() {
  static std::map<int, DevicePool> p;
  return p;
}

/// How many blocks torch has given back through gpuipc_torch_free in this process: a holder of a block's ref
/// (gpuipc.pool._TorchBlock) looks the block up again only when this moved.
std::atomic<std::uint64_t>& torch_frees() {
  static std::atomic<std::uint64_t> n{0};
  return n;
}

void check_device(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw Error(ErrorCode::InvalidArgument, "gpuipc.torch: device " + std::to_string(device) + " is out of range",
                "torch");
  }
}

/// The device's active pool (a handle sharing it), or Error(InvalidState) naming `call`.
Pool active_pool(int device, const char* call) {
  check_device(device);
  std::lock_guard lock(pools_mutex());
  auto it = pools().find(device);
  if (it == pools().end()) {
    throw Error(ErrorCode::InvalidState,
                std::string("gpuipc.torch: ") + call + ": device " + std::to_string(device) +
                    " has no active MemPool in this process; make one with gpuipc.torch.MemPool",
                call);
  }
  return it->second.pool;
}

}  // namespace

void bind_torch_allocator(nb::module_& m) {
  m.def(
      "_torch_pool_attach",
      [](const std::string& name, int device, bool create, std::size_t chunk_bytes, std::size_t max_bytes,
         std::uint32_t max_blocks, unsigned mode) {
        check_device(device);
        std::lock_guard lock(pools_mutex());
        auto& all = pools();
        if (auto it = all.find(device); it != all.end() && !it->second.blocks.empty()) {
          throw Error(ErrorCode::AlreadyExists,
                      "gpuipc.torch: device " + std::to_string(device) + " already has an active pool '" +
                          it->second.pool.name() + "' holding tensors; free them (or detach it) first",
                      "torch");
        }
        PoolOptions o;
        o.kind = SegmentKind::Device;
        o.device = device;
        o.mode = mode;
        o.chunk_bytes = chunk_bytes;
        o.max_bytes = max_bytes;
        o.max_blocks = max_blocks;
        DevicePool dp;
        dp.pool = create ? Pool::create(name, o) : Pool::open(name, {.access = Access::ReadWrite, .device = device});
        all[device] = std::move(dp);
      },
      nb::arg("name"), nb::arg("device"), nb::arg("create"), nb::arg("chunk_bytes"), nb::arg("max_bytes"),
      nb::arg("max_blocks"), nb::arg("mode"),
      "Makes pool `name` (created, or opened) the one torch allocations on `device` come from.");
  m.def(
      "_torch_pool_detach",
      [](int device) {
        check_device(device);
        std::lock_guard lock(pools_mutex());
        auto it = pools().find(device);
        if (it == pools().end()) return std::size_t{0};
        const std::size_t live = it->second.blocks.size();
        if (live == 0) pools().erase(it);
        return live;
      },
      nb::arg("device"), "Drops the device's active pool when torch holds nothing in it; returns the live blocks.");
  m.def(
      "_torch_block_view",
      [](std::uintptr_t address) -> std::optional<ArrayView> {
        std::lock_guard lock(pools_mutex());
        for (auto& [device, dp] : pools()) {
          auto it = dp.blocks.find(address);
          if (it == dp.blocks.end()) continue;
          // Where the allocator mapped it, through its own handle: a second handle of the pool (opened to resolve
          // the block) mapped the chunk again at other addresses, which a pause of the MemPool did not release and
          // after whose resume it refused every use (InvalidState, refresh() on a handle nobody could reach).
          return ArrayView::bytes(std::make_shared<const Pool>(dp.pool), address, it->second.size(), false, kDLCUDA,
                                  dp.pool.mapping_device());
        }
        return std::nullopt;
      },
      nb::arg("address"),
      "The block torch holds at `address` (its first byte) as bytes, where the allocator mapped it; None when "
      "there is none (torch gave it back).");
  m.def(
      "_torch_block_of",
      [](std::uintptr_t address) -> std::optional<std::tuple<nb::bytes, std::uintptr_t, std::string>> {
        std::lock_guard lock(pools_mutex());
        for (auto& [device, dp] : pools()) {
          auto it = dp.blocks.upper_bound(address);
          if (it == dp.blocks.begin()) continue;
          --it;
          if (address >= it->first + it->second.size()) continue;
          const auto bytes = encode_block_ref(it->second.ref());
          return std::make_tuple(nb::bytes(bytes.data(), bytes.size()), it->first, dp.pool.name());
        }
        return std::nullopt;
      },
      nb::arg("address"),
      "(encoded BlockRef, block address, pool name) of the torch block containing `address`, or None.");
  m.def(
      "_torch_frees", [] { return torch_frees().load(std::memory_order_acquire); },
      "How many blocks torch has freed through the pluggable allocator in this process (it only grows).");
  m.def(
      "_torch_pool_pause",
      [](int device, bool keep_contents, bool keep_buffer) {
        Pool pool = active_pool(device, "pause");
        GilReleased unlocked;
        pool.pause({.keep_contents = keep_contents, .keep_buffer = keep_buffer});
      },
      nb::arg("device"), nb::arg("keep_contents"), nb::arg("keep_buffer") = false,
      "Pauses the device's active pool (Pool::pause): its GPU memory is released, tensor addresses kept.");
  m.def(
      "_torch_pool_resume",
      [](int device) {
        Pool pool = active_pool(device, "resume");
        GilReleased unlocked;
        pool.resume();
      },
      nb::arg("device"), "Resumes the device's active pool (Pool::resume) at the same addresses.");
  m.def(
      "_torch_pool_paused", [](int device) { return active_pool(device, "paused").paused(); }, nb::arg("device"),
      "Whether the device's active pool is paused.");
  m.def(
      "_torch_pool_stats",
      [](int device) -> std::optional<std::tuple<std::size_t, std::size_t, std::size_t>> {
        std::lock_guard lock(pools_mutex());
        auto it = pools().find(device);
        if (it == pools().end()) return std::nullopt;
        return std::make_tuple(it->second.blocks.size(), it->second.pool.stats().used_bytes, it->second.failures);
      },
      nb::arg("device"), "(blocks torch holds, used bytes of the pool, refused allocations) of the device's pool.");
}

}  // namespace gpuipc::py

// torch.cuda.memory.CUDAPluggableAllocator's entry points (c10: void* (size_t, int, cudaStream_t) and
// void (void*, size_t, int, cudaStream_t)). Exported from the extension, which is built with hidden visibility.
extern "C" {

__attribute__((visibility("default"))) void* gpuipc_torch_alloc(std::size_t size, int device, void* stream) {
  (void)stream;  // a fresh block is not in use by any stream
  using namespace gpuipc::py;
  std::lock_guard lock(pools_mutex());
  auto it = pools().find(device);
  if (it == pools().end() || size == 0) return nullptr;
  gpuipc::Block block;
  if (it->second.pool.try_allocate(size, 512, block) != gpuipc::Status::Ok) {
    ++it->second.failures;
    return nullptr;  // torch raises OutOfMemoryError
  }
  void* p = block.data();
  it->second.blocks.emplace(reinterpret_cast<std::uintptr_t>(p), std::move(block));
  return p;
}

__attribute__((visibility("default"))) void gpuipc_torch_free(void* ptr, std::size_t size, int device, void* stream) {
  (void)size;
  using namespace gpuipc::py;
  std::lock_guard lock(pools_mutex());
  auto it = pools().find(device);
  if (it == pools().end()) return;
  auto b = it->second.blocks.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (b == it->second.blocks.end()) return;
  gpuipc::Block block = std::move(b->second);
  it->second.blocks.erase(b);
  torch_frees().fetch_add(1, std::memory_order_release);
  try {
    // Stream-ordered, like cudaFreeAsync: the memory is reused once `stream` has passed this point (and no other
    // process holds it).
    it->second.pool.free(std::move(block), static_cast<gpuipc::StreamHandle>(stream));
  } catch (...) {
    // Refused (LockTimeout): the Block is handed back, and letting it go here would free it at once, under the
    // stream. Kept instead (a failed stream write frees it at once inside free, which says so: nothing to keep).
    if (block) {
      try {
        it->second.unfreed.blocks.push_back(std::move(block));
      } catch (...) {
        (void)new (std::nothrow) gpuipc::Block(std::move(block));  // leaked rather than freed under the stream
      }
    }
  }
}

}  // extern "C"
