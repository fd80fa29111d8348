// Who this process is: its pid and its real uid and gid.
#pragma once

#include <sys/types.h>

namespace gpuipc::os {

/// getpid(2).
pid_t current_pid() noexcept;

/// getuid(2) / getgid(2).
uid_t current_uid() noexcept;
gid_t current_gid() noexcept;

}  // namespace gpuipc::os
