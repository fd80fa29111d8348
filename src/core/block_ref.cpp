// BlockRef's wire form: 40 bytes, little-endian, fields in declaration order. Decoding checks every field against
// the limits of any pool (src/shm/pool_block.hpp); Pool::resolve then checks it against the pool itself.
#include <fmt/format.h>

#include "gpuipc/pool.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc {
namespace {

template <typename T>
void put(std::byte* out, std::size_t& at, T v) noexcept {
  for (std::size_t i = 0; i < sizeof(T); ++i) out[at++] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}

template <typename T>
T get(std::span<const std::byte> in, std::size_t& at) noexcept {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(std::to_integer<T>(in[at++]) << (8 * i));
  return v;
}

/// The largest chunk any pool has (shm::read_geometry refuses larger).
constexpr std::uint64_t kMaxChunkBytes = std::uint64_t{1} << 40;

}  // namespace

std::array<std::byte, kBlockRefBytes> encode_block_ref(const BlockRef& ref) noexcept {
  std::array<std::byte, kBlockRefBytes> out{};
  std::size_t at = 0;
  put(out.data(), at, ref.pool);
  put(out.data(), at, ref.generation);
  put(out.data(), at, ref.offset);
  put(out.data(), at, ref.size);
  put(out.data(), at, ref.chunk);
  put(out.data(), at, ref.index);
  return out;
}

BlockRef decode_block_ref(std::span<const std::byte> bytes) {
  auto bad = [](const std::string& why) {
    return Error(ErrorCode::InvalidArgument, fmt::format("decode_block_ref: {}", why), "decode_block_ref");
  };
  if (bytes.size() != kBlockRefBytes) {
    throw bad(fmt::format("a BlockRef is {} bytes, not {}", kBlockRefBytes, bytes.size()));
  }
  std::size_t at = 0;
  BlockRef r;
  r.pool = get<std::uint64_t>(bytes, at);
  r.generation = get<std::uint64_t>(bytes, at);
  r.offset = get<std::uint64_t>(bytes, at);
  r.size = get<std::uint64_t>(bytes, at);
  r.chunk = get<std::uint32_t>(bytes, at);
  r.index = get<std::uint32_t>(bytes, at);
  if (r.pool == 0) throw bad("pool id 0 names no pool");
  if (r.generation == 0) throw bad("generation 0 names no block");
  if (r.size == 0) throw bad("size 0 names no block");
  if (r.chunk >= shm::kMaxChunks) throw bad(fmt::format("chunk {} is out of range (0 to {})", r.chunk, shm::kMaxChunks - 1));
  if (r.index >= shm::kMaxRecords) {
    throw bad(fmt::format("block index {} is out of range (0 to {})", r.index, shm::kMaxRecords - 1));
  }
  if (r.offset > kMaxChunkBytes || r.size > kMaxChunkBytes - r.offset) {
    throw bad(fmt::format("offset {} + size {} is past the largest chunk (1 TiB)", r.offset, r.size));
  }
  return r;
}

}  // namespace gpuipc
