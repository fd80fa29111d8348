// `gpuipc mps` with the real control daemon: start a private one, run `gpuipc demo` under it, stop it, and nothing
// of it is left running. Skips without a GPU or without nvidia-cuda-mps-control. Runs alone (ctest RUN_SERIAL): an
// MPS server on the GPU would change what other tests measure.
#include <dirent.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "os/process.hpp"
#include "support/gpu.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using namespace std::chrono_literals;


/// Processes whose environment names `pipe` as their CUDA_MPS_PIPE_DIRECTORY (the daemon, its servers, clients).
std::vector<std::string> processes_under(const std::string& pipe) {
  std::vector<std::string> found;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return found;
  const std::string needle = "CUDA_MPS_PIPE_DIRECTORY=" + pipe;
  while (const dirent* e = ::readdir(d)) {
    const std::string pid = e->d_name;
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto env = read_file("/proc/" + pid + "/environ");
    if (!env) continue;
    for (std::size_t at = 0; at < env->size();) {
      const std::size_t end = env->find('\0', at);
      if (env->compare(at, (end == std::string::npos ? env->size() : end) - at, needle) == 0) {
        found.push_back(pid + " " + read_file("/proc/" + pid + "/comm").value_or("?"));
        break;
      }
      at = end == std::string::npos ? env->size() : end + 1;
    }
  }
  ::closedir(d);
  return found;
}

TEST(MpsDevice, StartRunTheDemoUnderItStopAndNothingIsLeft) {
  GPUIPC_REQUIRE_GPU();
  const std::string cli = build_bin_dir() + "/gpuipc";
  if (os::find_in_path("nvidia-cuda-mps-control").empty()) GTEST_SKIP() << "nvidia-cuda-mps-control is not on PATH";
  TempDir dir{"gpuipc-mps"};
  const std::string mps = dir.file("mps");
  const std::vector<std::string> env{"GPUIPC_RUNTIME_DIR=" + dir.file("run"), "GPUIPC_LOG=warn",
                                     "GPUIPC_DAEMON=" + build_bin_dir() + "/gpuipcd"};
  const auto start = run_program(cli, {"mps", "start", "--dir", mps}, env, -1, 60s);
  std::printf("--- start\n%s%s", start.out.c_str(), start.err.c_str());
  ASSERT_EQ(start.exit_code, 0);
  EXPECT_EQ(start.out, "export CUDA_MPS_PIPE_DIRECTORY=" + mps + "/pipe\nexport CUDA_MPS_LOG_DIRECTORY=" + mps +
                           "/log\n");
  std::vector<std::string> under = env;
  under.push_back("CUDA_MPS_PIPE_DIRECTORY=" + mps + "/pipe");
  under.push_back("CUDA_MPS_LOG_DIRECTORY=" + mps + "/log");
  const auto again = run_program(cli, {"mps", "start", "--dir", mps}, env, -1, 60s);
  EXPECT_EQ(again.exit_code, 0);
  EXPECT_NE(again.err.find("already runs"), std::string::npos) << again.err;

  const auto demo = run_program(cli, {"demo"}, under, -1, 120s);
  std::printf("--- demo under MPS\n%s%s", demo.out.c_str(), demo.err.c_str());
  EXPECT_EQ(demo.exit_code, 0);
  EXPECT_NE(demo.out.find("all 2000 frames verified on the GPU"), std::string::npos);
  const auto status = run_program(cli, {"mps", "status", "--dir", mps, "--json"}, env, -1, 60s);
  std::printf("--- status\n%s", status.out.c_str());
  EXPECT_EQ(status.exit_code, 0);
  const auto j = nlohmann::json::parse(status.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << status.out;
  EXPECT_EQ(j["running"], true);
  // The demo's processes ran under it: the daemon started a server for them (it stays until stop).
  EXPECT_FALSE(j["servers"].empty()) << status.out;

  const auto stop = run_program(cli, {"mps", "stop", "--dir", mps}, env, -1, 60s);
  std::printf("--- stop\n%s%s", stop.out.c_str(), stop.err.c_str());
  EXPECT_EQ(stop.exit_code, 0);
  EXPECT_EQ(run_program(cli, {"mps", "status", "--dir", mps}, env, -1, 60s).exit_code, 5);
  // The demo started a broker on demand, with the demo's environment (the MPS variables too; it never uses CUDA):
  // stop it, then nothing at all may be left with those variables.
  run_program(cli, {"daemon", "--stop"}, env);
  std::vector<std::string> left;
  EXPECT_TRUE(wait_until([&] { return (left = processes_under(mps + "/pipe")).empty(); }, 10s))
      << "still running: " << (left.empty() ? "" : left.front());
}

}  // namespace
}  // namespace gpuipc::test
