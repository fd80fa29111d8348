// The `faults` suite: what happens to shared GPU memory when a process dies at a bad moment. Scenarios: the
// creator of a segment is killed; an opener is killed; a writer is killed in the middle of writing a large segment
// with kernels; a channel producer is killed after publishing but before its stream wrote the data; the broker
// (gpuipcd) is killed. Each outcome is checked, not assumed: does the memory survive (a survivor or a fresh process
// maps it and runs a kernel on it), is the data intact (a pattern verified on the GPU), is anything leaked (broker
// fds from /proc/<broker>/fd, free GPU memory seen by a fresh worker, the broker's segment list), does anyone hang
// (every wait is bounded; the time to the outcome is recorded).
//
// Everything runs against a private broker: workers set GPUIPC_RUNTIME_DIR to a fresh directory and GPUIPC_DAEMON
// to the gpuipcd next to this executable, so killing "the daemon" kills only the suite's own broker. The suite
// stops that broker and removes the directory at the end.
#include <dirent.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "bench.hpp"
#include "core/client.hpp"
#include "cuda/context.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/vmm.hpp"
#include "faults.hpp"
#include "gpuipc/segment.hpp"
#include "os/process.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/stream.hpp"

namespace gpuipc::bench::faults {

json Outcome::to_json() const {
  json j{{"scenario", scenario},       {"memory_survives", memory_survives}, {"data_intact", data_intact},
         {"leaked", leaked},           {"hang", hang},                       {"passed", passed()},
         {"time_to_outcome_ms", time_to_outcome_ms}, {"detail", fmt::format("{}", fmt::join(detail, "; "))}};
  for (const auto& [k, v] : extra.items()) j[k] = v;
  return j;
}

json finish(Worker& w, Outcome& o, const char* who, std::chrono::seconds timeout) {
  json r = join_worker(w, timeout);
  if (r.contains("error")) {
    const std::string e = r["error"].is_string() ? r["error"].get<std::string>() : r["error"].dump();
    if (e.find("did not finish") != std::string::npos || e.find("timed out") != std::string::npos) o.hang = true;
    o.detail.push_back(fmt::format("{}: {}", who, e));
  }
  return r;
}

void sigkill(Worker& w) {
  if (w.child.pid > 0) ::kill(w.child.pid, SIGKILL);
}

void kill_and_reap(Worker& w) {
  sigkill(w);
  [[maybe_unused]] const json ignored = join_worker(w, std::chrono::seconds(30));
}

std::string seg_name(const char* what) { return fmt::format("faults-{}-{}", what, now_ns() % 1000000); }

namespace {

/// Free GPU memory may differ by this much between two fresh workers without anything leaking.
constexpr std::int64_t kGpuTolerance = 64LL << 20;

/// Runs one scenario of the table (KillScenario says how).
Outcome run_kill(const Env& env, const KillScenario& s, std::size_t bytes) {
  Outcome o;
  o.scenario = s.name;
  const SyncPage page;
  Sync* sync = page.get();
  const Scene scene{sync, seg_name(s.tag), bytes};
  std::vector<Worker> workers;
  for (const auto& [role, body] : s.workers) {
    workers.push_back(spawn_synced(sync, [&scene, &body] { return body(scene); }, env));
  }
  if (!wait_for(sync, [&] { return s.ready(*sync); }, std::chrono::seconds(60))) {
    for (auto& w : workers) sigkill(w);
    for (std::size_t i = 0; i < workers.size(); ++i) finish(workers[i], o, s.workers[i].first);
    o.detail.push_back(workers.size() == 1 ? fmt::format("the {} did not get ready", s.workers[0].first)
                                           : std::string("the workers did not get ready"));
    return o;
  }
  if (s.settle.count() > 0) std::this_thread::sleep_for(s.settle);
  const auto t_kill = Clock::now();
  kill_and_reap(workers[s.victim]);
  sync->killed = 1;
  json report;
  if (s.judge) {
    auto judge = spawn_synced(sync, [&] { return s.judge(scene); }, env);
    report = finish(judge, o, s.judge_role);
  } else {
    const std::size_t survivor = 1 - s.victim;
    report = finish(workers[survivor], o, s.workers[survivor].first);
  }
  if (!report.contains("error")) {
    o.time_to_outcome_ms = ms_since(t_kill);
    s.verdict(scene, report, o);
  }
  return o;
}

/// Open fds of `pid`, or -1 when /proc does not show them.
int count_fds(pid_t pid) {
  if (pid <= 0) return -1;
  DIR* d = ::opendir(fmt::format("/proc/{}/fd", pid).c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n;
}

/// What a fresh worker sees: the broker's pid (connecting starts one if none runs), its segment list, free GPU memory.
struct Probe {
  bool ok = false;
  std::string error;
  pid_t broker = -1;
  json segments = json::array();
  std::int64_t gpu_free = -1;
};

Probe probe(const Env& env) {
  const SyncPage page;
  auto w = spawn_synced(page.get(), [] {
    const auto pid = core::BrokerClient::instance().broker_pid();
    json segs = json::array();
    for (const auto& s : Segment::list()) {
      segs.push_back({{"name", s.name}, {"id", s.id}, {"references", s.references}, {"mappers", s.mapper_pids}});
    }
    const auto mem = cuda::memory_info(0);
    return json{{"broker", pid}, {"segments", segs}, {"gpu_free", mem.free}};
  }, env);
  const json r = join_worker(w, std::chrono::seconds(60));
  Probe p;
  if (r.contains("error")) {
    p.error = r["error"].dump();
    return p;
  }
  p.ok = true;
  p.broker = static_cast<pid_t>(r["broker"].get<std::uint32_t>());
  p.segments = r["segments"];
  p.gpu_free = r["gpu_free"].get<std::int64_t>();
  return p;
}

/// The state a scenario must leave behind.
struct Baseline {
  int broker_fds = -1;
  std::int64_t gpu_free = -1;
};

/// Broker fds once the connections of exited workers are closed: polls until at most `target`, up to 3 s.
int settled_fds(pid_t broker, int target) {
  int n = count_fds(broker);
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while (n > target && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    n = count_fds(broker);
  }
  return n;
}

/// After a scenario (all its workers gone): is anything left? Fills `leaked` and appends to `detail`.
struct LeakReport {
  bool leaked = false;
  bool checked = false;
  std::string detail;
  pid_t broker = -1;
};

LeakReport check_leaks(const Env& env, const Baseline& base) {
  LeakReport out;
  Probe p;
  std::int64_t drop = 0;
  // GPU memory of a dead process is returned when the driver tears its context down: give it a moment.
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    p = probe(env);
    if (!p.ok) break;
    drop = base.gpu_free - p.gpu_free;
    if (drop <= kGpuTolerance && p.segments.empty()) break;
  }
  if (!p.ok) {
    out.leaked = true;
    out.detail = fmt::format("leak check failed: {}", p.error);
    return out;
  }
  out.checked = true;
  out.broker = p.broker;
  const int fds = settled_fds(p.broker, base.broker_fds);
  std::vector<std::string> what;
  if (!p.segments.empty()) what.push_back(fmt::format("segments still registered: {}", p.segments.dump()));
  if (drop > kGpuTolerance) what.push_back(fmt::format("{} MiB of GPU memory not returned", drop >> 20));
  if (fds >= 0 && base.broker_fds >= 0 && fds > base.broker_fds) {
    what.push_back(fmt::format("broker holds {} fds, {} before", fds, base.broker_fds));
  }
  out.leaked = !what.empty();
  out.detail = out.leaked ? fmt::format("LEAK: {}", fmt::join(what, "; "))
                          : fmt::format("no leak (segments 0, GPU free within {} MiB of the start ({:+.0f} MiB), "
                                        "broker fds {}{})",
                                        kGpuTolerance >> 20, static_cast<double>(-drop) / (1 << 20),
                                        fds >= 0 ? std::to_string(fds) : std::string("unreadable"),
                                        fds >= 0 ? fmt::format(" vs {} before", base.broker_fds) : "");
  return out;
}

/// Stops the suite's broker (it is ours: started in our private runtime directory).
void stop_broker(pid_t pid) {
  if (pid <= 0) return;
  try {
    auto fd = os::pidfd_open(pid);
    ::kill(pid, SIGTERM);
    if (!os::pidfd_wait_exit(fd.get(), 3000)) {
      ::kill(pid, SIGKILL);
      os::pidfd_wait_exit(fd.get(), 3000);
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): already gone
  }
}

Result run(const Options& o, const DeviceMeta& /*meta*/) {
  Result r;
  r.mps = false;
  const std::size_t bytes = o.quick ? (256ULL << 20) : (1ULL << 30);

  namespace fs = std::filesystem;
  const std::string exe = os::self_exe_path();
  std::string daemon = exe.empty() ? std::string() : (fs::path(exe).parent_path() / "gpuipcd").string();
  if (daemon.empty() || !fs::exists(daemon)) {
    r.notes.push_back(fmt::format("gpuipcd not found next to {} ({}): build the gpuipcd target; no scenario ran",
                                  exe.empty() ? "this program" : exe, daemon));
    r.metrics["faults_scenarios"] = 0;
    r.metrics["faults_passed"] = 0;
    return r;
  }
  char tmpl[] = "/tmp/gpuipc-faults-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    r.notes.push_back("mkdtemp failed: no private runtime directory; no scenario ran");
    return r;
  }
  const std::string dir = tmpl;
  const Env env{{"GPUIPC_RUNTIME_DIR", dir}, {"GPUIPC_DAEMON", daemon}, {"GPUIPC_IDLE_TIMEOUT_MS", "600000"}};

