#include "served.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <csignal>

#include "gpuipc/error.hpp"
#include "os/child.hpp"
#include "os/socket.hpp"

namespace gpuipc::bench {

using json = nlohmann::json;

ServedWorker::ServedWorker(std::string suite, std::string role, const std::function<CommandHandler()>& make,
                           std::span<const int> close_in_child)
    : m_suite(std::move(suite)), m_role(std::move(role)) {
  auto [mine, theirs] = os::seqpacket_pair();
  const int parent_end = mine.get(), child_end = theirs.get();
  const pid_t parent = ::getpid();
  const std::string suite_name = m_suite;
  m_worker.emplace(spawn_worker([&]() -> json {
    if (!os::tie_to_parent(parent)) ::_exit(3);
    ::close(parent_end);
    for (int fd : close_in_child) ::close(fd);
    const pair::Link link(child_end, "parent process", suite_name);
    const CommandHandler handler = make();
    for (;;) {
      std::vector<os::UniqueFd> fds;
      const json in = link.receive(-1, &fds);
      const std::string cmd = in.value("cmd", std::string("?"));
      if (cmd == "quit") return {{"ok", true}};
      Reply out;
      try {
        out = handler(cmd, in, fds);
      } catch (const std::exception& e) {
        link.send({{"error", fmt::format("'{}' failed: {}", cmd, e.what())}});
        throw;
      }
      std::vector<int> raw;
      for (const auto& fd : out.fds) raw.push_back(fd.get());
      link.send(out.body, raw);
    }
  }));
  theirs.reset();
  m_sock = std::move(mine);
  m_link.emplace(m_sock.get(), m_role, m_suite);
}

ServedWorker::~ServedWorker() { kill(); }

json ServedWorker::call(const std::string& cmd, json args, std::span<const int> fds, std::vector<os::UniqueFd>* fds_out,
                        int timeout_ms) {
  if (!m_worker) throw Error(ErrorCode::Protocol, fmt::format("bench {}: the {} is not running", m_suite, m_role));
  args["cmd"] = cmd;
  try {
    m_link->send(args, fds);
    return m_link->receive(timeout_ms, fds_out);
  } catch (...) {
    kill();
    throw;
  }
}

void ServedWorker::finish() {
  if (!m_worker) return;
  m_link->send({{"cmd", "quit"}});
  auto report = join_worker(*m_worker, std::chrono::seconds(60));
  m_worker.reset();
  m_link.reset();
  m_sock.reset();
  if (report.contains("error")) {
    throw Error(ErrorCode::System,
                fmt::format("gpuipc bench {}: the {} failed: {}", m_suite, m_role, report["error"].dump()),
                "bench " + m_suite);
  }
}

void ServedWorker::kill() noexcept {
  if (!m_worker) return;
  m_link.reset();
  m_sock.reset();  // the worker's receive sees the socket close and it ends; join_worker kills it after 5 s
  join_worker(*m_worker, std::chrono::seconds(5));
  m_worker.reset();
}

}  // namespace gpuipc::bench
