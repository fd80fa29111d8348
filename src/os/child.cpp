#include "os/child.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <thread>

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

pid_t fork_child(const std::function<int()>& body, int threw_code) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw_system("fork", "child process");
  if (pid != 0) return pid;
  int code = threw_code;
  try {
    code = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child %d: uncaught exception: %s\n", static_cast<int>(::getpid()), e.what());
  } catch (...) {
    std::fprintf(stderr, "child %d: uncaught non-standard exception\n", static_cast<int>(::getpid()));
  }
  std::fflush(stderr);
  ::_exit(code);
}

ChildExit wait_child(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ChildExit r;
  for (;;) {
    const pid_t rc = ::waitpid(pid, &r.wait_status, WNOHANG);
    if (rc == pid) {
      r.finished = true;
      return r;
    }
    if (rc < 0 && errno != EINTR) throw_system("waitpid", "child process " + std::to_string(pid));
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::kill(pid, SIGKILL);
  while (::waitpid(pid, &r.wait_status, 0) < 0 && errno == EINTR) {
  }
  return r;
}

int exit_code(int wait_status) noexcept {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return -1;
}

bool tie_to_parent(pid_t parent) noexcept {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  return ::getppid() == parent;
}

ReportingChild fork_reporting(const std::function<std::string()>& body,
                              const std::vector<std::pair<std::string, std::string>>& env) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw_system("pipe2", "report pipe of a child process");
  UniqueFd read_end(fds[0]);
  UniqueFd write_end(fds[1]);
  const pid_t pid = fork_child(
      [&] {
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
        return code;
      },
      1);
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
