// Streams in the public API: a CUstream / cudaStream_t passed as an opaque pointer, so gpuipc headers need no
// CUDA headers. nullptr is the legacy default stream.
#pragma once

namespace gpuipc {

/// A CUDA stream (CUstream or cudaStream_t, which are the same type), or nullptr for the default stream.
using StreamHandle = void*;

}  // namespace gpuipc
