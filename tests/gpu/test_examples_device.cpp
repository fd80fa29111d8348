// The C++ examples (examples/cpp) on GPUs, as a user runs them: each program in its device mode, with its own broker
// (a private runtime directory; the examples start the gpuipcd installed beside them). Skips without a GPU.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "support/examples.hpp"
#include "support/gpu.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

class ExamplesDevice : public ExampleTest {
 protected:
  // Within ctest's --timeout (300 s in scripts/gpu_check.sh): a hang fails here and prints what the example wrote.
  ExamplesDevice() : ExampleTest(std::chrono::seconds(240)) {}
};

TEST_F(ExamplesDevice, ProducerConsumerRawIpcShareAndChannel) {
  GPUIPC_REQUIRE_GPU();
  const std::string log = m_dir.file("producer.log");
  const pid_t producer =
      start_program(program("producer"), {"--dir", m_dir.path(), "--mib", "64", "--frames", "500"}, env(), -1, log);
  const auto consumer = run("consumer", {"--dir", m_dir.path(), "--mib", "64"});
  const int producer_exit = wait_child(producer, 60s);
  std::printf("--- producer\n%s", read_file(log).value_or("").c_str());
  EXPECT_EQ(producer_exit, 0);
  ASSERT_EQ(consumer.exit_code, 0);
  EXPECT_NE(consumer.out.find("raw IPC: cudaIpcOpenMemHandle"), std::string::npos);
  EXPECT_NE(consumer.out.find("64 MiB checked, 0 words wrong"), std::string::npos);
  EXPECT_NE(consumer.out.find("same mapping: yes"), std::string::npos);
  EXPECT_NE(consumer.out.find("channel: 500 frames of 1 MiB, 0 words wrong, 0 out of order"), std::string::npos);
}

TEST_F(ExamplesDevice, MasterWorkerOnGpuRedoesAKilledWorkersTaskOnce) {
  GPUIPC_REQUIRE_GPU();
  const auto o = run("master", {"--kind", "device", "--spawn", "3", "--crash-one", "--task-ms", "10"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("master: 64 tiles back, 0 wrong, 0 duplicates; tasks redelivered after a worker died: 1"),
            std::string::npos);
}

TEST_F(ExamplesDevice, PipelineWithKernels) {
  GPUIPC_REQUIRE_GPU();
  // Smaller frames than the default 1920x1080 keep it short; --compare then runs the three kernels in one process.
  // The frame rates are printed, not judged here (the pipeline benchmark suite measures them).
  const auto o = run("pipeline", {"--kind", "device", "--frames", "1000", "--width", "1024", "--height", "512",
                                  "--ppm-every", "250", "--compare", "--out", m_dir.path()});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("sink: 1000 of 1000 frames checked, 0 bad, 4 PPM files"), std::string::npos);
  EXPECT_NE(o.out.find(" frames/s (1024x512 RGBA, device channels)"), std::string::npos);
  EXPECT_NE(o.out.find("\none process: 1000 frames, "), std::string::npos);
  EXPECT_NE(o.out.find(" frames/s (1024x512 RGBA), 0 bad\n"), std::string::npos);
  EXPECT_NE(o.out.find("\npipeline / one process: "), std::string::npos);
  const std::string header = "P6\n1024 512\n255\n";
  for (const char* f : {"frame-0.ppm", "frame-250.ppm", "frame-500.ppm", "frame-750.ppm"}) {
    const auto ppm = read_file(m_dir.file(f));
    ASSERT_TRUE(ppm) << f;
    EXPECT_EQ(ppm->size(), header.size() + 1024 * 512 * 3) << f;
    EXPECT_EQ(ppm->rfind(header, 0), 0u) << f;
  }
}

TEST_F(ExamplesDevice, BenchmarkPrintsEveryRow) {
  GPUIPC_REQUIRE_GPU();
  const auto o = run("benchmark", {"--mib", "64", "--reps", "5"});
  ASSERT_EQ(o.exit_code, 0);
  for (const char* row : {"H2D pageable", "H2D pinned", "D2H pageable", "D2H pinned", "D2D", "P2P"})
    EXPECT_NE(o.out.find(row), std::string::npos) << row;
}

