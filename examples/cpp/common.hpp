// Helpers shared by the C++ examples, not part of gpuipc: command-line options, CUDA error checks, clocks,
// percentiles, starting the other example programs that sit in the same folder, and leaving cleanly: what a process
// created is removed on every way out (its return, an error, SIGINT or SIGTERM).
#pragma once

#include <cuda_runtime.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <gpuipc/error.hpp>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace example {

// Leaving. ----------------------------------------------------------------------------------------------------------

namespace detail {
/// What this process must undo when it leaves: names it created, children it started and has not reaped.
struct Leaving {
  std::mutex mutex;
  std::string program = "example";
  std::vector<std::pair<std::string, void (*)(std::string_view)>> names;
  std::vector<pid_t> children;
  bool done = false;                   ///< clean_up ran: a name created after it goes at once
  std::atomic<bool> stopping = false;  ///< a stop signal came: its thread ends the process
};
// Never destroyed: a signal or a thread's fail() may still use it while the process exits.
inline Leaving& leaving() {
  static Leaving* l = new Leaving;
  return *l;
}
inline void remove_name(const std::string& name, void (*unlink)(std::string_view)) noexcept {
  try {
    unlink(name);
  } catch (const gpuipc::Error& e) {
    if (e.code() != gpuipc::ErrorCode::NotFound)
      std::fprintf(stderr, "%s: could not remove %s: %s\n", leaving().program.c_str(), name.c_str(), e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: could not remove %s: %s\n", leaving().program.c_str(), name.c_str(), e.what());
  }
}
/// After a stop signal the thread that took it cleans up and ends the process: other threads must not go on (start
/// children, report children it stopped as failures, exit with another code). They wait here for the end.
inline void park_if_stopping() {
  while (leaving().stopping) std::this_thread::sleep_for(std::chrono::hours(1));
}
}  // namespace detail

/// Waits for child `pid` to end: its exit code, or 128 + the signal that ended it.
inline int wait_exit(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  {
    detail::Leaving& l = detail::leaving();
    const std::lock_guard lock(l.mutex);
    std::erase(l.children, pid);
  }
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
}

/// Whether child `pid` has exited (it stays a zombie, for wait_exit), or was reaped already.
inline bool has_exited(pid_t pid) {
  siginfo_t info{};
  const int r = ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT);
  return (r == 0 && info.si_pid == pid) || (r < 0 && errno == ECHILD);
}

/// "exited with N" or "was killed by signal N", for wait_exit's `code`.
inline std::string exit_text(int code) {
  return code > 128 ? "was killed by signal " + std::to_string(code - 128) : "exited with " + std::to_string(code);
}

/// Ends children `pids`: SIGTERM (each example then removes what it created and ends), SIGKILL to those still there
/// after `grace`; reaps them all and returns their wait_exit codes, in order.
inline std::vector<int> stop_children(const std::vector<pid_t>& pids,
                                      std::chrono::milliseconds grace = std::chrono::seconds(5)) {
  for (const pid_t pid : pids) ::kill(pid, SIGTERM);
  const auto until = std::chrono::steady_clock::now() + grace;
  std::vector<int> codes;
  for (const pid_t pid : pids) {
    while (!has_exited(pid) && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!has_exited(pid)) ::kill(pid, SIGKILL);
    codes.push_back(wait_exit(pid));
  }
  return codes;
}

/// Stops the children still running (stop_children), then removes the names remove_at_exit took, newest first. Runs
/// once, on every way out: run_main's return, fail() (CUDA_CHECK too), an exception out of main's body, SIGINT and
/// SIGTERM; later calls do nothing.
inline void clean_up() noexcept {
  detail::Leaving& l = detail::leaving();
  std::vector<std::pair<std::string, void (*)(std::string_view)>> names;
  std::vector<pid_t> children;
  {
    const std::lock_guard lock(l.mutex);
    if (l.done) return;
    l.done = true;
    names.swap(l.names);
    children = l.children;
  }
  stop_children(children);  // first: they remove their own names, which may be in use by this process's
  for (auto it = names.rbegin(); it != names.rend(); ++it) detail::remove_name(it->first, it->second);
}

