// Validation of the DeviceIpc record (proto/shm.hpp), shared by the broker (at Create) and openers (before they
// trust the record with cuIpcOpenMemHandle): both read memory another process wrote.
#include <fmt/format.h>

#include <cstring>

#include "proto/messages.hpp"
#include "proto/shm.hpp"

namespace gpuipc::proto {

std::string check_device_ipc_record(const DeviceIpcRecord& record, std::uint64_t size, const Uuid& device) {
  if (record.magic != kDeviceIpcMagic) {
    return fmt::format("magic {:#010x} is not a DeviceIpc record's ({:#010x})", record.magic, kDeviceIpcMagic);
  }
  if (record.version != kDeviceIpcVersion) {
    return fmt::format("version {}; this side reads version {}", record.version, kDeviceIpcVersion);
  }
  if (record.size == 0 || record.size != size) {
    return fmt::format("the record shares {} bytes but the segment has {}", record.size, size);
  }
  if (record.alloc_size > kMaxSegmentSize || record.size > record.alloc_size ||
      record.offset > record.alloc_size - record.size) {
    return fmt::format("bytes [{}, {} + {}) do not lie inside the allocation of {} bytes", record.offset,
                       record.offset, record.size, record.alloc_size);
  }
  if (std::memcmp(record.device, device.data(), sizeof record.device) != 0) {
    return "the record names another GPU than the segment";
  }
  return {};
}

}  // namespace gpuipc::proto
