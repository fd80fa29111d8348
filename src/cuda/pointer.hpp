// What the driver knows about an address a user hands in (gpuipc::share): its memory type, device, owning
// context, the allocation around it, and for VMM memory the allocation handle and its properties.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <optional>

#include "cuda/vmm.hpp"

namespace gpuipc::cuda {

/// cuPointerGetAttributes of one address. An address the driver does not know (host memory that is not
/// registered, freed device memory) reads as memory_type 0 and the defaults below.
struct PointerInfo {
  unsigned memory_type = 0;     ///< CUmemorytype: CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST, 0 (unknown)
  bool managed = false;         ///< cudaMallocManaged / cuMemAllocManaged
  int device = -1;              ///< ordinal of the device it was allocated on or registered with
  bool legacy_ipc = false;      ///< cuMemAlloc memory: cuIpcGetMemHandle works on its allocation's base
  bool from_pool = false;       ///< stream-ordered allocation (cudaMallocAsync, cuMemAllocFromPoolAsync)
  CUcontext context = nullptr;  ///< the context it was allocated in (nullptr for VMM memory)
};

/// Asks the driver about `ptr`. Throws Error(NoDriver) without a driver, Error(Cuda) when the query itself fails.
PointerInfo pointer_info(CUdeviceptr ptr);

/// An allocation's address range.
struct AddressRange {
  CUdeviceptr base = 0;
  std::size_t size = 0;
};

/// cuMemGetAddressRange in the current context: the cuMemAlloc allocation containing `ptr`, or for VMM memory the
/// one physical allocation mapped there (not the whole reservation). nullopt when no allocation contains it.
std::optional<AddressRange> address_range(CUdeviceptr ptr);

/// cuMemRetainAllocationHandle: the handle of the VMM allocation mapped at `ptr` (released by the owner), or an
/// empty handle when `ptr` is not VMM memory.
AllocationHandle retain_allocation(CUdeviceptr ptr);

/// cuMemGetAllocationPropertiesFromHandle. Throws Error(Cuda).
CUmemAllocationProp allocation_properties(const AllocationHandle& handle);

}  // namespace gpuipc::cuda
