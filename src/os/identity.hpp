// Who this process is: its pid and its real uid and gid.
#pragma once

#include <sys/types.h>

namespace gpuipc::os {

/// getpid(2).
pid_t current_pid() noexcept;

/// getuid(2) / getgid(2).
uid_t current_uid() noexcept;
/// geteuid(2): whose files this process makes (and may trust as its own).
uid_t effective_uid() noexcept;
gid_t current_gid() noexcept;

}  // namespace gpuipc::os
