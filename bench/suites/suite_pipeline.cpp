// Suite "pipeline" (issue 14: "the pipeline reaches at least 90% of the frame rate of the same three kernels in one
// process under MPS, and reports the same without MPS"). It runs the C++ example as a user does:
// gpuipc-example-pipeline (examples/cpp/pipeline.cu), installed beside gpuipc, with --compare: render -> post -> sink
// in three processes over two 4-slot device channels, the sink checking every frame with a kernel, then the same three
// kernels in one process on one stream. Each run reports both frame rates; the suite takes the medians of its runs,
// without MPS and under a private MPS control daemon. The CLI stays free of CUDA: the example runs as a child program.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdlib.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "bench.hpp"
#include "gpuipc/error.hpp"
#include "mps.hpp"
#include "os/process.hpp"
#include "programs.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

constexpr int kWidth = 1920, kHeight = 1080;  // 8 MiB RGBA frames: the example's default on a GPU
/// For a stuck run only: a run is four processes starting CUDA (three stages, then the one-process run) and the
/// frames through each, seconds at most on an H100.
constexpr std::chrono::seconds kRunLimit{300};
constexpr double kTarget = 0.9;

/// What one run of the example printed: both frame rates, or why there are none.
struct Run {
  double pipeline_fps = 0, one_process_fps = 0;
  std::string error, log;
};

/// The number in group 1 of the first match of `re` in `text`, or 0.
double number(const std::string& text, const std::regex& re) {
  std::smatch m;
  return std::regex_search(text, m, re) ? std::strtod(m[1].str().c_str(), nullptr) : 0.0;
}

Run run_once(const std::string& example, const Env& env, int frames, const std::string& name) {
  const ProgramRun p =
      run_program({example, "--kind", "device", "--frames", std::to_string(frames), "--width", std::to_string(kWidth),
                   "--height", std::to_string(kHeight), "--ppm-every", "0", "--compare", "--name", name},
                  env, kRunLimit);
  Run run;
  run.pipeline_fps = number(p.output, std::regex(R"(\nsink: ([0-9.]+) frames/s)"));
  run.one_process_fps = number(p.output, std::regex(R"(\none process: \d+ frames, ([0-9.]+) frames/s)"));
  if (!p.error.empty()) {
    run.error = p.error;
  } else if (run.pipeline_fps <= 0 || run.one_process_fps <= 0) {
    run.error = "no frame rate in its output";
  }
  if (!run.error.empty()) run.log = tail(p.output, 4000);
  return run;
}

/// A broker of the suite's own for the example's processes: a runtime directory under /tmp, where the first stage
/// starts gpuipcd (the one beside gpuipc); on destruction `gpuipc daemon --stop` and the directory removed.
class PrivateBroker {
 public:
  explicit PrivateBroker(std::filesystem::path bin) : m_bin(std::move(bin)) {
    char tmpl[] = "/tmp/gpuipc-bench-pipeline-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw Error(ErrorCode::System, "mkdtemp failed", "mkdtemp", errno);
    m_dir = tmpl;
  }
  ~PrivateBroker() {
    run_program({(m_bin / "gpuipc").string(), "daemon", "--stop"}, env(), std::chrono::seconds(30));
    std::error_code ec;
    std::filesystem::remove_all(m_dir, ec);
  }
  PrivateBroker(const PrivateBroker&) = delete;
  PrivateBroker& operator=(const PrivateBroker&) = delete;
  Env env() const {
    return {{"GPUIPC_RUNTIME_DIR", m_dir + "/run"},
            {"GPUIPC_DAEMON", (m_bin / "gpuipcd").string()},
            {"GPUIPC_LOG", "warn"}};
  }

 private:
  std::filesystem::path m_bin;
  std::string m_dir;
};

double median(std::vector<double> v) { return v.empty() ? 0.0 : summarize(std::move(v)).median; }

