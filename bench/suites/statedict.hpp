// The state dict of the pools suite (issue 12): 291 bf16 tensors, 2 GiB less 5 KiB, in a transformer-like mix of
// shapes, made by a fixed rule (no randomness), and the index a producer publishes it with: one small host segment
// holding each tensor's BlockRef, name and shape. docs/benchmarks.md ("The pools suite") describes both.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "gpuipc/pool.hpp"

namespace gpuipc::bench::statedict {

/// The model the dict is shaped after: a 32-layer decoder with grouped-query attention and a gated MLP.
struct Model {
  std::size_t layers = 32;
  std::size_t hidden = 1536;        ///< 12 heads of 128
  std::size_t kv = 256;             ///< 2 key/value heads of 128
  std::size_t intermediate = 4096;  ///< MLP up/gate/down
  std::size_t vocab = 95540;        ///< embedding rows and lm_head rows (untied)
};

struct Tensor {
  std::string name;                    ///< "model.layers.0.self_attn.q_proj.weight"
  std::vector<std::size_t> shape;      ///< rows, columns (norms: one dimension)
  std::size_t bytes() const noexcept;  ///< elements * 2 (bf16)
};

/// The tensors in order: the embedding; per layer input_layernorm, q/k/v/o projections, post_attention_layernorm,
/// MLP gate/up/down; the final norm; lm_head. 3 + 9 * layers tensors (291 for 32 layers).
std::vector<Tensor> make(const Model& model = {});
/// Sum of bytes().
std::size_t total_bytes(const std::vector<Tensor>& tensors) noexcept;
/// [{"name", "shape"}, ...]: what bench/analysis/baselines/statedict.py reads (--spec).
nlohmann::json to_json(const std::vector<Tensor>& tensors);

/// The index a producer publishes in a host segment: a header, then one entry per tensor. No pointers.
inline constexpr std::uint32_t kIndexMagic = 0x53444958;  // "SDIX"
inline constexpr std::uint32_t kIndexVersion = 1;
inline constexpr std::size_t kMaxDims = 4;

struct IndexHeader {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t count;         ///< entries that follow
  std::uint32_t dtype;         ///< 1: bfloat16
  std::array<char, 128> pool;  ///< the pool the BlockRefs name, NUL-terminated
};
struct IndexEntry {
  BlockRef ref;
  std::uint32_t ndim;
  std::uint32_t reserved;
  std::array<std::uint64_t, kMaxDims> shape;
  std::array<char, 64> name;  ///< NUL-terminated
};
static_assert(std::is_trivially_copyable_v<IndexHeader> && sizeof(IndexHeader) == 144);
static_assert(std::is_trivially_copyable_v<IndexEntry> && sizeof(IndexEntry) == 144);

/// Bytes of an index of `count` entries.
std::size_t index_bytes(std::size_t count) noexcept;
/// Writes the index of `tensors` with their refs (same order) into `at` (index_bytes(count) bytes).
void write_index(void* at, const std::string& pool, const std::vector<Tensor>& tensors,
                 const std::vector<BlockRef>& refs);
/// The header of an index at `at` (`bytes` long), checked: magic, version, count within bytes. Throws Error.
const IndexHeader& read_index(const void* at, std::size_t bytes);
/// Entry `i` of a checked index.
inline const IndexEntry& entry(const IndexHeader& h, std::size_t i) noexcept {
  return reinterpret_cast<const IndexEntry*>(&h + 1)[i];  // NOLINT: the entries follow the header
}

}  // namespace gpuipc::bench::statedict
