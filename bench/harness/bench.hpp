// gpuipc's benchmark harness: suites register here; `gpuipc bench SUITE` runs them and writes the results
// contract of docs/benchmarks.md ({"suite", "commit", "device", "driver", "date", "mps", "metrics", "samples"}) to
// bench/results/<suite>[-quick]-<device>-<YYYYMMDD>.json. Every figure a suite reports comes with the baseline it is
// compared to, measured in the same run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace gpuipc::bench {

struct Options {
  bool quick = false;        ///< fewer iterations and sizes (CI-sized, < 1 min a suite)
  std::string json_path;     ///< where to write; empty: <suite>[-quick]-<device>-<date>.json under out_dir
  std::string out_dir = "bench/results";
  bool progress = true;      ///< a progress line on stderr when it is a terminal
};

/// The GPU as a fresh process sees it (asked in a forked child, so the caller stays free to fork CUDA workers).
struct DeviceMeta {
  bool ok = false;
  std::string error;       ///< why not, when !ok
  std::string name;        ///< "NVIDIA H100 80GB HBM3"
  std::string short_name;  ///< "h100"
  std::string driver;      ///< "580.159.04" when the driver says, else its CUDA version "13.0"
  bool mps = false;        ///< MPS active for this process's contexts
  int devices = 0;
};
DeviceMeta probe_device();

/// What a suite produced.
struct Result {
  nlohmann::json metrics = nlohmann::json::object();  ///< stable names: _us, _gbs, _ratio
  nlohmann::json samples = nlohmann::json::array();   ///< per-measurement detail (sizes, distributions, ...)
  std::vector<std::string> notes;                     ///< plain-language findings, printed and stored
  bool mps = false;
  std::string python_commit;  ///< the commit of the gpuipc Python module a script measured (note_python_module)
};

struct Suite {
  std::string name;
  std::string description;
  bool needs_gpu = true;
  std::function<Result(const Options&, const DeviceMeta&)> run;
  int min_gpus = 1;  ///< with fewer GPUs (DeviceMeta::devices) it is skipped, saying why
};

/// Registers a suite (call from a static initializer in the suite's file via GPUIPC_BENCH_SUITE).
bool register_suite(Suite suite);
/// Every registered suite, by name.
const std::vector<Suite>& suites();

/// Summary statistics of samples (microseconds or any unit).
struct Summary {
  double median = 0, p99 = 0, min = 0, max = 0, mean = 0;
  std::size_t n = 0;
};
Summary summarize(std::vector<double> samples);
nlohmann::json to_json(const Summary& s);

/// Monotonic clock in nanoseconds / microseconds as double.
std::int64_t now_ns() noexcept;
/// Microseconds from `t0_ns` (a now_ns() reading) to now.
double us_since(std::int64_t t0_ns) noexcept;

/// `v` as a JSON array, each value rounded to 1e-3 (the nanosecond, for microseconds): short messages and files.
nlohmann::json values_json(const std::vector<double>& v);
/// GB/s (1e9 bytes per second) of moving `bytes` in each of `ms` milliseconds (0 for a non-positive time).
std::vector<double> gbs_of(const std::vector<double>& ms, double bytes);
/// The numbers of array `j[key]`.
std::vector<double> values_of(const nlohmann::json& j, const char* key);
/// One `samples` entry: {"name", "unit", summary of `v`, `extra`'s keys, and (keep_values) "values"}.
nlohmann::json sample(const std::string& name, const std::string& unit, const std::vector<double>& v,
                      nlohmann::json extra = {}, bool keep_values = true);

/// A one-line progress report on stderr (only on a terminal, and only when enabled).
void progress(const Options& options, const std::string& what);

/// Records which gpuipc Python module script result `j` measured (its "gpuipc_commit", "gpuipc_path"): in
/// Result::python_commit, and as a note when it is not this binary's commit (a stale wheel, another checkout).
void note_python_module(Result& r, const nlohmann::json& j);

/// The environment variables that change what a suite measures (GPUIPC_*, CUDA_VISIBLE_DEVICES, CUDA_MPS_*), as
/// they are now: {name: value}.
nlohmann::json measured_environment();

/// Writes the result document for `suite`; returns the path written.
std::string write_result(const std::string& suite, const Result& result, const DeviceMeta& meta,
                         const Options& options);

/// The git commit this binary was built from (full sha, "-dirty" appended when the tree had changes), or "unknown".
std::string git_commit();

}  // namespace gpuipc::bench

#define GPUIPC_BENCH_CONCAT2(a, b) a##b
#define GPUIPC_BENCH_CONCAT(a, b) GPUIPC_BENCH_CONCAT2(a, b)
/// Registers a suite at static-initialization time.
#define GPUIPC_BENCH_SUITE(...) \
  static const bool GPUIPC_BENCH_CONCAT(gpuipc_bench_registered_, __LINE__) = ::gpuipc::bench::register_suite(__VA_ARGS__)
