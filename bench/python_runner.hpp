// Python scripts run by the suites (baselines such as bench/baselines/handoff.py, gpuipc's own Python benchmarks):
// found in the source tree, run with the benchmark's interpreter, and their one-line JSON result parsed.
#pragma once

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>

namespace gpuipc::bench {

/// The interpreter Python benchmarks run with: $GPUIPC_BENCH_PYTHON, else `python3` from PATH.
std::string python_interpreter();

/// The absolute path of `relative` (e.g. "bench/baselines/handoff.py"), looked up under the current directory and
/// then the source tree of this binary (<build>/bin/../..); empty when it is in neither.
std::string find_script(const std::string& relative);

/// Runs `python_interpreter() <script> <args>` (stderr merged into stdout), killed after `limit`. Its result is the
/// last line that starts with {"impl": that object, with "error" added when the exit status is not 0. Never
/// throws: a failure comes back as {"error": why, "log": the tail of the output} (the log is kept with any error).
nlohmann::json run_python_json(const std::string& relative_script, const std::string& args,
                               std::chrono::seconds limit = std::chrono::seconds(600));

}  // namespace gpuipc::bench
