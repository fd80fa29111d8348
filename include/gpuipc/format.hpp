// Small formatting helpers shared by the library's messages and the front ends (the CLI's tables).
#pragma once

#include <cstdint>
#include <string>

namespace gpuipc {

/// "512 B", "1.5 MiB", "4.0 GiB": binary units, one decimal.
std::string human_bytes(std::uint64_t bytes);

}  // namespace gpuipc
