// Capability probing: what each GPU can do for gpuipc (gpuipc doctor prints it; core checks it before using a
// feature, and says which capability is missing instead of failing inside the driver).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuipc/device.hpp"

namespace gpuipc::cuda {

/// Everything gpuipc wants to know about one device: the public gpuipc::DeviceInfo (include/gpuipc/device.hpp).
using DeviceInfo = ::gpuipc::DeviceInfo;

/// Number of devices the driver shows (after CUDA_VISIBLE_DEVICES). Throws Error(NoDriver) without a driver;
/// 0 is returned, not thrown, when there is none (cuInit's CUDA_ERROR_NO_DEVICE).
int device_count();

/// Probes device `ordinal`. With `include_free_memory` the device's primary context is retained for the call
/// (created if nothing holds it: ~100 ms and some GPU memory) to read free memory; without, free_memory is 0 and
/// no context is touched. Throws Error(NoDevice) for a bad ordinal, Error(NoDriver) without a driver.
DeviceInfo query_device(int ordinal, bool include_free_memory = true);

/// Whether contexts this process makes on device `ordinal` are shared through MPS
/// (CU_DEVICE_ATTRIBUTE_MPS_ENABLED); nullopt when the driver does not say (CUDA < 12.4) or the ordinal is bad.
/// No context is created, nothing is thrown.
std::optional<bool> mps_enabled(int ordinal) noexcept;

/// The ordinal of the device with this UUID, or nullopt. No context is created.
std::optional<int> find_device(const std::array<std::uint8_t, 16>& uuid);

/// matrix[i][j]: device i can map memory of device j (cuDeviceCanAccessPeer; true on the diagonal).
std::vector<std::vector<bool>> peer_access_matrix();

/// cuDriverGetVersion, e.g. 13000 for CUDA 13.0. Throws Error(NoDriver).
int driver_version();

/// "13.0" for 13000.
std::string format_driver_version(int version);

/// "GPU-" followed by the 16 bytes in lowercase hex grouped 8-4-4-4-12, as nvidia-smi prints UUIDs.
std::string format_uuid(const std::array<std::uint8_t, 16>& uuid);

/// Parses format_uuid's output (the "GPU-" prefix optional, hex case-insensitive); nullopt when malformed.
std::optional<std::array<std::uint8_t, 16>> parse_uuid(std::string_view text);

}  // namespace gpuipc::cuda
