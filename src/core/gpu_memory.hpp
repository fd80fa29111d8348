// The GPU side of segments, over src/cuda: creating and exporting device memory, importing it into this
// process's VA arena, and registering host memory with the GPU. Each result owns its driver resources.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

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

/// Addresses of this process's VA arena kept for memory that is mapped, unmapped and mapped again at the same place
/// (a pool chunk across pause and resume: pointers into it stay valid). Reserving costs no memory; the range is
/// given back on destruction, after whatever was mapped into it has been unmapped. Move-only.
class VaSlot {
 public:
  VaSlot() noexcept;
  /// Reserves `bytes` rounded up to device `ordinal`'s allocation granularity, aligned to it. Throws Error.
  VaSlot(std::size_t bytes, int ordinal);
  VaSlot(VaSlot&&) noexcept;
  VaSlot& operator=(VaSlot&&) noexcept;
  VaSlot(const VaSlot&) = delete;
  VaSlot& operator=(const VaSlot&) = delete;
  ~VaSlot();
  std::uint64_t address() const noexcept;
  std::size_t size() const noexcept;
  explicit operator bool() const noexcept { return m_range != nullptr; }

 private:
  struct Range;
  std::unique_ptr<Range> m_range;
};

/// Allocates `bytes` (rounded up to the granularity) on device `ordinal`, exports it once, maps it read-write:
/// at `at` (a VaSlot's address, large enough) when not 0, else in the VA arena; for `also_for` too when it is
/// another device (>= 0) of this process (peer access required).
CreatedDevice create_device_memory(int ordinal, std::size_t bytes, std::uint64_t at = 0, int also_for = -1);

/// Imports an exported allocation of `size` bytes living on the device with `owner`'s UUID and maps it for device
/// `requested` (-1: the current context's device, else the owner), at `at` (a VaSlot's address) when not 0.
/// Read-only maps with PROT_READ access. Throws Error(Unsupported) when the mapping device cannot reach the
/// owner's memory (no peer access).
std::unique_ptr<GpuMemory> import_device_memory(int fd, std::size_t size, const proto::Uuid& owner, int requested,
                                                bool read_only, std::uint64_t at = 0);

/// The device whose context maps memory living on the GPU with `owner`'s UUID: `requested` when >= 0, else the
/// current context's device, else the owner's. Throws Error(NoDevice) when none applies, Error(Unsupported) when
/// that device has no peer access to the owner's.
int mapping_ordinal(const proto::Uuid& owner, int requested);

/// Memory this process already has (gpuipc::share's exporter side): owns nothing, reports `ptr` and `ordinal`.
std::unique_ptr<GpuMemory> borrow_device_memory(std::uint64_t ptr, int ordinal);

/// Another process's cuMemAlloc allocation, opened with cuIpcOpenMemHandle from the 64-byte `handle` on device
/// `requested` (as mapping_ordinal) — once per allocation and device in this process: every open of the same
/// handle shares one mapping, closed (cuIpcCloseMemHandle) when the last result goes. device_pointer() is the
/// allocation's base. `bytes` is set to the allocation's size as the driver maps it here (0 when it cannot say): what
/// the exporter's record claims is checked against it. Throws Error(Cuda) (e.g. the exporter freed it), NoDevice,
/// Unsupported, NoDriver.
std::unique_ptr<GpuMemory> open_legacy_memory(std::span<const std::uint8_t> handle, const proto::Uuid& owner,
                                              int requested, std::uint64_t& bytes);

/// How many distinct legacy IPC allocations this process has open now (tests, benchmarks).
std::size_t legacy_open_count();

/// Registers host memory [ptr, ptr+size) with the GPU (portable, device-mapped; read-only when asked and the
/// device supports it) using device `ordinal`'s primary context.
std::unique_ptr<GpuMemory> register_host_memory(void* ptr, std::size_t size, int ordinal, bool read_only);

}  // namespace gpuipc::core
