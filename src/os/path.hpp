// Files by path: where code was loaded from, and whether a path names a program.
#pragma once

#include <sys/types.h>

#include <string>

namespace gpuipc::os {

/// The file the code at `address` was loaded from (dladdr): the executable or a shared library. Empty if unknown.
std::string module_path(const void* address);

/// Whether `path` names an executable regular file (access X_OK).
bool is_executable(const std::string& path) noexcept;

/// What fstat(2) says of a file (read_text's, through the fd it read).
struct PathStatus {
  bool regular = false;  ///< a regular file
  uid_t owner = 0;
  unsigned mode = 0;  ///< the permission bits (07777)
};

}  // namespace gpuipc::os
