// Where code lives and who runs it.
#pragma once

#include <sys/types.h>

#include <string>

namespace gpuipc::os {

/// The file the code at `address` was loaded from (dladdr): the executable or a shared library. Empty if unknown.
std::string module_path(const void* address);

/// getpid(2).
pid_t current_pid() noexcept;

/// getuid(2) / getgid(2).
uid_t current_uid() noexcept;
gid_t current_gid() noexcept;

/// kill(pid, sig). Throws Error naming the pid.
void send_signal(pid_t pid, int sig);

/// Whether `path` names an executable regular file (access X_OK).
bool is_executable(const std::string& path) noexcept;

}  // namespace gpuipc::os
