// The C++ examples (examples/cpp) as a user runs them: real processes on host memory, each with its own broker
// (a private runtime directory; the examples start the gpuipcd installed beside them). The work queue with a worker
// that SIGKILLs itself in the middle of a task, the pipeline over host channels, intra-process sharing, and the
// supervisor that kills and restarts its worker and then finds nothing leaked.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "support/examples.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using Examples = ExampleTest;

/// The sum of the numbers in group 1 of every match of `re` in `text`.
long sum_of(const std::string& text, const std::regex& re) {
  long sum = 0;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
    sum += std::stol((*it)[1]);
  return sum;
}

TEST_F(Examples, MasterWorkerAllTilesOnce) {
  const auto o = run("master", {"--kind", "host", "--spawn", "2", "--tile", "16", "--tiles", "6", "--k", "64"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("master: 36 tiles back, 0 wrong, 0 duplicates; tasks redelivered after a worker died: 0"),
            std::string::npos);
  EXPECT_EQ(sum_of(o.out, std::regex(R"(worker \d+: (\d+) tasks)")), 36);
  EXPECT_NE(o.out.find("tasks/s"), std::string::npos);
}

TEST_F(Examples, MasterWorkerTaskOfAKilledWorkerIsDoneAgainExactlyOnce) {
  // 10 ms per task: every worker is up and taking tasks long before the queue is empty.
  const auto o = run("master", {"--kind", "host", "--spawn", "3", "--crash-one", "--task-ms", "10", "--tile", "16",
                                "--tiles", "6", "--k", "64"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("SIGKILL in the middle of task"), std::string::npos);
  EXPECT_NE(o.out.find("killed by signal 9"), std::string::npos);
  // Every tile came back once and was right; the broker handed the dead worker's task to another worker once.
  EXPECT_NE(o.out.find("master: 36 tiles back, 0 wrong, 0 duplicates; tasks redelivered after a worker died: 1"),
            std::string::npos);
  // The survivors did 35 tasks: all but the one the killed worker finished before it took its second.
  EXPECT_EQ(sum_of(o.out, std::regex(R"(worker \d+: (\d+) tasks)")), 35);
  EXPECT_EQ(listed().find("tiles."), std::string::npos) << listed();
}

TEST_F(Examples, MasterWorkerDoesNotWaitForASpawnedWorkerThatExitedBeforeJoining) {
  // The master spawns gpuipc-example-worker from its own folder: a copy of it beside a worker that exits at once
  // the first time, then runs the real one. The master must go on with the worker that joined, not wait out
  // --timeout-s for the one that is gone (it then has that long again for the tasks).
  const std::string bin = m_dir.file("bin");
  std::filesystem::create_directory(bin);
  std::filesystem::copy_file(program("master"), bin + "/gpuipc-example-master");
  write_file(bin + "/gpuipc-example-worker", "#!/bin/sh\nif mkdir '" + m_dir.file("first") +
                                                 "' 2>/dev/null; then exit 3; fi\nexec '" + program("worker") +
                                                 "' \"$@\"\n");
  std::filesystem::permissions(bin + "/gpuipc-example-worker", std::filesystem::perms::owner_exec,
                               std::filesystem::perm_options::add);
  const ProgramOutcome o =
      run_program(bin + "/gpuipc-example-master",
                  {"--kind", "host", "--spawn", "2", "--tile", "16", "--tiles", "4", "--k", "64", "--timeout-s", "30"},
                  env(), -1, std::chrono::seconds(25));
  std::printf("--- stdout\n%s--- stderr\n%s", o.out.c_str(), o.err.c_str());
  ASSERT_NE(o.exit_code, kChildTimedOut) << "the master waited for the worker that had exited";
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.err.find("exited before it joined the task queue"), std::string::npos);
  EXPECT_NE(o.out.find("master: 16 tiles back, 0 wrong, 0 duplicates"), std::string::npos);
  EXPECT_NE(o.out.find("exited with 3"), std::string::npos);
}

TEST_F(Examples, PipelineOverHostChannelsChecksEveryFrame) {
  const std::string out = m_dir.file("frames");
  std::filesystem::create_directory(out);
  const auto o = run("pipeline", {"--kind", "host", "--frames", "120", "--width", "64", "--height", "48", "--ppm-every",
                                  "50", "--out", out});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("sink: 120 of 120 frames checked, 0 bad, 3 PPM files"), std::string::npos);
  EXPECT_NE(o.out.find("frames/s"), std::string::npos);
  EXPECT_NE(o.out.find("end to end"), std::string::npos);
  for (const char* f : {"frame-0.ppm", "frame-50.ppm", "frame-100.ppm"}) {
    const auto ppm = read_file(out + "/" + f);
    ASSERT_TRUE(ppm) << f;
    EXPECT_EQ(ppm->rfind("P6\n64 48\n255\n", 0), 0u) << f;
    EXPECT_EQ(ppm->size(), std::string("P6\n64 48\n255\n").size() + 64 * 48 * 3) << f;
  }
  EXPECT_EQ(listed().find("pipeline."), std::string::npos) << listed();
}

TEST_F(Examples, PipelineOneProcessAndCompareAreDeviceOnly) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--kind", "host", "--stage", "one"}, {"--kind", "host", "--compare"}}) {
    const auto o = run("pipeline", args);
    EXPECT_EQ(o.exit_code, 64);
    EXPECT_NE(o.err.find("device-only"), std::string::npos);
  }
}

TEST_F(Examples, IntraProcessCacheHitsThreadsAndChannel) {
  const auto o = run("intra", {"--kind", "host", "--threads", "4", "--opens", "200", "--messages", "2000"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("same mapping: yes"), std::string::npos);
  EXPECT_NE(o.out.find("4 threads wrote their slices through their own handles; 0 bytes wrong"), std::string::npos);
  EXPECT_NE(o.out.find("2000 messages between two threads, 0 out of order"), std::string::npos);
}

TEST_F(Examples, SupervisorRestartsKilledWorkersAndNothingLeaks) {
  const auto o = run("supervisor", {"--kind", "host", "--jobs", "30", "--kills", "2", "--job-ms", "10"});
  ASSERT_EQ(o.exit_code, 0);
  const std::regex restarted(R"(worker \d+ Killed; starting a new one)");
  EXPECT_EQ(std::distance(std::sregex_iterator(o.out.begin(), o.out.end(), restarted), std::sregex_iterator()), 2);
  EXPECT_NE(o.out.find("supervisor: 30 of 30 jobs done (0 wrong"), std::string::npos);
  EXPECT_NE(o.out.find("2 restarts, last worker exited 0"), std::string::npos);
  EXPECT_NE(o.out.find("nothing leaked"), std::string::npos);
  EXPECT_EQ(listed().find("supervised."), std::string::npos) << listed();
}

}  // namespace
}  // namespace gpuipc::test
