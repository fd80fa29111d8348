// The gpuipc command-line tool: each subcommand registers itself on the CLI11 app.
// Front end only: parsing, printing and exit codes; the work is done by the library, and it includes only the
// public headers (include/gpuipc; tests/boundary checks it). `demo` and `bench` are programs of their own
// (tools/gpuipc-demo, tools/gpuipc-bench) that the CLI hands over to.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"

namespace gpuipc::cli {

/// Each register_* adds one subcommand whose callback runs the command and stores its exit code in `exit_code`.
void register_doctor(CLI::App& app, int& exit_code);
void register_daemon(CLI::App& app, int& exit_code);
void register_segments(CLI::App& app, int& exit_code);  // ls, stat, rm
void register_top(CLI::App& app, int& exit_code);
void register_demo(CLI::App& app, int& exit_code);   // hands over to gpuipc-demo
void register_bench(CLI::App& app, int& exit_code);  // hands over to gpuipc-bench
void register_watch(CLI::App& app, int& exit_code);  // who, watch
void register_mps(CLI::App& app, int& exit_code);    // mps start, stop, status, env

/// `j` as JSON text (`indent` as nlohmann::json::dump's). Strings that are not UTF-8 (a path or a variable from the
/// environment, a process name) are printed with U+FFFD in place of their bad bytes: the output stays JSON, and the
/// command its exit code (nlohmann's dump would throw).
inline std::string json_text(const nlohmann::json& j, int indent = -1) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

/// Replaces this process with gpuipc program `path` (found with gpuipc::program_path) run with `args`, and -v
/// first when this process logs at debug level (gpuipc -v). Returns only by throwing Error.
[[noreturn]] void hand_over(const std::string& path, const std::vector<std::string>& args);

}  // namespace gpuipc::cli
