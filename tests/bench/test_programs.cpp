// The suites' program runner (bench/harness/programs.hpp): a program's output, exit status and environment, and a program
// that outlives its time limit killed together with the processes it started (the pipeline suite's example runs
// three stage processes under its own).
#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include "programs.hpp"

namespace gpuipc::bench {
namespace {

using namespace std::chrono_literals;

/// Whether `pid` exists and is not a zombie (an orphan waits for whoever adopted it to reap it).
bool running(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto state = line.rfind(") ");
  return state != std::string::npos && line[state + 2] != 'Z';
}

TEST(BenchPrograms, OutputExitStatusAndEnvironment) {
  const ProgramRun run = run_program({"/bin/sh", "-c", "echo \"$GPUIPC_TEST_WORD\"; echo to-stderr >&2; exit 3"},
                                     {{"GPUIPC_TEST_WORD", "two 'quoted' words"}}, 30s);
  EXPECT_EQ(run.status, 3);
  EXPECT_EQ(run.error, "exit status 3");
  EXPECT_NE(run.output.find("two 'quoted' words\n"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("to-stderr\n"), std::string::npos) << run.output;

  const ProgramRun ok = run_program({"/bin/echo", "fine"}, {}, 30s);
  EXPECT_EQ(ok.status, 0);
  EXPECT_TRUE(ok.error.empty()) << ok.error;
  EXPECT_EQ(ok.output, "fine\n");
}

TEST(BenchPrograms, TimeLimitKillsTheProgramAndWhatItStarted) {
  const auto t0 = std::chrono::steady_clock::now();
  // The background sleep keeps the output pipe open: the call returns only once it is gone too.
  const ProgramRun run = run_program({"/bin/sh", "-c", "sleep 100 & echo $!; wait"}, {}, 1s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s);
  EXPECT_EQ(run.status, 124);
  EXPECT_EQ(run.error, "timed out after 1 s");
  const pid_t child = std::stoi(run.output);
  for (int i = 0; i < 100 && running(child); ++i) std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(running(child)) << "pid " << child;
}

}  // namespace
}  // namespace gpuipc::bench
