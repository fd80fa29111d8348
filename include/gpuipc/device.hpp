// The CUDA driver and the GPUs as gpuipc sees them: whether the driver loads, what each GPU can do for gpuipc
// (`gpuipc doctor` and `python -m gpuipc doctor` print it), which device an address lives on, and a synchronous copy
// between any two addresses. The driver is loaded at run time (docs/architecture.md#layers): every call here works
// on a machine without one, reporting NoDriver.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "gpuipc/stream.hpp"

namespace gpuipc {

/// Everything gpuipc wants to know about one device.
struct DeviceInfo {
  int ordinal = -1;
  std::string name;                     ///< "NVIDIA H100 80GB HBM3"
  std::array<std::uint8_t, 16> uuid{};  ///< cuDeviceGetUuid (v2: a MIG instance has its own)
  std::string uuid_string;              ///< "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi -L prints it
  std::string pci_bus_id;               ///< "0000:3B:00.0" (cuDeviceGetPCIBusId)
  std::size_t total_memory = 0;         ///< bytes (cuDeviceTotalMem)
  std::size_t free_memory = 0;          ///< bytes (cuMemGetInfo in the primary context); 0 when not queried
  int cc_major = 0;                     ///< compute capability
  int cc_minor = 0;
  int sm_count = 0;               ///< CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  bool vmm = false;               ///< cuMemCreate / cuMemMap family (VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
  bool posix_fd_handles = false;  ///< cuMemCreate memory exportable as a POSIX fd: device segments need it
  bool fabric_handles = false;    ///< ... as a fabric handle (multi-node NVLink; also needs an IMEX channel)
  bool memory_pools = false;      ///< cuMemPool* / cuMemAllocAsync (MEMORY_POOLS_SUPPORTED)
  bool memory_pool_ipc = false;   ///< MEMPOOL_SUPPORTED_HANDLE_TYPES has the POSIX fd bit: shareable pools
  /// cuStreamWaitValue64 / cuStreamWriteValue64 (CAN_USE_64_BIT_STREAM_MEM_OPS, the CUDA 12 attribute: since
  /// CUDA 12 the 32-bit stream memory operations are always available, the 64-bit ones where this is set).
  /// Semaphores need it.
  bool stream_mem_ops_64 = false;
  bool legacy_ipc = false;               ///< cuIpc*MemHandle works: unified addressing on Linux
  bool ipc_events = false;               ///< cuIpc*EventHandle works (IPC_EVENT_SUPPORTED)
  bool host_register = false;            ///< cuMemHostRegister (HOST_REGISTER_SUPPORTED): host_pinned segments need it
  bool read_only_host_register = false;  ///< CU_MEMHOSTREGISTER_READ_ONLY (READ_ONLY_HOST_REGISTER_SUPPORTED)
  bool unified_addressing = false;       ///< UNIFIED_ADDRESSING
  bool mps_known = false;                ///< the driver answered CU_DEVICE_ATTRIBUTE_MPS_ENABLED (CUDA >= 12.4)
  bool mps_enabled = false;              ///< contexts on this device are shared through MPS (valid when mps_known)
  std::size_t granularity_min = 0;       ///< cuMemCreate granularity for exportable memory, bytes (0 without VMM)
  std::size_t granularity_recommended = 0;
};

/// The loaded driver.
struct DriverInfo {
  int version = 0;      ///< cuDriverGetVersion, e.g. 13000 for CUDA 13.0
  std::string library;  ///< the file it was loaded from
};

/// Whether the CUDA driver loads and initialises here; never throws. On false, `why` (when given) gets the reason
/// driver_info() would throw with.
bool driver_available(std::string* why = nullptr) noexcept;

/// Loads the driver (once per process) and says which. Throws Error(NoDriver) when it cannot be loaded,
/// Error(NoDevice) when it reports no GPU.
DriverInfo driver_info();

/// "13.0" for 13000.
std::string format_driver_version(int version);

/// Number of devices the driver shows (after CUDA_VISIBLE_DEVICES); 0 when there is none. Throws Error(NoDriver).
int device_count();

/// Probes device `ordinal`. With `include_free_memory` the device's primary context is retained for the call
/// (created if nothing holds it: ~100 ms and some GPU memory) to read free memory; without, free_memory is 0 and
/// no context is touched. Throws Error(NoDevice) for a bad ordinal, Error(NoDriver) without a driver.
DeviceInfo device_info(int ordinal, bool include_free_memory = true);

/// matrix[i][j]: device i can map memory of device j (cuDeviceCanAccessPeer; true on the diagonal).
std::vector<std::vector<bool>> peer_access_matrix();

/// The ordinal, in this process, of the GPU with UUID `uuid` ("GPU-…" as DeviceInfo::uuid_string and
/// SegmentInfo::device_uuid give it; the prefix and case are optional), or -1 when this process does not see it
/// (CUDA_VISIBLE_DEVICES). Ordinals differ between processes that see the GPUs in other orders; UUIDs do not.
/// Creates no context. Throws Error(InvalidArgument) for a malformed UUID, Error(NoDriver).
int device_ordinal(std::string_view uuid);

/// How GPU `from` reaches the memory of GPU `to` (`gpuipc doctor`'s topology).
struct PeerLink {
  int from = -1;  ///< ordinals in this process
  int to = -1;
  /// cuDeviceCanAccessPeer(from, to): the driver allows `from` to map `to`'s memory. Device segments, channels
  /// and pools of `to` opened from `from` need it (else Segment::open throws Unsupported).
  bool peer_access = false;
  /// Whether a mapping was tried (peer_links(true)): memory made on `to`, mapped for `from` as Segment::open maps
  /// it (cuMemSetAccess). `mapping_works` is its outcome and `mapping_error` the driver's reason when it failed.
  bool mapping_tried = false;
  bool mapping_works = false;
  std::string mapping_error;
  int performance_rank = -1;     ///< CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK (lower is faster); -1 unknown
  bool native_atomics = false;   ///< CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
  bool array_access = false;     ///< CU_DEVICE_P2P_ATTRIBUTE_CUDA_ARRAY_ACCESS_SUPPORTED
  /// "nvlink", "pcie" or "unknown". From NVML where it loads (link_source "nvml"); else inferred from the driver:
  /// native peer atomics go over NVLink and not over PCIe (link_source "cuda"); "none" when nothing said.
  std::string link = "unknown";
  std::string link_source = "none";
  int nvlinks = -1;       ///< active NVLinks from `from` that reach `to`: ending at `to`, or at NVSwitches (NVML); -1 unknown
  std::string pcie_path;  ///< NVML's common PCIe ancestor: board, switch, switches, host_bridge, numa_node, system
};

/// Every ordered pair of distinct GPUs this process sees, from the driver (cuDeviceCanAccessPeer,
/// cuDeviceGetP2PAttribute) and NVML (loaded at run time, not linked; absent is fine: `nvml_error` says why).
/// With `try_mapping`, each pair with peer access is also tried for real (a 2 MiB allocation on `to` mapped for
/// `from`; creates both primary contexts). Throws Error(NoDriver).
struct Topology {
  std::vector<PeerLink> links;
  bool nvml = false;       ///< NVML loaded and answered
  std::string nvml_error;  ///< why not
};
Topology topology(bool try_mapping = false);

/// The ordinal of the device that GPU address `address` was allocated on or registered with, -1 for an address the
/// driver does not know. Throws Error(NoDriver), Error(Cuda) when the query fails.
int device_of(std::uint64_t address);

/// One side of copy_synchronous: an address in host memory (device -1) or in the memory of GPU `device`.
struct MemoryAddress {
  std::uint64_t address = 0;
  int device = -1;
};

/// Copies `bytes` from `source` to `destination` after `stream` has finished the work queued on it, and returns
/// when the copy is done. Anything with a GPU side runs in the primary context of the destination's GPU, else the
/// source's (synchronous driver copies); host to host is a memcpy and needs no driver. Throws Error(NoDriver),
/// Error(Cuda) naming the step that failed.
void copy_synchronous(MemoryAddress destination, MemoryAddress source, std::size_t bytes, StreamHandle stream);

}  // namespace gpuipc
