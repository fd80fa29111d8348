// Kernels for GPU tests, benchmarks and the demo. Device code only: compiled to an embedded fatbinary
// (cmake/kernels.cmake) and launched by name through the run-time-loaded driver (kernels.cpp). No runtime API.
// Every kernel is extern "C" so its name in the module is the plain name below; keep kernels.cpp in sync.
#include <cuda/atomic>

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

/// read_sum that also records when it ran: stamp[0] = the earliest block start, stamp[1] = ~(the latest block end)
/// (%globaltimer ns, the same clock in every process; the caller fills both with ~0 first, one memset).
/// For GPU timelines of streaming (bench/suites/suite_ordering.cpp).
extern "C" __global__ void gpuipc_read_sum_timed(const uint4* p, unsigned long long n, unsigned long long* out,
                                                 unsigned long long* stamp) {
  if (threadIdx.x == 0) atomicMin(&stamp[0], global_timer_ns());
  unsigned long long sum = 0;
  for (unsigned long long i = global_index(); i < n; i += grid_stride()) {
    const uint4 v = p[i];
    sum += static_cast<unsigned long long>(v.x) + v.y + v.z + v.w;
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) {
    atomicAdd(out, sum);
    atomicMin(&stamp[1], ~global_timer_ns());
  }
}

/// write_fill that records when it ran, as read_sum_timed.
extern "C" __global__ void gpuipc_write_fill_timed(uint4* p, unsigned long long n, unsigned value,
                                                   unsigned long long* stamp) {
  if (threadIdx.x == 0) atomicMin(&stamp[0], global_timer_ns());
  const uint4 v = make_uint4(value, value, value, value);
  for (unsigned long long i = global_index(); i < n; i += grid_stride()) p[i] = v;
  __syncthreads();
  if (threadIdx.x == 0) atomicMin(&stamp[1], ~global_timer_ns());
}

/// One thread writes *p = value (through a read-only mapping this faults the context: the test of PROT_READ).
extern "C" __global__ void gpuipc_write_one(unsigned* p, unsigned value) {
  if (global_index() == 0) *p = value;
}

/// One thread waits until *flag >= value (another process or the host writes it), polling with a short sleep.
/// Gives up after timeout_ns (0: never) and then sets *timed_out = 1, so a lost writer cannot hang the GPU.
/// Without MPS, kernels of different processes time-slice: a round trip through such a flag costs milliseconds
/// (docs/study.md, the coherence study); use stream memory operations for cross-process synchronisation.
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

// ---- the coherence study (bench/suites/suite_coherence.cpp) ----------------------------------------------------------
// A writer kernel in one process and a reader kernel in another hand data over through a flag in shared (IPC)
// memory, trial after trial: block b of the writer writes its chunk of data[] = i and then flags[b] = i; block b of
// the reader waits for flags[b] >= i, reads the chunk, counts the words older than the flag (stale data after the
// flag) and acknowledges with acks[b] = i + 1, which the writer waits for before trial i + 1. The flag protocol
// is the thing measured: mode 0 (plain volatile stores and loads), 1 (__threadfence_system() between data and
// flag on the writer, after the flag on the reader), 2 (cuda::atomic_ref at system scope: store(release) /
// load(acquire)). The acknowledgement always uses release/acquire at system scope. Every wait gives up after
// timeout_ns of %globaltimer and the kernel then stops (its result counts the block as timed out).
namespace {

// mode 0: plain volatile accesses (no constant: it is the default branch)
constexpr unsigned kCoherenceFence = 1;
constexpr unsigned kCoherenceReleaseAcquire = 2;
/// u64 words between two blocks' flags (and acknowledgements): one 256-byte line each.
constexpr unsigned long long kCoherenceFlagStride = 32;

using SystemAtomicU64 = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

__device__ __forceinline__ unsigned long long load_flag(unsigned long long* p, unsigned mode) {
  if (mode == kCoherenceReleaseAcquire) return SystemAtomicU64(*p).load(cuda::memory_order_acquire);
  return *const_cast<volatile unsigned long long*>(p);
}

__device__ __forceinline__ void store_flag(unsigned long long* p, unsigned long long v, unsigned mode) {
  if (mode == kCoherenceReleaseAcquire) {
    SystemAtomicU64(*p).store(v, cuda::memory_order_release);
  } else {
    *const_cast<volatile unsigned long long*>(p) = v;
  }
}

/// Spins until load_flag(p, mode) >= v (true; *seen = the value) or timeout_ns passed (false).
__device__ bool wait_flag_geq(unsigned long long* p, unsigned long long v, unsigned mode,
                              unsigned long long timeout_ns, unsigned long long* seen) {
  const unsigned long long start = global_timer_ns();
  for (unsigned n = 0;; ++n) {
    const unsigned long long x = load_flag(p, mode);
    if (x >= v) {
      *seen = x;
      return true;
    }
    if ((n & 15U) == 15U && global_timer_ns() - start > timeout_ns) return false;
  }
}

}  // namespace