  progress(o, "faults: starting a private broker");
  pid_t broker = -1;
  Baseline base;
  {
    const Probe p0 = probe(env);  // starts the broker
    const Probe p1 = probe(env);  // the steady state, once the first probe's connection is gone
    if (!p0.ok || !p1.ok) {
      r.notes.push_back(fmt::format("faults: the private broker did not answer: {}", p0.ok ? p1.error : p0.error));
      stop_broker(p0.ok ? p0.broker : -1);
      std::error_code ec;
      fs::remove_all(dir, ec);
      return r;
    }
    broker = p1.broker;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    base.broker_fds = count_fds(broker);
    base.gpu_free = p1.gpu_free;
    r.samples.push_back({{"what", "baseline"}, {"broker_pid", broker}, {"broker_fds", base.broker_fds},
                         {"gpu_free_mib", base.gpu_free >> 20}, {"runtime_dir", dir}, {"daemon", daemon}});
    if (base.broker_fds < 0) r.notes.push_back("faults: /proc/<broker>/fd is not readable here: fd leaks unchecked");
  }

  std::vector<Outcome> outcomes;
  auto run_one = [&](const char* label, const std::function<Outcome()>& f) {
    progress(o, fmt::format("faults: {}", label));
    const auto t0 = Clock::now();
    Outcome out;
    try {
      out = f();
    } catch (const std::exception& e) {
      out.scenario = label;
      out.detail.push_back(fmt::format("the scenario failed: {}", e.what()));
    }
    const auto leaks = check_leaks(env, base);
    if (leaks.broker > 0) broker = leaks.broker;
    out.leaked = leaks.leaked;
    out.detail.push_back(leaks.detail);
    out.extra["scenario_s"] = ms_since(t0) / 1e3;
    outcomes.push_back(std::move(out));
  };
  for (const KillScenario& s : worker_kills()) {
    run_one(s.name, [&] { return run_kill(env, s, s.bytes != 0 ? s.bytes : bytes); });
  }
  run_one("kill_daemon", [&] {
    // The fresh broker's idle fd count is the baseline's: compared by check_leaks as for the others.
    pid_t fresh = -1;
    auto out = kill_daemon(env, bytes, &fresh);
    if (fresh > 0) broker = fresh;
    return out;
  });

