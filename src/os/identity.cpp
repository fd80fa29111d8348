#include "os/identity.hpp"

#include <unistd.h>

namespace gpuipc::os {

pid_t current_pid() noexcept { return ::getpid(); }
uid_t current_uid() noexcept { return ::getuid(); }
gid_t current_gid() noexcept { return ::getgid(); }

}  // namespace gpuipc::os
