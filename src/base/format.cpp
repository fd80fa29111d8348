#include "base/format.hpp"

#include <fmt/format.h>

namespace gpuipc {

std::string human_bytes(std::uint64_t bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", v, kUnits[u]);
}

std::string printable(std::string_view text, std::size_t max_bytes) {
  std::string out;
  for (const char c : text.substr(0, max_bytes)) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f && u != '\\') {
      out += c;
    } else {
      out += fmt::format("\\x{:02x}", u);
    }
  }
  if (text.size() > max_bytes) out += fmt::format("... ({} bytes)", text.size());
  return out;
}

}  // namespace gpuipc
