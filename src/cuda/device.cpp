#include "cuda/device.hpp"

#include <fmt/format.h>

#include <cctype>

#include "base/log.hpp"
#include "cuda/context.hpp"
#include "cuda/driver.hpp"
#include "cuda/vmm.hpp"

namespace gpuipc::cuda {
namespace {

// Attributes newer than the driver come back as CUDA_ERROR_INVALID_VALUE: nullopt, not an error.
std::optional<int> attribute(const DriverApi& api, CUdevice device, CUdevice_attribute attr) noexcept {
  int value = 0;
  if (api.cuDeviceGetAttribute(&value, attr, device) != CUDA_SUCCESS) return std::nullopt;
  return value;
}

bool flag(const DriverApi& api, CUdevice device, CUdevice_attribute attr) noexcept {
  return attribute(api, device, attr).value_or(0) != 0;
}

int hex_value(char c) noexcept {
  if (c >= '0' && c <= '9') return c - '0';
  const char l = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (l >= 'a' && l <= 'f') return l - 'a' + 10;
  return -1;
}

}  // namespace

int device_count() {
  const DriverApi* api = nullptr;
  try {
    api = &driver();
  } catch (const Error& e) {
    if (e.code() == ErrorCode::NoDevice) return 0;
    throw;
  }
  int count = 0;
  check(api->cuDeviceGetCount(&count), "cuDeviceGetCount", "devices");
  return count;
}

DeviceInfo query_device(int ordinal, bool include_free_memory) {
  const DriverApi& api = driver();
  const CUdevice device = device_handle(ordinal);
  const std::string what = fmt::format("GPU {}", ordinal);
  DeviceInfo info;
  info.ordinal = ordinal;

  char name[256] = {};
  check(api.cuDeviceGetName(name, sizeof(name) - 1, device), "cuDeviceGetName", what);
  info.name = name;

  CUuuid uuid{};
  check(api.cuDeviceGetUuid(&uuid, device), "cuDeviceGetUuid", what);
  for (std::size_t i = 0; i < info.uuid.size(); ++i) info.uuid[i] = static_cast<std::uint8_t>(uuid.bytes[i]);
  info.uuid_string = format_uuid(info.uuid);

  char bus_id[64] = {};
  check(api.cuDeviceGetPCIBusId(bus_id, sizeof(bus_id) - 1, device), "cuDeviceGetPCIBusId", what);
  info.pci_bus_id = bus_id;

  std::size_t total = 0;
  check(api.cuDeviceTotalMem(&total, device), "cuDeviceTotalMem", what);
  info.total_memory = total;

  info.cc_major = attribute(api, device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).value_or(0);
  info.cc_minor = attribute(api, device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR).value_or(0);
  info.sm_count = attribute(api, device, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).value_or(0);
  info.vmm = flag(api, device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  info.posix_fd_handles = flag(api, device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
  info.fabric_handles = flag(api, device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED);
  info.memory_pools = flag(api, device, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
  const int pool_handles = attribute(api, device, CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES).value_or(0);
  info.memory_pool_ipc = info.memory_pools && (pool_handles & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) != 0;
  // CUDA 12 retired the V1 memop attributes (92-94): 32-bit stream memory operations are always on, and
  // attribute 122 says whether the 64-bit ones (what semaphores use) are.
  info.stream_mem_ops_64 = flag(api, device, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS);
  info.unified_addressing = flag(api, device, CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING);
  // cuIpc*MemHandle is a Linux feature that needs unified addressing; there is no attribute for it.
  info.legacy_ipc = info.unified_addressing;
  info.ipc_events = flag(api, device, CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED);
  info.host_register = flag(api, device, CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED);
  info.read_only_host_register = flag(api, device, CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED);
#if CUDA_VERSION >= 12040
  if (const auto mps = attribute(api, device, CU_DEVICE_ATTRIBUTE_MPS_ENABLED)) {
    info.mps_known = true;
    info.mps_enabled = *mps != 0;
  }
#endif

  if (info.vmm) {
    try {
      info.granularity_min = allocation_granularity(ordinal, false);
      info.granularity_recommended = allocation_granularity(ordinal, true);
    } catch (const Error& e) {
      GPUIPC_LOG_INFO("GPU {}: no allocation granularity for exportable memory: {}", ordinal, e.what());
    }
  }
  if (include_free_memory) info.free_memory = memory_info(ordinal).free;
  return info;
}

std::optional<bool> mps_enabled(int ordinal) noexcept {
#if CUDA_VERSION >= 12040
  const DriverApi* api = loaded_driver();
  CUdevice device = 0;
  if (api == nullptr || api->cuDeviceGet(&device, ordinal) != CUDA_SUCCESS) return std::nullopt;
  if (const auto mps = attribute(*api, device, CU_DEVICE_ATTRIBUTE_MPS_ENABLED)) return *mps != 0;
#else
  (void)ordinal;
#endif
  return std::nullopt;
}

std::optional<int> find_device(const std::array<std::uint8_t, 16>& uuid) {
  const int count = device_count();
  if (count == 0) return std::nullopt;
  const DriverApi& api = driver();
  for (int i = 0; i < count; ++i) {
    CUuuid u{};
    check(api.cuDeviceGetUuid(&u, device_handle(i)), "cuDeviceGetUuid", fmt::format("GPU {}", i));
    bool same = true;
    for (std::size_t b = 0; b < uuid.size(); ++b) same = same && static_cast<std::uint8_t>(u.bytes[b]) == uuid[b];
    if (same) return i;
  }
  return std::nullopt;
}

std::vector<std::vector<bool>> peer_access_matrix() {
  const int count = device_count();
  std::vector<std::vector<bool>> matrix(static_cast<std::size_t>(count),
                                        std::vector<bool>(static_cast<std::size_t>(count)));
  if (count == 0) return matrix;
  const DriverApi& api = driver();
  std::vector<CUdevice> devices;
  for (int i = 0; i < count; ++i) devices.push_back(device_handle(i));
  for (int i = 0; i < count; ++i) {
    for (int j = 0; j < count; ++j) {
      const auto si = static_cast<std::size_t>(i);
      const auto sj = static_cast<std::size_t>(j);
      if (i == j) {
        matrix[si][sj] = true;
        continue;
      }
      int can = 0;
      check(api.cuDeviceCanAccessPeer(&can, devices[si], devices[sj]), "cuDeviceCanAccessPeer",
            fmt::format("GPU {} -> GPU {}", i, j));
      matrix[si][sj] = can != 0;
    }
  }
  return matrix;
}

int driver_version() { return driver().driver_version; }

std::string format_driver_version(int version) { return fmt::format("{}.{}", version / 1000, (version % 1000) / 10); }

std::string format_uuid(const std::array<std::uint8_t, 16>& u) {
  return fmt::format(
      "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}", u[0],
      u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
}

std::optional<std::array<std::uint8_t, 16>> parse_uuid(std::string_view text) {
  if (text.size() >= 4 && (text.substr(0, 4) == "GPU-" || text.substr(0, 4) == "gpu-")) text.remove_prefix(4);
  // 32 hex digits with dashes after the 8th, 12th, 16th and 20th.
  if (text.size() != 36) return std::nullopt;
  std::array<std::uint8_t, 16> out{};
  std::size_t byte = 0;
  for (std::size_t i = 0; i < text.size();) {
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      if (text[i] != '-') return std::nullopt;
      ++i;
      continue;
    }
    const int hi = hex_value(text[i]);
    const int lo = i + 1 < text.size() ? hex_value(text[i + 1]) : -1;
    if (hi < 0 || lo < 0 || byte >= out.size()) return std::nullopt;
    out[byte++] = static_cast<std::uint8_t>(hi * 16 + lo);
    i += 2;
  }
  if (byte != out.size()) return std::nullopt;
  return out;
}

}  // namespace gpuipc::cuda
