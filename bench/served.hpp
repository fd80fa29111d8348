// A long-lived benchmark worker that answers commands: the parent (CUDA-free) forks it, then drives it with JSON
// commands over a socket while it forks other, short-lived workers (fresh consumer processes) beside it. Used by
// the pools suite, whose producer must outlive many fresh consumers.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "os/fd.hpp"
#include "pair.hpp"
#include "workers.hpp"

namespace gpuipc::bench {

/// Answers one command in the worker: (command, arguments) -> reply. An exception ends the worker and becomes
/// the error of the parent's call.
using CommandHandler = std::function<nlohmann::json(const std::string&, const nlohmann::json&)>;

class ServedWorker {
 public:
  /// Forks the worker: it calls `make` (in the child: it may initialise CUDA) and then answers commands with the
  /// handler it returned until "quit" or until the parent goes (it dies with the parent).
  ServedWorker(std::string suite, std::string role, const std::function<CommandHandler()>& make);
  ServedWorker(const ServedWorker&) = delete;
  ServedWorker& operator=(const ServedWorker&) = delete;
  /// Kills the worker if it was not finished.
  ~ServedWorker();

  /// Sends `cmd` with `args` and returns the reply. Throws Error naming the worker and its error when it failed,
  /// died (PeerDied) or did not answer within `timeout_ms` (Timeout; the worker is killed then).
  nlohmann::json call(const std::string& cmd, nlohmann::json args = nlohmann::json::object(),
                      int timeout_ms = 120'000);
  /// Asks the worker to quit and reaps it (bounded). Throws Error when it ended with an error.
  void finish();

 private:
  void stop(std::chrono::seconds wait) noexcept;

  std::string m_suite;
  std::string m_role;
  os::UniqueFd m_sock;
  std::optional<pair::Link> m_link;
  std::optional<Worker> m_worker;
};

}  // namespace gpuipc::bench
