// `gpuipc doctor` without a CUDA driver: GPUIPC_CUDA_LIBRARY points at a file that does not exist, so this means
// the same on a machine with a GPU. Runs the built binary.
#include <fcntl.h>
#include <poll.h>
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

extern char** environ;

namespace gpuipc {
namespace {

using namespace std::chrono_literals;

constexpr const char* kGpuipc = GPUIPC_BUILD_BIN_DIR "/gpuipc";
constexpr const char* kMissingLibrary = "/nonexistent/gpuipc-doctor-test/libcuda.so.1";

struct Outcome {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs kGpuipc with `args` and the extra environment `env` ("NAME=value"), collecting stdout and stderr.
Outcome run_gpuipc(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  std::vector<std::string> argv_s = {kGpuipc};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_s = env;
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const bool overridden = std::any_of(env_s.begin(), env_s.end(), [&](const std::string& mine) {
      return entry.compare(0, mine.find('=') + 1, mine, 0, mine.find('=') + 1) == 0;
    });
    if (!overridden) envp.push_back(*e);
  }
  for (auto& e : env_s) envp.push_back(e.data());
  envp.push_back(nullptr);

  int out_pipe[2];
  int err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) return {};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::execve(kGpuipc, argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  Outcome o;
  std::array<pollfd, 2> fds{pollfd{out_pipe[0], POLLIN, 0}, pollfd{err_pipe[0], POLLIN, 0}};
  int open_count = 2;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (open_count > 0 && std::chrono::steady_clock::now() < deadline) {
    if (::poll(fds.data(), fds.size(), 1000) < 0 && errno != EINTR) break;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        (i == 0 ? o.out : o.err).append(buf, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_count;
      }
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) ::close(f.fd);
  }
  o.exit_code = test::wait_child(pid, 30s);
  return o;
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

TEST(CliDoctor, UnknownFlagIsUsageError) {
  const test::TempDir dir("gpuipc-doctor");
  const Outcome o = run_gpuipc({"doctor", "--no-such-flag"}, base_env(dir));
  EXPECT_EQ(o.exit_code, 2) << o.out << o.err;
}

}  // namespace
}  // namespace gpuipc
