// A long-lived benchmark worker that answers commands: the parent (CUDA-free) forks it, then drives it with JSON
// commands over a socket while it forks other, short-lived workers (fresh consumer processes) beside it. Used by
// the segments suite (an exporter and an importer, fds passed between them through the parent) and the pools suite
// (a producer that outlives many fresh consumers).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "os/fd.hpp"
#include "pair.hpp"
#include "workers.hpp"

namespace gpuipc::bench {

/// A command's answer: JSON with fds attached (sent with SCM_RIGHTS, then closed in the worker).
struct Reply {
  nlohmann::json body = nlohmann::json::object();
  std::vector<os::UniqueFd> fds;
};

/// Answers one command in the worker: (command, arguments, fds that came with it) -> reply. An exception ends the
/// worker and becomes the error of the parent's call.
using CommandHandler = std::function<Reply(const std::string&, const nlohmann::json&, std::vector<os::UniqueFd>&)>;

/// A CommandHandler over a fresh `H` (made in the worker): H::handle(cmd, args, fds) -> Reply.
template <class H>
std::function<CommandHandler()> serve() {
  return [] {
    auto h = std::make_shared<H>();
    return CommandHandler([h](const std::string& cmd, const nlohmann::json& args, std::vector<os::UniqueFd>& fds) {
      return h->handle(cmd, args, fds);
    });
  };
}

class ServedWorker {
 public:
  /// Forks the worker: it calls `make` (in the child: it may initialise CUDA) and then answers commands with the
  /// handler it returned until "quit" or until the parent goes (it dies with the parent). The child closes
  /// `close_in_child` first (other workers' sockets).
  ServedWorker(std::string suite, std::string role, const std::function<CommandHandler()>& make,
               std::span<const int> close_in_child = {});
  ServedWorker(const ServedWorker&) = delete;
  ServedWorker& operator=(const ServedWorker&) = delete;
  /// Kills the worker if it was not finished.
  ~ServedWorker();

  /// Sends `cmd` with `args` (and `fds`) and returns the reply's body; its fds go to `fds_out`. Throws Error naming
  /// the worker and its error when it failed, died (PeerDied) or did not answer within `timeout_ms` (Timeout); the
  /// worker is stopped then.
  nlohmann::json call(const std::string& cmd, nlohmann::json args = nlohmann::json::object(),
                      std::span<const int> fds = {}, std::vector<os::UniqueFd>* fds_out = nullptr,
                      int timeout_ms = 120'000);
  /// Asks the worker to quit and reaps it (bounded). Throws Error when it ended with an error.
  void finish();
  /// Closes the socket (the worker ends when it sees that) and reaps the worker, killing it after 5 s. No-op once
  /// finished.
  void kill() noexcept;
  /// The parent's end of the worker's socket (for close_in_child of later workers).
  int socket() const noexcept { return m_sock.get(); }

 private:
  std::string m_suite;
  std::string m_role;
  os::UniqueFd m_sock;
  std::optional<pair::Link> m_link;
  std::optional<Worker> m_worker;
};

}  // namespace gpuipc::bench