/// The writing side. t_write[i - 1] = %globaltimer just before block 0 stores flag i. result[0] += trials
/// completed (summed over blocks), result[1] += blocks that timed out waiting for an acknowledgement.
extern "C" __global__ void gpuipc_coherence_writer(unsigned* data, unsigned long long* flags, unsigned long long* acks,
                                                   unsigned words_per_block, unsigned trials, unsigned mode,
                                                   unsigned long long timeout_ns, unsigned long long* t_write,
                                                   unsigned long long* result) {
  __shared__ int s_abort;
  const unsigned b = blockIdx.x;
  unsigned long long* flag = flags + b * kCoherenceFlagStride;
  unsigned long long* ack = acks + b * kCoherenceFlagStride;
  volatile unsigned* mine = data + static_cast<unsigned long long>(b) * words_per_block;
  unsigned done = 0;
  int aborted = 0;
  for (unsigned i = 1; i <= trials; ++i) {
    if (threadIdx.x == 0) {
      unsigned long long seen = 0;
      s_abort = wait_flag_geq(ack, i, kCoherenceReleaseAcquire, timeout_ns, &seen) ? 0 : 1;
    }
    __syncthreads();
    if (s_abort != 0) {
      aborted = 1;
      break;
    }
    for (unsigned k = threadIdx.x; k < words_per_block; k += blockDim.x) mine[k] = i;
    if (mode == kCoherenceFence) __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned long long t = global_timer_ns();
      store_flag(flag, i, mode);
      if (b == 0) t_write[i - 1] = t;
    }
    done = i;
  }
  if (threadIdx.x == 0) {
    atomicAdd(&result[0], static_cast<unsigned long long>(done));
    if (aborted != 0) atomicAdd(&result[1], 1ULL);
  }
}

