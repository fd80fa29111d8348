// gpuipc-bench, which `gpuipc bench SUITE...` runs: the benchmark suites (bench/) and their result files
// (docs/cli/bench.md). A program apart from the CLI because it links the benchmark library, which measures the
// layers themselves (gpuipc::internal), and the CLI links the public library only (docs/architecture.md#layers).
#include <fmt/format.h>

#include <algorithm>
#include <iostream>

#include "bench.hpp"
#include "cli.hpp"
#include "gpuipc/log.hpp"

int main(int argc, char** argv) {
  using namespace gpuipc;
  using namespace gpuipc::cli;
  CLI::App app{"run benchmark suites: gpuipc bench list | all | SUITE...", "gpuipc bench"};
  int exit_code = kExitOk;
  std::vector<std::string> names;
  std::string json_path;
  std::string out_dir = "bench/results";
  bool quick = false;
  bool no_progress = false;
  bool verbose = false;
  app.add_option("SUITE", names, "suites to run ('list' shows them, 'all' runs every one)")->required();
  app.add_option("--json", json_path, "write the result here (one suite only); default OUT_DIR/<suite>[-quick]-<device>-<date>.json");
  app.add_option("--out-dir", out_dir, "directory of result files")->capture_default_str();
  app.add_flag("--quick", quick, "fewer sizes and iterations");
  app.add_flag("--no-progress", no_progress, "no progress line on stderr");
  app.add_flag("-v,--verbose", verbose)->group("");  // gpuipc -v bench (tools/gpuipc/cmd_programs.cpp)
  app.callback([&] {
    if (verbose) set_log_level(LogLevel::Debug);
    const auto& all = bench::suites();
    if (names.size() == 1 && names[0] == "list") {
      for (const auto& s : all) std::cout << fmt::format("{:<12} {}{}\n", s.name, s.description, s.needs_gpu ? "" : " (host only)");
      exit_code = kExitOk;
      return;
    }
    std::vector<const bench::Suite*> chosen;
    for (const auto& n : names) {
      bool found = false;
      for (const auto& s : all) {
        if (n == "all" || s.name == n) {
          chosen.push_back(&s);
          found = true;
        }
      }
      if (!found) throw CLI::ValidationError("SUITE", fmt::format("no suite '{}' (gpuipc bench list)", n));
    }
    if (!json_path.empty() && chosen.size() != 1) throw CLI::ValidationError("--json", "takes exactly one suite");
    const auto meta = bench::probe_device();
    bench::Options options{.quick = quick, .json_path = json_path, .out_dir = out_dir, .progress = !no_progress};
    exit_code = kExitOk;
    for (const auto* s : chosen) {
      if (s->needs_gpu && !meta.ok) {
        std::cerr << fmt::format("gpuipc bench {}: needs a GPU: {}\n", s->name, meta.error);
        exit_code = kExitNeedsGpu;
        continue;
      }
      if (s->needs_gpu && meta.devices < s->min_gpus) {
        std::cerr << fmt::format("gpuipc bench {}: skipped: needs {} GPUs, this machine shows {}\n", s->name,
                                 s->min_gpus, meta.devices);
        if (std::find(names.begin(), names.end(), "all") == names.end()) exit_code = kExitNeedsGpu;
        continue;
      }
      const auto t0 = bench::now_ns();
      auto result = s->run(options, meta);
      const auto path = bench::write_result(s->name, result, meta, options);
      if (options.progress) std::cerr << "\n";
      std::cout << fmt::format("{} ({:.1f} s) -> {}\n", s->name, static_cast<double>(bench::now_ns() - t0) / 1e9, path);
      for (const auto& [k, v] : result.metrics.items()) std::cout << fmt::format("  {:<40} {}\n", k, v.dump());
      for (const auto& note : result.notes) std::cout << "  note: " << note << "\n";
    }
  });
  return run(app, argc, argv, exit_code);
}
