// Helpers shared by the C++ examples, not part of gpuipc: command-line options, CUDA error checks, clocks,
// percentiles, and starting the other example programs that sit in the same folder.
#pragma once

#include <cuda_runtime.h>
#include <fcntl.h>
#include <limits.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace example {

/// Exits with the failing CUDA call, where it is, and the runtime's message.
#define CUDA_CHECK(call) ::example::cuda_check((call), #call, __FILE__, __LINE__)
inline void cuda_check(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "%s:%d: %s failed: %s\n", file, line, call, cudaGetErrorString(e));
  std::exit(2);
}

/// Options "--name value" and flags "--name"; anything not in `known` is refused with the usage text.
class Args {
 public:
  Args(int argc, char** argv, std::string_view usage, std::initializer_list<std::string_view> known)
      : m_args(argv + 1, argv + argc) {
    for (const std::string& a : m_args) {
      if (a == "--help" || a == "-h") {
        std::printf("%.*s", static_cast<int>(usage.size()), usage.data());
        std::exit(0);
      }
      if (a.rfind("--", 0) == 0 && std::find(known.begin(), known.end(), a) == known.end()) {
        std::fprintf(stderr, "unknown option %s\n%.*s", a.c_str(), static_cast<int>(usage.size()), usage.data());
        std::exit(64);
      }
    }
  }
  /// The value of the last `name` given, else `fallback`.
  std::string get(std::string_view name, std::string_view fallback) const {
    std::string value(fallback);
    for (std::size_t i = 0; i + 1 < m_args.size(); ++i)
      if (m_args[i] == name) value = m_args[i + 1];
    return value;
  }
  long num(std::string_view name, long fallback) const {
    const std::string v = get(name, "");
    return v.empty() ? fallback : std::strtol(v.c_str(), nullptr, 10);
  }
  bool flag(std::string_view name) const { return std::find(m_args.begin(), m_args.end(), name) != m_args.end(); }

 private:
  std::vector<std::string> m_args;
};

/// GPUs the CUDA runtime sees: 0 where there is no driver or no device, with the runtime's reason in `why`.
inline int gpu_count(std::string* why = nullptr) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    if (why) *why = cudaGetErrorString(e);
    return 0;
  }
  if (n == 0 && why) *why = "no CUDA device";
  return n;
}

/// Seconds on the steady clock, which every process of the machine shares (CLOCK_MONOTONIC).
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Waits for the work enqueued on `s`, exiting if a kernel launch or the work failed; returns now_s() after it.
inline double synchronize(cudaStream_t s) {
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaStreamSynchronize(s));
  return now_s();
}

/// The p-th percentile (0..100) of `v`, nearest rank; 0 for an empty vector.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t i = std::min(v.size() - 1, static_cast<std::size_t>(p / 100.0 * static_cast<double>(v.size())));
  return v[i];
}

/// The number just before the first `unit` in `text` ("5000.0" in "sink: 5000.0 frames/s"), or 0.
inline double number_before(const std::string& text, std::string_view unit) {
  const std::size_t end = text.find(unit);
  if (end == std::string::npos || end == 0) return 0;
  const std::size_t space = text.rfind(' ', end - 1);
  return std::strtod(text.c_str() + (space == std::string::npos ? 0 : space + 1), nullptr);
}

/// The folder this program is in: the other examples and gpuipcd are installed beside it.
inline std::string program_dir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<std::size_t>(n));
  return path.substr(0, path.rfind('/'));
}

/// Starts `program` (a file in program_dir()) with `args`; returns its pid, or exits saying why it could not.
/// With `out_fd`, the program's stdout is a pipe and `*out_fd` its read end.
inline pid_t spawn(const std::string& program, const std::vector<std::string>& args, int* out_fd = nullptr) {
  const std::string path = program_dir() + "/" + program;
  int out[2] = {-1, -1};
  if (out_fd != nullptr && ::pipe2(out, O_CLOEXEC) != 0) {
    std::perror("pipe2");
    std::exit(2);
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("fork");
    std::exit(2);
  }
  if (pid == 0) {
    if (out_fd != nullptr) ::dup2(out[1], STDOUT_FILENO);  // dup2 clears close-on-exec on the copy
    std::vector<char*> argv{const_cast<char*>(path.c_str())};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(path.c_str(), argv.data());
    std::fprintf(stderr, "cannot run %s (install the examples together): %s\n", path.c_str(), std::strerror(errno));
    ::_exit(127);
  }
  if (out_fd != nullptr) {
    ::close(out[1]);
    *out_fd = out[0];
  }
  return pid;
}

/// Waits for child `pid`: its exit code, or 128 + the signal that killed it.
inline int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

/// Whether child `pid` has exited; it stays a zombie, for wait_exit.
inline bool has_exited(pid_t pid) {
  siginfo_t info{};
  return ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == pid;
}

/// Runs `program` like spawn and waits for it (wait_exit's code); what it prints goes to stdout as it comes, and
/// into `said`.
inline int run_tee(const std::string& program, const std::vector<std::string>& args, std::string& said) {
  int fd = -1;
  const pid_t pid = spawn(program, args, &fd);
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    said.append(buf, static_cast<std::size_t>(n));
    std::fwrite(buf, 1, static_cast<std::size_t>(n), stdout);
    std::fflush(stdout);
  }
  ::close(fd);
  return wait_exit(pid);
}

}  // namespace example
