// The VMM primitives device segments are built on (docs/segments.md, Kinds): physical allocations (cuMemCreate),
// their export and import as POSIX fds, reserved virtual address ranges, mappings and access rights. None of these
// calls needs a current context.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <span>

#include "cuda/unique_handle.hpp"
#include "os/fd.hpp"

namespace gpuipc::cuda {

/// A physical allocation (CUmemGenericAllocationHandle); cuMemRelease on destruction. The memory itself lives
/// until every handle, exported fd and mapping of it is gone.
class AllocationHandle {
 public:
  AllocationHandle() noexcept = default;
  /// Takes ownership of `handle`.
  explicit AllocationHandle(CUmemGenericAllocationHandle handle) noexcept : m_owned(Owned{handle, true}) {}

  CUmemGenericAllocationHandle get() const noexcept { return m_owned.get().handle; }
  bool valid() const noexcept { return !m_owned.empty(); }
  explicit operator bool() const noexcept { return valid(); }

 private:
  struct Owned {
    CUmemGenericAllocationHandle handle = 0;
    bool valid = false;  // 0 may be a valid handle
    bool operator==(const Owned&) const = default;
  };
  struct Release {
    void operator()(const Owned& owned) const noexcept;
  };
  UniqueHandle<Owned, Release> m_owned;
};

/// A range of GPU addresses and its size: what a VaRange or MemMapping owns.
struct AddressSpan {
  CUdeviceptr ptr = 0;
  std::size_t size = 0;
  bool operator==(const AddressSpan&) const = default;
};

/// A reserved range of virtual addresses; cuMemAddressFree on destruction (unmap what is mapped in it first:
/// declare the MemMapping after the VaRange so it is destroyed before).
class VaRange {
 public:
  VaRange() noexcept = default;
  /// Takes ownership of a range from cuMemAddressReserve.
  VaRange(CUdeviceptr base, std::size_t size) noexcept : m_owned(AddressSpan{base, size}) {}

  CUdeviceptr base() const noexcept { return m_owned.get().ptr; }
  std::size_t size() const noexcept { return m_owned.get().size; }
  explicit operator bool() const noexcept { return base() != 0; }

 private:
  struct Release {
    void operator()(const AddressSpan& range) const noexcept;
  };
  UniqueHandle<AddressSpan, Release> m_owned;
};

/// An allocation mapped at an address; cuMemUnmap on destruction.
class MemMapping {
 public:
  MemMapping() noexcept = default;
  /// Takes ownership of a mapping made by cuMemMap.
  MemMapping(CUdeviceptr ptr, std::size_t size) noexcept : m_owned(AddressSpan{ptr, size}) {}

  CUdeviceptr ptr() const noexcept { return m_owned.get().ptr; }
  std::size_t size() const noexcept { return m_owned.get().size; }
  explicit operator bool() const noexcept { return ptr() != 0; }

 private:
  struct Release {
    void operator()(const AddressSpan& mapping) const noexcept;
  };
  UniqueHandle<AddressSpan, Release> m_owned;
};

/// cuMemGetAllocationGranularity for pinned device memory of `ordinal` with POSIX-fd handles: the minimum, or
/// the recommended (better performance) when `recommended`. Sizes passed to create_exportable must be multiples
/// of the minimum. Throws Error.
std::size_t allocation_granularity(int ordinal, bool recommended);

/// Rounds `size` up to a multiple of `granularity` (a power of two or not). Throws Error(InvalidArgument) on
/// overflow.
std::size_t round_up(std::size_t size, std::size_t granularity);

/// cuMemCreate of `size` bytes (already a multiple of allocation_granularity(ordinal, false): else
/// Error(InvalidArgument)) of pinned memory on device `ordinal`, exportable as a POSIX fd, and also as a fabric
/// handle when `fabric` is true and the device supports fabric handles (if the driver then refuses fabric, e.g.
/// no IMEX channel, it falls back to POSIX fd only, logged at info). Throws Error naming size and device
/// ("out of GPU memory" when it is).
AllocationHandle create_exportable(int ordinal, std::size_t size, bool fabric = false);

/// cuMemExportToShareableHandle as a POSIX fd (costs 0.6-0.8 ms: export once). The fd keeps the memory alive on
/// its own, in any process that holds it, CUDA or not. The driver returns it close-on-exec (driver 580; checked by
/// tests/gpu/test_cuda_layer.cpp). Throws Error.
os::UniqueFd export_fd(const AllocationHandle& handle);

/// cuMemImportFromShareableHandle of a POSIX fd from export_fd (any process). The caller keeps (and closes) its
/// fd. Throws Error.
AllocationHandle import_fd(int fd);

/// cuMemAddressReserve of `size` bytes aligned to `alignment` (0: the driver's default), anywhere. Throws Error.
VaRange reserve_va(std::size_t size, std::size_t alignment);

/// cuMemMap of `size` bytes of `handle`, from `offset` into the allocation, at `at` (inside a VaRange). The
/// mapping is not accessible until set_access. Throws Error.
MemMapping map(CUdeviceptr at, std::size_t size, const AllocationHandle& handle, std::size_t offset = 0);

/// cuMemSetAccess over [ptr, ptr + size): one descriptor per device ordinal, read-only (CU_MEM_ACCESS_FLAGS_PROT_READ:
/// a write faults the writer's context) or read-write. Throws Error.
void set_access(CUdeviceptr ptr, std::size_t size, std::span<const int> ordinals, bool read_only);

/// Free and total memory of a device.
struct MemoryInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

/// cuMemGetInfo in device `ordinal`'s primary context (retained for the call: this creates it if nothing holds
/// it, which costs ~100 ms). Throws Error.
MemoryInfo memory_info(int ordinal);

}  // namespace gpuipc::cuda
