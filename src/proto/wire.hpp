// Private to src/proto: little-endian byte writer and bounds-checked reader for the wire format. Integers go
// through a byte array assembled with shifts, so the code is independent of host byte order and alignment.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace gpuipc::proto::wire {

/// Appends little-endian fixed-width values to a byte vector it does not own.
class Writer {
 public:
  explicit Writer(std::vector<std::byte>& out) noexcept : m_out(out) {}

  void u8(std::uint8_t v) { put(v); }
  void u16(std::uint16_t v) { put(v); }
  void u32(std::uint32_t v) { put(v); }
  void u64(std::uint64_t v) { put(v); }
  /// Two's complement, as C++20 defines the conversion.
  void i32(std::int32_t v) { put(static_cast<std::uint32_t>(v)); }
  void raw(const void* data, std::size_t n) {
    if (n == 0) return;
    const std::size_t at = m_out.size();
    m_out.resize(at + n);
    std::memcpy(m_out.data() + at, data, n);
  }
  /// Overwrites a u16 written earlier at `offset` (the header's body_length).
  void patch_u16(std::size_t offset, std::uint16_t v) noexcept {
    const std::array<unsigned char, 2> b{static_cast<unsigned char>(v & 0xffU),
                                         static_cast<unsigned char>((v >> 8) & 0xffU)};
    std::memcpy(m_out.data() + offset, b.data(), b.size());
  }
  std::size_t size() const noexcept { return m_out.size(); }

 private:
  template <class T>
  void put(T v) {
    static_assert(std::is_unsigned_v<T>);
    std::array<unsigned char, sizeof(T)> b{};
    for (std::size_t i = 0; i < sizeof(T); ++i) b[i] = static_cast<unsigned char>((v >> (8 * i)) & 0xffU);
    raw(b.data(), b.size());
  }

  std::vector<std::byte>& m_out;
};

/// Reads little-endian fixed-width values from a span it does not own. Every read checks the remaining length
/// first and returns false (consuming nothing) when the value does not fit.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) noexcept : m_in(in) {}

  bool u8(std::uint8_t& v) noexcept { return get(v); }
  bool u16(std::uint16_t& v) noexcept { return get(v); }
  bool u32(std::uint32_t& v) noexcept { return get(v); }
  bool u64(std::uint64_t& v) noexcept { return get(v); }
  bool i32(std::int32_t& v) noexcept {
    std::uint32_t u = 0;
    if (!get(u)) return false;
    v = static_cast<std::int32_t>(u);
    return true;
  }
  bool raw(void* out, std::size_t n) noexcept {
    if (n > remaining()) return false;
    if (n != 0) std::memcpy(out, m_in.data() + m_pos, n);
    m_pos += n;
    return true;
  }
  /// A view of the next n bytes (valid as long as the input is), or false if fewer remain.
  bool view(std::size_t n, std::string_view& out) noexcept {
    if (n > remaining()) return false;
    out = std::string_view(reinterpret_cast<const char*>(m_in.data() + m_pos), n);
    m_pos += n;
    return true;
  }
  std::size_t offset() const noexcept { return m_pos; }
  std::size_t remaining() const noexcept { return m_in.size() - m_pos; }

 private:
  template <class T>
  bool get(T& v) noexcept {
    static_assert(std::is_unsigned_v<T>);
    std::array<unsigned char, sizeof(T)> b{};
    if (!raw(b.data(), b.size())) return false;
    T r = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) r = static_cast<T>(r | (static_cast<T>(b[i]) << (8 * i)));
    v = r;
    return true;
  }

  std::span<const std::byte> m_in;
  std::size_t m_pos = 0;
};

}  // namespace gpuipc::proto::wire
