// Which GPU of this process maps memory that lives on a GPU named by its UUID (segments, channel slots, pool
// chunks): the requested one, else the current context's, else the owner's. Pure decisions over what the driver
// reported, so that unit tests check them without a GPU; gpu_memory.cpp asks the driver and calls them.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace gpuipc::core {

/// What the driver says in this process about a mapping to be made.
struct DeviceChoice {
  std::string owner_uuid;      ///< "GPU-…" of the GPU the memory lives on (for messages)
  std::optional<int> owner;    ///< that GPU's ordinal here; nullopt when this process does not see it
  int requested = -1;          ///< OpenOptions::device (-1: not asked)
  std::optional<int> current;  ///< the device of the calling thread's current context, if any
  int device_count = 0;        ///< GPUs this process sees
};

/// The ordinal whose context maps the memory. `can_access(from, to)` answers cuDeviceCanAccessPeer for two
/// distinct visible ordinals. Throws Error: NoDevice (a requested ordinal this process does not have; nothing
/// requested, no current context and the owner not visible: names the UUID and CUDA_VISIBLE_DEVICES),
/// Unsupported (the mapping GPU has no peer access to the owner: names both and what to do instead).
/// When the owner is not visible but a device was requested or is current, that device is returned: whether it
/// can map the memory only the driver can say (import_device_memory words its failure).
int choose_mapping_device(const DeviceChoice& in, const std::function<bool(int from, int to)>& can_access);

/// The message of a driver failure while mapping memory of a GPU this process does not see (`cause`: the
/// driver's error text), saying to make that GPU visible.
std::string invisible_owner_message(const std::string& owner_uuid, int ordinal, const std::string& cause);

}  // namespace gpuipc::core
