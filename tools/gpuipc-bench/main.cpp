// gpuipc-bench, which `gpuipc bench SUITE...` runs: the benchmark suites (bench/) and their result files
// (docs/cli/bench.md). A program apart from the CLI because it links the benchmark library, which measures the
// layers themselves (gpuipc::internal), and the CLI links the public library only (docs/architecture.md#layers).
#include <fmt/format.h>

#include <algorithm>
#include <iostream>

#include "bench.hpp"
#include "cli.hpp"
#include "gpuipc/log.hpp"

namespace {

/// A path option that may not be empty (`--out-dir ''` named the filesystem root's files, and `--json ''` meant the
/// default file): "an empty path; give `what`".
CLI::Validator non_empty_path(const std::string& what) {
  return CLI::Validator(
      [what](std::string& s) -> std::string { return s.empty() ? "an empty path; give " + what : std::string(); },
      "PATH", "NonEmptyPath");
}

}  // namespace

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
  app.add_option("SUITE", names, "suites to run ('all' runs every one; 'list [SUITE...]' shows them)")->required();
  app.add_option("--json", json_path,
                 "write the result here (one suite only); default OUT_DIR/<suite>[-quick]-<device>-<date>.json")
      ->check(non_empty_path("a file, or leave --json out for the default file under --out-dir"));
  app.add_option("--out-dir", out_dir, "directory of result files")
      ->capture_default_str()
      ->check(non_empty_path("a directory (\".\" for this one), or leave --out-dir out for bench/results"));
  app.add_flag("--quick", quick, "fewer sizes and iterations");
  app.add_flag("--no-progress", no_progress, "no progress line on stderr");
  app.add_flag("-v,--verbose", verbose)->group("");  // gpuipc -v bench (tools/gpuipc/cmd_programs.cpp)
  app.callback([&] {
    if (verbose) set_log_level(LogLevel::Debug);
    const auto& all = bench::suites();
    const bool listing = names.front() == "list";
    std::vector<const bench::Suite*> chosen;
    for (std::size_t k = listing ? 1 : 0; k < names.size(); ++k) {
      const auto& n = names[k];
      if (n == "list") throw CLI::ValidationError("SUITE", "'list' comes first: gpuipc bench list [SUITE...]");
      bool found = false;
      for (const auto& s : all) {
        if (n == "all" || s.name == n) {
          chosen.push_back(&s);
          found = true;
        }
      }
      if (!found) throw CLI::ValidationError("SUITE", fmt::format("no suite '{}' (gpuipc bench list)", n));
    }
    if (listing) {  // the suites named, or every one
      if (names.size() == 1) {
        for (const auto& s : all) chosen.push_back(&s);
      }
      for (const auto* s : chosen) {
        std::cout << fmt::format("{:<12} {}{}\n", s->name, s->description, s->needs_gpu ? "" : " (host only)");
      }
      exit_code = kExitOk;
      return;
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
