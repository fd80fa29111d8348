// Small helpers shared by the test suites: temporary directories, forked child processes, fd counting, signal
// injection and bounded polling. Test code only: these call POSIX directly and abort nothing on failure.
#pragma once

#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gpuipc/error.hpp"
#include "os/fd.hpp"

namespace gpuipc::test {

using namespace std::chrono_literals;

/// A fresh directory (mode 0700) under $TMPDIR (when set and short enough for socket paths), else /tmp; removed
/// with all its contents on destruction. Only the creating process removes it, so a forked child that leaves
/// through exit() instead of _exit() does not delete it under its parent. Throws std::runtime_error if it cannot be
/// created.
class TempDir {
 public:
  explicit TempDir(std::string_view prefix = "gpuipc-test");
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir();

  const std::string& path() const noexcept { return m_path; }
  /// path() + "/" + name.
  std::string file(std::string_view name) const;

 private:
  std::string m_path;
  pid_t m_owner;
};

/// How long wait_child / run_child give a child by default before they SIGKILL it.
inline constexpr std::chrono::milliseconds kDefaultChildTimeout = 20s;
/// wait_child's result when the child outlived its timeout (it was SIGKILLed and reaped).
inline constexpr int kChildTimedOut = -1;
/// Exit code of a child whose body threw (the exception's what() goes to stderr).
inline constexpr int kChildThrew = 125;

/// Forks; the child runs `body` and leaves with _exit(its return value) (kChildThrew if it throws), never returning
/// into the test framework. Use exit codes 0..124 in bodies and GPUIPC_CHILD_CHECK instead of gtest assertions,
/// which would only fail the child's copy of the test. Returns the child's pid; the caller must wait_child it.
pid_t start_child(const std::function<int()>& body);

/// Waits at most `timeout` for `pid` (a child) to end and reaps it. Returns its exit code, 128 + the signal number
/// when a signal killed it, or kChildTimedOut after SIGKILLing and reaping it when the time ran out.
int wait_child(pid_t pid, std::chrono::milliseconds timeout = kDefaultChildTimeout);

/// start_child + wait_child: `EXPECT_EQ(run_child([] { ...; return 0; }), 0);`
int run_child(const std::function<int()>& body, std::chrono::milliseconds timeout = kDefaultChildTimeout);

/// Prints "file:line: child check failed: expr" to stderr (used by GPUIPC_CHILD_CHECK).
void report_child_failure(const char* file, int line, const char* expr) noexcept;

/// Whether `call` throws gpuipc::Error with `code` and a message containing `text`; when not, what it did instead
/// (in the result, and on stderr for a child's check). For `EXPECT_TRUE(fails_with([] { ... }, ErrorCode::NotFound,
/// "..."))` and `GPUIPC_CHILD_CHECK(fails_with(...))`.
::testing::AssertionResult fails_with(const std::function<void()>& call, ErrorCode code, std::string_view text);

/// Lowers this process's soft RLIMIT_NOFILE to the fds it has open and fills every free number below it (the fds
/// stay open): no fd can be made until the limit returned (the one before) is set again. For a child process.
rlimit use_up_fds();

/// Inside a start_child / run_child body: returns 1 from the body, after saying which check failed, when `cond` is
/// false.
#define GPUIPC_CHILD_CHECK(cond)                                       \
  do {                                                                 \
    if (!(cond)) {                                                     \
      ::gpuipc::test::report_child_failure(__FILE__, __LINE__, #cond); \
      return 1;                                                        \
    }                                                                  \
  } while (0)

/// A one-way pipe (both ends CLOEXEC) for "I am ready" notifications between a parent and a forked child.
class SyncPipe {
 public:
  SyncPipe();
  /// Writes one byte.
  void notify() const;
  /// Waits at most `timeout` for a byte and consumes it; false on timeout or when every writer closed.
  bool wait(std::chrono::milliseconds timeout) const;
  int read_fd() const noexcept { return m_read.get(); }
  int write_fd() const noexcept { return m_write.get(); }

 private:
  os::UniqueFd m_read;
  os::UniqueFd m_write;
};

/// A TCP connection over loopback whose peer never reads, its send buffer full, set to linger `seconds` on close:
/// closing its last fd waits that long (the kernel tries to send what is queued), or until `peer` is closed.
os::UniqueFd lingering_socket(int seconds, os::UniqueFd& peer);

/// Polls `pred` every `interval` until it returns true (-> true) or `timeout` passed (-> false, after one last try).
bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout,
                std::chrono::milliseconds interval = 2ms);

/// What kill_storm did.
struct KillStorm {
  unsigned kills = 0;          ///< victims SIGKILLed and reaped
  unsigned other_exits = 0;    ///< of those, how many had exited otherwise first (not 128 + SIGKILL)
  long not_ready = -1;         ///< the victim that was not ready within 60 s (the storm stopped there); -1: none
  std::vector<pid_t> running;  ///< the two victims still running: the caller kills them when it is done
};

/// Two victims at a time, from `start(id)` (ids 0, 1, 2, ...): one of them, picked at random (`seed`), is SIGKILLed
/// 0-1.5 ms after `ready(id)` holds and replaced by the next, until `kills` were killed.
KillStorm kill_storm(const std::function<pid_t(std::uint32_t)>& start, const std::function<bool(std::uint32_t)>& ready,
                     unsigned kills, unsigned seed);

/// The open fds of this process, one "fd -> target" per line, for leak-check failure messages.
std::string describe_open_fds();

/// The scheduler state letter of a process or thread (field 3 of /proc/<id>/stat: 'R', 'S', 'D', 'Z', ...), or '\0'
/// when it cannot be read (the task is gone).
char task_state(pid_t id);

/// Waits at most `timeout` until process or thread `id` sleeps in the kernel (state 'S' or 'D'): how a test knows
/// that a child or thread has reached a blocking call before it pokes it.
bool wait_until_sleeping(pid_t id, std::chrono::milliseconds timeout);

/// Installs a handler for `sig` that only counts deliveries, WITHOUT SA_RESTART, so a blocking system call the
/// signal interrupts fails with EINTR; restores the previous action on destruction. The signal mask is left alone.
/// One instance per signal at a time.
class ScopedSignalCounter {
 public:
  explicit ScopedSignalCounter(int sig);
  ScopedSignalCounter(const ScopedSignalCounter&) = delete;
  ScopedSignalCounter& operator=(const ScopedSignalCounter&) = delete;
  ~ScopedSignalCounter();

