#include "os/identity.hpp"

#include <unistd.h>

namespace gpuipc::os {

pid_t current_pid() noexcept { return ::getpid(); }
uid_t current_uid() noexcept { return ::getuid(); }
uid_t effective_uid() noexcept { return ::geteuid(); }
gid_t current_gid() noexcept { return ::getgid(); }

}  // namespace gpuipc::os
