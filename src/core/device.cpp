// include/gpuipc/device.hpp over src/cuda: the driver and device queries front ends need, and the synchronous copy
// the Python views use for DLPack sources.
#include "gpuipc/device.hpp"

#include <cstring>

#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/pointer.hpp"
#include "cuda/stream_ops.hpp"

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
