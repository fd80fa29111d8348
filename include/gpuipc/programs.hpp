// The programs that come with the library (gpuipcd, gpuipc-demo, gpuipc-bench): where they are and how a front end
// hands a command to one. The gpuipc CLI runs `gpuipc demo`, `gpuipc bench` and `gpuipc daemon --foreground` this
// way, so that it links the public library only (docs/architecture.md#layers).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace gpuipc {

/// The path of program `name` (e.g. "gpuipc-demo"), searched as the broker is: next to the executable, else next
/// to the library (each also in ../bin and bin/), else on $PATH. An absolute path; empty when none is found.
std::string program_path(std::string_view name);

/// Replaces this process with `argv` (argv[0] an absolute path, as program_path returns): the new program keeps
/// this process's pid, environment and file descriptors. Returns only by throwing Error(System), or
/// Error(InvalidArgument) for a relative argv[0].
[[noreturn]] void exec_program(const std::vector<std::string>& argv);

}  // namespace gpuipc
