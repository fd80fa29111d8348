// The result document (bench/harness/bench.hpp, docs/benchmarks.md#results): what it records of the run besides the
// figures (quick, the environment, the Python module's commit), and a file it could not write.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>

#include "bench.hpp"

namespace gpuipc::bench {
namespace {

namespace fs = std::filesystem;

struct Dir {
  fs::path path = fs::temp_directory_path() / ("gpuipc-bench-results-" + std::to_string(::getpid()));
  Dir() { fs::create_directories(path); }
  ~Dir() { fs::remove_all(path); }
};

nlohmann::json read(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(BenchResults, RecordQuickTheEnvironmentAndThePythonModule) {
  const Dir dir;
  const std::string not_utf8 = std::string("a") + '\xff' + "b";  // still a document
  ASSERT_EQ(::setenv("GPUIPC_BENCH_TEST_SETTING", not_utf8.c_str(), 1), 0);
  Result r;
  r.metrics["x_us"] = 1.5;
  note_python_module(r, {{"impl", "gpuipc"}, {"gpuipc_commit", git_commit()}, {"gpuipc_path", "/here"}});
  EXPECT_TRUE(r.notes.empty()) << "the same commit is nothing to say";
  note_python_module(r, {{"impl", "gpuipc"}, {"gpuipc_commit", "0123abc"}, {"gpuipc_path", "/elsewhere"}});
  ASSERT_EQ(r.notes.size(), 1U);
  EXPECT_NE(r.notes[0].find("/elsewhere"), std::string::npos) << r.notes[0];
  EXPECT_NE(r.notes[0].find("0123abc"), std::string::npos) << r.notes[0];

  Options quick;
  quick.quick = true;
  quick.out_dir = dir.path.string();
  quick.progress = false;
  const std::string path = write_result("demo", r, DeviceMeta{}, quick);
  EXPECT_EQ(fs::path(path).filename().string().rfind("demo-quick-cpu-", 0), 0U) << path;
  const auto doc = read(path);
  EXPECT_EQ(doc.at("quick"), true);
  EXPECT_EQ(doc.at("commit"), git_commit());
  EXPECT_EQ(doc.at("python_commit"), git_commit() + ",0123abc");
  EXPECT_EQ(doc.at("environment").at("GPUIPC_BENCH_TEST_SETTING"), std::string("a") + "\xef\xbf\xbd" + "b");  // U+FFFD
  EXPECT_EQ(doc.at("metrics").at("x_us"), 1.5);

  Options full;
  full.out_dir = dir.path.string();
  full.progress = false;
  const auto plain = read(write_result("demo", Result{}, DeviceMeta{}, full));
  EXPECT_EQ(plain.at("quick"), false);
  EXPECT_FALSE(plain.contains("python_commit"));
  ::unsetenv("GPUIPC_BENCH_TEST_SETTING");
}

TEST(BenchResults, AFileThatCannotBeWrittenIsAnError) {
  const Dir dir;
  const Options into_a_directory{.json_path = dir.path.string(), .progress = false};
  EXPECT_THROW(write_result("demo", Result{}, DeviceMeta{}, into_a_directory), std::runtime_error);
}

}  // namespace
}  // namespace gpuipc::bench
