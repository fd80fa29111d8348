// Host functions in stream order (cuLaunchHostFunc): how a GPU stream wakes a sleeping host thread.
#pragma once

#include <cuda.h>

namespace gpuipc::cuda {

/// cuLaunchHostFunc(stream, fn, data). Hot path: no exception; returns the CUresult
/// (CUDA_ERROR_NOT_INITIALIZED without a driver). The function runs on a driver thread once the stream reaches
/// it and must not call CUDA.
CUresult launch_host_func(CUstream stream, void (*fn)(void*), void* data) noexcept;

/// Makes `ctx` current on the calling thread if no context is (as the CUDA runtime does implicitly on a thread's
/// first call). Hot path: no exception; returns false when it could not.
bool ensure_current(CUcontext ctx) noexcept;

}  // namespace gpuipc::cuda