/// On the way out (clean_up), `unlink(name)` removes `name`, which this process created: Segment::unlink,
/// Channel::unlink, Pool::unlink, Semaphore::unlink or a function of the same type. Call it right after the create,
/// so that a process removes only what it made (a run that found the name taken leaves it to its owner).
inline void remove_at_exit(std::string name, void (*unlink)(std::string_view)) {
  detail::Leaving& l = detail::leaving();
  {
    const std::lock_guard lock(l.mutex);
    if (!l.done) {
      l.names.emplace_back(std::move(name), unlink);
      return;
    }
  }
  detail::remove_name(name, unlink);  // leaving already (a signal came while it was being made)
}

/// Prints "PROGRAM: message" (printf's format) to stderr, cleans up and exits with `code`.
[[noreturn]] inline void fail(int code, const char* format, ...) __attribute__((format(printf, 2, 3)));
inline void fail(int code, const char* format, ...) {
  detail::park_if_stopping();
  std::fprintf(stderr, "%s: ", detail::leaving().program.c_str());
  va_list ap;
  va_start(ap, format);
  std::vfprintf(stderr, format, ap);
  va_end(ap);
  std::fputc('\n', stderr);
  std::fflush(stdout);
  clean_up();
  std::exit(code);
}

/// The main() of an example: `body` runs with SIGINT and SIGTERM handled by a thread of their own, which cleans up
/// (clean_up) and ends the process by that signal; an exception out of `body` (gpuipc::Error: a create or open that
/// failed) is printed with the program's name and gives exit code 1. Every way out cleans up.
inline int run_main(const char* program, const std::function<int()>& body) {
  detail::leaving().program = program;
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  // Blocked before any other thread starts (the library's inherit it): only the thread below takes them.
  ::pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  std::thread([stop] {
    int sig = 0;
    while (::sigwait(&stop, &sig) != 0) {
    }
    detail::leaving().stopping = true;
    std::fprintf(stderr, "%s: %s: stopping, removing what it made\n", detail::leaving().program.c_str(),
                 ::strsignal(sig));
    std::fflush(stdout);
    clean_up();
    // End by the signal, as a process without a handler would (a shell or supervisor tells it from the status).
    ::signal(sig, SIG_DFL);
    ::pthread_sigmask(SIG_UNBLOCK, &stop, nullptr);
    ::raise(sig);
    ::_exit(128 + sig);
  }).detach();
  int code = 1;
  try {
    code = body();
  } catch (const gpuipc::Error& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    if (e.code() == gpuipc::ErrorCode::AlreadyExists)
      std::fprintf(stderr,
                   "%s: another run uses this --name, or one before left it: pick another --name, or remove it "
                   "with `gpuipc rm NAME`\n",
                   program);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
  }
  std::fflush(stdout);
  detail::park_if_stopping();
  clean_up();
  return code;
}

/// Exits with the failing CUDA call, where it is, and the runtime's message (after clean_up).
#define CUDA_CHECK(call) ::example::cuda_check((call), #call, __FILE__, __LINE__)
inline void cuda_check(cudaError_t e, const char* call, const char* file, int line) {
  if (e == cudaSuccess) return;
  fail(2, "%s:%d: %s failed: %s", file, line, call, cudaGetErrorString(e));
}

// Options. ----------------------------------------------------------------------------------------------------------

