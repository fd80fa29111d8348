// The C++ examples (examples/cpp) as a user runs them: real processes on host memory, each with its own broker
// (a private runtime directory; the examples start the gpuipcd installed beside them). The work queue with a worker
// that SIGKILLs itself in the middle of a task, the pipeline over host channels, intra-process sharing, and the
// supervisor that kills and restarts its worker and then finds nothing leaked.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <gpuipc/segment.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "../../examples/cpp/common.hpp"  // the examples' own helpers (percentile), tested as they are
#include "support/examples.hpp"
#include "support/gpu.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using Examples = ExampleTest;

/// The processes whose command line has an argument equal to `arg` (a test's unique --name): the stages and
/// workers an example started, which must be gone when it is.
std::vector<pid_t> processes_with_arg(const std::string& arg) {
  std::vector<pid_t> found;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string pid = entry.path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto cmdline = read_file(entry.path().string() + "/cmdline");
    if (!cmdline || std::stol(pid) == ::getpid()) continue;
    for (std::size_t at = 0; at < cmdline->size();) {
      const std::size_t end = std::min(cmdline->find('\0', at), cmdline->size());
      if (cmdline->compare(at, end - at, arg) == 0) {
        found.push_back(static_cast<pid_t>(std::stol(pid)));
        break;
      }
      at = end + 1;
    }
  }
  return found;
}

/// Processes left with `arg` in their command line (none, when the example cleaned up), SIGKILLed so that a failed
/// test leaves nothing running; what was left, for the assertion message.
std::string kill_leftovers(const std::string& arg) {
  std::string left;
  for (const pid_t pid : processes_with_arg(arg)) {
    left += read_file("/proc/" + std::to_string(pid) + "/cmdline").value_or("") + "; ";
    ::kill(pid, SIGKILL);
  }
  std::replace(left.begin(), left.end(), '\0', ' ');
  return left;
}

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

// Failures and interruptions (examples/cpp/README.md, "When something goes wrong"). ------------------------------

/// A copy of the pipeline in its own bin/ (as gpuipc-example-pipeline.real) beside a gpuipc-example-pipeline that
/// runs it, except that stage `stage` runs `stage_body` (sh) instead: the driver starts its stages from its own folder.
std::string pipeline_with_stage(const ExampleTest& t, const TempDir& dir, const std::string& stage,
                                const std::string& stage_body) {
  const std::string bin = dir.file("bin"), real = bin + "/gpuipc-example-pipeline.real";
  std::filesystem::create_directory(bin);
  std::filesystem::copy_file(build_bin_dir() + "/gpuipc-example-pipeline", real);
  write_file(bin + "/gpuipc-example-pipeline", "#!/bin/sh\nfor a; do last=$a; done\nif [ \"$last\" = " + stage +
                                                   " ]; then " + stage_body + "; fi\nexec '" + real + "' \"$@\"\n");
  std::filesystem::permissions(bin + "/gpuipc-example-pipeline", std::filesystem::perms::owner_exec,
                               std::filesystem::perm_options::add);
  (void)t;
  return real;
}

TEST_F(Examples, PipelineStopsTheOtherStagesWhenOneFails) {
  // The post stage exits 3 before it joins anything: render fills its ring and the sink waits for NAME.post. The
  // driver must stop them and fail at once, not wait for them for ever.
  const std::string real = pipeline_with_stage(*this, m_dir, "post", "exit 3");
  const ProgramOutcome o =
      run_program(real, {"--kind", "host", "--frames", "50", "--name", "pl-fail"}, env(), -1, std::chrono::seconds(40));
  std::printf("--- stdout\n%s--- stderr\n%s", o.out.c_str(), o.err.c_str());
  const std::string left = kill_leftovers("pl-fail");
  ASSERT_NE(o.exit_code, kChildTimedOut) << "the driver waited for stages that could not finish";
  EXPECT_EQ(o.exit_code, 1);
  EXPECT_NE(o.err.find("post exited with 3"), std::string::npos);
  EXPECT_EQ(left, "") << "stages left running";
  EXPECT_EQ(listed().find("pl-fail."), std::string::npos) << listed();
}

TEST_F(Examples, PipelineStageFailsWhenItsPeerNeverJoins) {
  // Render alone: nobody consumes NAME.raw. It must give up after --wait-s and say why, and remove its channel.
  const auto render =
      run("pipeline", {"--kind", "host", "--stage", "render", "--frames", "10", "--name", "pl-alone", "--wait-s", "2"});
  EXPECT_EQ(render.exit_code, 1);
  EXPECT_NE(render.err.find("no consumer joined pl-alone.raw within 2 s"), std::string::npos);
  // The sink alone: nobody makes NAME.post.
  const auto sink = run("pipeline", {"--kind", "host", "--stage", "sink", "--name", "pl-alone", "--wait-s", "2"});
  EXPECT_EQ(sink.exit_code, 1);
  EXPECT_NE(sink.err.find("pl-alone.post"), std::string::npos);
  EXPECT_EQ(listed().find("pl-alone."), std::string::npos) << listed();
}

