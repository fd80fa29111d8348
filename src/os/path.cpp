#include "os/path.hpp"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

namespace gpuipc::os {

std::string module_path(const void* address) {
  Dl_info info{};
  if (::dladdr(address, &info) == 0 || info.dli_fname == nullptr) return {};
  return info.dli_fname;
}

bool is_executable(const std::string& path) noexcept {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace gpuipc::os
