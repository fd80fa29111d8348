#include "cuda/nvml.hpp"

#include <fmt/format.h>

#include <array>
#include <cstdio>
#include <mutex>

#include "os/dynamic_library.hpp"

namespace gpuipc::cuda {
namespace {

// The few NVML declarations used here (nvml.h is not among the CUDA toolkit's headers everywhere): a stable C ABI.
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kP2PCapsIndexNvlink = 2;  // NVML_P2P_CAPS_INDEX_NVLINK
constexpr int kP2PStatusOk = 0;         // NVML_P2P_STATUS_OK
constexpr unsigned kMaxNvlinks = 18;    // NVML_NVLINK_MAX_LINKS
constexpr int kFeatureEnabled = 1;      // NVML_FEATURE_ENABLED

struct PciInfo {  // nvmlPciInfo_t (v3)
  char bus_id_legacy[16];
  unsigned domain;
  unsigned bus;
  unsigned device;
  unsigned pci_device_id;
  unsigned pci_subsystem_id;
  char bus_id[32];
};

struct Nvml {
  nvmlReturn_t (*init)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*by_uuid)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*p2p_status)(nvmlDevice_t, nvmlDevice_t, int, int*) = nullptr;
  nvmlReturn_t (*common_ancestor)(nvmlDevice_t, nvmlDevice_t, int*) = nullptr;
  nvmlReturn_t (*nvlink_state)(nvmlDevice_t, unsigned, int*) = nullptr;
  nvmlReturn_t (*nvlink_remote_pci)(nvmlDevice_t, unsigned, PciInfo*) = nullptr;
  nvmlReturn_t (*nvlink_remote_type)(nvmlDevice_t, unsigned, int*) = nullptr;  // nvmlIntNvLinkDeviceType_t
  std::string error;  // why NVML is unusable; empty when it works
};

template <typename F>
void fetch(const os::DynamicLibrary& lib, const char* name, F& out) {
  out = reinterpret_cast<F>(lib.symbol(name));  // NOLINT(cppcoreguidelines-pro-type-reinterpret-cast): dlsym
}

/// Loaded and initialised once per process; NVML is never shut down (its init is reference counted, and a
/// process that asks once may ask again).
const Nvml& nvml() {
  static Nvml n;
  static std::once_flag once;
  std::call_once(once, [] {
    std::string why;
    const auto lib = os::DynamicLibrary::open("libnvidia-ml.so.1", why);
    if (!lib) {
      n.error = "libnvidia-ml.so.1 not loaded: " + why;
      return;
    }
    fetch(lib, "nvmlInit_v2", n.init);
    fetch(lib, "nvmlErrorString", n.error_string);
    fetch(lib, "nvmlDeviceGetHandleByUUID", n.by_uuid);
    fetch(lib, "nvmlDeviceGetP2PStatus", n.p2p_status);
    fetch(lib, "nvmlDeviceGetTopologyCommonAncestor", n.common_ancestor);
    fetch(lib, "nvmlDeviceGetNvLinkState", n.nvlink_state);
    fetch(lib, "nvmlDeviceGetNvLinkRemotePciInfo_v2", n.nvlink_remote_pci);
    fetch(lib, "nvmlDeviceGetNvLinkRemoteDeviceType", n.nvlink_remote_type);
    if (n.init == nullptr || n.by_uuid == nullptr) {
      n.error = "libnvidia-ml.so.1 lacks nvmlInit_v2 or nvmlDeviceGetHandleByUUID";
      return;
    }
    if (const nvmlReturn_t r = n.init(); r != kNvmlSuccess) {
      n.error = fmt::format("nvmlInit_v2 failed: {}", n.error_string != nullptr ? n.error_string(r) : "error")
                + fmt::format(" ({})", r);
    }
  });
  return n;
}

/// (domain, bus, device) of "0000:3B:00.0" or NVML's "00000000:3B:00.0"; nullopt when malformed.
std::optional<std::array<unsigned, 3>> parse_bus_id(const std::string& s) {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  if (std::sscanf(s.c_str(), "%x:%x:%x.%x", &domain, &bus, &device, &function) != 4) return std::nullopt;
  return std::array<unsigned, 3>{domain, bus, device};
}

