#include "cuda/host_registration.hpp"

#include <fmt/format.h>

#include "cuda/context.hpp"

namespace gpuipc::cuda {

HostRegistration HostRegistration::register_memory(void* ptr, std::size_t size, bool read_only) {
  const DriverApi& api = driver();
  unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
  if (read_only) flags |= CU_MEMHOSTREGISTER_READ_ONLY;
  const CUcontext ctx = current_context();
  check(api.cuMemHostRegister(ptr, size, flags), "cuMemHostRegister",
        fmt::format("registering {} bytes of host memory at {}{}", size, ptr, read_only ? " read-only" : ""));
  return HostRegistration(Registered{ptr, size, ctx});
}

void HostRegistration::Release::operator()(const Registered& registered) const noexcept {
  release_in(
      registered.ctx, "cuMemHostUnregister",
      [&](const DriverApi& api) { return api.cuMemHostUnregister(registered.ptr); },
      [] { return "registered host memory"; });
}

CUdeviceptr HostRegistration::device_pointer() const {
  const DriverApi& api = driver();
  CUdeviceptr dptr = 0;
  const CUresult r = call_in(api, m_owned.get().ctx,
                             [&](const DriverApi& a) { return a.cuMemHostGetDevicePointer(&dptr, host_pointer(), 0); });
  check(r, "cuMemHostGetDevicePointer", fmt::format("registered host memory at {}", host_pointer()));
  return dptr;
}

PinnedHostBuffer::PinnedHostBuffer(std::size_t bytes) {
  void* ptr = nullptr;
  check(driver().cuMemHostAlloc(&ptr, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc",
        fmt::format("{} bytes of pinned host memory", bytes));
  m_owned = UniqueHandle<Allocated, Release>(Allocated{ptr, bytes});
}

void PinnedHostBuffer::Release::operator()(const Allocated& allocated) const noexcept {
  release_in(
      nullptr, "cuMemFreeHost", [&](const DriverApi& api) { return api.cuMemFreeHost(allocated.ptr); },
      [&] { return fmt::format("{} bytes of pinned host memory", allocated.bytes); });
}

}  // namespace gpuipc::cuda