/// The reading side. t_seen[i - 1] = %globaltimer when block 0 saw flag i. result[0] += trials completed (summed
/// over blocks), result[1] += blocks that timed out, result[2] += observations (block, trial) with stale data
/// after the flag, result[3] += stale words, result[4] += observations where the flag was already past i.
extern "C" __global__ void gpuipc_coherence_reader(const unsigned* data, unsigned long long* flags,
                                                   unsigned long long* acks, unsigned words_per_block,
                                                   unsigned trials, unsigned mode, unsigned long long timeout_ns,
                                                   unsigned long long* t_seen, unsigned long long* result) {
  __shared__ int s_abort;
  __shared__ unsigned long long s_seen;
  __shared__ unsigned s_bad;
  const unsigned b = blockIdx.x;
  unsigned long long* flag = flags + b * kCoherenceFlagStride;
  unsigned long long* ack = acks + b * kCoherenceFlagStride;
  const volatile unsigned* mine = data + static_cast<unsigned long long>(b) * words_per_block;
  unsigned long long done = 0, events = 0, words = 0, overshoot = 0;
  int aborted = 0;
  if (threadIdx.x == 0) {
    s_bad = 0;
    store_flag(ack, 1, kCoherenceReleaseAcquire);  // ready for trial 1
  }
  __syncthreads();
  for (unsigned i = 1; i <= trials; ++i) {
    if (threadIdx.x == 0) {
      unsigned long long seen = 0;
      const bool ok = wait_flag_geq(flag, i, mode, timeout_ns, &seen);
      const unsigned long long t = global_timer_ns();
      if (mode == kCoherenceFence) __threadfence_system();
      s_abort = ok ? 0 : 1;
      s_seen = seen;
      if (ok && b == 0) t_seen[i - 1] = t;
    }
    __syncthreads();
    if (s_abort != 0) {
      aborted = 1;
      break;
    }
    const unsigned want = static_cast<unsigned>(s_seen);
    unsigned bad = 0;
    for (unsigned k = threadIdx.x; k < words_per_block; k += blockDim.x) bad += mine[k] < want ? 1U : 0U;
    if (bad != 0) atomicAdd(&s_bad, bad);
    __syncthreads();
    if (threadIdx.x == 0) {
      if (s_bad != 0) {
        ++events;
        words += s_bad;
        s_bad = 0;
      }
      if (s_seen != i) ++overshoot;
      store_flag(ack, static_cast<unsigned long long>(i) + 1, kCoherenceReleaseAcquire);
    }
    done = i;
  }
  if (threadIdx.x == 0) {
    atomicAdd(&result[0], done);
    if (aborted != 0) atomicAdd(&result[1], 1ULL);
    if (events != 0) atomicAdd(&result[2], events);
    if (words != 0) atomicAdd(&result[3], words);
    if (overshoot != 0) atomicAdd(&result[4], overshoot);
  }
}

/// One thread stores %globaltimer to *out (stream-ordered timestamps, same clock in every process on this GPU).
extern "C" __global__ void gpuipc_stamp_time(unsigned long long* out) {
  if (global_index() == 0) *out = global_timer_ns();
}

/// *stamp = %globaltimer when the kernel starts (block 0, thread 0); *mismatches (zeroed by the caller) += the
/// number of i < n_words with p[i] != value.
extern "C" __global__ void gpuipc_check_value(const unsigned* p, unsigned long long n_words, unsigned value,
                                              unsigned long long* mismatches, unsigned long long* stamp) {
  if (global_index() == 0) *stamp = global_timer_ns();
  unsigned long long bad = 0;
  for (unsigned long long i = global_index(); i < n_words; i += grid_stride()) bad += p[i] != value ? 1 : 0;
  if (bad != 0) atomicAdd(mismatches, bad);
}

/// counts[s] (s < 3; zeroed by the caller) += words that equal pattern_word(seed_s, i); counts[3] += words that
/// equal none of the three (torn or foreign data). A word that several patterns share counts for the first.
extern "C" __global__ void gpuipc_classify_patterns(const unsigned* p, unsigned long long n_words,
                                                    unsigned long long seed0, unsigned long long seed1,
                                                    unsigned long long seed2, unsigned long long* counts) {
  unsigned long long c0 = 0, c1 = 0, c2 = 0, none = 0;
  for (unsigned long long i = global_index(); i < n_words; i += grid_stride()) {
    const unsigned v = p[i];
    if (v == gpuipc::kernels::pattern_word(seed0, i)) {
      ++c0;
    } else if (v == gpuipc::kernels::pattern_word(seed1, i)) {
      ++c1;
    } else if (v == gpuipc::kernels::pattern_word(seed2, i)) {
      ++c2;
    } else {
      ++none;
    }
  }
  if (c0 != 0) atomicAdd(&counts[0], c0);
  if (c1 != 0) atomicAdd(&counts[1], c1);
  if (c2 != 0) atomicAdd(&counts[2], c2);
  if (none != 0) atomicAdd(&counts[3], none);
}
