// Shared libraries loaded at run time (dlopen, dlsym): how src/cuda loads the CUDA driver without linking it
// (docs/architecture.md, Layers).
#pragma once

#include <string>

namespace gpuipc::os {

/// A shared library opened with dlopen(RTLD_NOW | RTLD_LOCAL). Never closed: code that runs during exit (destructors
/// of static objects) may still call into it. Copyable: it names the library, it does not own it.
class DynamicLibrary {
 public:
  /// Opens `name` (a file name looked up as dlopen does, or a path). On failure returns an empty library and sets
  /// `error` to dlerror's text on one line.
  static DynamicLibrary open(const std::string& name, std::string& error);

  /// dlsym(name): the address of the symbol, nullptr when the library lacks it.
  void* symbol(const char* name) const noexcept;
  explicit operator bool() const noexcept { return m_handle != nullptr; }

 private:
  explicit DynamicLibrary(void* handle) noexcept : m_handle(handle) {}
  void* m_handle = nullptr;
};

}  // namespace gpuipc::os
