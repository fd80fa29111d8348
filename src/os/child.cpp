#include "os/child.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <exception>

#include "base/errors.hpp"

namespace gpuipc::os {
namespace {

void write_all(int fd, const std::string& s) noexcept {
  std::size_t off = 0;
  while (off < s.size()) {
    const auto n = ::write(fd, s.data() + off, s.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    off += static_cast<std::size_t>(n);
  }
}

}  // namespace

ReportingChild fork_reporting(const std::function<std::string()>& body,
                              const std::vector<std::pair<std::string, std::string>>& env) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw_system("pipe2", "report pipe of a child process");
  UniqueFd read_end(fds[0]);
  UniqueFd write_end(fds[1]);
  const pid_t pid = ::fork();
  if (pid < 0) throw_system("fork", "child process");
  if (pid == 0) {
    read_end.reset();
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    int code = 0;
    std::string out;
    try {
      out = body();
    } catch (const std::exception& e) {
      out = std::string("error: ") + e.what();
      code = 1;
    } catch (...) {
      out = "error: unknown exception";
      code = 1;
    }
    write_all(write_end.get(), out);
    ::_exit(code);
  }
  return ReportingChild{pid, std::move(read_end)};
}

ChildReport join_reporting(ReportingChild& child, std::chrono::milliseconds timeout) {
  ChildReport r;
  if (child.pid < 0) return r;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool expired = false;
  while (child.report) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      expired = true;
      break;
    }
    pollfd p{child.report.get(), POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (n < 0 && errno != EINTR) break;
    if (n <= 0) continue;
    char buf[8192];
    const auto got = ::read(child.report.get(), buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    r.text.append(buf, static_cast<std::size_t>(got));
  }
  child.report.reset();
  if (expired) ::kill(child.pid, SIGKILL);
  while (::waitpid(child.pid, &r.wait_status, 0) < 0 && errno == EINTR) {
  }
  r.finished = !expired;
  child.pid = -1;
  return r;
}

}  // namespace gpuipc::os
