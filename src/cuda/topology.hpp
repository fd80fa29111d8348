// How the GPUs of this machine are joined: per ordered pair, peer access and the link (NVLink or PCIe) from the
// driver's P2P attributes and NVML (cuda/nvml.hpp), and a real peer mapping tried on request. `gpuipc doctor`
// prints it (gpuipc::topology, include/gpuipc/device.hpp).
#pragma once

#include <optional>
#include <string>

#include "cuda/nvml.hpp"
#include "gpuipc/device.hpp"

namespace gpuipc::cuda {

/// The driver's P2P attributes of one ordered pair (cuDeviceGetP2PAttribute).
struct P2PAttributes {
  bool access = false;
  int performance_rank = -1;
  bool native_atomics = false;
  bool array_access = false;
};

/// The driver's attributes of (from, to); nullopt when the driver lacks cuDeviceGetP2PAttribute or refuses.
std::optional<P2PAttributes> p2p_attributes(int from, int to);

/// Fills `link`'s kind and source: NVML's word where it has one (nvlink, else pcie when NVML knows the PCIe
/// path), else the driver's hint (native peer atomics: nvlink; peer access without them: pcie), else "unknown".
/// Pure: unit-tested without a GPU.
void classify_link(PeerLink& link, const std::optional<P2PAttributes>& cuda, const std::optional<NvmlLink>& nvml);

/// Maps 2 MiB made on GPU `owner` for GPU `accessor`, as Segment::open does for a peer (cuMemCreate on the owner,
/// cuMemMap, cuMemSetAccess for the accessor), then frees it. Returns the driver's reason when that fails, an
/// empty string when it works. Retains both primary contexts for the call.
std::string try_peer_mapping(int owner, int accessor);

}  // namespace gpuipc::cuda
