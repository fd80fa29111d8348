#include "workers.hpp"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "sync.hpp"

#include "gpuipc/error.hpp"

namespace gpuipc::bench {

Worker spawn_worker(const std::function<nlohmann::json()>& body, const Env& env) {
  return Worker{os::fork_reporting([&] { return body().dump(); }, env)};
}

nlohmann::json join_worker(Worker& w, std::chrono::seconds timeout) {
  const auto r = os::join_reporting(w.child, timeout);
  if (!r.finished) return {{"error", fmt::format("worker did not finish within {} s", timeout.count())}};
  if (r.text.rfind("error: ", 0) == 0) return {{"error", r.text.substr(7)}};
  try {
    return nlohmann::json::parse(r.text);
  } catch (const std::exception&) {
    return {{"error", fmt::format("worker ended without a report (wait status {:#x})", r.wait_status)}};
  }
}

std::vector<nlohmann::json> run_workers(const std::vector<std::function<nlohmann::json()>>& bodies, const Env& env,
                                        std::chrono::seconds timeout) {
  std::vector<Worker> ws;
  ws.reserve(bodies.size());
  for (const auto& b : bodies) ws.push_back(spawn_worker(b, env));
  std::vector<nlohmann::json> out;
  // One limit for them all, not one each: two workers stuck on each other took twice the stated limit. (At least
  // a second each, so that one past the deadline is still asked for its report before it is killed.)
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& w : ws) {
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - std::chrono::steady_clock::now());
    out.push_back(join_worker(w, std::max(left, std::chrono::seconds(1))));
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i].contains("error")) {
      throw Error(ErrorCode::System, fmt::format("bench worker {} failed: {}", i, out[i]["error"].dump()), "bench");
    }
  }
  return out;
}

Worker spawn_synced(Sync* sync, std::function<nlohmann::json()> body, const Env& env) {
  return spawn_worker(
      [sync, body = std::move(body)]() -> nlohmann::json {
        try {
          return body();
        } catch (...) {
          sync->failed = 1;
          throw;
        }
      },
      env);
}

UnlinkOnExit::~UnlinkOnExit() {
  try {
    m_unlink();
  } catch (...) {  // NOLINT(bugprone-empty-catch): never made, or already gone; the worker's error is the one to report
  }
}

void check_status(Status st, const char* what) {
  if (st != Status::Ok) throw Error(ErrorCode::System, fmt::format("{}: {}", what, to_string(st)), "bench");
}

SharedPage::SharedPage() : m_ptr(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0)) {
  if (m_ptr == MAP_FAILED) throw Error(ErrorCode::System, "bench: mmap failed", "mmap", errno);
}

SharedPage::~SharedPage() { ::munmap(m_ptr, 4096); }

}  // namespace gpuipc::bench
