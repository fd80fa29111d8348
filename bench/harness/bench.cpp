#include <fmt/chrono.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <stdexcept>

#include "bench.hpp"
#include "bench_commit.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "os/child.hpp"

namespace gpuipc::bench {
namespace {

std::vector<Suite>& registry() {
  static std::vector<Suite> r;
  return r;
}

std::string short_name_of(const std::string& full) {
  std::string lower;
  for (char c : full) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  for (const char* known : {"h200", "h100", "h800", "a100", "l40s", "l4", "b200", "gh200"}) {
    if (lower.find(known) != std::string::npos) return known;
  }
  std::string s;
  for (char c : lower) {
    if (std::isalnum(static_cast<unsigned char>(c))) s.push_back(c);
  }
  return s.empty() ? "gpu" : s.substr(0, 16);
}

}  // namespace

bool register_suite(Suite suite) {
  registry().push_back(std::move(suite));
  std::sort(registry().begin(), registry().end(), [](const Suite& a, const Suite& b) { return a.name < b.name; });
  return true;
}

const std::vector<Suite>& suites() { return registry(); }

DeviceMeta probe_device() {
  // In a child: the caller must not initialise CUDA before it forks its workers.
  DeviceMeta meta;
  auto child = os::fork_reporting([]() -> std::string {
    nlohmann::json j;
    std::string why;
    if (!cuda::driver_available(&why)) {
      j["error"] = why;
    } else {
      j["devices"] = cuda::device_count();
      if (j["devices"].get<int>() == 0) {
        j["error"] = "the CUDA driver reports no GPU";
      } else {
        const auto info = cuda::query_device(0, false);
        j["name"] = info.name;
        j["mps"] = info.mps_known && info.mps_enabled;
        j["driver"] = cuda::format_driver_version(cuda::driver_version());
      }
    }
    return j.dump();
  });
  const auto report = os::join_reporting(child, std::chrono::seconds(120));
  const std::string out = report.text.rfind("error: ", 0) == 0
                              ? nlohmann::json{{"error", report.text.substr(7)}}.dump()
                              : report.text;
  try {
    const auto j = nlohmann::json::parse(out);
    if (j.contains("error")) {
      meta.error = j["error"].get<std::string>();
      return meta;
    }
    meta.ok = true;
    meta.devices = j.value("devices", 0);
    meta.name = j.value("name", "");
    meta.mps = j.value("mps", false);
    meta.driver = j.value("driver", "");
    meta.short_name = short_name_of(meta.name);
    // nvidia-smi knows the full driver version (580.159.04); the driver API gives only its CUDA version.
    if (FILE* f = ::popen("nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null", "r")) {
      char line[128] = {};
      if (std::fgets(line, sizeof line, f) != nullptr) {
        std::string v(line);
        while (!v.empty() && (v.back() == '\n' || v.back() == '\r' || v.back() == ' ')) v.pop_back();
        if (!v.empty()) meta.driver = v;
      }
      ::pclose(f);
    }
  } catch (const std::exception& e) {
    meta.error = std::string("device probe failed: ") + e.what();
  }
  return meta;
}

Summary summarize(std::vector<double> v) {
  Summary s;
  s.n = v.size();
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    const double pos = q * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<std::size_t>(std::floor(pos));
    const auto hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
  };
  s.median = at(0.5);
  s.p99 = at(0.99);
  s.min = v.front();
  s.max = v.back();
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}

nlohmann::json to_json(const Summary& s) {
  return {{"median", s.median}, {"p99", s.p99}, {"min", s.min}, {"max", s.max}, {"mean", s.mean}, {"n", s.n}};
}

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double us_since(std::int64_t t0_ns) noexcept { return static_cast<double>(now_ns() - t0_ns) / 1e3; }

nlohmann::json values_json(const std::vector<double>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (double x : v) a.push_back(std::round(x * 1e3) / 1e3);
  return a;
}