/// `reps` runs with `env`; metrics, samples and notes named with `suffix` ("" or "_mps").
void measure(Result& r, const Options& o, const std::string& example, const Env& env, int frames, int reps,
             const std::string& suffix) {
  const std::string where = suffix.empty() ? "without MPS" : "under MPS";
  std::vector<double> pipeline, one, ratio;
  for (int i = 0; i < reps; ++i) {
    progress(o, fmt::format("pipeline: run {} of {} {}", i + 1, reps, where));
    const Run run = run_once(example, env, frames, fmt::format("bench-pipeline{}-{}", suffix, i));
    if (!run.error.empty()) {
      r.notes.push_back(fmt::format("run {} {} failed: {} (its output is in samples)", i + 1, where, run.error));
      r.samples.push_back({{"what", "failed_run" + suffix}, {"run", i + 1}, {"error", run.error}, {"log", run.log}});
      continue;
    }
    pipeline.push_back(run.pipeline_fps);
    one.push_back(run.one_process_fps);
    ratio.push_back(run.pipeline_fps / run.one_process_fps);
  }
  if (pipeline.empty()) {
    for (const char* m : {"pipeline_fps", "one_process_fps", "pipeline_ratio"}) r.metrics[m + suffix] = nullptr;
    return;
  }
  const double p = median(pipeline), q = median(one);
  r.metrics["pipeline_fps" + suffix] = p;
  r.metrics["one_process_fps" + suffix] = q;
  r.metrics["pipeline_ratio" + suffix] = p / q;
  r.samples.push_back(sample("pipeline_fps" + suffix, "frames/s", pipeline));
  r.samples.push_back(sample("one_process_fps" + suffix, "frames/s", one));
  r.samples.push_back(sample("pipeline_ratio" + suffix, "ratio", ratio, {{"of", "each run's two frame rates"}}));
  r.notes.push_back(fmt::format(
      "{}: the pipeline {:.0f} frames/s, the same kernels in one process {:.0f} frames/s: {:.3f} (medians of {} "
      "run{}; each run's ratio: {:.3f})",
      where, p, q, p / q, pipeline.size(), pipeline.size() == 1 ? "" : "s", fmt::join(ratio, ", ")));
}

Result run(const Options& o, const DeviceMeta& meta) {
  namespace fs = std::filesystem;
  Result r;
  r.mps = meta.mps;
  const fs::path bin = fs::path(os::self_exe_path()).parent_path();
  const std::string example = (bin / "gpuipc-example-pipeline").string();
  if (!fs::exists(example)) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} not found (the examples are built into the folder of gpuipc): build them with "
                            "`cmake --build build --target gpuipc-examples`",
                            example),
                "bench pipeline");
  }
  const int frames = o.quick ? 3000 : 20000;
  const int reps = o.quick ? 1 : 3;

  const PrivateBroker broker(bin);
  Env env = broker.env();
  // One GPU, as the one-process run uses: with two, the example would run post on the second.
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");  // NOLINT(concurrency-mt-unsafe): no threads yet
  if (visible == nullptr) env.emplace_back("CUDA_VISIBLE_DEVICES", "0");
  r.samples.push_back({{"what", "setup"},
                       {"example", example},
                       {"frames", frames},
                       {"width", kWidth},
                       {"height", kHeight},
                       {"runs", reps},
                       {"slots", 4},
                       {"cuda_visible_devices", visible != nullptr ? visible : "0"}});

  if (meta.mps) {
    // The machine's own MPS serves every process: there is no run without it, and it is the runs' MPS.
    r.notes.push_back(
        "MPS is already active for this machine's processes: every run is under it (_mps metrics); "
        "no runs without MPS and no private daemon");
    measure(r, o, example, env, frames, reps, "_mps");
  } else {
    measure(r, o, example, env, frames, reps, "");
    progress(o, "pipeline: starting a private MPS control daemon");
    run_under_mps(r.notes, "_mps metrics", [&](const Env& mps_env) {
      Env with_mps = env;
      with_mps.insert(with_mps.end(), mps_env.begin(), mps_env.end());
      measure(r, o, example, with_mps, frames, reps, "_mps");
    });
  }

  r.notes.insert(r.notes.begin(),
                 fmt::format("each run: gpuipc-example-pipeline --kind device --frames {} --width {} --height {} "
                             "--ppm-every 0 --compare. The pipeline's rate is the sink's, from its first frame to the "
                             "GPU finishing the last frame's check; the one-process rate times the same kernels on "
                             "one stream after 20 frames of warm-up, to a final synchronize",
                             frames, kWidth, kHeight));
  const json mps_ratio = r.metrics.value("pipeline_ratio_mps", json());
  r.notes.push_back(
      mps_ratio.is_number()
          ? fmt::format("target pipeline_ratio_mps >= {}: {} ({:.3f})", kTarget,
                        mps_ratio.get<double>() >= kTarget ? "met" : "MISSED", mps_ratio.get<double>())
          : fmt::format("target pipeline_ratio_mps >= {}: not measured here (no MPS, or every run under it failed)",
                        kTarget));
  return r;
}

GPUIPC_BENCH_SUITE(Suite{"pipeline",
                         "the pipeline example (render -> post -> sink, three processes, device channels) beside the "
                         "same three kernels in one process; with and without MPS",
                         true, run});

}  // namespace
}  // namespace gpuipc::bench
