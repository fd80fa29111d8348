// Legacy CUDA IPC of cuMemAlloc (cudaMalloc) memory: gpuipc::share exports such memory by its cuIpcMemHandle, and
// the importer opens it (docs/segments.md). Both work in the context current on the calling thread.
#pragma once

#include <cuda.h>

#include "cuda/unique_handle.hpp"

namespace gpuipc::cuda {

/// The legacy IPC handle of memory from cuMemAlloc (cudaMalloc) at `ptr`, which must be the allocation's base
/// (cuIpcGetMemHandle; the importer adds the offset). Throws Error(Cuda).
CUipcMemHandle ipc_get_mem_handle(CUdeviceptr ptr);

/// Another process's cuMemAlloc memory opened with cuIpcOpenMemHandle in the current context;
/// cuIpcCloseMemHandle on destruction. Lives no longer than the exporter's allocation.
class IpcMapping {
 public:
  IpcMapping() noexcept = default;
  /// cuIpcOpenMemHandle(handle, flags). Throws Error(Cuda); opening a handle of this same process fails with
  /// CUDA_ERROR_INVALID_CONTEXT (a driver rule).
  static IpcMapping open(const CUipcMemHandle& handle, unsigned flags = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);

  CUdeviceptr get() const noexcept { return m_owned.get().ptr; }
  explicit operator bool() const noexcept { return get() != 0; }

 private:
  struct Opened {
    CUdeviceptr ptr = 0;
    CUcontext ctx = nullptr;
    bool operator==(const Opened&) const = default;
  };
  struct Release {
    void operator()(const Opened& opened) const noexcept;
  };
  explicit IpcMapping(Opened opened) noexcept : m_owned(opened) {}
  UniqueHandle<Opened, Release> m_owned;
};

}  // namespace gpuipc::cuda
