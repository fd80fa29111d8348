#include "cuda/topology.hpp"

#include <fmt/format.h>

#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/vmm.hpp"

namespace gpuipc::cuda {

std::optional<P2PAttributes> p2p_attributes(int from, int to) {
  const DriverApi& api = driver();
  if (api.cuDeviceGetP2PAttribute == nullptr) return std::nullopt;
  const CUdevice a = device_handle(from);
  const CUdevice b = device_handle(to);
  auto get = [&](CUdevice_P2PAttribute attr) -> std::optional<int> {
    int v = 0;
    if (api.cuDeviceGetP2PAttribute(&v, attr, a, b) != CUDA_SUCCESS) return std::nullopt;
    return v;
  };
  const auto access = get(CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED);
  if (!access) return std::nullopt;
  P2PAttributes p;
  p.access = *access != 0;
  p.performance_rank = get(CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK).value_or(-1);
  p.native_atomics = get(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED).value_or(0) != 0;
  p.array_access = get(CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED).value_or(0) != 0;
  return p;
}

void classify_link(PeerLink& link, const std::optional<P2PAttributes>& cuda, const std::optional<NvmlLink>& nvml) {
  if (cuda) {
    link.performance_rank = cuda->performance_rank;
    link.native_atomics = cuda->native_atomics;
    link.array_access = cuda->array_access;
  }
  if (nvml) {
    link.nvlinks = nvml->nvlinks;
    link.pcie_path = nvml->pcie_path;
    if (nvml->nvlink || nvml->nvlinks > 0) {
      link.link = "nvlink";
      link.link_source = "nvml";
      return;
    }
    if (!nvml->pcie_path.empty()) {
      link.link = "pcie";
      link.link_source = "nvml";
      return;
    }
  }
  // Without NVML's word: all CUDA atomics over the link is what NVLink gives and PCIe does not.
  if (cuda && cuda->access) {
    link.link = cuda->native_atomics ? "nvlink" : "pcie";
    link.link_source = "cuda";
    return;
  }
  link.link = "unknown";
  link.link_source = "none";
}

std::string try_peer_mapping(int owner, int accessor) {
  try {
    PrimaryContext owner_ctx(owner);
    PrimaryContext accessor_ctx(accessor);
    ScopedContext scope(owner_ctx.get());
    const std::size_t size = allocation_granularity(owner, false);
    const AllocationHandle handle = create_exportable(owner, size);
    const VaRange range = reserve_va(size, size);
    const MemMapping mapping = map(range.base(), size, handle);
    const int access[] = {accessor};
    set_access(mapping.ptr(), size, access, false);
    return {};
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace gpuipc::cuda
