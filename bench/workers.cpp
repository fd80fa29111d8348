#include "workers.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>

#include "gpuipc/error.hpp"

namespace gpuipc::bench {

Worker spawn_worker(const std::function<nlohmann::json()>& body,
                    const std::vector<std::pair<std::string, std::string>>& env) {
  int fds[2];
  if (::pipe(fds) != 0) throw Error(ErrorCode::System, "bench: pipe failed", "pipe", errno);
  const pid_t pid = ::fork();
  if (pid < 0) throw Error(ErrorCode::System, "bench: fork failed", "fork", errno);
  if (pid == 0) {
    ::close(fds[0]);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    nlohmann::json r;
    try {
      r = body();
    } catch (const std::exception& e) {
      r = nlohmann::json{{"error", e.what()}};
    }
    const std::string s = r.dump();
    std::size_t off = 0;
    while (off < s.size()) {
      const auto n = ::write(fds[1], s.data() + off, s.size() - off);
      if (n <= 0) break;
      off += static_cast<std::size_t>(n);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  return Worker{pid, fds[0]};
}

nlohmann::json join_worker(Worker& w, std::chrono::seconds timeout) {
  if (w.pid < 0) return {{"error", "no worker"}};
  std::string out;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool timed_out = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{w.fd, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 1000)));
    if (r < 0 && errno != EINTR) break;
    if (r <= 0) continue;
    char buf[8192];
    const auto n = ::read(w.fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(w.fd);
  if (timed_out) ::kill(w.pid, SIGKILL);
  int status = 0;
  ::waitpid(w.pid, &status, 0);
  w.pid = -1;
  if (timed_out) return {{"error", fmt::format("worker did not finish within {} s", timeout.count())}};
  try {
    return nlohmann::json::parse(out);
  } catch (const std::exception&) {
    return {{"error", fmt::format("worker ended without a report (wait status {:#x})", status)}};
  }
}

std::vector<nlohmann::json> run_workers(const std::vector<std::function<nlohmann::json()>>& bodies,
                                        const std::vector<std::pair<std::string, std::string>>& env,
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

SharedPage::SharedPage() : m_ptr(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0)) {
  if (m_ptr == MAP_FAILED) throw Error(ErrorCode::System, "bench: mmap failed", "mmap", errno);
}

SharedPage::~SharedPage() { ::munmap(m_ptr, 4096); }

}  // namespace gpuipc::bench
