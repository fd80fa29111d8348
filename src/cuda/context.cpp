#include "cuda/context.hpp"

#include <fmt/format.h>

namespace gpuipc::cuda {

PrimaryContext::PrimaryContext(int ordinal) {
  const DriverApi& api = driver();
  const CUdevice device = device_handle(ordinal);
  CUcontext ctx = nullptr;
  check(api.cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain",
        fmt::format("primary context of GPU {}", ordinal));
  m_owned = UniqueHandle<Retained, Release>(Retained{ordinal, device, ctx});
}

void PrimaryContext::Release::operator()(const Retained& retained) const noexcept {
  release_in(
      nullptr, "cuDevicePrimaryCtxRelease",
      [&](const DriverApi& api) { return api.cuDevicePrimaryCtxRelease(retained.device); },
      [&] { return fmt::format("primary context of GPU {}", retained.ordinal); });
}

void PrimaryContext::make_current() const {
  check(driver().cuCtxSetCurrent(get()), "cuCtxSetCurrent", fmt::format("primary context of GPU {}", ordinal()));
}

ScopedContext::ScopedContext(CUcontext ctx) : m_previous(current_context()) {
  if (m_previous != ctx) {
    check(driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent", "switching context");
    m_switched = true;
  }
}

ScopedContext::~ScopedContext() {
  if (!m_switched) return;
  if (const DriverApi* api = loaded_driver()) {
    warn_release(api->cuCtxSetCurrent(m_previous), "cuCtxSetCurrent", "restoring the previous context");
  }
}

CUcontext current_context() {
  CUcontext ctx = nullptr;
  check(driver().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent", "current context");
  return ctx;
}

CUcontext current_context_or_null() noexcept {
  const DriverApi* api = loaded_driver();
  CUcontext ctx = nullptr;
  if (api == nullptr || api->cuCtxGetCurrent(&ctx) != CUDA_SUCCESS) return nullptr;
  return ctx;
}

int current_ordinal() {
  const DriverApi& api = driver();
  CUdevice device = 0;
  check(api.cuCtxGetDevice(&device), "cuCtxGetDevice", "device of the current context");
  // CUdevice is a handle, not formally the ordinal: find the ordinal that maps to it.
  int count = 0;
  check(api.cuDeviceGetCount(&count), "cuDeviceGetCount", "devices");
  for (int i = 0; i < count; ++i) {
    CUdevice d = 0;
    if (api.cuDeviceGet(&d, i) == CUDA_SUCCESS && d == device) return i;
  }
  return static_cast<int>(device);
}

CUdevice device_handle(int ordinal) {
  CUdevice device = 0;
  check(driver().cuDeviceGet(&device, ordinal), "cuDeviceGet", fmt::format("GPU {}", ordinal));
  return device;
}

int device_attribute(CUdevice_attribute attribute, int ordinal) {
  int value = 0;
  check(driver().cuDeviceGetAttribute(&value, attribute, device_handle(ordinal)), "cuDeviceGetAttribute",
        fmt::format("attribute {} of GPU {}", static_cast<int>(attribute), ordinal));
  return value;
}

}  // namespace gpuipc::cuda