  stop_broker(broker);
  std::error_code ec;
  fs::remove_all(dir, ec);

  int passed = 0;
  for (const auto& out : outcomes) {
    r.samples.push_back(out.to_json());
    r.metrics[fmt::format("faults_{}_ok", out.scenario)] = out.passed() ? 1 : 0;
    r.metrics[fmt::format("faults_{}_ms", out.scenario)] =
        out.time_to_outcome_ms >= 0 ? json(out.time_to_outcome_ms) : json(nullptr);
    passed += out.passed() ? 1 : 0;
    r.notes.push_back(fmt::format("{}: {} (memory survives: {}, data intact: {}, leaked: {}, hang: {}{}) {}",
                                  out.scenario, out.passed() ? "PASS" : "FAIL", out.memory_survives ? "yes" : "no",
                                  out.data_intact ? "yes" : "no", out.leaked ? "YES" : "no", out.hang ? "YES" : "no",
                                  out.time_to_outcome_ms >= 0 ? fmt::format(", {:.0f} ms to the outcome", out.time_to_outcome_ms)
                                                              : std::string(),
                                  fmt::join(out.detail, "; ")));
  }
  r.metrics["faults_scenarios"] = outcomes.size();
  r.metrics["faults_passed"] = passed;
  return r;
}

}  // namespace
}  // namespace gpuipc::bench::faults

namespace gpuipc::bench {
namespace {

GPUIPC_BENCH_SUITE(Suite{.name = "faults",
                         .description = "kill the creator, an opener, a writer mid-write, a channel producer "
                                        "mid-publish, the broker: does the memory survive, is the data intact, is "
                                        "anything leaked, does anyone hang",
                         .needs_gpu = true,
                         .run = faults::run});

}  // namespace
}  // namespace gpuipc::bench
