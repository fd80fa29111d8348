#include "testkit/kernels/kernels.hpp"

#include <algorithm>

#include "cuda/context.hpp"
#include "cuda/stream_ops.hpp"
#include "testkit/cuda/device_memory.hpp"

// The fatbinary of kernels.cu, embedded by cmake/embed.cmake (gpuipc_add_fatbin in testkit/CMakeLists.txt).
extern const unsigned char gpuipc_kernels_fatbin[];
extern const std::size_t gpuipc_kernels_fatbin_size;

namespace gpuipc::kernels {
namespace {

// Enough resident blocks to saturate memory bandwidth with grid-stride loops, few enough to keep per-block
// atomics negligible.
constexpr unsigned kBlocksPerSm = 8;

}  // namespace

Kernels::Kernels()
    : m_module(cuda::Module::load(gpuipc_kernels_fatbin, "embedded gpuipc kernels")),
      m_fill_pattern(m_module.function("gpuipc_fill_pattern")),
      m_verify_pattern(m_module.function("gpuipc_verify_pattern")),
      m_read_sum(m_module.function("gpuipc_read_sum")),
      m_write_fill(m_module.function("gpuipc_write_fill")),
      m_read_sum_timed(m_module.function("gpuipc_read_sum_timed")),
      m_write_fill_timed(m_module.function("gpuipc_write_fill_timed")),
      m_write_one(m_module.function("gpuipc_write_one")),
      m_spin_until(m_module.function("gpuipc_spin_until")),
      m_write_flag(m_module.function("gpuipc_write_flag")),
      m_coherence_writer(m_module.function("gpuipc_coherence_writer")),
      m_coherence_reader(m_module.function("gpuipc_coherence_reader")),
      m_stamp_time(m_module.function("gpuipc_stamp_time")),
      m_check_value(m_module.function("gpuipc_check_value")),
      m_classify_patterns(m_module.function("gpuipc_classify_patterns")),
      m_sm_count(
          std::max(1, cuda::device_attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, cuda::current_ordinal()))) {}

unsigned Kernels::grid_for(std::size_t items) const noexcept {
  const std::size_t needed = std::max<std::size_t>(1, (items + kBlock - 1) / kBlock);
  const std::size_t cap = static_cast<std::size_t>(m_sm_count) * kBlocksPerSm;
  return static_cast<unsigned>(std::min(needed, cap));
}

void Kernels::fill_pattern(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint64_t seed) const {
  unsigned long long n = n_words;
  unsigned long long s = seed;
  void* args[] = {&words, &n, &s};
  cuda::launch(m_fill_pattern, grid_for(n_words), kBlock, 0, stream, args, "gpuipc_fill_pattern");
}

void Kernels::verify_pattern(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint64_t seed,
                             CUdeviceptr mismatches) const {
  unsigned long long n = n_words;
  unsigned long long s = seed;
  void* args[] = {&words, &n, &s, &mismatches};
  cuda::launch(m_verify_pattern, grid_for(n_words), kBlock, 0, stream, args, "gpuipc_verify_pattern");
}

std::uint64_t Kernels::count_mismatches(CUstream stream, CUdeviceptr words, std::size_t n_words,
                                        std::uint64_t seed) const {
  const cuda::DeviceBuffer counter = cuda::DeviceBuffer::allocate(sizeof(std::uint64_t));
  // Zeroed in stream order: a synchronous memset could run before earlier work on `stream` that the caller
  // expects the verification to follow.
  cuda::memset_d8_async(counter.get(), 0, sizeof(std::uint64_t), stream);
  verify_pattern(stream, words, n_words, seed, counter.get());
  cuda::synchronize(stream, "stream of gpuipc_verify_pattern");
  std::uint64_t result = 0;
  cuda::copy_to_host(&result, counter.get(), sizeof(result));
  return result;
}

void Kernels::read_sum(CUstream stream, CUdeviceptr data, std::size_t n_vec16, CUdeviceptr out) const {
  unsigned long long n = n_vec16;
  void* args[] = {&data, &n, &out};
  cuda::launch(m_read_sum, grid_for(n_vec16), kBlock, 0, stream, args, "gpuipc_read_sum");
}

void Kernels::write_fill(CUstream stream, CUdeviceptr data, std::size_t n_vec16, std::uint32_t value) const {
  unsigned long long n = n_vec16;
  unsigned v = value;
  void* args[] = {&data, &n, &v};
  cuda::launch(m_write_fill, grid_for(n_vec16), kBlock, 0, stream, args, "gpuipc_write_fill");
}

