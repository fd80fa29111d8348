// include/gpuipc/mps.hpp over src/os: the folders and programs of a private MPS control daemon (docs/mps.md).
#include "gpuipc/mps.hpp"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>

#include "base/config.hpp"
#include "gpuipc/error.hpp"
#include "os/process.hpp"

namespace gpuipc {
namespace {

using namespace std::chrono_literals;

constexpr const char* kControl = "nvidia-cuda-mps-control";

}  // namespace

std::vector<std::string> MpsDirs::env() const {
  return {"CUDA_MPS_PIPE_DIRECTORY=" + pipe, "CUDA_MPS_LOG_DIRECTORY=" + log};
}

MpsDirs mps_dirs(const std::string& dir) {
  const std::string base = dir.empty() ? config::runtime_dir() + "/mps" : std::filesystem::absolute(dir).string();
  return {base, base + "/pipe", base + "/log"};
}

std::string mps_control_program() {
  std::string path = os::find_in_path(kControl);
  if (path.empty()) {
    throw Error(ErrorCode::NoDriver,
                fmt::format("{} is not on PATH: it comes with the NVIDIA driver (on Debian and Ubuntu the "
                            "nvidia-cuda-mps package; the driver's .run installer puts it in /usr/bin); install it or "
                            "add its folder to PATH",
                            kControl),
                "mps");
  }
  return path;
}

std::optional<std::string> mps_ask(const std::string& program, const MpsDirs& dirs, const std::string& command) {
  std::error_code ec;
  if (!std::filesystem::exists(dirs.pipe + "/control", ec)) return std::nullopt;
  const os::CapturedRun r = os::run_captured({program}, dirs.env(), command + "\n", 10s);
  if (r.exit_code != 0) return std::nullopt;
  return r.output;
}

MpsStart mps_start_daemon(const std::string& program, const MpsDirs& dirs) {
  os::ensure_private_dir(dirs.base, 0700);
  os::ensure_private_dir(dirs.pipe, 0700);
  os::ensure_private_dir(dirs.log, 0700);
  const os::CapturedRun r = os::run_captured({program, "-d"}, dirs.env(), {}, 30s);
  return {.exit_code = r.exit_code, .output = r.output};
}

}  // namespace gpuipc
