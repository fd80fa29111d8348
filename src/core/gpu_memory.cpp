#include "core/gpu_memory.hpp"

#include <fmt/format.h>

#include <map>
#include <mutex>
#include <vector>

#include "base/log.hpp"
#include "core/device_choice.hpp"
#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/vmm.hpp"

namespace gpuipc::core {
namespace {

/// Virtual address space for imported segments. cuMemAddressReserve costs 0.5-0.8 ms per call, so ranges are
/// carved out of large reservations (reserving address space costs no memory) and given back on unmap.
class VaArena {
 public:
  static VaArena& instance() {
    static VaArena* arena = new VaArena();  // NOLINT: process lifetime: mappings may outlive static destructors
    return *arena;
  }

  CUdeviceptr allocate(std::size_t size, std::size_t alignment) {
    std::lock_guard lock(m_mutex);
    for (auto& chunk : m_chunks) {
      if (auto p = chunk.take(size, alignment)) return p;
    }
    const std::size_t chunk_size = std::max(kChunkSize, cuda::round_up(size, kChunkAlignment));
    m_chunks.emplace_back(cuda::reserve_va(chunk_size, kChunkAlignment));
    GPUIPC_LOG_DEBUG("reserved a {} GiB VA arena chunk", chunk_size >> 30);
    return m_chunks.back().take(size, alignment);
  }

  void release(CUdeviceptr ptr, std::size_t size) noexcept {
    std::lock_guard lock(m_mutex);
    for (auto& chunk : m_chunks) {
      if (chunk.owns(ptr)) {
        chunk.give(ptr, size);
        return;
      }
    }
  }

 private:
  static constexpr std::size_t kChunkSize = 256ULL << 30;
  static constexpr std::size_t kChunkAlignment = 2ULL << 20;

  struct Chunk {
    explicit Chunk(cuda::VaRange r) : range(std::move(r)) { free[range.base()] = range.size(); }
    bool owns(CUdeviceptr p) const noexcept { return p >= range.base() && p < range.base() + range.size(); }
    CUdeviceptr take(std::size_t size, std::size_t alignment) {
      for (auto it = free.begin(); it != free.end(); ++it) {
        const CUdeviceptr start = (it->first + alignment - 1) / alignment * alignment;
        const CUdeviceptr end = it->first + it->second;
        if (start + size > end) continue;
        const CUdeviceptr block = it->first;
        free.erase(it);
        if (start > block) free[block] = start - block;
        if (start + size < end) free[start + size] = end - (start + size);
        return start;
      }
      return 0;
    }
    void give(CUdeviceptr p, std::size_t size) {
      auto it = free.emplace(p, size).first;
      auto next = std::next(it);
      if (next != free.end() && it->first + it->second == next->first) {
        it->second += next->second;
        free.erase(next);
      }
      if (it != free.begin()) {
        auto prev = std::prev(it);
        if (prev->first + prev->second == it->first) {
          prev->second += it->second;
          free.erase(it);
        }
      }
    }
    cuda::VaRange range;
    std::map<CUdeviceptr, std::size_t> free;  // start -> length
  };

  std::mutex m_mutex;
  std::vector<Chunk> m_chunks;
};

/// A range of the arena, given back on destruction.
class ArenaRange {
 public:
  ArenaRange(std::size_t size, std::size_t alignment) : m_size(size), m_ptr(VaArena::instance().allocate(size, alignment)) {}
  ArenaRange(const ArenaRange&) = delete;
  ArenaRange& operator=(const ArenaRange&) = delete;
  ~ArenaRange() { VaArena::instance().release(m_ptr, m_size); }
  CUdeviceptr ptr() const noexcept { return m_ptr; }

 private:
  std::size_t m_size;
  CUdeviceptr m_ptr;
};

/// Device memory mapped into this process (constructed with the device's primary context current). Members in acquisition order: destruction unmaps, returns the
/// address range, releases the allocation handle, then the context.
class DeviceMemory final : public GpuMemory {
 public:
  /// Maps at `at` (a VaSlot the caller keeps) when not 0, else in a range of the arena owned here.
  DeviceMemory(int ordinal, cuda::AllocationHandle handle, std::size_t size, std::size_t alignment,
               std::span<const int> access, bool read_only, std::uint64_t at)
      : m_ctx(ordinal),
        m_handle(std::move(handle)),
        m_range(at == 0 ? std::make_unique<ArenaRange>(size, alignment) : nullptr),
        m_mapping(cuda::map(at == 0 ? m_range->ptr() : at, size, m_handle)) {
    cuda::set_access(m_mapping.ptr(), size, access, read_only);
  }
  std::uint64_t device_pointer() const noexcept override { return m_mapping.ptr(); }
  int device() const noexcept override { return m_ctx.ordinal(); }

 private:
  cuda::PrimaryContext m_ctx;  // retained for as long as the mapping exists
  cuda::AllocationHandle m_handle;
  std::unique_ptr<ArenaRange> m_range;  // null when mapped into the caller's VaSlot
  cuda::MemMapping m_mapping;
};

class PinnedMemory final : public GpuMemory {
 public:
  PinnedMemory(int ordinal, void* ptr, std::size_t size, bool read_only) : m_ctx(ordinal) {
    cuda::ScopedContext scope(m_ctx.get());
    m_registration = cuda::HostRegistration::register_memory(ptr, size, read_only);
    m_device_ptr = m_registration.device_pointer();
  }
  std::uint64_t device_pointer() const noexcept override { return m_device_ptr; }
  int device() const noexcept override { return m_ctx.ordinal(); }