TEST_F(Examples, PipelineStopsItsStagesAndRemovesItsNamesOnSigint) {
  const pid_t driver = start_program(program("pipeline"),
                                     {"--kind", "host", "--frames", "100000000", "--width", "16", "--height", "16",
                                      "--ppm-every", "0", "--name", "pl-int"},
                                     env(), -1, m_dir.file("pipeline.log"));
  const bool running = wait_until([&] { return listed().find("pl-int.post") != std::string::npos; }, 30s, 50ms);
  ::kill(driver, SIGINT);
  const int code = wait_child(driver, 30s);
  std::printf("--- pipeline\n%s", read_file(m_dir.file("pipeline.log")).value_or("").c_str());
  const std::string left = kill_leftovers("pl-int");
  ASSERT_TRUE(running);
  EXPECT_EQ(code, 128 + SIGINT);
  EXPECT_EQ(left, "") << "stages left running";
  EXPECT_EQ(listed().find("pl-int."), std::string::npos) << listed();
}

TEST_F(Examples, MasterRemovesItsNamesWhenItFailsAndTheNextRunStarts) {
  for (int run_number = 0; run_number < 2; ++run_number) {
    // No worker: it gives up after --timeout-s. The second run, with the same (default) name, must not find the
    // first one's names.
    const auto o = run("master", {"--kind", "host", "--tile", "8", "--tiles", "2", "--k", "8", "--timeout-s", "1"});
    EXPECT_EQ(o.exit_code, 1) << "run " << run_number;
    EXPECT_NE(o.err.find("are workers running"), std::string::npos) << "run " << run_number;
    EXPECT_EQ(listed().find("tiles."), std::string::npos) << listed();
  }
}

TEST_F(Examples, MasterRemovesItsNamesOnSigterm) {
  const pid_t master = start_program(program("master"), {"--kind", "host", "--tile", "8", "--tiles", "2", "--k", "8"},
                                     env(), -1, m_dir.file("master.log"));
  const bool running = wait_until([&] { return listed().find("tiles.results") != std::string::npos; }, 30s, 50ms);
  ::kill(master, SIGTERM);
  const int code = wait_child(master, 30s);
  std::printf("--- master\n%s", read_file(m_dir.file("master.log")).value_or("").c_str());
  ASSERT_TRUE(running);
  EXPECT_EQ(code, 128 + SIGTERM);
  EXPECT_EQ(listed().find("tiles."), std::string::npos) << listed();
}

TEST_F(Examples, MasterThatCannotCreateItsNamesSaysWhyAndLeavesTheOtherRunsNames) {
  const pid_t first = start_program(program("master"), {"--kind", "host", "--tile", "8", "--tiles", "2", "--k", "8"},
                                    env(), -1, m_dir.file("master.log"));
  const bool running = wait_until([&] { return listed().find("tiles.results") != std::string::npos; }, 30s, 50ms);
  const auto second = run("master", {"--kind", "host", "--tile", "8", "--tiles", "2", "--k", "8"});
  const std::string names = listed();
  ::kill(first, SIGTERM);
  EXPECT_EQ(wait_child(first, 30s), 128 + SIGTERM);
  ASSERT_TRUE(running);
  EXPECT_EQ(second.exit_code, 1);
  EXPECT_NE(second.err.find("already exists"), std::string::npos);
  EXPECT_NE(second.err.find("gpuipc rm"), std::string::npos);  // what to do about it
  // The second run removed nothing of the first's.
  for (const char* n : {"tiles.matrices", "tiles.tasks", "tiles.results"})
    EXPECT_NE(names.find(n), std::string::npos) << n << "\n" << names;
}

TEST_F(Examples, SupervisorStopsItsWorkerAndRemovesItsNamesOnSigterm) {
  const pid_t sup =
      start_program(program("supervisor"), {"--kind", "host", "--name", "sv-term", "--jobs", "100000", "--kills", "0"},
                    env(), -1, m_dir.file("supervisor.log"));
  const bool running =
      wait_until([&] { return processes_with_arg("--worker").size() > 0 && processes_with_arg("sv-term").size() >= 2; },
                 30s, 50ms);
  ::kill(sup, SIGTERM);
  const int code = wait_child(sup, 30s);
  std::printf("--- supervisor\n%s", read_file(m_dir.file("supervisor.log")).value_or("").c_str());
  const std::string left = kill_leftovers("sv-term");
  ASSERT_TRUE(running);
  EXPECT_EQ(code, 128 + SIGTERM);
  EXPECT_EQ(left, "") << "worker left running";
  EXPECT_EQ(listed().find("sv-term."), std::string::npos) << listed();
}

