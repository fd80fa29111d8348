#include "statedict.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "gpuipc/error.hpp"

namespace gpuipc::bench::statedict {

std::size_t Tensor::bytes() const noexcept {
  std::size_t n = 2;  // bf16
  for (auto d : shape) n *= d;
  return n;
}

std::vector<Tensor> make(const Model& m) {
  std::vector<Tensor> t;
  t.push_back({"model.embed_tokens.weight", {m.vocab, m.hidden}});
  for (std::size_t l = 0; l < m.layers; ++l) {
    const auto p = fmt::format("model.layers.{}.", l);
    t.push_back({p + "input_layernorm.weight", {m.hidden}});
    t.push_back({p + "self_attn.q_proj.weight", {m.hidden, m.hidden}});
    t.push_back({p + "self_attn.k_proj.weight", {m.kv, m.hidden}});
    t.push_back({p + "self_attn.v_proj.weight", {m.kv, m.hidden}});
    t.push_back({p + "self_attn.o_proj.weight", {m.hidden, m.hidden}});
    t.push_back({p + "post_attention_layernorm.weight", {m.hidden}});
    t.push_back({p + "mlp.gate_proj.weight", {m.intermediate, m.hidden}});
    t.push_back({p + "mlp.up_proj.weight", {m.intermediate, m.hidden}});
    t.push_back({p + "mlp.down_proj.weight", {m.hidden, m.intermediate}});
  }
  t.push_back({"model.norm.weight", {m.hidden}});
  t.push_back({"lm_head.weight", {m.vocab, m.hidden}});
  return t;
}

std::size_t total_bytes(const std::vector<Tensor>& tensors) noexcept {
  std::size_t n = 0;
  for (const auto& t : tensors) n += t.bytes();
  return n;
}

nlohmann::json to_json(const std::vector<Tensor>& tensors) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& t : tensors) a.push_back({{"name", t.name}, {"shape", t.shape}});
  return a;
}

std::size_t index_bytes(std::size_t count) noexcept { return sizeof(IndexHeader) + count * sizeof(IndexEntry); }

namespace {
template <std::size_t N>
void copy_name(std::array<char, N>& to, const std::string& from, const char* what) {
  if (from.size() >= N) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("state dict index: {} '{}' is too long", what, from),
                "write_index");
  }
  to.fill('\0');
  std::memcpy(to.data(), from.data(), from.size());
}
}  // namespace

void write_index(void* at, const std::string& pool, const std::vector<Tensor>& tensors,
                 const std::vector<BlockRef>& refs) {
  if (refs.size() != tensors.size()) {
    throw Error(ErrorCode::InvalidArgument, "state dict index: one BlockRef per tensor", "write_index");
  }
  IndexHeader h{};
  h.magic = kIndexMagic;
  h.version = kIndexVersion;
  h.count = static_cast<std::uint32_t>(tensors.size());
  h.dtype = 1;
  copy_name(h.pool, pool, "pool name");
  std::memcpy(at, &h, sizeof h);
  auto* entries = static_cast<std::byte*>(at) + sizeof h;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].shape.size() > kMaxDims) {
      throw Error(ErrorCode::InvalidArgument, "state dict index: more than 4 dimensions", "write_index");
    }
    IndexEntry e{};
    e.ref = refs[i];
    e.ndim = static_cast<std::uint32_t>(tensors[i].shape.size());
    std::copy(tensors[i].shape.begin(), tensors[i].shape.end(), e.shape.begin());
    copy_name(e.name, tensors[i].name, "tensor name");
    std::memcpy(entries + i * sizeof e, &e, sizeof e);
  }
}

const IndexHeader& read_index(const void* at, std::size_t bytes) {
  const auto& h = *static_cast<const IndexHeader*>(at);
  if (bytes < sizeof h || h.magic != kIndexMagic || h.version != kIndexVersion || index_bytes(h.count) > bytes ||
      std::find(h.pool.begin(), h.pool.end(), '\0') == h.pool.end()) {
    throw Error(ErrorCode::Protocol, "state dict index: not an index of this version, or truncated", "read_index");
  }
  return h;
}

}  // namespace gpuipc::bench::statedict
