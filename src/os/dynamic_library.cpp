#include "os/dynamic_library.hpp"

#include <dlfcn.h>

#include <algorithm>

namespace gpuipc::os {

DynamicLibrary DynamicLibrary::open(const std::string& name, std::string& error) {
  ::dlerror();
  void* handle = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* text = ::dlerror();
    error = text != nullptr ? text : "unknown error";
    std::replace(error.begin(), error.end(), '\n', ' ');
  }
  return DynamicLibrary(handle);
}

void* DynamicLibrary::symbol(const char* name) const noexcept { return ::dlsym(m_handle, name); }

}  // namespace gpuipc::os
