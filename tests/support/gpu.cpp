#include "support/gpu.hpp"

#include <cstdlib>
#include <cstring>
#include <sstream>

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

const std::vector<std::string>& gpu_uuids() {
  static const std::vector<std::string> uuids = [] {
    std::vector<std::string> out;
    std::istringstream lines(ask_child([]() -> std::string {
      try {
        std::string all;
        for (int i = 0; i < cuda::device_count(); ++i) all += cuda::query_device(i, false).uuid_string + "\n";
        return all;
      } catch (const std::exception&) {
        return "";
      }
    }));
    for (std::string line; std::getline(lines, line);) {
      if (!line.empty()) out.push_back(line);
    }
    return out;
  }();
  return uuids;
}

namespace {

/// "" when GPUs 0 and 1 can map each other's memory, "no-peer" when both exist without it, else why not.
const std::string& two_gpu_probe() {
  static const std::string answer = ask_child([]() -> std::string {
    try {
      const int n = cuda::device_count();
      if (n < 2) return "fewer than two GPUs (" + std::to_string(n) + " visible): multi-GPU tests need two";
      const auto info = cuda::query_device(1, false);
      if (!info.vmm || !info.posix_fd_handles) return "GPU 1 lacks VMM POSIX-fd handles (device segments)";
      const auto peers = cuda::peer_access_matrix();
      if (!peers[0][1] || !peers[1][0]) return "no-peer";
    } catch (const std::exception& e) {
      return std::string("no usable GPUs: ") + e.what();
    }
    return "";
  });
  return answer;
}

}  // namespace

std::optional<std::string> no_two_gpus_reason() {
  if (auto why = no_gpu_reason()) return why;
  const std::string& a = two_gpu_probe();
  if (a.empty()) return std::nullopt;
  if (a == "no-peer") return "GPUs 0 and 1 have no peer access to each other (cuDeviceCanAccessPeer)";
  return a;
}

bool two_gpus_without_peer_access() { return !no_gpu_reason() && two_gpu_probe() == "no-peer"; }

std::string visible_devices(std::initializer_list<int> ordinals) {
  const bool inherited = std::getenv("CUDA_VISIBLE_DEVICES") != nullptr;  // NOLINT(concurrency-mt-unsafe)
  std::string out;
  for (const int o : ordinals) {
    if (!out.empty()) out += ",";
    out += inherited ? gpu_uuids().at(static_cast<std::size_t>(o)) : std::to_string(o);
  }
  return out;
}

}  // namespace gpuipc::test
