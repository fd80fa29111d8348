// Small formatting helpers shared by the library's messages and the front ends (the CLI's tables).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace gpuipc {

/// "512 B", "1.5 MiB", "4.0 GiB": binary units, one decimal.
std::string human_bytes(std::uint64_t bytes);

/// `text` as it may be shown in a message or on a terminal: printable ASCII as is, other bytes and '\\' as \xNN,
/// at most `max_bytes` of it, then "... (N bytes)" (a name or a command-line word may hold control bytes, a NUL, or
/// be very long).
std::string printable(std::string_view text, std::size_t max_bytes);

}  // namespace gpuipc
