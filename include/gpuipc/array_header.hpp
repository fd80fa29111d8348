// gpuipc array header: how Python's Channel.send describes an array in a message's inline header (its element
// type, shape and size), defined here once. A C++ consumer decodes what Python sends with decode_array_header; a
// C++ producer writes what Python's Channel.recv reads (Message.array) with encode_array_header. The Python
// package reads this layout from its extension (python/gpuipc/_array_header.py); docs/channels.md#arrays.
//
// Little-endian, at offset 0 of the message's header:
//
//     offset  size      field
//     0       4         magic "GPYA"
//     4       2         version (1)
//     6       1         ndim (0..64)
//     7       1         flags (bit 0, aborted: the producer failed while filling the slot; Python's recv skips it)
//     8       1         DLPack type code (0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool)
//     9       1         bits per lane
//     10      2         lanes (1)
//     12      4         meta_len: bytes of user metadata after the shape
//     16      8         nbytes of payload
//     24      8*ndim    shape, int64 each, C order (the payload is C-contiguous)
//     24+8n   meta_len  user metadata (Python: send(..., meta=b"..."), Message.meta)
//
// With a channel's default header_bytes (256) an array may have up to 29 dimensions (fewer with metadata).
// Header-only: no library call, no allocation beyond the decoded shape.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

namespace gpuipc {

static_assert(std::endian::native == std::endian::little, "the array header is read and written in place");

/// The fixed part of the array header, as it lies in the message header (little-endian, no padding).
struct ArrayHeaderPrefix {
  std::array<char, 4> magic;   ///< kArrayHeaderMagic
  std::uint16_t version;       ///< kArrayHeaderVersion
  std::uint8_t ndim;           ///< extents that follow (0..kArrayHeaderMaxNdim)
  std::uint8_t flags;          ///< kArrayHeaderAborted
  std::uint8_t dtype_code;     ///< DLPack DLDataTypeCode
  std::uint8_t dtype_bits;     ///< bits per lane
  std::uint16_t dtype_lanes;   ///< lanes (1 for every type Python sends)
  std::uint32_t meta_len;      ///< bytes of user metadata after the shape
  std::uint64_t nbytes;        ///< payload bytes
};
static_assert(sizeof(ArrayHeaderPrefix) == 24 && alignof(ArrayHeaderPrefix) == 8);
static_assert(offsetof(ArrayHeaderPrefix, version) == 4 && offsetof(ArrayHeaderPrefix, ndim) == 6 &&
              offsetof(ArrayHeaderPrefix, flags) == 7 && offsetof(ArrayHeaderPrefix, dtype_code) == 8 &&
              offsetof(ArrayHeaderPrefix, dtype_bits) == 9 && offsetof(ArrayHeaderPrefix, dtype_lanes) == 10 &&
              offsetof(ArrayHeaderPrefix, meta_len) == 12 && offsetof(ArrayHeaderPrefix, nbytes) == 16);

inline constexpr std::array<char, 4> kArrayHeaderMagic{'G', 'P', 'Y', 'A'};
inline constexpr std::uint16_t kArrayHeaderVersion = 1;
/// flags bit: the producer failed while filling the slot; the message carries no array.
inline constexpr std::uint8_t kArrayHeaderAborted = 1;
inline constexpr std::size_t kArrayHeaderMaxNdim = 64;
/// ArrayHeaderPrefix as a Python struct format (the extension exports it; python/gpuipc/_array_header.py).
inline constexpr char kArrayHeaderFormat[] = "<4sHBBBBHIQ";

/// An array header, decoded (or to encode). `meta` points into the bytes it was decoded from.
struct ArrayHeader {
  std::uint8_t flags = 0;              ///< kArrayHeaderAborted
  std::uint8_t dtype_code = 0;         ///< DLPack type code (0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool)
  std::uint8_t dtype_bits = 8;         ///< bits per lane
  std::uint16_t dtype_lanes = 1;       ///< lanes
  std::uint64_t nbytes = 0;            ///< payload bytes
  std::vector<std::int64_t> shape{};   ///< extents, C order
  std::span<const std::byte> meta{};   ///< user metadata

  /// Whether the producer gave the message up while filling it (Python's recv skips such messages).
  bool aborted() const noexcept { return (flags & kArrayHeaderAborted) != 0; }
  /// The header's size: what Channel header_bytes must hold.
  std::size_t encoded_bytes() const noexcept {
    return sizeof(ArrayHeaderPrefix) + sizeof(std::int64_t) * shape.size() + meta.size();
  }
};

/// Decodes the array header at the start of `bytes` (a MessageView's header). nullopt when `bytes` does not start
/// with one of this version (a message not sent as an array) or is shorter than the header says.
inline std::optional<ArrayHeader> decode_array_header(std::span<const std::byte> bytes) {
  ArrayHeaderPrefix p{};
  if (bytes.size() < sizeof p) return std::nullopt;
  std::memcpy(&p, bytes.data(), sizeof p);
  if (p.magic != kArrayHeaderMagic || p.version != kArrayHeaderVersion) return std::nullopt;
  const std::size_t shape_bytes = sizeof(std::int64_t) * p.ndim;
  if (bytes.size() - sizeof p < shape_bytes || bytes.size() - sizeof p - shape_bytes < p.meta_len) return std::nullopt;
  ArrayHeader h{.flags = p.flags,
                .dtype_code = p.dtype_code,
                .dtype_bits = p.dtype_bits,
                .dtype_lanes = p.dtype_lanes,
                .nbytes = p.nbytes,
                .shape = std::vector<std::int64_t>(p.ndim),
                .meta = bytes.subspan(sizeof p + shape_bytes, p.meta_len)};
  if (shape_bytes != 0) std::memcpy(h.shape.data(), bytes.data() + sizeof p, shape_bytes);  // a 0-d array: data() null
  return h;
}

/// Encodes `header` at the start of `out` (a SlotView's header buffer, or the span given to publish). Returns the
/// bytes written (encoded_bytes()), or 0 when `out` is too small or the shape has more than kArrayHeaderMaxNdim
/// dimensions.
inline std::size_t encode_array_header(const ArrayHeader& header, std::span<std::byte> out) noexcept {
  const std::size_t bytes = header.encoded_bytes();
  if (header.shape.size() > kArrayHeaderMaxNdim || out.size() < bytes) return 0;
  const ArrayHeaderPrefix p{.magic = kArrayHeaderMagic,
                            .version = kArrayHeaderVersion,
                            .ndim = static_cast<std::uint8_t>(header.shape.size()),
                            .flags = header.flags,
                            .dtype_code = header.dtype_code,
                            .dtype_bits = header.dtype_bits,
                            .dtype_lanes = header.dtype_lanes,
                            .meta_len = static_cast<std::uint32_t>(header.meta.size()),
                            .nbytes = header.nbytes};
  std::memcpy(out.data(), &p, sizeof p);
  const std::size_t shape_bytes = sizeof(std::int64_t) * header.shape.size();
  if (shape_bytes != 0) std::memcpy(out.data() + sizeof p, header.shape.data(), shape_bytes);
  if (!header.meta.empty()) std::memcpy(out.data() + sizeof p + shape_bytes, header.meta.data(), header.meta.size());
  return bytes;
}

}  // namespace gpuipc
