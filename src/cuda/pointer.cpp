#include "cuda/pointer.hpp"

#include <fmt/format.h>

#include <array>

namespace gpuipc::cuda {

static_assert(sizeof(CUipcMemHandle) == CU_IPC_HANDLE_SIZE && CU_IPC_HANDLE_SIZE == 64);

PointerInfo pointer_info(CUdeviceptr ptr) {
  const DriverApi& api = driver();
  // Booleans come back as one byte or four depending on the attribute and driver: zeroed 4-byte slots read right
  // either way on little-endian machines.
  unsigned memory_type = 0;
  unsigned managed = 0;
  int device = -1;
  unsigned legacy_ipc = 0;
  void* pool = nullptr;
  CUcontext context = nullptr;
  std::array<CUpointer_attribute, 6> attributes = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE,  CU_POINTER_ATTRIBUTE_IS_MANAGED,     CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
      CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, CU_POINTER_ATTRIBUTE_CONTEXT};
  std::array<void*, 6> data = {&memory_type, &managed, &device, &legacy_ipc, &pool, &context};
  const CUresult r = api.cuPointerGetAttributes(static_cast<unsigned>(attributes.size()), attributes.data(),
                                                data.data(), ptr);
  PointerInfo info;
  // An address no context knows: some drivers answer INVALID_VALUE / INVALID_CONTEXT instead of defaults.
  if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_CONTEXT) return info;
  check(r, "cuPointerGetAttributes", fmt::format("pointer {:#x}", ptr));
  info.memory_type = memory_type;
  info.managed = managed != 0;
  info.device = memory_type == 0 ? -1 : device;
  info.legacy_ipc = legacy_ipc != 0;
  info.from_pool = pool != nullptr;
  info.context = context;
  return info;
}

std::optional<AddressRange> address_range(CUdeviceptr ptr) {
  AddressRange range;
  const CUresult r = driver().cuMemGetAddressRange(&range.base, &range.size, ptr);
  if (r == CUDA_ERROR_NOT_FOUND || r == CUDA_ERROR_INVALID_VALUE) return std::nullopt;
  check(r, "cuMemGetAddressRange", fmt::format("pointer {:#x}", ptr));
  return range;
}

AllocationHandle retain_allocation(CUdeviceptr ptr) {
  CUmemGenericAllocationHandle handle = 0;
  // The driver takes the address as a void*.
  const CUresult r =
      driver().cuMemRetainAllocationHandle(&handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr)));
  if (r != CUDA_SUCCESS) return AllocationHandle();
  return AllocationHandle(handle);
}

CUmemAllocationProp allocation_properties(const AllocationHandle& handle) {
  CUmemAllocationProp prop{};
  check(driver().cuMemGetAllocationPropertiesFromHandle(&prop, handle.get()), "cuMemGetAllocationPropertiesFromHandle",
        "a retained GPU allocation");
  return prop;
}

}  // namespace gpuipc::cuda