TEST_F(Examples, BadOptionValuesAreRefusedWithTheUsage) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"master", {"--tile", "0"}},
      {"master", {"--tiles", "abc"}},
      {"master", {"--k", "0"}},
      {"master", {"--tile", "-1"}},
      {"master", {"--tile", "5000", "--tiles", "1", "--k", "1"}},
      {"master", {"--kind", "gpu"}},
      {"master", {"--timeout-s", "5x"}},
      {"worker", {"--kind", "cpu"}},
      {"pipeline", {"--frames", "-1"}},
      {"pipeline", {"--width", "0"}},
      {"pipeline", {"--stage", "nope"}},
      {"intra", {"--threads", "0"}},
      {"intra", {"--opens", "-5"}},
      {"supervisor", {"--jobs", "1e3"}},
      {"supervisor", {"--kind", "dev"}},
      {"producer", {"--mib", "0"}},
      {"consumer", {"--mib", "-1"}},
      {"benchmark", {"--reps", "0"}},
  };
  for (const auto& [example, args] : cases) {
    // (A value out of range comes last: the last of an option given twice wins.)
    std::vector<std::string> a{"--name", "bad-args"};
    if (example == "master") a.insert(a.end(), {"--timeout-s", "1"});
    a.insert(a.end(), args.begin(), args.end());
    const ProgramOutcome o = run_program(program(example), a, env(), -1, std::chrono::seconds(20));
    std::string line = example;
    for (const std::string& s : a) line += " " + s;
    EXPECT_EQ(o.exit_code, 64) << line << "\n" << o.err;
    EXPECT_NE(o.err.find("gpuipc-example-" + example + " ["), std::string::npos) << line << ": no usage\n" << o.err;
    kill_leftovers("bad-args");
  }
  EXPECT_EQ(listed().find("bad-args"), std::string::npos) << listed();
}

TEST_F(Examples, MasterFailsAtOnceWhenNoWorkerIsLeft) {
  // Its only worker joins and SIGKILLs itself in its second task: nobody is left to do the tasks.
  const ProgramOutcome o = run_program(
      program("master"),
      {"--kind", "host", "--spawn", "1", "--crash-one", "--tile", "8", "--tiles", "4", "--k", "8", "--timeout-s", "60"},
      env(), -1, std::chrono::seconds(30));
  std::printf("--- stdout\n%s--- stderr\n%s", o.out.c_str(), o.err.c_str());
  ASSERT_NE(o.exit_code, kChildTimedOut) << "the master waited out --timeout-s with no worker left";
  EXPECT_EQ(o.exit_code, 1);
  EXPECT_NE(o.err.find("killed by signal 9"), std::string::npos);
  EXPECT_NE(o.err.find("no worker left"), std::string::npos);
  EXPECT_EQ(listed().find("tiles."), std::string::npos) << listed();
}

TEST_F(Examples, PipelineStageRowsLeaveOutTheWaitForADownstreamSlot) {
  // A slow sink (a PPM file of every frame): render and post spend most of their time waiting for a free slot
  // downstream. Their rows must show their own work, under the sink's.
  const auto o = run("pipeline", {"--kind", "host", "--frames", "60", "--width", "512", "--height", "512",
                                  "--ppm-every", "1", "--out", m_dir.path(), "--name", "pl-lat"});
  ASSERT_EQ(o.exit_code, 0);
  auto p50 = [&](const std::string& row) {
    std::smatch m;
    const std::regex re("\n" + row + R"( +([0-9.]+) +[0-9.]+\n)");
    return std::regex_search(o.out, m, re) ? std::stod(m[1]) : -1.0;
  };
  const double render = p50("render"), post = p50("post"), sink = p50(R"(sink \(check\))");
  ASSERT_GT(render, 0);
  ASSERT_GT(post, 0);
  ASSERT_GT(sink, 0);
  // Without the waits, each does less than the sink per frame (post about half, render a fifth); with them, each
  // takes about as long as the sink's whole period (p50s of 4600, 4560 and 2280 us before the fix).
  EXPECT_LT(render, sink) << "render's row has the wait for a slot of NAME.raw in it";
  EXPECT_LT(post, sink) << "post's row has the wait for a slot of NAME.post in it";
}

