// The test pattern shared by the kernels (kernels.cu, compiled by nvcc) and host code (tests check data
// written or read by either side): word `index` of a buffer filled with `seed`. Keep this file free of includes.
#pragma once

#if defined(__CUDACC__)
#define GPUIPC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GPUIPC_HOST_DEVICE inline
#endif

namespace gpuipc::kernels {

/// splitmix64's finaliser: a cheap, well-mixed 64-bit hash.
GPUIPC_HOST_DEVICE constexpr unsigned long long mix64(unsigned long long z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// The 32-bit word at `index` of the pattern `seed`: distinct seeds give unrelated patterns, and no word equals
/// its index or a constant, so a stale, shifted or zeroed buffer does not verify.
GPUIPC_HOST_DEVICE constexpr unsigned pattern_word(unsigned long long seed, unsigned long long index) {
  const unsigned long long z = mix64(mix64(seed) + index * 0x9E3779B97F4A7C15ULL);
  return static_cast<unsigned>(z ^ (z >> 32));
}

}  // namespace gpuipc::kernels
