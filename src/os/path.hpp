// Files by path: where code was loaded from, and whether a path names a program.
#pragma once

#include <string>

namespace gpuipc::os {

/// The file the code at `address` was loaded from (dladdr): the executable or a shared library. Empty if unknown.
std::string module_path(const void* address);

/// Whether `path` names an executable regular file (access X_OK).
bool is_executable(const std::string& path) noexcept;

}  // namespace gpuipc::os