TEST(ExampleHelpers, PercentileIsTheNearestRankAndTheMedianOfAnEvenCountIsTheMeanOfTheMiddleTwo) {
  std::vector<double> hundred;
  for (int i = 1; i <= 100; ++i) hundred.push_back(i);
  EXPECT_EQ(example::percentile(hundred, 99), 99);  // rank ceil(0.99 * 100) = 99, not the maximum
  EXPECT_EQ(example::percentile(hundred, 100), 100);
  EXPECT_EQ(example::percentile(hundred, 0), 1);
  EXPECT_EQ(example::percentile(hundred, 1), 1);
  EXPECT_EQ(example::percentile(hundred, 50), 50.5);
  EXPECT_EQ(example::percentile({4, 1, 3, 2}, 50), 2.5);
  EXPECT_EQ(example::percentile({3, 1, 2}, 50), 2);
  EXPECT_EQ(example::percentile({5}, 99), 5);
  EXPECT_EQ(example::percentile({}, 50), 0);
  std::vector<double> ten;
  for (int i = 1; i <= 10; ++i) ten.push_back(i);
  EXPECT_EQ(example::percentile(ten, 99), 10);  // rank ceil(9.9) = 10
  EXPECT_EQ(example::percentile(ten, 90), 9);   // rank 9
}

TEST_F(Examples, IntraWithMoreThan255Threads) {
  const auto o = run("intra", {"--kind", "host", "--threads", "257", "--opens", "10", "--messages", "10"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("257 threads wrote their slices through their own handles; 0 bytes wrong"), std::string::npos);
}

TEST_F(Examples, SupervisorChecksTheSumReadBackFromThePoolBlock) {
  // While the worker's job sleeps, another process overwrites the pool's chunk: the sums the worker reads back
  // from its block are then wrong, and the supervisor must say so (it must not sum the worker's own source buffer).
  Shared<int> stop;
  const std::vector<std::string> e = env();
  const pid_t scribbler = start_child([&] {
    for (const std::string& kv : e) ::putenv(const_cast<char*>(kv.c_str()));
    for (int i = 0; i < 3000 && !stop[0]; ++i) {
      try {
        const gpuipc::Segment chunk = gpuipc::Segment::open("sv-scribble.pool.chunk.0");
        while (!stop[0]) {
          std::memset(chunk.data(), 0xff, chunk.size());
          std::this_thread::sleep_for(1ms);
        }
        return 0;
      } catch (const gpuipc::Error&) {
        std::this_thread::sleep_for(10ms);
      }
    }
    return 1;
  });
  const auto o =
      run("supervisor", {"--kind", "host", "--name", "sv-scribble", "--jobs", "4", "--kills", "0", "--job-ms", "300"});
  stop[0] = 1;
  EXPECT_EQ(wait_child(scribbler, 30s), 0);
  EXPECT_EQ(o.exit_code, 1);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(o.out, m, std::regex(R"(jobs done \((\d+) wrong)"))) << o.out;
  EXPECT_GT(std::stoi(m[1]), 0) << "the worker summed memory that is not the pool's";
}

TEST_F(Examples, SupervisorTimesOutAfterTimeoutS) {
  const ProgramOutcome o = run_program(
      program("supervisor"),
      {"--kind", "host", "--name", "sv-slow", "--jobs", "1000", "--kills", "0", "--job-ms", "100", "--timeout-s", "2"},
      env(), -1, std::chrono::seconds(40));
  std::printf("--- stdout\n%s--- stderr\n%s", o.out.c_str(), o.err.c_str());
  const std::string left = kill_leftovers("sv-slow");
  ASSERT_NE(o.exit_code, kChildTimedOut);
  EXPECT_EQ(o.exit_code, 1);
  EXPECT_NE(o.err.find("timed out after 2 s"), std::string::npos);
  EXPECT_EQ(left, "");
  EXPECT_EQ(listed().find("sv-slow."), std::string::npos) << listed();
}

TEST_F(Examples, SupervisorCountsAKillThatLandsBetweenJobs) {
  // No pause per job: the kill often lands after the worker finished its job (or all jobs). It must still be seen
  // and counted as a restart, and the last worker be the new one.
  for (int i = 0; i < 6; ++i) {
    const std::string name = "sv-idle" + std::to_string(i);
    const auto o =
        run("supervisor", {"--kind", "host", "--name", name, "--jobs", "2", "--kills", "1", "--job-ms", "0"});
    EXPECT_EQ(o.exit_code, 0) << "run " << i;
    EXPECT_NE(o.out.find("1 restarts, last worker exited 0"), std::string::npos) << "run " << i;
  }
}

}  // namespace
}  // namespace gpuipc::test