std::vector<double> gbs_of(const std::vector<double>& ms, double bytes) {
  std::vector<double> v;
  for (double t : ms) v.push_back(t > 0 ? bytes / (t * 1e-3) / 1e9 : 0.0);
  return v;
}

std::vector<double> values_of(const nlohmann::json& j, const char* key) {
  std::vector<double> v;
  for (const auto& x : j.at(key)) v.push_back(x.get<double>());
  return v;
}

nlohmann::json sample(const std::string& name, const std::string& unit, const std::vector<double>& v,
                      nlohmann::json extra, bool keep_values) {
  nlohmann::json j = {{"name", name}, {"unit", unit}};
  j.update(to_json(summarize(v)));
  if (extra.is_object()) j.update(extra);
  if (keep_values) j["values"] = values_json(v);
  return j;
}

void progress(const Options& options, const std::string& what) {
  if (!options.progress) return;
  if (::isatty(STDERR_FILENO) != 0) {
    std::cerr << "\r\033[K" << what << std::flush;
  } else {
    std::cerr << what << "\n";
  }
}

std::string git_commit() { return GPUIPC_BENCH_GIT_COMMIT; }

void note_python_module(Result& r, const nlohmann::json& j) {
  if (!j.contains("gpuipc_commit") || !j["gpuipc_commit"].is_string()) return;
  const auto commit = j["gpuipc_commit"].get<std::string>();
  if (commit == r.python_commit) return;
  const bool first = r.python_commit.empty();
  r.python_commit = first ? commit : r.python_commit + "," + commit;
  if (commit != git_commit()) {
    r.notes.push_back(
        fmt::format("the gpuipc Python module measured ({}) was built from {}, this benchmark binary from "
                    "{}: the Python figures are of that build",
                    j.value("gpuipc_path", std::string("?")), commit, git_commit()));
  }
}

nlohmann::json measured_environment() {
  nlohmann::json env = nlohmann::json::object();
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    const auto name = kv.substr(0, eq);
    if (name.starts_with("GPUIPC_") || name == "CUDA_VISIBLE_DEVICES" || name.starts_with("CUDA_MPS_")) {
      env[std::string(name)] = std::string(kv.substr(eq + 1));
    }
  }
  return env;
}

std::string write_result(const std::string& suite, const Result& result, const DeviceMeta& meta,
                         const Options& options) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  std::string path = options.json_path;
  if (path.empty()) {
    // An empty out_dir would make the path absolute: the file would land in the filesystem's root.
    if (options.out_dir.empty()) {
      throw std::invalid_argument(fmt::format(
          "no place for the result file of suite {}: the result directory is empty; give --out-dir DIR or --json FILE",
          suite));
    }
    path = fmt::format("{}/{}{}-{}-{:%Y%m%d}.json", options.out_dir, suite, options.quick ? "-quick" : "",
                       meta.ok ? meta.short_name : "cpu", fmt::gmtime(t));
  }
  nlohmann::json doc{{"suite", suite},
                     {"commit", git_commit()},
                     {"device", meta.ok ? meta.name : "none"},
                     {"driver", meta.driver},
                     {"date", fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(t))},
                     {"mps", result.mps},
                     {"quick", options.quick},
                     {"environment", measured_environment()},
                     {"metrics", result.metrics},
                     {"notes", result.notes},
                     {"samples", result.samples}};
  if (!result.python_commit.empty()) doc["python_commit"] = result.python_commit;
  const auto dir = std::filesystem::path(path).parent_path();
  if (!dir.empty()) std::filesystem::create_directories(dir);
  // (replace: an environment variable or a path need not be UTF-8; the document still is)
  const std::string text = doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::ofstream out(path);
  out << text;
  out.flush();
  if (!out) throw std::runtime_error(fmt::format("cannot write the result file {}", path));
  return path;
}

}  // namespace gpuipc::bench
