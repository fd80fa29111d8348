// The GPU side of segments, over src/cuda: creating and exporting device memory, importing it into this
// process's VA arena, and registering host memory with the GPU. Each result owns its driver resources.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "os/fd.hpp"
#include "proto/messages.hpp"

namespace gpuipc::core {

/// Driver resources behind one mapping; released (in reverse order of acquisition) on destruction.
class GpuMemory {
 public:
  virtual ~GpuMemory() = default;
  /// The address GPU code uses.
  virtual std::uint64_t device_pointer() const noexcept = 0;
  /// The device ordinal whose context mapped or registered it.
  virtual int device() const noexcept = 0;
};

/// What create_device_memory made.
struct CreatedDevice {
  std::unique_ptr<GpuMemory> memory;  ///< mapped read-write in this process
  os::UniqueFd exported;              ///< the POSIX fd for the broker
  std::size_t size = 0;               ///< rounded up to the allocation granularity
  proto::Uuid uuid{};                 ///< the device's UUID
};

/// Allocates `bytes` (rounded up to the granularity) on device `ordinal`, exports it once, maps it read-write.
CreatedDevice create_device_memory(int ordinal, std::size_t bytes);

/// Imports an exported allocation of `size` bytes living on the device with `owner`'s UUID and maps it for device
/// `requested` (-1: the current context's device, else the owner). Read-only maps with PROT_READ access.
/// Throws Error(Unsupported) when the mapping device cannot reach the owner's memory (no peer access).
std::unique_ptr<GpuMemory> import_device_memory(int fd, std::size_t size, const proto::Uuid& owner, int requested,
                                                bool read_only);

/// Registers host memory [ptr, ptr+size) with the GPU (portable, device-mapped; read-only when asked and the
/// device supports it) using device `ordinal`'s primary context.
std::unique_ptr<GpuMemory> register_host_memory(void* ptr, std::size_t size, int ordinal, bool read_only);

}  // namespace gpuipc::core
