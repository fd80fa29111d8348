// gpuipc demo and gpuipc bench: the CLI hands them, with their arguments, to the programs that do them (gpuipc-demo,
// gpuipc-bench; docs/cli/demo.md, docs/cli/bench.md), which link what the CLI must not: the GPU kernels and the
// benchmark suites. The help of each is that program's (`gpuipc demo --help`).
#include <iostream>

#include "commands.hpp"
#include "gpuipc/log.hpp"
#include "gpuipc/programs.hpp"

namespace gpuipc::cli {
namespace {

/// A subcommand whose arguments, --help included, all go to the program that runs it.
CLI::App* add_handed_over(CLI::App& app, const char* name, const char* description) {
  auto* cmd = app.add_subcommand(name, description);
  cmd->prefix_command();
  cmd->set_help_flag();
  return cmd;
}

}  // namespace

void hand_over(const std::string& path, const std::vector<std::string>& args) {
  std::vector<std::string> argv{path};
  if (log_level() == LogLevel::Debug) argv.emplace_back("-v");
  argv.insert(argv.end(), args.begin(), args.end());
  std::cout.flush();
  exec_program(argv);
}

void register_demo(CLI::App& app, int& /*exit_code*/) {
  auto* cmd = add_handed_over(app, "demo", "stream frames between a producer and a consumer process through a channel");
  cmd->callback([cmd] {
    const std::string path = program_path("gpuipc-demo");
    if (path.empty()) throw Error(ErrorCode::NotFound, "gpuipc-demo is not next to gpuipc nor on PATH", "demo");
    hand_over(path, cmd->remaining());
  });
}

void register_bench(CLI::App& app, int& exit_code) {
  auto* cmd = add_handed_over(app, "bench", "run benchmark suites: gpuipc bench list | all | SUITE...");
  cmd->callback([cmd, &exit_code] {
    const std::string path = program_path("gpuipc-bench");
    if (path.empty()) {
      std::cerr << "gpuipc bench: this build has no benchmarks (built without nvcc)\n";
      exit_code = kExitFailure;
      return;
    }
    hand_over(path, cmd->remaining());
  });
}

}  // namespace gpuipc::cli
