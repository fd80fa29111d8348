// Running the C++ examples (examples/cpp) as a user runs them: the programs of this build's bin/, each test with a
// broker of its own on a private runtime directory, stopped after the test. Used by tests/examples (host modes)
// and tests/gpu/test_examples_device.cpp (device modes).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "support/support.hpp"

namespace gpuipc::test {

class ExampleTest : public ::testing::Test {
 protected:
  explicit ExampleTest(std::chrono::milliseconds limit = std::chrono::seconds(120)) : m_limit(limit) {}

  std::string program(const std::string& example) const { return build_bin_dir() + "/gpuipc-example-" + example; }
  /// Runs gpuipc-example-`example` with `args` within the limit, and prints what it wrote.
  ProgramOutcome run(const std::string& example, const std::vector<std::string>& args) {
    ProgramOutcome o = run_program(program(example), args, env(), -1, m_limit);
    std::printf("--- %s stdout\n%s--- stderr\n%s", example.c_str(), o.out.c_str(), o.err.c_str());
    return o;
  }
  std::vector<std::string> env() const {
    return {"GPUIPC_RUNTIME_DIR=" + m_dir.file("run"), "GPUIPC_LOG=warn", "GPUIPC_DAEMON=" + build_bin_dir() + "/gpuipcd"};
  }
  /// What `gpuipc ls` lists in this test's broker.
  std::string listed() const { return run_program(build_bin_dir() + "/gpuipc", {"ls"}, env()).out; }
  void TearDown() override { run_program(build_bin_dir() + "/gpuipc", {"daemon", "--stop"}, env()); }

  TempDir m_dir{"gpuipc-examples"};

 private:
  std::chrono::milliseconds m_limit;
};

}  // namespace gpuipc::test
