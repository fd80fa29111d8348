#include "cuda/vmm.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "base/log.hpp"
#include "cuda/context.hpp"

namespace gpuipc::cuda {
namespace {

CUmemAllocationProp exportable_prop(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// An attribute newer than the driver reads as absent (CUDA_ERROR_INVALID_VALUE) rather than failing.
int attribute_or_zero(const DriverApi& api, CUdevice_attribute attribute, CUdevice device) noexcept {
  int value = 0;
  return api.cuDeviceGetAttribute(&value, attribute, device) == CUDA_SUCCESS ? value : 0;
}

}  // namespace

void AllocationHandle::Release::operator()(const Owned& owned) const noexcept {
  release_in(
      nullptr, "cuMemRelease", [&](const DriverApi& api) { return api.cuMemRelease(owned.handle); },
      [] { return "GPU allocation handle"; });
}

void VaRange::Release::operator()(const AddressSpan& range) const noexcept {
  release_in(
      nullptr, "cuMemAddressFree", [&](const DriverApi& api) { return api.cuMemAddressFree(range.ptr, range.size); },
      [&] { return fmt::format("virtual address range {:#x} of {} bytes", range.ptr, range.size); });
}

void MemMapping::Release::operator()(const AddressSpan& mapping) const noexcept {
  release_in(
      nullptr, "cuMemUnmap", [&](const DriverApi& api) { return api.cuMemUnmap(mapping.ptr, mapping.size); },
      [&] { return fmt::format("mapping at {:#x} of {} bytes", mapping.ptr, mapping.size); });
}

std::size_t allocation_granularity(int ordinal, bool recommended) {
  const DriverApi& api = driver();
  const CUmemAllocationProp prop = exportable_prop(ordinal);
  std::size_t granularity = 0;
  check(api.cuMemGetAllocationGranularity(
            &granularity, &prop, recommended ? CU_MEM_ALLOC_GRANULARITY_RECOMMENDED : CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity", fmt::format("GPU {}", ordinal));
  return granularity;
}

std::size_t round_up(std::size_t size, std::size_t granularity) {
  if (granularity == 0) return size;
  const std::size_t rem = size % granularity;
  if (rem == 0) return size;
  if (size > std::numeric_limits<std::size_t>::max() - (granularity - rem)) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("size {} is too large", size), "round_up");
  }
  return size + (granularity - rem);
}

AllocationHandle create_exportable(int ordinal, std::size_t size, bool fabric) {
  const DriverApi& api = driver();
  const std::size_t granularity = allocation_granularity(ordinal, false);
  if (size == 0 || size % granularity != 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("GPU allocation of {} bytes on GPU {}: the size must be a positive multiple of the "
                            "allocation granularity ({} bytes)",
                            size, ordinal, granularity),
                "cuMemCreate");
  }
  CUmemAllocationProp prop = exportable_prop(ordinal);
  CUmemGenericAllocationHandle handle = 0;
  if (fabric && attribute_or_zero(api, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, device_handle(ordinal)) != 0) {
    CUmemAllocationProp with_fabric = prop;
    with_fabric.requestedHandleTypes =
        static_cast<CUmemAllocationHandleType>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC);
    const CUresult r = api.cuMemCreate(&handle, size, &with_fabric, 0);
    if (r == CUDA_SUCCESS) return AllocationHandle(handle);
    // Fabric handles also need an IMEX channel (/dev/nvidia-caps-imex-channels); without one the driver refuses
    // the request with NOT_PERMITTED or NOT_SUPPORTED although the device reports fabric support.
    if (r != CUDA_ERROR_NOT_PERMITTED && r != CUDA_ERROR_NOT_SUPPORTED) {
      check(r, "cuMemCreate", fmt::format("GPU allocation of {} bytes on GPU {} (POSIX fd + fabric)", size, ordinal));
    }
    GPUIPC_LOG_INFO("GPU {}: fabric handles refused ({}); allocating with POSIX fd handles only", ordinal,
                    result_name(r));
  }
  check(api.cuMemCreate(&handle, size, &prop, 0), "cuMemCreate",
        fmt::format("GPU allocation of {} bytes on GPU {}", size, ordinal));
  return AllocationHandle(handle);
}

os::UniqueFd export_fd(const AllocationHandle& handle) {
  int fd = -1;
  check(driver().cuMemExportToShareableHandle(&fd, handle.get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle", "exporting a GPU allocation as a POSIX fd");
  return os::UniqueFd(fd);
}

AllocationHandle import_fd(int fd) {
  CUmemGenericAllocationHandle handle = 0;
  // The handle argument of a POSIX fd import is the fd itself, passed as a pointer-sized integer.
  check(driver().cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle", fmt::format("importing GPU allocation fd {}", fd));
  return AllocationHandle(handle);
}

VaRange reserve_va(std::size_t size, std::size_t alignment) {
  CUdeviceptr base = 0;
  check(driver().cuMemAddressReserve(&base, size, alignment, 0, 0), "cuMemAddressReserve",
        fmt::format("reserving {} bytes of GPU virtual addresses (alignment {})", size, alignment));
  return VaRange(base, size);
}

MemMapping map(CUdeviceptr at, std::size_t size, const AllocationHandle& handle, std::size_t offset) {
  check(driver().cuMemMap(at, size, offset, handle.get(), 0), "cuMemMap",
        fmt::format("mapping {} bytes (offset {}) at {:#x}", size, offset, at));
  return MemMapping(at, size);
}

void set_access(CUdeviceptr ptr, std::size_t size, std::span<const int> ordinals, bool read_only) {
  if (ordinals.empty()) {
    throw Error(ErrorCode::InvalidArgument, "set_access: no device to grant access to", "cuMemSetAccess");
  }
  std::vector<CUmemAccessDesc> descs;
  descs.reserve(ordinals.size());
  for (const int ordinal : ordinals) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal;
    desc.flags = read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    descs.push_back(desc);
  }
  check(driver().cuMemSetAccess(ptr, size, descs.data(), descs.size()), "cuMemSetAccess",
        fmt::format("{} access to {} bytes at {:#x} for GPU {}", read_only ? "read-only" : "read-write", size, ptr,
                    fmt::join(ordinals, ", ")));
}

MemoryInfo memory_info(int ordinal) {
  const PrimaryContext context(ordinal);
  const ScopedContext current(context.get());
  MemoryInfo info;
  check(driver().cuMemGetInfo(&info.free, &info.total), "cuMemGetInfo", fmt::format("memory of GPU {}", ordinal));
  return info;
}

}  // namespace gpuipc::cuda