void Kernels::read_sum_timed(CUstream stream, CUdeviceptr data, std::size_t n_vec16, CUdeviceptr out,
                             CUdeviceptr stamp) const {
  unsigned long long n = n_vec16;
  void* args[] = {&data, &n, &out, &stamp};
  cuda::launch(m_read_sum_timed, grid_for(n_vec16), kBlock, 0, stream, args, "gpuipc_read_sum_timed");
}

void Kernels::write_fill_timed(CUstream stream, CUdeviceptr data, std::size_t n_vec16, std::uint32_t value,
                               CUdeviceptr stamp) const {
  unsigned long long n = n_vec16;
  unsigned v = value;
  void* args[] = {&data, &n, &v, &stamp};
  cuda::launch(m_write_fill_timed, grid_for(n_vec16), kBlock, 0, stream, args, "gpuipc_write_fill_timed");
}

void Kernels::write_one(CUstream stream, CUdeviceptr word, std::uint32_t value) const {
  unsigned v = value;
  void* args[] = {&word, &v};
  cuda::launch(m_write_one, 1, 32, 0, stream, args, "gpuipc_write_one");
}

void Kernels::spin_until(CUstream stream, CUdeviceptr flag, std::uint64_t value, std::uint64_t timeout_ns,
                         CUdeviceptr timed_out) const {
  unsigned long long v = value;
  unsigned long long t = timeout_ns;
  void* args[] = {&flag, &v, &t, &timed_out};
  cuda::launch(m_spin_until, 1, 32, 0, stream, args, "gpuipc_spin_until");
}

void Kernels::write_flag(CUstream stream, CUdeviceptr flag, std::uint64_t value) const {
  unsigned long long v = value;
  void* args[] = {&flag, &v};
  cuda::launch(m_write_flag, 1, 32, 0, stream, args, "gpuipc_write_flag");
}

void Kernels::coherence_writer(CUstream stream, unsigned blocks, CUdeviceptr data, CUdeviceptr flags, CUdeviceptr acks,
                               unsigned words_per_block, unsigned trials, FlagProtocol protocol,
                               std::uint64_t timeout_ns, CUdeviceptr t_write, CUdeviceptr result) const {
  unsigned wpb = words_per_block;
  unsigned n = trials;
  unsigned mode = static_cast<unsigned>(protocol);
  unsigned long long t = timeout_ns;
  void* args[] = {&data, &flags, &acks, &wpb, &n, &mode, &t, &t_write, &result};
  cuda::launch(m_coherence_writer, blocks, kBlock, 0, stream, args, "gpuipc_coherence_writer");
}

void Kernels::coherence_reader(CUstream stream, unsigned blocks, CUdeviceptr data, CUdeviceptr flags, CUdeviceptr acks,
                               unsigned words_per_block, unsigned trials, FlagProtocol protocol,
                               std::uint64_t timeout_ns, CUdeviceptr t_seen, CUdeviceptr result) const {
  unsigned wpb = words_per_block;
  unsigned n = trials;
  unsigned mode = static_cast<unsigned>(protocol);
  unsigned long long t = timeout_ns;
  void* args[] = {&data, &flags, &acks, &wpb, &n, &mode, &t, &t_seen, &result};
  cuda::launch(m_coherence_reader, blocks, kBlock, 0, stream, args, "gpuipc_coherence_reader");
}

void Kernels::stamp_time(CUstream stream, CUdeviceptr out) const {
  void* args[] = {&out};
  cuda::launch(m_stamp_time, 1, 32, 0, stream, args, "gpuipc_stamp_time");
}

void Kernels::check_value(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint32_t value,
                          CUdeviceptr mismatches, CUdeviceptr stamp) const {
  unsigned long long n = n_words;
  unsigned v = value;
  void* args[] = {&words, &n, &v, &mismatches, &stamp};
  cuda::launch(m_check_value, grid_for(n_words), kBlock, 0, stream, args, "gpuipc_check_value");
}

void Kernels::classify_patterns(CUstream stream, CUdeviceptr words, std::size_t n_words, std::uint64_t seed0,
                                std::uint64_t seed1, std::uint64_t seed2, CUdeviceptr counts) const {
  unsigned long long n = n_words;
  unsigned long long s0 = seed0;
  unsigned long long s1 = seed1;
  unsigned long long s2 = seed2;
  void* args[] = {&words, &n, &s0, &s1, &s2, &counts};
  cuda::launch(m_classify_patterns, grid_for(n_words), kBlock, 0, stream, args, "gpuipc_classify_patterns");
}

}  // namespace gpuipc::kernels
