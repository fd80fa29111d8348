// include/gpuipc/array_header.hpp: decodes the bytes Python's Channel.send writes and encodes the same bytes. The
// golden header below is also checked on the Python side (tests/python/test_channels.py,
// test_array_header_matches_the_cpp_definition): one wire format, two languages.
#include "gpuipc/array_header.hpp"

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

namespace gpuipc {
namespace {

/// A float32 array of shape (2, 3) with meta "hi", as Python's Channel.send writes it.
constexpr std::string_view kGoldenHex =
    "475059410100020002200100020000001800000000000000020000000000000003000000000000006869";
/// The header of a message its producer gave up (Python: Slot left unpublished, or a failed send).
constexpr std::string_view kAbortedHex = "475059410100000101080100000000000000000000000000";

std::vector<std::byte> from_hex(std::string_view hex) {
  std::vector<std::byte> out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<std::byte>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return out;
}

TEST(ArrayHeader, DecodesWhatPythonSends) {
  const auto bytes = from_hex(kGoldenHex);
  const auto h = decode_array_header(bytes);
  ASSERT_TRUE(h.has_value());
  EXPECT_FALSE(h->aborted());
  EXPECT_EQ(h->dtype_code, 2);  // kDLFloat
  EXPECT_EQ(h->dtype_bits, 32);
  EXPECT_EQ(h->dtype_lanes, 1);
  EXPECT_EQ(h->nbytes, 24U);
  EXPECT_EQ(h->shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(std::string_view(reinterpret_cast<const char*>(h->meta.data()), h->meta.size()), "hi");
  EXPECT_EQ(h->encoded_bytes(), bytes.size());
}

TEST(ArrayHeader, EncodesWhatPythonReads) {
  const std::vector<std::byte> meta{std::byte{'h'}, std::byte{'i'}};
  const ArrayHeader h{.dtype_code = 2, .dtype_bits = 32, .nbytes = 24, .shape = {2, 3}, .meta = meta};
  std::vector<std::byte> out(256);
  ASSERT_EQ(encode_array_header(h, out), h.encoded_bytes());
  out.resize(h.encoded_bytes());
  EXPECT_EQ(out, from_hex(kGoldenHex));

  const ArrayHeader aborted{.flags = kArrayHeaderAborted, .dtype_code = 1, .dtype_bits = 8};
  std::vector<std::byte> out2(sizeof(ArrayHeaderPrefix));
  ASSERT_EQ(encode_array_header(aborted, out2), out2.size());
  EXPECT_EQ(out2, from_hex(kAbortedHex));
  const auto back = decode_array_header(out2);
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(back->aborted());
  EXPECT_TRUE(back->shape.empty());
}

TEST(ArrayHeader, RefusesWhatIsNotOne) {
  auto bytes = from_hex(kGoldenHex);
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {  // cut short anywhere: the fixed part, shape or meta
    EXPECT_FALSE(decode_array_header(std::span(bytes).first(cut)).has_value()) << cut;
  }
  auto wrong_magic = bytes;
  wrong_magic[0] = std::byte{'X'};
  EXPECT_FALSE(decode_array_header(wrong_magic).has_value());
  auto wrong_version = bytes;
  wrong_version[4] = std::byte{2};
  EXPECT_FALSE(decode_array_header(wrong_version).has_value());
  bytes.push_back(std::byte{0});  // trailing bytes are the user's
  EXPECT_TRUE(decode_array_header(bytes).has_value());
}

TEST(ArrayHeader, EncodeRefusesWhatDoesNotFit) {
  std::vector<std::byte> out(4096);
  ArrayHeader h{.shape = std::vector<std::int64_t>(kArrayHeaderMaxNdim + 1, 1)};
  EXPECT_EQ(encode_array_header(h, out), 0U);
  h.shape.resize(2);
  EXPECT_EQ(encode_array_header(h, std::span(out).first(h.encoded_bytes() - 1)), 0U);
  EXPECT_EQ(encode_array_header(h, out), sizeof(ArrayHeaderPrefix) + 16);
}

}  // namespace
}  // namespace gpuipc
