// gpuipc bench SUITE: runs benchmark suites (bench/*.cpp) and writes their results (docs/cli/bench.md).
#include <fmt/format.h>

#include <iostream>

#include "commands.hpp"
#if defined(GPUIPC_HAVE_BENCH)
#include "bench.hpp"
#endif

namespace gpuipc::cli {

void register_bench(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench", "run benchmark suites: gpuipc bench list | all | SUITE...");
  static std::vector<std::string> names;
  static std::string json_path;
  static std::string out_dir = "bench/results";
  static bool quick = false;
  static bool no_progress = false;
  cmd->add_option("SUITE", names, "suites to run ('list' shows them, 'all' runs every one)")->required();
  cmd->add_option("--json", json_path, "write the result here (one suite only); default OUT_DIR/<suite>-<device>-<date>.json");
  cmd->add_option("--out-dir", out_dir, "directory of result files")->capture_default_str();
  cmd->add_flag("--quick", quick, "fewer sizes and iterations");
  cmd->add_flag("--no-progress", no_progress, "no progress line on stderr");
  cmd->callback([&exit_code] {
#if !defined(GPUIPC_HAVE_BENCH)
    std::cerr << "gpuipc bench: this build has no benchmarks (built without nvcc)\n";
    exit_code = kExitFailure;
#else
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
      const auto t0 = bench::now_ns();
      auto result = s->run(options, meta);
      const auto path = bench::write_result(s->name, result, meta, options);
      if (options.progress) std::cerr << "\n";
      std::cout << fmt::format("{} ({:.1f} s) -> {}\n", s->name, static_cast<double>(bench::now_ns() - t0) / 1e9, path);
      for (const auto& [k, v] : result.metrics.items()) std::cout << fmt::format("  {:<40} {}\n", k, v.dump());
      for (const auto& note : result.notes) std::cout << "  note: " << note << "\n";
    }
#endif
  });
}

}  // namespace gpuipc::cli
