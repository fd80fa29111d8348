// Forked benchmark workers: each runs a body in a fresh process (which may initialise CUDA; the parent never
// does) and reports one JSON object back through a pipe. Waits are bounded: a stuck worker is killed.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "gpuipc/error.hpp"
#include "os/child.hpp"

namespace gpuipc::bench {

/// Environment variables set in a worker before its body runs (e.g. CUDA_MPS_PIPE_DIRECTORY).
using Env = std::vector<std::pair<std::string, std::string>>;

struct Worker {
  os::ReportingChild child;
};

/// Forks a worker running `body`; an exception becomes {"error": what}. `env` entries are set in the child
/// before `body` runs (e.g. CUDA_MPS_PIPE_DIRECTORY).
Worker spawn_worker(const std::function<nlohmann::json()>& body, const Env& env = {});

/// Waits at most `timeout` for the worker's report and its exit; kills it on timeout. Never throws: failures come
/// back as {"error": ...}.
nlohmann::json join_worker(Worker& w, std::chrono::seconds timeout = std::chrono::seconds(300));

/// Runs workers to completion, `timeout` for them all (each still gets at least a second to report); throws
/// gpuipc::Error naming the first worker error.
std::vector<nlohmann::json> run_workers(const std::vector<std::function<nlohmann::json()>>& bodies,
                                        const Env& env = {},
                                        std::chrono::seconds timeout = std::chrono::seconds(300));

/// Calls `unlink` when the scope ends, however it ends: the names a measurement makes outlive the workers that made
/// them (and keep a device channel's or semaphore's GPU memory), so a worker that failed, making run_workers throw,
/// must not leave them behind. What `unlink` throws is dropped: a worker that failed early never made the name.
class UnlinkOnExit {
 public:
  explicit UnlinkOnExit(std::function<void()> unlink) : m_unlink(std::move(unlink)) {}
  ~UnlinkOnExit();
  UnlinkOnExit(const UnlinkOnExit&) = delete;
  UnlinkOnExit& operator=(const UnlinkOnExit&) = delete;

 private:
  std::function<void()> m_unlink;
};

/// In a worker: throws Error(System) "<what>: <status>" unless `st` is Ok.
void check_status(Status st, const char* what);

/// A page of memory shared with workers forked after it is made (MAP_SHARED | MAP_ANONYMOUS).
class SharedPage {
 public:
  SharedPage();
  ~SharedPage();
  SharedPage(const SharedPage&) = delete;
  SharedPage& operator=(const SharedPage&) = delete;
  template <typename T>
  T* as() const noexcept {
    return static_cast<T*>(m_ptr);
  }

 private:
  void* m_ptr;
};

}  // namespace gpuipc::bench
