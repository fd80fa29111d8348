// A naive VMM importer, step by step: what the segments suite compares a gpuipc first open with.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <vector>

#include "os/fd.hpp"

namespace gpuipc::bench {

/// A naive VMM importer's open of each received fd: import + (raw only: reserve) + map + setAccess, each step
/// timed; the mapping, range and handle are released after each, untimed. floor: one range reserved up front.
/// Needs a current context on `device`; `size` a multiple of its allocation granularity. Returns {"total",
/// "import", "reserve", "map", "set_access"}: microseconds per fd.
nlohmann::json time_vmm_imports(int device, bool raw, std::size_t size, std::vector<os::UniqueFd>& fds);

}  // namespace gpuipc::bench
