// Modules (cubin, PTX or fatbinary images) and kernel launches through the driver, for the embedded kernels of
// testkit/kernels (no CUDA runtime). Part of testkit/ (README.md there): not in libgpuipc.
#pragma once

#include <cuda.h>

#include <string>
#include <string_view>
#include <utility>

#include "cuda/unique_handle.hpp"

namespace gpuipc::cuda {

/// A module loaded into the current context; cuModuleUnload on destruction.
class Module {
 public:
  Module() noexcept = default;
  /// cuModuleLoadData(image). `what` names the image in errors ("embedded gpuipc kernels"). Throws Error(Cuda),
  /// e.g. CUDA_ERROR_NO_BINARY_FOR_GPU when the image has no code for this GPU.
  static Module load(const void* image, std::string_view what);

  /// cuModuleGetFunction. Throws Error(NotFound) naming the kernel when the module lacks it.
  CUfunction function(const char* name) const;
  CUmodule get() const noexcept { return m_owned.get().module; }
  explicit operator bool() const noexcept { return get() != nullptr; }

 private:
  struct Loaded {
    CUmodule module = nullptr;
    CUcontext ctx = nullptr;
    std::string what;
    bool operator==(const Loaded&) const = default;
  };
  struct Release {
    void operator()(const Loaded& loaded) const noexcept;
  };
  explicit Module(Loaded loaded) noexcept : m_owned(std::move(loaded)) {}
  UniqueHandle<Loaded, Release> m_owned;
};

/// One kernel launch (cuLaunchKernel) of a 1-D grid. `args` as cuLaunchKernel's kernelParams; `name` for errors.
/// Throws Error(Cuda) (launch failures only: faults surface at the next synchronisation).
void launch(CUfunction function, unsigned grid, unsigned block, unsigned shared_bytes, CUstream stream, void** args,
            const char* name);

}  // namespace gpuipc::cuda