  /// Deliveries since construction.
  int count() const noexcept;

 private:
  int m_sig;
  struct Saved;
  Saved* m_saved;
};

/// A thread that sends `sig` to thread `target` (pthread_kill) first after `delay`, then every `period`, until it has
/// sent `max_signals` or is destroyed; for making signals arrive while `target` blocks in a system call. Declare it
/// after the ScopedSignalCounter of the same signal, so it stops before the handler goes.
class SignalPulser {
 public:
  SignalPulser(pthread_t target, int sig, std::chrono::milliseconds delay, std::chrono::milliseconds period,
               int max_signals = INT_MAX);
  SignalPulser(const SignalPulser&) = delete;
  SignalPulser& operator=(const SignalPulser&) = delete;
  ~SignalPulser();

  /// Signals sent so far.
  int sent() const noexcept { return m_sent.load(); }

 private:
  std::mutex m_mutex;
  std::condition_variable m_cv;
  bool m_stop = false;
  std::atomic<int> m_sent{0};
  std::thread m_thread;
};

/// The whole content of a file, or nullopt when it cannot be opened.
std::optional<std::string> read_file(const std::string& path);

/// Creates or replaces a file with `content`; throws std::runtime_error on failure.
void write_file(const std::string& path, std::string_view content);

/// This build's bin/ folder (the programs: gpuipcd, gpuipc, the examples), found from the running test's own path
/// (<build>/tests/<test>), so that a build tree moved to another folder (the GPU machine) still finds it.
std::string build_bin_dir();

/// Byte i of the test pattern `seed` (distinct seeds give distinct contents).
std::uint8_t pattern_byte(std::uint64_t seed, std::size_t i);
/// Fills `n` bytes at `p` with pattern `seed`.
void fill_pattern(void* p, std::size_t n, std::uint64_t seed);
/// Whether the `n` bytes at `p` hold pattern `seed`.
bool holds_pattern(const void* p, std::size_t n, std::uint64_t seed);

/// What run_program saw.
struct ProgramOutcome {
  int exit_code = -1;  ///< as wait_child reports it (128 + signal; kChildTimedOut)
  std::string out;
  std::string err;
};

/// Runs `program` with `args` (argv[0] is `program`), this process's environment with `env` ("NAME=value")
/// added or replacing, and, for `keep_fd` >= 0, that fd of this process inherited as fd 3 (how systemd passes a
/// listening socket; with `keep_fd` the child also gets LISTEN_PID=<its pid> and LISTEN_FDS=1 unless `env` sets
/// them). Collects stdout and stderr; SIGKILLs it after `timeout`.
ProgramOutcome run_program(const std::string& program, const std::vector<std::string>& args,
                           const std::vector<std::string>& env = {}, int keep_fd = -1,
                           std::chrono::milliseconds timeout = 30s);

/// run_program of `program` ("gpuipc", "gpuipcd") from this build's bin directory, with 60 s to finish.
ProgramOutcome run_built(const char* program, const std::vector<std::string>& args,
                         const std::vector<std::string>& env = {});

/// Starts `program` like run_program (same `env` and `keep_fd` rules) but does not wait: its stdout and stderr go
/// to `log_path`. Returns its pid; the caller must wait_child it.
pid_t start_program(const std::string& program, const std::vector<std::string>& args,
                    const std::vector<std::string>& env, int keep_fd, const std::string& log_path);

/// Memory shared with forked children (MAP_SHARED | MAP_ANONYMOUS, made before fork).
template <typename T>
class Shared {
 public:
  explicit Shared(std::size_t count = 1) : m_bytes(sizeof(T) * count) {
    m_ptr = ::mmap(nullptr, m_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (m_ptr == MAP_FAILED) throw std::runtime_error("mmap");
    std::memset(m_ptr, 0, m_bytes);
  }
  ~Shared() { ::munmap(m_ptr, m_bytes); }
  Shared(const Shared&) = delete;
  Shared& operator=(const Shared&) = delete;
  T* get() const { return static_cast<T*>(m_ptr); }
  T& operator[](std::size_t i) const { return get()[i]; }

 private:
  std::size_t m_bytes;
  void* m_ptr;
};

}  // namespace gpuipc::test
