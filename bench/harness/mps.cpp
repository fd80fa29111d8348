#include "mps.hpp"

#include <fmt/format.h>
#include <stdlib.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "cuda/context.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/mps.hpp"
#include "workers.hpp"

namespace gpuipc::bench {

// The MPS calls of the public library (include/gpuipc/mps.hpp, what `gpuipc mps` runs), in a private folder.
MpsDaemon::MpsDaemon() {
  char tmpl[] = "/tmp/gpuipc-mps-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return;
  m_dir = tmpl;
  try {
    m_program = mps_control_program();
    m_started = mps_start_daemon(m_program, mps_dirs(m_dir)).exit_code == 0;
  } catch (const Error&) {
    m_started = false;  // no nvidia-cuda-mps-control here: the caller notes it
  }
  if (m_started) std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

MpsDaemon::~MpsDaemon() {
  if (m_started) {
    [[maybe_unused]] auto answer = mps_ask(m_program, mps_dirs(m_dir), "quit");
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  if (!m_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(m_dir, ec);
  }
}

std::vector<std::pair<std::string, std::string>> MpsDaemon::env() const {
  const MpsDirs dirs = mps_dirs(m_dir);
  return {{"CUDA_MPS_PIPE_DIRECTORY", dirs.pipe}, {"CUDA_MPS_LOG_DIRECTORY", dirs.log}};
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
