// The embedded kernels (kernels.cu) for GPU tests, benchmarks and the demo, launched through src/cuda (no CUDA
// runtime). Every launch is asynchronous on the given stream; errors inside a kernel surface at the next
// synchronisation of that stream.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "testkit/cuda/module.hpp"
#include "testkit/kernels/pattern.hpp"

namespace gpuipc::kernels {

/// The kernels loaded into one context. Move-only (it owns the module).
class Kernels {
 public:
  /// Loads the embedded fatbinary (sm_80 and sm_90 machine code, compute_90 PTX) into the context current on
  /// the calling thread and sizes grids from that device's SM count. Throws Error(NoDriver) without a driver,
  /// Error(Cuda) when no context is current or the image has no code for this GPU.
  Kernels();

  /// words[i] = pattern_word(seed, i) for i < n_words (u32 words).
  void fill_pattern(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint64_t seed) const;
  /// *mismatches (a device u64, zeroed by the caller) += the number of words that differ from the pattern.
  void verify_pattern(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint64_t seed,
                      CUdeviceptr mismatches) const;
  /// Runs verify_pattern with its own counter, waits for the stream and returns the count. Throws Error(Cuda)
  /// (a fault in the kernel shows here).
  std::uint64_t count_mismatches(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint64_t seed) const;
  /// *out (a device u64, zeroed by the caller) += the sum of the u32 lanes of n_vec16 16-byte vectors: a
  /// read-bandwidth kernel (grid-stride, 16-byte loads, one atomic per block). `data` must be 16-byte aligned.
  void read_sum(CUstream stream, CUdeviceptr data, std::size_t n_vec16, CUdeviceptr out) const;
  /// Writes `value` to every u32 of n_vec16 16-byte vectors: a write-bandwidth kernel. 16-byte aligned.
  void write_fill(CUstream stream, CUdeviceptr data, std::size_t n_vec16, std::uint32_t value) const;
  /// read_sum and write_fill that also record when they ran on the GPU: stamp (device u64[2], filled with ~0 by
  /// the caller) gets the earliest block start and the bitwise NOT of the latest block end, in %globaltimer ns, a
  /// clock every process on the GPU shares: timelines of streaming across processes.
  void read_sum_timed(CUstream stream, CUdeviceptr data, std::size_t n_vec16, CUdeviceptr out, CUdeviceptr stamp) const;
  void write_fill_timed(CUstream stream, CUdeviceptr data, std::size_t n_vec16, std::uint32_t value,
                        CUdeviceptr stamp) const;
  /// One thread writes *word = value: through a read-only mapping this faults the context (CUDA_ERROR_ILLEGAL_ADDRESS
  /// or similar at the next synchronisation; the context is unusable afterwards: run it in a child process).
  void write_one(CUstream stream, CUdeviceptr word, std::uint32_t value) const;
  /// One thread waits until the u64 *flag >= value (written by the host or another process), at most
  /// `timeout_ns` (0: forever), then sets the device u32 *timed_out = 1 if it gave up. Without MPS a
  /// cross-process spin costs milliseconds per round trip: benchmarks and demos only.
  void spin_until(CUstream stream, CUdeviceptr flag, std::uint64_t value, std::uint64_t timeout_ns,
                  CUdeviceptr timed_out) const;
  /// One thread stores the u64 *flag = value with system-scope fences around it (visible to the host and other
  /// processes after the stream's earlier work).
  void write_flag(CUstream stream, CUdeviceptr flag, std::uint64_t value) const;

  // ---- the coherence study (bench/suites/suite_coherence.cpp; see kernels.cu) ----
  /// Flag protocols of coherence_writer / coherence_reader.
  enum class FlagProtocol : unsigned { Plain = 0, Fence = 1, ReleaseAcquire = 2 };
  /// u64 words between two blocks' flags (and acknowledgements) in the flag and acknowledgement arrays.
  static constexpr std::size_t kCoherenceFlagStride = 32;
  /// `blocks` blocks of kBlock threads: block b writes words_per_block u32 words of `data` (from b *
  /// words_per_block) = i, then flags[b * kCoherenceFlagStride] = i, for trials i = 1..trials, each after
  /// acks[b * stride] >= i. t_write[i - 1] (device u64[trials]) = %globaltimer before block 0's flag store.
  /// result (device u64[2], zeroed): [0] trials completed summed over blocks, [1] blocks that timed out (a wait
  /// longer than timeout_ns).
  void coherence_writer(CUstream stream, unsigned blocks, CUdeviceptr data, CUdeviceptr flags, CUdeviceptr acks,
                        unsigned words_per_block, unsigned trials, FlagProtocol protocol, std::uint64_t timeout_ns,
                        CUdeviceptr t_write, CUdeviceptr result) const;
  /// The reading side: acks[b] = 1, then per trial waits flags[b] >= i, reads its chunk, acks[b] = i + 1.
  /// t_seen[i - 1] = %globaltimer when block 0 saw flag i. result (device u64[5], zeroed): [0] trials completed
  /// summed over blocks, [1] blocks that timed out, [2] observations with stale data after the flag, [3] stale
  /// words, [4] observations where the flag was already past i.
  void coherence_reader(CUstream stream, unsigned blocks, CUdeviceptr data, CUdeviceptr flags, CUdeviceptr acks,
                        unsigned words_per_block, unsigned trials, FlagProtocol protocol, std::uint64_t timeout_ns,
                        CUdeviceptr t_seen, CUdeviceptr result) const;
  /// One thread stores %globaltimer (ns) to the device u64 *out.
  void stamp_time(CUstream stream, CUdeviceptr out) const;
  /// *stamp = %globaltimer at the kernel's start; *mismatches (device u64, zeroed) += u32 words != value.
  void check_value(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint32_t value, CUdeviceptr mismatches,
                   CUdeviceptr stamp) const;
  /// counts (device u64[4], zeroed): words matching pattern seed0, seed1, seed2, and none of them.
  void classify_patterns(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint64_t seed0,
                         std::uint64_t seed1, std::uint64_t seed2, CUdeviceptr counts) const;

  /// Streaming multiprocessors of the device the kernels were loaded for.
  int sm_count() const noexcept { return m_sm_count; }

  /// Threads per block of every launch.
  static constexpr unsigned kBlock = 256;

 private:
  unsigned grid_for(std::size_t items) const noexcept;

  cuda::Module m_module;
  CUfunction m_fill_pattern = nullptr;
  CUfunction m_verify_pattern = nullptr;
  CUfunction m_read_sum = nullptr;
  CUfunction m_write_fill = nullptr;
  CUfunction m_read_sum_timed = nullptr;
  CUfunction m_write_fill_timed = nullptr;
  CUfunction m_write_one = nullptr;
  CUfunction m_spin_until = nullptr;
  CUfunction m_write_flag = nullptr;
  CUfunction m_coherence_writer = nullptr;
  CUfunction m_coherence_reader = nullptr;
  CUfunction m_stamp_time = nullptr;
  CUfunction m_check_value = nullptr;
  CUfunction m_classify_patterns = nullptr;
  int m_sm_count = 1;
};

}  // namespace gpuipc::kernels
