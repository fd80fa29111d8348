// Processes: pidfd, signals as fds, file locks, directories, clocks.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "os/fd.hpp"
#include "os/path.hpp"

namespace gpuipc::os {

/// pidfd_open(pid). Throws Error(NotFound) when the process does not exist, Error(Unsupported) when the kernel
/// lacks pidfd (ENOSYS; Linux < 5.3).
UniqueFd pidfd_open(pid_t pid);

/// Polls a pidfd: true once the process has exited, false when `timeout_ms` passed first (-1: wait forever).
bool pidfd_wait_exit(int pidfd, int timeout_ms);

/// Blocks every signal in the calling thread for its scope; the destructor restores the mask it found.
class SignalsBlocked {
 public:
  SignalsBlocked() noexcept;
  ~SignalsBlocked();
  SignalsBlocked(const SignalsBlocked&) = delete;
  SignalsBlocked& operator=(const SignalsBlocked&) = delete;

 private:
  sigset_t m_old{};
};

/// Registers fork(2) handlers for this process from now on (pthread_atfork; any may be null), with every signal
/// blocked meanwhile: glibc registers under the lock that fork takes, so a signal handler that forked inside the
/// registration would wait for its own thread for ever. The child handler must be async-signal-safe.
void at_fork(void (*prepare)(), void (*parent)(), void (*child)()) noexcept;

/// Starts a detached thread running `body` with every signal blocked, so that a process's signal handlers never
/// run on the library's thread. Throws std::system_error when no thread can be made.
void start_thread_without_signals(std::function<void()> body);

/// Whether a process with this pid exists (kill(pid, 0); EPERM counts as existing).
bool process_alive(pid_t pid) noexcept;

/// When process `pid` started, in clock ticks after boot (/proc/PID/stat, field 22), or 0 when unknown (no such
/// process, no /proc). With the pid it names one process for good: a pid used again has a later start.
std::uint64_t process_start_ticks(pid_t pid) noexcept;

/// kill(pid, sig). Throws Error naming the pid.
void send_signal(pid_t pid, int sig);

/// Sets `sig`'s disposition to SIG_IGN for the whole process (signal(2)).
void ignore_signal(int sig) noexcept;

/// Blocks `signals` in the calling thread and returns a signalfd (CLOEXEC | NONBLOCK) that reports them.
UniqueFd signal_fd(const std::vector<int>& signals);

/// Reads one pending signal number from a signalfd, or 0 when none is pending.
int read_signal(int sigfd);

/// Unblocks `signals` in the calling thread (a forked child of a process that blocked them for its signal_fd).
void unblock_signals(const std::vector<int>& signals) noexcept;

/// Ends this process by signal `sig`, as its default action does (its exit status says so to a shell: 128 + sig):
/// the default disposition restored, the signal unblocked and raised.
[[noreturn]] void die_by_signal(int sig) noexcept;

/// eventfd (CLOEXEC | NONBLOCK) and its write/read.
UniqueFd event_fd();
void event_fd_signal(int efd) noexcept;
void event_fd_drain(int efd) noexcept;

/// Opens (creating, mode 0600) and flock(LOCK_EX | LOCK_NB)s `path`. Returns an invalid UniqueFd when another
/// process holds the lock. The lock lives as long as the fd (and dies with the process).
UniqueFd try_lock_file(const std::string& path);

/// Creates `path` (and missing parents) with `mode` if absent. Then checks that it is a directory owned by the
/// caller or root and not writable by group or others unless sticky; throws Error(PermissionDenied) with what is
/// wrong and what to do otherwise.
void ensure_private_dir(const std::string& path, unsigned mode = 0755);

/// Raises this process's soft RLIMIT_NOFILE to its hard limit (capped at 1 << 20) and returns the soft limit in
/// force afterwards.
std::uint64_t raise_fd_limit() noexcept;

/// This process's soft RLIMIT_NOFILE (what it may have open), or 0 when unknown.
std::uint64_t fd_limit() noexcept;


/// Writes `text` to `path` (created 0644, truncated) and checks every step (a full filesystem is an error, not an
/// empty file). Throws Error(System) naming the path and the call.
void write_file(const std::string& path, std::string_view text);

/// Opens `path` for appending (created with `mode`, O_APPEND | O_CLOEXEC | O_NOFOLLOW). Throws Error(System).
UniqueFd open_append(const std::string& path, unsigned mode);

/// Appends `text` with one write(2) per call (lines of one writer never interleave). Throws Error(System) on a
/// short or failed write (a full filesystem); a part of `text` such a write left is taken back (the file truncated to
/// its size before), so that the next text does not join it. When that cannot be done, `*cut_left` (if given) is
/// set: the file then ends with that part.
void append_text(int fd, std::string_view text, bool* cut_left = nullptr);

/// The whole content of `path`, or an empty string when it does not exist (not through a symbolic link; a FIFO is
/// not waited on). With `status`, what fstat says of the file read (nullopt when there is none): checks made on it
/// hold for what was read, where a check of the path before could be of another file. Throws Error(System) on other
/// errors.
std::string read_text(const std::string& path, std::optional<PathStatus>* status = nullptr);

/// Replaces `path` with `text` atomically (a temporary file beside it, then rename). Throws Error(System).
void replace_file(const std::string& path, std::string_view text, unsigned mode);

/// CLOCK_MONOTONIC in nanoseconds.
std::int64_t monotonic_ns() noexcept;

/// The path of the running executable (/proc/self/exe), or empty.
std::string self_exe_path();

/// How long spawn_detached waits for the detached program's execv to succeed or fail.
inline constexpr std::chrono::milliseconds kSpawnOutcomeWait{2000};

/// Starts `argv[0]` (an absolute path) with `argv`, detached: double fork, setsid, stdin/stdout to /dev/null,
/// stderr to `log_path` (appended; /dev/null when empty), all other fds closed. Returns once the intermediate
/// child has been reaped, so no zombie is left, and the program's execv succeeded or kSpawnOutcomeWait passed
/// without a word from it (a process another thread forked meanwhile can hold the pipe that tells). Throws Error
/// if the program cannot be started.
void spawn_detached(const std::vector<std::string>& argv, const std::string& log_path);

/// What run_captured saw: the exit code (128 + the signal when one ended it; -1 when it was killed at the time
/// limit, or waitpid could not say how it ended, as when SIGCHLD is ignored) and everything it wrote to stdout and
/// stderr, in order.
struct CapturedRun {
  int exit_code = -1;
  std::string output;
};

/// Runs `argv[0]` (looked up in PATH) with `argv`, the environment of this process with `env` added or replaced
/// ("NAME=value" each), `input` on its stdin and its stdout and stderr captured; SIGKILLed after `timeout`. Throws
/// Error (NotFound when no such program is on PATH) when it cannot be started.
CapturedRun run_captured(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                         std::string_view input, std::chrono::milliseconds timeout);

/// Where `program` is found in PATH, empty entries skipped (or `program` itself when it holds a '/'), as an
/// executable regular file; empty if nowhere.
std::string find_in_path(const std::string& program);

}  // namespace gpuipc::os
