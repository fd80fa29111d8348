// include/gpuipc/device.hpp over src/cuda: the driver and device queries front ends need, and the synchronous copy
// the Python views use for DLPack sources.
#include "gpuipc/device.hpp"

#include <fmt/format.h>

#include <cstring>
#include <vector>

#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/pointer.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/topology.hpp"

namespace gpuipc {

bool driver_available(std::string* why) noexcept { return cuda::driver_available(why); }

DriverInfo driver_info() {
  const cuda::DriverApi& api = cuda::driver();
  return {.version = api.driver_version, .library = api.library};
}

std::string format_driver_version(int version) { return cuda::format_driver_version(version); }

int device_count() { return cuda::device_count(); }

DeviceInfo device_info(int ordinal, bool include_free_memory) {
  return cuda::query_device(ordinal, include_free_memory);
}

std::vector<std::vector<bool>> peer_access_matrix() { return cuda::peer_access_matrix(); }

int device_ordinal(std::string_view uuid) {
  const auto parsed = cuda::parse_uuid(uuid);
  if (!parsed) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi -L "
                            "prints it)",
                            uuid),
                "device_ordinal");
  }
  return cuda::find_device(*parsed).value_or(-1);
}

Topology topology(bool try_mapping) {
  Topology t;
  const int count = cuda::device_count();
  std::vector<cuda::NvmlGpu> gpus;
  for (int i = 0; i < count; ++i) {
    const DeviceInfo info = cuda::query_device(i, false);
    gpus.push_back({.uuid = info.uuid_string, .pci_bus_id = info.pci_bus_id});
  }
  if (count < 2) return t;
  const auto peers = cuda::peer_access_matrix();
  const cuda::NvmlTopology nvml = cuda::nvml_topology(gpus);
  t.nvml = nvml.loaded;
  t.nvml_error = nvml.error;
  // Every GPU's primary context held across the mapping probes. Each probe retains the two it needs; with no other
  // retain they would be created and destroyed again for every pair (~100 ms and a few hundred MiB each time; 56
  // ordered pairs on an 8-GPU node). A GPU whose context cannot be made is left to its probes, which report why.
  std::vector<cuda::PrimaryContext> held;
  if (try_mapping) {
    for (int i = 0; i < count; ++i) {
      try {
        held.emplace_back(i);
      } catch (const Error&) {  // NOLINT(bugprone-empty-catch): the probes of this GPU report the driver's reason
      }
    }
  }
  for (int i = 0; i < count; ++i) {
    for (int j = 0; j < count; ++j) {
      if (i == j) continue;
      const auto si = static_cast<std::size_t>(i);
      const auto sj = static_cast<std::size_t>(j);
      PeerLink link;
      link.from = i;
      link.to = j;
      link.peer_access = peers[si][sj];
      cuda::classify_link(link, cuda::p2p_attributes(i, j), nvml.loaded ? nvml.links[si][sj] : std::nullopt);
      if (try_mapping && link.peer_access) {
        link.mapping_tried = true;
        link.mapping_error = cuda::try_peer_mapping(j, i);
        link.mapping_works = link.mapping_error.empty();
      }
      t.links.push_back(std::move(link));
    }
  }
  return t;
}

int device_of(std::uint64_t address) { return cuda::pointer_info(static_cast<CUdeviceptr>(address)).device; }

void copy_synchronous(MemoryAddress destination, MemoryAddress source, std::size_t bytes, StreamHandle stream) {
  const bool dst_gpu = destination.device >= 0;
  const bool src_gpu = source.device >= 0;
  if (!dst_gpu && !src_gpu) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the caller's host addresses
    std::memcpy(reinterpret_cast<void*>(destination.address), reinterpret_cast<const void*>(source.address), bytes);
    return;
  }
  cuda::PrimaryContext ctx(dst_gpu ? destination.device : source.device);
  cuda::ScopedContext current(ctx.get());
  cuda::synchronize(static_cast<CUstream>(stream), "the source's stream before a copy into a channel");
  if (dst_gpu && src_gpu) {
    cuda::copy_device_to_device(destination.address, source.address, bytes);
  } else if (dst_gpu) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the caller's host address
    cuda::copy_to_device(destination.address, reinterpret_cast<const void*>(source.address), bytes);
  } else {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): the caller's host address
    cuda::copy_to_host(reinterpret_cast<void*>(destination.address), source.address, bytes);
  }
}

}  // namespace gpuipc
