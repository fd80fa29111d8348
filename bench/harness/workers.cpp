#include "workers.hpp"

#include "sync.hpp"

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

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
  for (auto& w : ws) out.push_back(join_worker(w, timeout));
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