/// Active NVLinks from `from` that reach the GPU `to_bus_id`: those whose far end is that GPU, or, on machines whose
/// GPUs are joined through NVSwitches (HGX H100/H200: every link of a GPU ends at a switch), the active links to
/// switches, which is what `nvidia-smi topo -m` reports (NV18 on a two-H200 machine, where counting far ends that are
/// the other GPU gave 0). -1 when NVML cannot say.
int count_nvlinks(const Nvml& n, nvmlDevice_t from, const std::string& to_bus_id) {
  if (n.nvlink_state == nullptr || n.nvlink_remote_pci == nullptr) return -1;
  const auto target = parse_bus_id(to_bus_id);
  if (!target) return -1;
  constexpr int kRemoteSwitch = 2;  // NVML_NVLINK_DEVICE_TYPE_SWITCH
  int direct = 0;
  int to_switches = 0;
  for (unsigned link = 0; link < kMaxNvlinks; ++link) {
    int active = 0;
    if (n.nvlink_state(from, link, &active) != kNvmlSuccess) continue;  // no such link, or not supported
    if (active != kFeatureEnabled) continue;
    int type = -1;
    if (n.nvlink_remote_type != nullptr && n.nvlink_remote_type(from, link, &type) == kNvmlSuccess &&
        type == kRemoteSwitch) {
      ++to_switches;
      continue;
    }
    PciInfo pci{};
    if (n.nvlink_remote_pci(from, link, &pci) != kNvmlSuccess) continue;
    if (pci.domain == (*target)[0] && pci.bus == (*target)[1] && pci.device == (*target)[2]) ++direct;
  }
  return direct > 0 ? direct : to_switches;
}

}  // namespace

std::string pcie_path_name(int level) {
  switch (level) {
    case 0: return "board";         // NVML_TOPOLOGY_INTERNAL: one board (a multi-GPU board)
    case 10: return "switch";       // NVML_TOPOLOGY_SINGLE: one PCIe switch
    case 20: return "switches";     // NVML_TOPOLOGY_MULTIPLE: several PCIe switches, no host bridge
    case 30: return "host_bridge";  // NVML_TOPOLOGY_HOSTBRIDGE
    case 40: return "numa_node";    // NVML_TOPOLOGY_NODE: host bridges of one NUMA node
    case 50: return "system";       // NVML_TOPOLOGY_SYSTEM: across NUMA nodes (the CPUs' interconnect)
    default: return "";
  }
}

NvmlTopology nvml_topology(const std::vector<NvmlGpu>& gpus) noexcept {
  NvmlTopology t;
  try {
    t.links.assign(gpus.size(), std::vector<std::optional<NvmlLink>>(gpus.size()));
    const Nvml& n = nvml();
    if (!n.error.empty()) {
      t.error = n.error;
      return t;
    }
    t.loaded = true;
    std::vector<nvmlDevice_t> handles(gpus.size(), nullptr);
    for (std::size_t i = 0; i < gpus.size(); ++i) {
      if (n.by_uuid(gpus[i].uuid.c_str(), &handles[i]) != kNvmlSuccess) handles[i] = nullptr;
    }
    for (std::size_t i = 0; i < gpus.size(); ++i) {
      for (std::size_t j = 0; j < gpus.size(); ++j) {
        if (i == j || handles[i] == nullptr || handles[j] == nullptr) continue;
        NvmlLink link;
        int status = -1;
        if (n.p2p_status != nullptr && n.p2p_status(handles[i], handles[j], kP2PCapsIndexNvlink, &status) == kNvmlSuccess) {
          link.nvlink = status == kP2PStatusOk;
        }
        link.nvlinks = count_nvlinks(n, handles[i], gpus[j].pci_bus_id);
        if (link.nvlinks > 0) link.nvlink = true;
        int level = -1;
        if (n.common_ancestor != nullptr && n.common_ancestor(handles[i], handles[j], &level) == kNvmlSuccess) {
          link.pcie_path = pcie_path_name(level);
        }
        t.links[i][j] = link;
      }
    }
  } catch (const std::exception& e) {
    t.loaded = false;
    t.error = e.what();
  }
  return t;
}

}  // namespace gpuipc::cuda
