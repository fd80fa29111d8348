#include "support/gpu.hpp"

#include <cstring>

#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/vmm.hpp"
#include "os/child.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

/// Runs `probe` in a child; returns what it reported.
template <typename F>
std::string ask_child(F&& probe) {
  auto child = os::fork_reporting(std::forward<F>(probe));
  return os::join_reporting(child, std::chrono::seconds(60)).text;
}

}  // namespace

std::optional<std::string> no_gpu_reason() {
  static const std::string answer = ask_child([]() -> std::string {
    std::string why;
    if (!cuda::driver_available(&why)) return "no CUDA driver: " + why;
    try {
      if (cuda::device_count() == 0) return "the CUDA driver reports no GPU";
      const auto info = cuda::query_device(0, false);
      if (!info.vmm || !info.posix_fd_handles) return "GPU 0 lacks VMM POSIX-fd handles (device segments)";
    } catch (const std::exception& e) {
      return std::string("no usable GPU: ") + e.what();
    }
    return "";
  });
  if (answer.empty()) return std::nullopt;
  return answer;
}

std::size_t gpu_free_memory() {
  const std::string a = ask_child([]() -> std::string {
    try {
      return std::to_string(cuda::memory_info(0).free);
    } catch (const std::exception&) {
      return "0";
    }
  });
  return static_cast<std::size_t>(std::strtoull(a.c_str(), nullptr, 10));
}

}  // namespace gpuipc::test
