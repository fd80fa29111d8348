#include "core/device_choice.hpp"

#include <fmt/format.h>

#include <cstdlib>

#include "gpuipc/error.hpp"

namespace gpuipc::core {
namespace {

std::string visible_devices() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");  // NOLINT(concurrency-mt-unsafe): read, for a message
  return v == nullptr ? std::string("unset") : fmt::format("\"{}\"", v);
}

}  // namespace

int choose_mapping_device(const DeviceChoice& in, const std::function<bool(int from, int to)>& can_access) {
  if (in.requested >= in.device_count) {
    throw Error(ErrorCode::NoDevice,
                fmt::format("GPU {} was requested to map memory of {}, but this process sees {} GPU{} "
                            "(CUDA_VISIBLE_DEVICES {})",
                            in.requested, in.owner_uuid, in.device_count, in.device_count == 1 ? "" : "s",
                            visible_devices()),
                "open");
  }
  int ordinal = in.requested;
  if (ordinal < 0) ordinal = in.current ? *in.current : in.owner.value_or(-1);
  if (ordinal < 0) {
    throw Error(ErrorCode::NoDevice,
                fmt::format("the memory lives on {}, which this process does not see (CUDA_VISIBLE_DEVICES {}), "
                            "and no device was requested: pass the GPU to map it from, or make {} visible",
                            in.owner_uuid, visible_devices(), in.owner_uuid),
                "open");
  }
  if (in.owner && *in.owner != ordinal && !can_access(ordinal, *in.owner)) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("GPU {} cannot map memory of GPU {} ({}): the driver reports no peer access between "
                            "them (cuDeviceCanAccessPeer; `gpuipc doctor` shows the topology); open it from GPU {}, "
                            "or copy it there through host memory",
                            ordinal, *in.owner, in.owner_uuid, *in.owner),
                "open");
  }
  return ordinal;
}

std::string invisible_owner_message(const std::string& owner_uuid, int ordinal, const std::string& cause) {
  return fmt::format("the memory lives on {}, which this process does not see (CUDA_VISIBLE_DEVICES {}); mapping "
                     "it from GPU {} failed: {}. Make {} visible to this process",
                     owner_uuid, visible_devices(), ordinal, cause, owner_uuid);
}

}  // namespace gpuipc::core
