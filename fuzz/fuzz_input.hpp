// The fuzz input of the stateful harnesses (fuzz_shm, fuzz_broker), read front to back as the operations they run
// ask for bytes; reads past its end give zeros, so every input is a complete run (libFuzzer then learns to make
// longer ones).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

namespace gpuipc::fuzz {

class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) noexcept : m_data(data), m_size(size) {}
  bool empty() const noexcept { return m_at >= m_size; }
  std::uint8_t byte() noexcept { return m_at < m_size ? m_data[m_at++] : 0; }
  /// `n` bytes (at most 8), little-endian.
  std::uint64_t bytes(int n) noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(byte()) << (8 * i);
    return v;
  }
  std::uint32_t u32() noexcept { return static_cast<std::uint32_t>(bytes(4)); }
  std::uint64_t u64() noexcept { return bytes(8); }
  /// The next `n` bytes (fewer at the end).
  std::span<const std::byte> take(std::size_t n) noexcept {
    n = std::min(n, m_size - std::min(m_at, m_size));
    const std::span<const std::byte> s(reinterpret_cast<const std::byte*>(m_data + m_at), n);
    m_at += n;
    return s;
  }

 private:
  const std::uint8_t* m_data;
  std::size_t m_size;
  std::size_t m_at = 0;
};

}  // namespace gpuipc::fuzz
