// Kernels for GPU tests, benchmarks and the demo. Device code only: compiled to an embedded fatbinary
// (cmake/kernels.cmake) and launched by name through the run-time-loaded driver (kernels.cpp). No runtime API.
// Every kernel is extern "C" so its name in the module is the plain name below; keep kernels.cpp in sync.
#include "pattern.hpp"

namespace {

__device__ __forceinline__ unsigned long long global_index() {
  return static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ unsigned long long grid_stride() {
  return static_cast<unsigned long long>(gridDim.x) * blockDim.x;
}

// Nanoseconds of the GPU's global timer.
__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Sum over the block; the result is valid in thread 0. blockDim.x must be a multiple of 32, at most 1024.
__device__ unsigned long long block_sum(unsigned long long v) {
  __shared__ unsigned long long warp_sums[32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffU, v, offset);
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  v = 0;
  if (warp == 0) {
    if (lane < blockDim.x / 32) v = warp_sums[lane];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffU, v, offset);
  }
  return v;
}

}  // namespace

/// p[i] = pattern_word(seed, i) for i < n_words.
extern "C" __global__ void gpuipc_fill_pattern(unsigned* p, unsigned long long n_words, unsigned long long seed) {
  for (unsigned long long i = global_index(); i < n_words; i += grid_stride()) {
    p[i] = gpuipc::kernels::pattern_word(seed, i);
  }
}

/// Adds to *mismatches the number of i < n_words with p[i] != pattern_word(seed, i).
extern "C" __global__ void gpuipc_verify_pattern(const unsigned* p, unsigned long long n_words, unsigned long long seed,
                                                 unsigned long long* mismatches) {
  unsigned long long bad = 0;
  for (unsigned long long i = global_index(); i < n_words; i += grid_stride()) {
    bad += p[i] != gpuipc::kernels::pattern_word(seed, i) ? 1 : 0;
  }
  if (bad != 0) atomicAdd(mismatches, bad);
}

/// Reads n 16-byte vectors and adds the sum of their 32-bit lanes to *out (one atomic per block): read bandwidth.
extern "C" __global__ void gpuipc_read_sum(const uint4* p, unsigned long long n, unsigned long long* out) {
  unsigned long long sum = 0;
  for (unsigned long long i = global_index(); i < n; i += grid_stride()) {
    const uint4 v = p[i];
    sum += static_cast<unsigned long long>(v.x) + v.y + v.z + v.w;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) atomicAdd(out, sum);
}

/// Writes `value` to every lane of n 16-byte vectors: write bandwidth.
extern "C" __global__ void gpuipc_write_fill(uint4* p, unsigned long long n, unsigned value) {
  const uint4 v = make_uint4(value, value, value, value);
  for (unsigned long long i = global_index(); i < n; i += grid_stride()) p[i] = v;
}

/// One thread writes *p = value (through a read-only mapping this faults the context: the test of PROT_READ).
extern "C" __global__ void gpuipc_write_one(unsigned* p, unsigned value) {
  if (global_index() == 0) *p = value;
}

/// One thread waits until *flag >= value (another process or the host writes it), polling with a short sleep.
/// Gives up after timeout_ns (0: never) and then sets *timed_out = 1, so a lost writer cannot hang the GPU.
/// Without MPS, kernels of different processes time-slice: a round trip through such a flag costs milliseconds
/// (shared/DESIGN.md); use stream memory operations for cross-process synchronisation.
extern "C" __global__ void gpuipc_spin_until(const volatile unsigned long long* flag, unsigned long long value,
                                             unsigned long long timeout_ns, unsigned* timed_out) {
  if (global_index() != 0) return;
  const unsigned long long start = global_timer_ns();
  while (*flag < value) {
    if (timeout_ns != 0 && global_timer_ns() - start > timeout_ns) {
      *timed_out = 1;
      return;
    }
    __nanosleep(256);
  }
  // Acquire: what the writer stored before the flag is visible to work after this kernel.
  __threadfence_system();
}

/// One thread publishes *flag = value with system scope, after every earlier write of this kernel's stream is
/// visible (release): host code and other processes polling the flag see the data first.
extern "C" __global__ void gpuipc_write_flag(volatile unsigned long long* flag, unsigned long long value) {
  if (global_index() != 0) return;
  __threadfence_system();
  *flag = value;
  __threadfence_system();
}