/// Options "--name value" and flags "--name"; anything not in `known`, and any value out of its range, is refused
/// with the usage text and exit code 64.
class Args {
 public:
  Args(int argc, char** argv, std::string_view usage, std::initializer_list<std::string_view> known)
      : m_args(argv + 1, argv + argc), m_usage(usage) {
    for (const std::string& a : m_args) {
      if (a == "--help" || a == "-h") {
        std::printf("%.*s", static_cast<int>(usage.size()), usage.data());
        std::exit(0);
      }
      if (a.rfind("--", 0) == 0 && std::find(known.begin(), known.end(), a) == known.end())
        refuse("unknown option " + a);
    }
  }
  /// The value of the last `name` given, else `fallback`.
  std::string get(std::string_view name, std::string_view fallback) const {
    std::string value(fallback);
    for (std::size_t i = 0; i < m_args.size(); ++i)
      if (m_args[i] == name) {
        if (i + 1 == m_args.size()) refuse(std::string(name) + " needs a value");
        value = m_args[i + 1];
      }
    return value;
  }
  /// The whole number of the last `name` given, else `fallback`; refused unless it is a number from `min` to `max`.
  long long num(std::string_view name, long long fallback, long long min, long long max) const {
    const std::string v = get(name, "");
    if (v.empty()) return fallback;
    errno = 0;
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (errno != 0 || end == v.c_str() || *end != '\0' || n < min || n > max)
      refuse(std::string(name) + " " + v + ": not a whole number from " + std::to_string(min) + " to " +
             std::to_string(max));
    return n;
  }
  /// The value of the last `name` given, else `fallback`; refused unless it is one of `choices`.
  std::string choice(std::string_view name, std::string_view fallback,
                     std::initializer_list<std::string_view> choices) const {
    const std::string v = get(name, fallback);
    if (std::find(choices.begin(), choices.end(), v) != choices.end()) return v;
    std::string list;
    for (std::string_view c : choices) list += (list.empty() ? "" : ", ") + std::string(c);
    refuse(std::string(name) + " " + v + ": not one of " + list);
  }
  bool flag(std::string_view name) const { return std::find(m_args.begin(), m_args.end(), name) != m_args.end(); }
  /// Exits 64 with `why` and the usage text.
  [[noreturn]] void refuse(const std::string& why) const {
    std::fprintf(stderr, "%s\n%.*s", why.c_str(), static_cast<int>(m_usage.size()), m_usage.data());
    std::exit(64);
  }

 private:
  std::vector<std::string> m_args;
  std::string_view m_usage;
};

// GPUs and clocks. --------------------------------------------------------------------------------------------------

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

/// Whether GPUs `a` and `b` can each map the other's memory (peer access both ways), which a device segment or
/// channel made on one and opened on the other needs (gpuipc throws Unsupported without it).
inline bool peer_access(int a, int b) {
  int ab = 0, ba = 0;
  return cudaDeviceCanAccessPeer(&ab, a, b) == cudaSuccess && cudaDeviceCanAccessPeer(&ba, b, a) == cudaSuccess &&
         ab != 0 && ba != 0;
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

/// The median of `v`: the middle value, or the mean of the two middle values of an even count; 0 for an empty vector.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const std::size_t mid = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid), v.end());
  const double upper = v[mid];
  if (v.size() % 2 == 1) return upper;
  return (*std::max_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(mid)) + upper) / 2;
}

/// The p-th percentile (0..100) of `v` by nearest rank: the ceil(p/100 * n)-th smallest (the smallest for p = 0),
/// except that p = 50 is the median(). 0 for an empty vector.
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  if (p == 50) return median(std::move(v));
  std::sort(v.begin(), v.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(v.size()));
  const std::size_t i = rank < 1 ? 0 : std::min(v.size(), static_cast<std::size_t>(rank)) - 1;
  return v[i];
}

/// The number just before the first `unit` in `text` ("5000.0" in "sink: 5000.0 frames/s"), or 0.
inline double number_before(const std::string& text, std::string_view unit) {
  const std::size_t end = text.find(unit);
  if (end == std::string::npos || end == 0) return 0;
  const std::size_t space = text.rfind(' ', end - 1);
  return std::strtod(text.c_str() + (space == std::string::npos ? 0 : space + 1), nullptr);
}

// Other programs. ---------------------------------------------------------------------------------------------------

/// The folder this program is in: the other examples and gpuipcd are installed beside it.
inline std::string program_dir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<std::size_t>(n));
  return path.substr(0, path.rfind('/'));
}

