// `gpuipc doctor` without a CUDA driver: GPUIPC_CUDA_LIBRARY points at a file that does not exist, so this means
// the same on a machine with a GPU. Runs the built binary.
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/support.hpp"


namespace gpuipc {
namespace {

using namespace std::chrono_literals;

constexpr const char* kGpuipc = GPUIPC_BUILD_BIN_DIR "/gpuipc";
constexpr const char* kMissingLibrary = "/nonexistent/gpuipc-doctor-test/libcuda.so.1";

using Outcome = test::ProgramOutcome;

/// Runs kGpuipc with `args` and the extra environment `env` ("NAME=value"), collecting stdout and stderr.
Outcome run_gpuipc(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  return test::run_program(kGpuipc, args, env, -1, 60s);
}

std::vector<std::string> base_env(const test::TempDir& dir) {
  return {std::string("GPUIPC_CUDA_LIBRARY=") + kMissingLibrary, "GPUIPC_RUNTIME_DIR=" + dir.file("runtime"),
          "GPUIPC_LOG=warn"};
}

TEST(CliDoctor, WithoutDriverExits3WithOneLine) {
  const test::TempDir dir("gpuipc-doctor");
  const Outcome o = run_gpuipc({"doctor"}, base_env(dir));
  EXPECT_EQ(o.exit_code, 3) << o.out << o.err;
  EXPECT_EQ(std::count(o.out.begin(), o.out.end(), '\n'), 1) << "one line: " << o.out;
  EXPECT_NE(o.out.find("no CUDA driver"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find(kMissingLibrary), std::string::npos) << "the line names the library: " << o.out;
  EXPECT_NE(o.out.find("host segments work without it"), std::string::npos) << o.out;
  EXPECT_TRUE(o.err.empty()) << o.err;
}

TEST(CliDoctor, WithoutDriverJsonIsCompleteAndValid) {
  const test::TempDir dir("gpuipc-doctor");
  const Outcome o = run_gpuipc({"doctor", "--json"}, base_env(dir));
  EXPECT_EQ(o.exit_code, 3) << o.out << o.err;
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(o.out)) << o.out;
  ASSERT_TRUE(j.is_object());
  for (const char* key : {"schema", "exit_code", "ok", "error", "driver", "devices", "peer_access", "mps",
                          "runtime_dir", "problems", "advice"}) {
    EXPECT_TRUE(j.contains(key)) << "missing key " << key;
  }
  EXPECT_EQ(j["schema"], 1);
  EXPECT_EQ(j["exit_code"], 3);
  EXPECT_EQ(j["ok"], false);
  EXPECT_TRUE(j["driver"].is_null());
  ASSERT_TRUE(j["error"].is_string());
  EXPECT_NE(j["error"].get<std::string>().find(kMissingLibrary), std::string::npos);
  EXPECT_TRUE(j["devices"].is_array() && j["devices"].empty());
  EXPECT_TRUE(j["peer_access"].is_array() && j["peer_access"].empty());
  for (const char* key : {"active", "method", "detail", "attribute", "control_pipe", "control_pipe_exists"}) {
    EXPECT_TRUE(j["mps"].contains(key)) << "missing mps." << key;
  }
  EXPECT_EQ(j["mps"]["method"], "control_pipe");
  EXPECT_EQ(j["runtime_dir"]["path"], dir.file("runtime"));
  EXPECT_EQ(j["runtime_dir"]["usable"], true) << j["runtime_dir"].dump();
  EXPECT_TRUE(j["runtime_dir"]["error"].is_null());
}

// Host segments need the runtime directory too: without a driver the doctor still says when it is unusable. Before,
// it returned before judging it, and its JSON had `usable: false` with no problem listed.
TEST(CliDoctor, WithoutDriverAnUnusableRuntimeDirectoryIsAProblem) {
  const test::TempDir dir("gpuipc-doctor");
  test::write_file(dir.file("runtime"), "a file, not a directory");
  auto env = base_env(dir);
  const Outcome text = run_gpuipc({"doctor"}, env);
  EXPECT_EQ(text.exit_code, 3) << text.out << text.err;
  EXPECT_NE(text.out.find("runtime directory " + dir.file("runtime") + " is not usable"), std::string::npos)
      << text.out;
  const Outcome json = run_gpuipc({"doctor", "--json"}, env);
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(json.out)) << json.out;
  EXPECT_EQ(j["runtime_dir"]["usable"], false);
  ASSERT_EQ(j["problems"].size(), 1U) << j.dump();
  EXPECT_NE(j["problems"][0].get<std::string>().find("not a directory"), std::string::npos) << j.dump();
  EXPECT_EQ(j["advice"].size(), 1U) << j.dump();
}

// A relative GPUIPC_RUNTIME_DIR is refused, and the doctor said so of "runtime directory  is not usable" (and "path":
// ""): the path came from the call that refused it. It shows the path as given.
TEST(CliDoctor, ARelativeRuntimeDirectoryIsShownAsGiven) {
  const test::TempDir dir("gpuipc-doctor");
  auto env = base_env(dir);
  env[1] = "GPUIPC_RUNTIME_DIR=relative-runtime";
  const Outcome text = run_gpuipc({"doctor"}, env);
  EXPECT_EQ(text.exit_code, 3) << text.out << text.err;
  EXPECT_NE(text.out.find("runtime directory relative-runtime is not usable: GPUIPC_RUNTIME_DIR='relative-runtime' "
                          "is a relative path"),
            std::string::npos)
      << text.out;
  const Outcome json = run_gpuipc({"doctor", "--json"}, env);
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(json.out)) << json.out;
  EXPECT_EQ(j["runtime_dir"]["path"], "relative-runtime") << j["runtime_dir"].dump();
  EXPECT_EQ(j["runtime_dir"]["usable"], false);
  EXPECT_EQ(j["exit_code"], 3) << "no driver comes first";
  EXPECT_EQ(j["problems"].size(), 1U) << j.dump();
}

TEST(CliDoctor, UnknownFlagIsUsageError) {
  const test::TempDir dir("gpuipc-doctor");
  const Outcome o = run_gpuipc({"doctor", "--no-such-flag"}, base_env(dir));
  EXPECT_EQ(o.exit_code, 2) << o.out << o.err;
}

}  // namespace
}  // namespace gpuipc
