#include "mps.hpp"

#include <fmt/format.h>
#include <stdlib.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "cuda/context.hpp"
#include "workers.hpp"

namespace gpuipc::bench {

MpsDaemon::MpsDaemon() {
  char tmpl[] = "/tmp/gpuipc-mps-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return;
  m_dir = tmpl;
  std::filesystem::create_directories(m_dir + "/pipe");
  std::filesystem::create_directories(m_dir + "/log");
  const std::string cmd = fmt::format("{} nvidia-cuda-mps-control -d >/dev/null 2>&1", prefix());
  m_started = std::system(cmd.c_str()) == 0;  // NOLINT(cert-env33-c): a fixed command line of our own
  if (m_started) std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

MpsDaemon::~MpsDaemon() {
  if (m_started) {
    const std::string cmd = fmt::format("echo quit | {} nvidia-cuda-mps-control >/dev/null 2>&1", prefix());
    [[maybe_unused]] int rc = std::system(cmd.c_str());  // NOLINT(cert-env33-c)
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (!m_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(m_dir, ec);
  }
}

std::vector<std::pair<std::string, std::string>> MpsDaemon::env() const {
  return {{"CUDA_MPS_PIPE_DIRECTORY", m_dir + "/pipe"}, {"CUDA_MPS_LOG_DIRECTORY", m_dir + "/log"}};
}

std::string MpsDaemon::prefix() const {
  return fmt::format("CUDA_MPS_PIPE_DIRECTORY={0}/pipe CUDA_MPS_LOG_DIRECTORY={0}/log", m_dir);
}

bool mps_active(const std::vector<std::pair<std::string, std::string>>& env) {
  const auto r = run_workers({[]() -> nlohmann::json {
                               cuda::PrimaryContext ctx(0);
                               ctx.make_current();
                               // CU_DEVICE_ATTRIBUTE_MPS_ENABLED (133): named by number, older headers lack it.
                               const int v = cuda::device_attribute(static_cast<CUdevice_attribute>(133), 0);
                               return nlohmann::json{{"mps", v != 0}};
                             }},
                             env);
  return r[0].value("mps", false);
}

bool run_under_mps(std::vector<std::string>& notes, const std::string& missing,
                   const std::function<void(const std::vector<std::pair<std::string, std::string>>&)>& body) {
  MpsDaemon mps;
  if (!mps.started()) {
    notes.push_back(fmt::format("MPS: nvidia-cuda-mps-control -d could not be started here: no {}", missing));
    return false;
  }
  bool active = false;
  std::string why;
  try {
    active = mps_active(mps.env());
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!active) {
    notes.push_back(fmt::format("MPS: the control daemon started but the workers' contexts do not report MPS{}: no {}",
                                why.empty() ? "" : " (" + why + ")", missing));
    return false;
  }
  body(mps.env());
  return true;
}

}  // namespace gpuipc::bench