 private:
  cuda::PrimaryContext m_ctx;
  cuda::HostRegistration m_registration;
  std::uint64_t m_device_ptr = 0;
};

class BorrowedMemory final : public GpuMemory {
 public:
  BorrowedMemory(std::uint64_t ptr, int ordinal) noexcept : m_ptr(ptr), m_ordinal(ordinal) {}
  std::uint64_t device_pointer() const noexcept override { return m_ptr; }
  int device() const noexcept override { return m_ordinal; }

 private:
  std::uint64_t m_ptr;
  int m_ordinal;
};

std::unique_ptr<GpuMemory> make_device_memory(int ordinal, cuda::AllocationHandle handle, std::size_t size,
                                              std::span<const int> access, bool read_only, std::uint64_t at) {
  const std::size_t alignment = cuda::allocation_granularity(ordinal, false);
  return std::make_unique<DeviceMemory>(ordinal, std::move(handle), size, alignment, access, read_only, at);
}

}  // namespace

struct VaSlot::Range {
  Range(std::size_t bytes, std::size_t alignment) : range(bytes, alignment), size(bytes) {}
  ArenaRange range;
  std::size_t size;
};

VaSlot::VaSlot() noexcept = default;
VaSlot::VaSlot(std::size_t bytes, int ordinal) {
  const std::size_t alignment = cuda::allocation_granularity(ordinal, false);
  m_range = std::make_unique<Range>(cuda::round_up(bytes, alignment), alignment);
}
VaSlot::VaSlot(VaSlot&&) noexcept = default;
VaSlot& VaSlot::operator=(VaSlot&&) noexcept = default;
VaSlot::~VaSlot() = default;
std::uint64_t VaSlot::address() const noexcept { return m_range ? m_range->range.ptr() : 0; }
std::size_t VaSlot::size() const noexcept { return m_range ? m_range->size : 0; }

CreatedDevice create_device_memory(int ordinal, std::size_t bytes, std::uint64_t at, int also_for) {
  const auto info = cuda::query_device(ordinal, false);
  if (!info.vmm || !info.posix_fd_handles) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("GPU {} ({}) cannot export memory as a POSIX fd (VMM {}, POSIX fd handles {}): device "
                            "segments are unavailable on it; use host_pinned segments",
                            ordinal, info.name, info.vmm ? "yes" : "no", info.posix_fd_handles ? "yes" : "no"),
                "create");
  }
  cuda::PrimaryContext ctx(ordinal);
  cuda::ScopedContext scope(ctx.get());
  CreatedDevice out;
  out.size = cuda::round_up(bytes, cuda::allocation_granularity(ordinal, false));
  out.uuid = info.uuid;
  auto handle = cuda::create_exportable(ordinal, out.size);
  out.exported = cuda::export_fd(handle);
  const int both[] = {ordinal, also_for};
  const std::span<const int> access(both, also_for >= 0 && also_for != ordinal ? 2 : 1);
  out.memory = make_device_memory(ordinal, std::move(handle), out.size, access, false, at);
  return out;
}

int mapping_ordinal(const proto::Uuid& owner, int requested) {
  DeviceChoice in;
  in.owner_uuid = cuda::format_uuid(owner);
  in.owner = cuda::find_device(owner);
  in.requested = requested;
  if (cuda::current_context() != nullptr) in.current = cuda::current_ordinal();
  in.device_count = cuda::device_count();
  // -> bool: the matrix is a temporary, and vector<bool>::at gives a proxy into it; returning the proxy (the
  // deduced type) read freed memory after the return and said "no peer access" on an NVLink pair.
  return choose_mapping_device(in, [](int from, int to) -> bool {
    const auto peers = cuda::peer_access_matrix();
    return peers.at(static_cast<std::size_t>(from)).at(static_cast<std::size_t>(to));
  });
}

std::unique_ptr<GpuMemory> import_device_memory(int fd, std::size_t size, const proto::Uuid& owner, int requested,
                                                bool read_only, std::uint64_t at) {
  const int ordinal = mapping_ordinal(owner, requested);
  try {
    cuda::PrimaryContext ctx(ordinal);
    cuda::ScopedContext scope(ctx.get());
    auto handle = cuda::import_fd(fd);
    const int access[] = {ordinal};
    return make_device_memory(ordinal, std::move(handle), size, access, read_only, at);
  } catch (const Error& e) {
    // Memory of a GPU hidden by CUDA_VISIBLE_DEVICES: whether the driver maps it depends on the driver; say why
    // it may have failed.
    if (cuda::find_device(owner)) throw;
    throw Error(e.code(), invisible_owner_message(cuda::format_uuid(owner), ordinal, e.what()), e.call(),
                e.sys_errno(), e.cu_result());
  }
}

std::unique_ptr<GpuMemory> borrow_device_memory(std::uint64_t ptr, int ordinal) {
  return std::make_unique<BorrowedMemory>(ptr, ordinal);
}

std::unique_ptr<GpuMemory> register_host_memory(void* ptr, std::size_t size, int ordinal, bool read_only) {
  return std::make_unique<PinnedMemory>(ordinal, ptr, size, read_only);
}

}  // namespace gpuipc::core
