// Replacing this process with another program (execv): how the gpuipc CLI hands `gpuipc demo`, `gpuipc bench` and
// `gpuipc daemon --foreground` to the programs that do them (include/gpuipc/programs.hpp).
#pragma once

#include <string>
#include <vector>

namespace gpuipc::os {

/// execv(argv[0], argv): argv[0] must be an absolute path. Returns only by throwing Error(System) naming the
/// program (Error(InvalidArgument) for an empty or relative argv[0]).
[[noreturn]] void exec_replace(const std::vector<std::string>& argv);

}  // namespace gpuipc::os
