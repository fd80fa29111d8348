#include "cuda/host_func.hpp"

#include "cuda/driver.hpp"

namespace gpuipc::cuda {

CUresult launch_host_func(CUstream stream, void (*fn)(void*), void* data) noexcept {
  const DriverApi* d = loaded_driver();
  if (d == nullptr || d->cuLaunchHostFunc == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return d->cuLaunchHostFunc(stream, fn, data);
}

bool ensure_current(CUcontext ctx) noexcept {
  const DriverApi* d = loaded_driver();
  if (d == nullptr || ctx == nullptr) return false;
  CUcontext current = nullptr;
  if (d->cuCtxGetCurrent(&current) != CUDA_SUCCESS) return false;
  return current != nullptr || d->cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
}

}  // namespace gpuipc::cuda
