// Legacy IPC (cuIpcOpenMemHandle) mappings of other processes' cuMemAlloc allocations, opened once per allocation
// and device in this process. Many names can share one allocation (a caching allocator hands out blocks of one
// cudaMalloc), and the driver allows one open of a handle per context: every opener of the same handle shares one
// mapping, counted by shared_ptr references, closed when the last goes.
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "core/gpu_memory.hpp"
#include "cuda/context.hpp"
#include "cuda/legacy_ipc.hpp"
#include "cuda/pointer.hpp"
#include "proto/shm.hpp"

namespace gpuipc::core {
namespace {

/// One open of one handle on one device. Members in acquisition order: the mapping closes before the context goes.
struct LegacyOpen {
  cuda::PrimaryContext ctx;
  cuda::IpcMapping mapping;
  std::uint64_t bytes = 0;  ///< the allocation's size here (cuMemGetAddressRange of the base), 0 if unknown
};

class LegacyCache {
 public:
  static LegacyCache& instance() {
    static LegacyCache* cache = new LegacyCache();  // NOLINT: process lifetime: mappings may outlive statics
    return *cache;
  }

  std::shared_ptr<LegacyOpen> open(std::span<const std::uint8_t> handle, int ordinal) {
    Key key;
    std::memcpy(key.first.data(), handle.data(), key.first.size());
    key.second = ordinal;
    // Opens and closes run under the lock: a close in flight must finish before the same handle is opened again
    // (the driver refuses a second open of a handle that one context still has open).
    std::lock_guard lock(m_mutex);
    if (auto it = m_open.find(key); it != m_open.end()) {
      if (auto live = it->second.lock()) return live;
    }
    auto* fresh = new LegacyOpen{cuda::PrimaryContext(ordinal), {}};  // NOLINT: owned by the shared_ptr below
    std::shared_ptr<LegacyOpen> open(fresh, [this, key](LegacyOpen* o) {
      std::lock_guard relock(m_mutex);
      if (auto it = m_open.find(key); it != m_open.end() && it->second.expired()) m_open.erase(it);
      delete o;  // NOLINT: the deleter of the shared_ptr made above
    });
    cuda::ScopedContext scope(open->ctx.get());
    CUipcMemHandle h{};
    std::memcpy(h.reserved, handle.data(), sizeof h.reserved);
    open->mapping = cuda::IpcMapping::open(h);
    try {
      if (const auto range = cuda::address_range(open->mapping.get()); range && range->base == open->mapping.get()) {
        open->bytes = range->size;
      }
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): bytes stays 0, and the opener refuses the record
    }
    m_open[key] = open;
    return open;
  }

  std::size_t count() {
    std::lock_guard lock(m_mutex);
    std::size_t n = 0;
    for (const auto& [key, weak] : m_open) n += weak.expired() ? 0 : 1;
    return n;
  }

 private:
  using Key = std::pair<std::array<std::uint8_t, proto::kIpcHandleBytes>, int>;
  std::recursive_mutex m_mutex;  // recursive: a failed open drops its shared_ptr, whose deleter locks too
  std::map<Key, std::weak_ptr<LegacyOpen>> m_open;
};

class LegacyMemory final : public GpuMemory {
 public:
  explicit LegacyMemory(std::shared_ptr<LegacyOpen> open) noexcept : m_open(std::move(open)) {}
  std::uint64_t device_pointer() const noexcept override { return m_open->mapping.get(); }
  int device() const noexcept override { return m_open->ctx.ordinal(); }

 private:
  std::shared_ptr<LegacyOpen> m_open;
};

}  // namespace

std::unique_ptr<GpuMemory> open_legacy_memory(std::span<const std::uint8_t> handle, const proto::Uuid& owner,
                                              int requested, std::uint64_t& bytes) {
  if (handle.size() != proto::kIpcHandleBytes) {
    throw Error(ErrorCode::InvalidArgument, "a legacy IPC handle has 64 bytes", "cuIpcOpenMemHandle");
  }
  const int ordinal = mapping_ordinal(owner, requested);
  std::shared_ptr<LegacyOpen> open = LegacyCache::instance().open(handle, ordinal);
  bytes = open->bytes;
  return std::make_unique<LegacyMemory>(std::move(open));
}

std::size_t legacy_open_count() { return LegacyCache::instance().count(); }

}  // namespace gpuipc::core
