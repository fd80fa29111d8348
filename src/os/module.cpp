#include "os/module.hpp"

#include <dlfcn.h>
#include <fmt/format.h>
#include <csignal>

#include "base/errors.hpp"
#include <sys/stat.h>
#include <unistd.h>

namespace gpuipc::os {

std::string module_path(const void* address) {
  Dl_info info{};
  if (::dladdr(address, &info) == 0 || info.dli_fname == nullptr) return {};
  return info.dli_fname;
}

pid_t current_pid() noexcept { return ::getpid(); }
uid_t current_uid() noexcept { return ::getuid(); }
gid_t current_gid() noexcept { return ::getgid(); }

void send_signal(pid_t pid, int sig) {
  if (::kill(pid, sig) != 0) throw_system("kill", fmt::format("signal {} to pid {}", sig, pid));
}

bool is_executable(const std::string& path) noexcept {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace gpuipc::os
