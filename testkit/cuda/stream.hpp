// Owned streams for GPU tests, benchmarks and the demo (the library works on its callers' streams:
// src/cuda/stream_ops.hpp). Part of testkit/ (README.md there): not in libgpuipc.
#pragma once

#include <cuda.h>

#include "cuda/unique_handle.hpp"

namespace gpuipc::cuda {

/// A stream of the current context; cuStreamDestroy on destruction (pending work still completes).
class Stream {
 public:
  Stream() noexcept = default;
  /// cuStreamCreate with CU_STREAM_NON_BLOCKING (no implicit sync with the legacy default stream) unless
  /// `non_blocking` is false. Throws Error(Cuda).
  static Stream create(bool non_blocking = true);

  CUstream get() const noexcept { return m_owned.get().stream; }
  /// Blocks until the stream's work is done. Throws Error(Cuda) when it failed.
  void synchronize() const;
  /// True when the stream's work is done, false while some is pending. Throws Error(Cuda) when it failed.
  bool query() const;
  explicit operator bool() const noexcept { return get() != nullptr; }

 private:
  struct Created {
    CUstream stream = nullptr;
    CUcontext ctx = nullptr;
    bool operator==(const Created&) const = default;
  };
  struct Release {
    void operator()(const Created& created) const noexcept;
  };
  explicit Stream(Created created) noexcept : m_owned(created) {}
  UniqueHandle<Created, Release> m_owned;
};

}  // namespace gpuipc::cuda
