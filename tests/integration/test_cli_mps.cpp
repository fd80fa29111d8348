// `gpuipc mps` without a GPU: its arguments and its errors, with the control program missing, or a stand-in that
// refuses everything (a shell script on PATH; the real daemon is tests/gpu/test_mps_device.cpp's). Runs the built
// binary.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>
#include <vector>

#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using namespace std::chrono_literals;

constexpr const char* kGpuipc = GPUIPC_BUILD_BIN_DIR "/gpuipc";

class CliMps : public ::testing::Test {
 protected:
  /// gpuipc with PATH = only our folder (so the machine's own nvidia-cuda-mps-control, if any, is not found).
  ProgramOutcome gpuipc(const std::vector<std::string>& args) {
    return run_program(kGpuipc, args, {"PATH=" + m_dir.file("bin"), "GPUIPC_RUNTIME_DIR=" + m_dir.file("run")}, -1,
                       60s);
  }
  /// Puts a nvidia-cuda-mps-control on that PATH that fails every command, as the real one does with no daemon.
  void refusing_control() {
    const std::string bin = m_dir.file("bin");
    ::mkdir(bin.c_str(), 0700);
    const std::string path = bin + "/nvidia-cuda-mps-control";
    write_file(path, "#!/bin/sh\necho 'Cannot find MPS control daemon process' >&2\nexit 1\n");
    ASSERT_EQ(::chmod(path.c_str(), 0700), 0);
  }
  TempDir m_dir{"gpuipc-cli-mps"};
};

TEST_F(CliMps, WithoutTheControlProgramEverySubcommandButEnvSaysWhereItComesFrom) {
  for (const char* sub : {"start", "stop", "status"}) {
    const auto o = gpuipc({"mps", sub});
    EXPECT_EQ(o.exit_code, 3) << sub << ": " << o.err;  // kExitNoDriver: it is part of the driver
    EXPECT_NE(o.err.find("nvidia-cuda-mps-control is not on PATH"), std::string::npos) << o.err;
    EXPECT_NE(o.err.find("NVIDIA driver"), std::string::npos) << o.err;
  }
  const auto env = gpuipc({"mps", "env"});
  EXPECT_EQ(env.exit_code, 0);
  EXPECT_NE(env.out.find("export CUDA_MPS_PIPE_DIRECTORY=" + m_dir.file("run") + "/mps/pipe\n"), std::string::npos)
      << env.out;
  EXPECT_NE(env.out.find("export CUDA_MPS_LOG_DIRECTORY=" + m_dir.file("run") + "/mps/log\n"), std::string::npos);
}

TEST_F(CliMps, EnvQuotesAFolderTheShellWouldSplit) {
  const auto o = gpuipc({"mps", "env", "--dir", "/tmp/it's here"});
  EXPECT_EQ(o.exit_code, 0);
  EXPECT_EQ(o.out,
            "export CUDA_MPS_PIPE_DIRECTORY='/tmp/it'\\''s here/pipe'\n"
            "export CUDA_MPS_LOG_DIRECTORY='/tmp/it'\\''s here/log'\n");
}

TEST_F(CliMps, BadCommandLinesAreUsageErrors) {
  EXPECT_EQ(gpuipc({"mps"}).exit_code, 2);
  EXPECT_EQ(gpuipc({"mps", "restart"}).exit_code, 2);
  EXPECT_EQ(gpuipc({"mps", "stop", "--json"}).exit_code, 2);
  EXPECT_EQ(gpuipc({"mps", "status", "--dir"}).exit_code, 2);
}

TEST_F(CliMps, NothingRunningIsSaidByStatusAndStopAndAFailedStartSaysSo) {
  refusing_control();
  const std::string dir = m_dir.file("mine");
  const auto status = gpuipc({"mps", "status", "--dir", dir});
  EXPECT_EQ(status.exit_code, 5);  // kExitNotFound, as `gpuipc daemon status`
  EXPECT_NE(status.out.find("no MPS control daemon runs with its pipe in " + dir + "/pipe"), std::string::npos);
  const auto json = gpuipc({"mps", "status", "--dir", dir, "--json"});
  EXPECT_EQ(json.exit_code, 5);
  EXPECT_NE(json.out.find("\"running\":false"), std::string::npos) << json.out;
  const auto stop = gpuipc({"mps", "stop", "--dir", dir});
  EXPECT_EQ(stop.exit_code, 0);
  EXPECT_NE(stop.out.find("no MPS control daemon runs"), std::string::npos);
  const auto start = gpuipc({"mps", "start", "--dir", dir});
  EXPECT_EQ(start.exit_code, 1);
  EXPECT_NE(start.err.find("did not start a control daemon (exit 1)"), std::string::npos) << start.err;
  EXPECT_NE(start.err.find("Cannot find MPS control daemon process"), std::string::npos) << start.err;
  EXPECT_EQ(start.out, "");  // nothing for an eval to pick up
}

}  // namespace
}  // namespace gpuipc::test
