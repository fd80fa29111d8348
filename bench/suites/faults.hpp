// The faults suite (docs/benchmarks.md) in two files: suite_faults.cpp runs the scenarios against a private broker
// and checks what each left behind; faults_scenarios.cpp is the table of kill scenarios, each a set of workers, a
// victim and a verdict, run by one function (run_kill). What both share is declared here.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sync.hpp"
#include "workers.hpp"

namespace gpuipc::bench::faults {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

inline constexpr std::uint64_t kSeedOld = 0xfa17'0001;
inline constexpr std::uint64_t kSeedNewA = 0xfa17'0002;
inline constexpr std::uint64_t kSeedNewB = 0xfa17'0003;
/// How often a worker of this suite looks at a shared flag while it waits.
inline constexpr std::chrono::microseconds kPoll{200};

inline double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// One row of the table.
struct Outcome {
  std::string scenario;
  bool memory_survives = false;
  bool data_intact = false;
  bool leaked = true;
  bool hang = false;
  double time_to_outcome_ms = -1;
  std::vector<std::string> detail;
  json extra = json::object();
  bool extra_ok = true;  ///< scenario-specific expectations (e.g. a broker restarts)
  bool passed() const { return memory_survives && data_intact && !leaked && !hang && extra_ok; }
  json to_json() const;
};

/// What the workers of one scenario share: the flags, the name of the segment or channel, its size.
struct Scene {
  Sync* sync;
  std::string name;
  std::size_t bytes;
  /// In a worker: waits for `pred`, at most `timeout`; throws then (the worker never hangs).
  template <typename P>
  void await(P&& pred, const char* what, std::chrono::milliseconds timeout = std::chrono::seconds(60)) const {
    sync->await(std::forward<P>(pred), what, timeout, kPoll);
  }
};

using Body = std::function<json(const Scene&)>;

/// One kill scenario. Its workers start in order; once `ready` holds (at most 60 s), the worker `victim` is
/// SIGKILLed and reaped and sync->killed set. Then the judge reports: a fresh process running `judge` when it is
/// set, else the worker that is not the victim. `verdict` turns the judge's report into the outcome; a judge that
/// failed or hung is the outcome already (finish()).
struct KillScenario {
  const char* name = "";                                ///< the row's and the metrics' name: "kill_creator"
  const char* tag = "";                                 ///< in the segment's name
  std::size_t bytes = 0;                                ///< the segment's or the slot's size; 0: the suite's size
  std::vector<std::pair<const char*, Body>> workers{};  ///< {role, body}
  std::size_t victim = 0;                               ///< index into `workers`
  std::function<bool(const Sync&)> ready{};
  std::chrono::milliseconds settle{0};  ///< from ready to the kill (the victim's kernels get going)
  const char* judge_role = nullptr;
  Body judge{};
  std::function<void(const Scene&, const json& report, Outcome&)> verdict{};
};

/// The scenarios whose victim is a worker: the creator, an opener, a writer mid-write, a producer mid-publish.
std::vector<KillScenario> worker_kills();

/// The broker dies: existing mappings keep working, a new request starts a new broker (`*broker_out`).
Outcome kill_daemon(const Env& env, std::size_t bytes, pid_t* broker_out);

/// Joins a worker; a timeout counts as a hang, an error goes to the detail. Returns the report.
json finish(Worker& w, Outcome& o, const char* who, std::chrono::seconds timeout = std::chrono::seconds(60));
void sigkill(Worker& w);
/// Kills `w` with SIGKILL and reaps it (it reports nothing).
void kill_and_reap(Worker& w);
std::string seg_name(const char* what);

/// In the parent: waits for `pred`, at most `timeout`, giving up early when a worker reported failure.
template <typename P>
bool wait_for(const Sync* sync, P&& pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (sync != nullptr && sync->failed.load() != 0) return false;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  return true;
}

}  // namespace gpuipc::bench::faults