/// Starts `program` (a file in program_dir()) with `args`; returns its pid, or exits saying why it could not. The
/// child is stopped on the way out (clean_up) unless wait_exit reaped it first. With `out_fd`, the program's stdout
/// is a pipe and `*out_fd` its read end.
inline pid_t spawn(const std::string& program, const std::vector<std::string>& args, int* out_fd = nullptr) {
  const std::string path = program_dir() + "/" + program;
  int out[2] = {-1, -1};
  if (out_fd != nullptr && ::pipe2(out, O_CLOEXEC) != 0) fail(2, "pipe2: %s", std::strerror(errno));
  // Made before fork: the child of a process with threads may only make async-signal-safe calls.
  std::vector<char*> argv{const_cast<char*>(path.c_str())};
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const std::string cannot = "cannot run " + path + " (install the examples together)\n";
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  detail::park_if_stopping();  // starts nothing while it ends
  detail::Leaving& l = detail::leaving();
  std::unique_lock lock(l.mutex);  // a clean_up meanwhile must see the child
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    lock.unlock();
    fail(2, "fork: %s", std::strerror(err));
  }
  if (pid == 0) {
    if (out_fd != nullptr) ::dup2(out[1], STDOUT_FILENO);  // dup2 clears close-on-exec on the copy
    ::sigprocmask(SIG_UNBLOCK, &stop, nullptr);            // run_main blocked them; exec keeps the mask
    ::execv(path.c_str(), argv.data());
    (void)!::write(STDERR_FILENO, cannot.data(), cannot.size());
    ::_exit(127);
  }
  l.children.push_back(pid);
  if (out_fd != nullptr) {
    ::close(out[1]);
    *out_fd = out[0];
  }
  return pid;
}

/// A child this program started (spawn), what to call it in messages, and how it ended (wait_exit's code).
struct Child {
  pid_t pid = -1;
  std::string what;
  int code = -1;
};

/// Waits for `children` to end, passing on what `out_fd` (a child's stdout pipe, or -1) brings to stdout as it
/// comes, and into `said`. When one ends with a code other than 0, says so (on stderr) and stops the others
/// (stop_children). Sets each one's `code`; true when all exited with 0.
inline bool wait_all(std::vector<Child>& children, int out_fd, std::string& said) {
  bool failed = false;
  for (std::size_t running = children.size(); running > 0 || out_fd >= 0;) {
    if (out_fd >= 0) {
      pollfd p{out_fd, POLLIN, 0};
      if (::poll(&p, 1, 20) > 0) {
        char buf[4096];
        const ssize_t n = ::read(out_fd, buf, sizeof buf);
        if (n > 0) {
          said.append(buf, static_cast<std::size_t>(n));
          std::fwrite(buf, 1, static_cast<std::size_t>(n), stdout);
          std::fflush(stdout);
        } else if (n == 0 || errno != EINTR) {
          ::close(out_fd);
          out_fd = -1;
        }
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    for (Child& c : children) {
      if (c.code >= 0 || !has_exited(c.pid)) continue;
      c.code = wait_exit(c.pid);
      --running;
      if (c.code == 0 || failed) continue;
      detail::park_if_stopping();  // stopped by this process's clean_up: not a failure to report
      failed = true;
      std::fprintf(stderr, "%s: %s %s; stopping the others\n", detail::leaving().program.c_str(), c.what.c_str(),
                   exit_text(c.code).c_str());
      std::vector<Child*> others;
      std::vector<pid_t> pids;
      for (Child& o : children)
        if (o.code < 0) others.push_back(&o), pids.push_back(o.pid);
      const std::vector<int> codes = stop_children(pids);
      for (std::size_t i = 0; i < others.size(); ++i) others[i]->code = codes[i], --running;
    }
  }
  return !failed;
}

/// Runs `program` like spawn and waits for it (wait_exit's code); what it prints goes to stdout as it comes, and
/// into `said`.
inline int run_tee(const std::string& program, const std::vector<std::string>& args, std::string& said) {
  int fd = -1;
  std::vector<Child> one{{spawn(program, args, &fd), program}};
  wait_all(one, fd, said);
  return one[0].code;
}

}  // namespace example
