// Kernels shared by the producer and consumer examples: fill a buffer with a pattern, count words that differ.
#pragma once

#include <cstdint>

namespace example {

/// The header of each frame on the producer's channel: its number and how many the producer sends, so that the
/// consumer knows when a stream ended early.
struct FrameHeader {
  std::uint64_t number, of;
};

__host__ __device__ inline std::uint32_t pattern_word(std::uint64_t seed, std::size_t i) {
  return static_cast<std::uint32_t>(i * 2654435761u + seed * 40503u + 1);
}
__global__ void fill_kernel(std::uint32_t* p, std::size_t words, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += std::size_t{gridDim.x} * blockDim.x)
    p[i] = pattern_word(seed, i);
}
__global__ void check_kernel(const std::uint32_t* p, std::size_t words, std::uint64_t seed, unsigned long long* wrong) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words; i += std::size_t{gridDim.x} * blockDim.x)
    if (p[i] != pattern_word(seed, i)) atomicAdd(wrong, 1ULL);
}

}  // namespace example
