// NVML, loaded at run time (dlopen libnvidia-ml.so.1, never linked) for what the CUDA driver does not say about
// the link between two GPUs: whether it is NVLink, how many NVLinks join them, and the PCIe path otherwise.
// NVML names devices by UUID and ignores CUDA_VISIBLE_DEVICES, so it answers for the physical GPUs. Optional:
// where the library is missing or fails to initialise, callers fall back to what the driver says.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace gpuipc::cuda {

/// The link between two GPUs as NVML reports it.
struct NvmlLink {
  bool nvlink = false;  ///< nvmlDeviceGetP2PStatus(NVLINK) is OK: they are joined by NVLink
  int nvlinks = -1;     ///< active NVLinks to the other GPU, direct or through NVSwitches (-1: NVML did not say)
  /// nvmlDeviceGetTopologyCommonAncestor: "board", "switch", "switches", "host_bridge", "numa_node", "system";
  /// empty when NVML did not say.
  std::string pcie_path;
};

/// One GPU as NVML is asked about it: its UUID ("GPU-…") and PCI bus id ("0000:3B:00.0", cuDeviceGetPCIBusId).
struct NvmlGpu {
  std::string uuid;
  std::string pci_bus_id;
};

/// What NVML says about every ordered pair of `gpus`: links[i][j] (nullopt on the diagonal and where NVML could
/// not answer for that pair). Never throws: `error` says why NVML is unusable (then every entry is nullopt).
struct NvmlTopology {
  bool loaded = false;  ///< libnvidia-ml loaded and nvmlInit_v2 succeeded
  std::string error;    ///< why not, when !loaded
  std::vector<std::vector<std::optional<NvmlLink>>> links;
};
NvmlTopology nvml_topology(const std::vector<NvmlGpu>& gpus) noexcept;

/// The name of NVML's common-ancestor level `level` (nvmlGpuTopologyLevel_t), empty for an unknown one.
std::string pcie_path_name(int level);

}  // namespace gpuipc::cuda