TEST_F(ExamplesDevice, IntraOnDeviceMemory) {
  GPUIPC_REQUIRE_GPU();
  const auto o = run("intra", {"--kind", "device", "--messages", "2000"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("same mapping: yes"), std::string::npos);
  EXPECT_NE(o.out.find("0 bytes wrong"), std::string::npos);
  EXPECT_NE(o.out.find("2000 messages between two threads, 0 out of order"), std::string::npos);
}

TEST_F(ExamplesDevice, SupervisorWithADevicePoolLeaksNothing) {
  GPUIPC_REQUIRE_GPU();
  const auto o = run("supervisor", {"--kind", "device", "--jobs", "30", "--kills", "2"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("2 restarts, last worker exited 0"), std::string::npos);
  EXPECT_NE(o.out.find("nothing leaked"), std::string::npos);
}

// Failure paths. ------------------------------------------------------------------------------------------------

TEST_F(ExamplesDevice, ProducerRemovesStaleRawIpcFilesFirst) {
  GPUIPC_REQUIRE_GPU();
  // A run before left its files: the consumer must not take the old handle, nor the producer the old "done".
  const std::string dir = m_dir.file("handoff");
  std::filesystem::create_directory(dir);
  write_file(dir + "/raw.handle", std::string(64, '\x5a'));
  write_file(dir + "/raw.done", "1");
  const std::string log = m_dir.file("producer.log");
  const pid_t producer =
      start_program(program("producer"), {"--dir", dir, "--mib", "16", "--frames", "50"}, env(), -1, log);
  std::this_thread::sleep_for(2s);  // the producer first: it owns the files
  const auto consumer = run("consumer", {"--dir", dir, "--mib", "16"});
  const int producer_exit = wait_child(producer, 60s);
  std::printf("--- producer\n%s", read_file(log).value_or("").c_str());
  EXPECT_EQ(producer_exit, 0);
  ASSERT_EQ(consumer.exit_code, 0);
  EXPECT_NE(consumer.out.find("16 MiB checked, 0 words wrong"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir + "/raw.handle"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/raw.done"));
}

TEST_F(ExamplesDevice, ConsumerFailsWhenTheProducerDiesMidStream) {
  GPUIPC_REQUIRE_GPU();
  const std::string dir = m_dir.file("handoff");
  std::filesystem::create_directory(dir);
  const pid_t producer = start_program(program("producer"), {"--dir", dir, "--mib", "16", "--frames", "100000000"},
                                       env(), -1, m_dir.file("producer.log"));
  const pid_t consumer =
      start_program(program("consumer"), {"--dir", dir, "--mib", "16"}, env(), -1, m_dir.file("consumer.log"));
  // Killed once frames flow: the channel is made after the consumer's segment step, then it has had a consumer and
  // messages for a while. (Asked of `gpuipc ls`: the producer's log is a file, whose lines may sit in its buffer.)
  const bool streaming = wait_until([&] { return listed().find("handoff.frames") != std::string::npos; }, 60s, 100ms);
  std::this_thread::sleep_for(2s);
  ::kill(producer, SIGKILL);
  EXPECT_EQ(wait_child(producer, 30s), 128 + SIGKILL);
  const int consumer_exit = wait_child(consumer, 60s);
  const std::string said = read_file(m_dir.file("consumer.log")).value_or("");
  std::printf("--- consumer\n%s", said.c_str());
  ASSERT_TRUE(streaming);
  EXPECT_EQ(consumer_exit, 1);
  EXPECT_NE(said.find("PeerDied"), std::string::npos);
  // The consumer removed its semaphore (the SIGKILLed producer could not remove its channel: gpuipc rm).
  EXPECT_EQ(listed().find("handoff.done"), std::string::npos) << listed();
}

TEST_F(ExamplesDevice, PipelinePostOnGpu0WithoutPeerAccess) {
  GPUIPC_REQUIRE_GPU();
  if (!two_gpus_without_peer_access()) GTEST_SKIP() << "needs GPUs 0 and 1 without peer access";
  const auto o = run("pipeline", {"--kind", "device", "--frames", "100", "--width", "256", "--height", "256",
                                  "--ppm-every", "0", "--name", "pl-nopeer"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("post on GPU 0 (GPUs 0 and 1 have no peer access)"), std::string::npos);
  EXPECT_NE(o.out.find("sink: 100 of 100 frames checked, 0 bad"), std::string::npos);
}

TEST_F(ExamplesDevice, BenchmarkSkipsP2PWithoutPeerAccess) {
  GPUIPC_REQUIRE_GPU();
  if (!two_gpus_without_peer_access()) GTEST_SKIP() << "needs GPUs 0 and 1 without peer access";
  const auto o = run("benchmark", {"--mib", "16", "--reps", "2", "--name", "bw-nopeer"});
  ASSERT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("skipped: GPUs 0 and 1 have no peer access"), std::string::npos);
  EXPECT_EQ(listed().find("bw-nopeer"), std::string::npos) << listed();
}

}  // namespace
}  // namespace gpuipc::test
