#include "cuda/host_func.hpp"

#include "cuda/driver.hpp"

namespace gpuipc::cuda {

CUresult launch_host_func(CUstream stream, void (*fn)(void*), void* data) noexcept {
  const DriverApi* d = loaded_driver();
  if (d == nullptr || d->cuLaunchHostFunc == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return d->cuLaunchHostFunc(stream, fn, data);
}

}  // namespace gpuipc::cuda
