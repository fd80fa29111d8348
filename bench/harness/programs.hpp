// Programs run by the suites, each with a time limit and its output collected: any program (run_program; e.g. the
// C++ examples installed beside gpuipc), and Python scripts (baselines such as bench/analysis/baselines/handoff.py, gpuipc's
// own Python benchmarks), found in the source tree, run with the benchmark's interpreter, their one-line JSON result
// parsed.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace gpuipc::bench {

/// What a program run by run_program did.
struct ProgramRun {
  int status = -1;     ///< its exit status (128 + signal); 124 or 137 when it ran out of time
  std::string output;  ///< stdout and stderr, merged
  std::string error;   ///< empty when it exited with 0, else what went wrong, in words
};

/// Runs `argv` (argv[0]: a path, or a name looked up on PATH) with `env` added to this process's environment,
/// stderr merged into stdout. After `limit` it and every process it started in its process group are killed
/// (coreutils' timeout). Never throws.
ProgramRun run_program(const std::vector<std::string>& argv,
                       const std::vector<std::pair<std::string, std::string>>& env, std::chrono::seconds limit);

/// The interpreter Python benchmarks run with: $GPUIPC_BENCH_PYTHON, else `python3` from PATH.
std::string python_interpreter();

/// The absolute path of `relative` (e.g. "bench/analysis/baselines/handoff.py"), looked up under the source tree of
/// this binary (<build>/bin/../..: the scripts of the commit it records) and then the current directory; empty when
/// it is in neither.
std::string find_script(const std::string& relative);

/// Runs `python_interpreter() <script> <args>` (stderr merged into stdout), killed after `limit`. Its result is the
/// last line that starts with {"impl": that object, with "error" added when the exit status is not 0. Never
/// throws: a failure comes back as {"error": why, "log": the tail of the output} (the log is kept with any error).
nlohmann::json run_python_json(const std::string& relative_script, const std::string& args,
                               std::chrono::seconds limit = std::chrono::seconds(600));

/// The last `n` characters of `s` (all of it when shorter): a log's tail for a result file.
std::string tail(const std::string& s, std::size_t n);

}  // namespace gpuipc::bench
