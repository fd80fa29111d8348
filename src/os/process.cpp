#include "os/process.hpp"

#include <algorithm>


#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <sstream>
#include <thread>

#include "base/errors.hpp"
#include "os/memfd.hpp"
#include "os/path.hpp"
#include "os/socket.hpp"

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

namespace gpuipc::os {

UniqueFd pidfd_open(pid_t pid) {
  if (pid <= 0) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("pidfd_open: pid {} is not a process id", pid), "pidfd_open",
                EINVAL);
  }
#ifdef SYS_pidfd_open
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  const int err = fd < 0 ? errno : 0;
#else
  const long fd = -1;
  const int err = ENOSYS;
#endif
  if (fd >= 0) return above_stdio(UniqueFd(static_cast<int>(fd)), "pidfd");
  const std::string what = fmt::format("process {}", pid);
  if (err == ESRCH) {
    throw Error(ErrorCode::NotFound, fmt::format("{}: pidfd_open failed: no such process", what), "pidfd_open", err);
  }
  if (err == ENOSYS) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: pidfd_open failed: the kernel lacks pidfd (Linux 5.3 or newer is needed)", what),
                "pidfd_open", err);
  }
  throw_system("pidfd_open", what, err);
}

bool pidfd_wait_exit(int pidfd, int timeout_ms) { return wait_readable(pidfd, timeout_ms); }

bool process_alive(pid_t pid) noexcept {
  if (pid <= 0) return false;  // kill(0 or -n, 0) would probe a process group
  return ::kill(pid, 0) == 0 || errno == EPERM;
}

SignalsBlocked::SignalsBlocked() noexcept {
  sigset_t all{};
  sigfillset(&all);
  (void)::pthread_sigmask(SIG_BLOCK, &all, &m_old);
}

SignalsBlocked::~SignalsBlocked() { (void)::pthread_sigmask(SIG_SETMASK, &m_old, nullptr); }

void at_fork(void (*prepare)(), void (*parent)(), void (*child)()) noexcept {
  const SignalsBlocked blocked;
  (void)::pthread_atfork(prepare, parent, child);
}

void start_thread_without_signals(std::function<void()> body) {
  const SignalsBlocked blocked;  // the new thread inherits the mask
  std::thread(std::move(body)).detach();
}

std::uint64_t process_start_ticks(pid_t pid) noexcept {
  if (pid <= 0) return 0;
  try {
    const std::string stat = read_text(fmt::format("/proc/{}/stat", pid));
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so count fields after the last ')'.
    const auto close = stat.rfind(')');
    if (close == std::string::npos) return 0;
    std::istringstream in(stat.substr(close + 1));
    std::string field;
    for (int i = 3; i < 22 && (in >> field); ++i) {
    }
    std::uint64_t ticks = 0;
    return (in >> ticks) ? ticks : 0;
  } catch (...) {  // NOLINT(bugprone-empty-catch): gone, or no /proc: unknown
    return 0;
  }
}

void send_signal(pid_t pid, int sig) {
  if (::kill(pid, sig) != 0) throw_system("kill", fmt::format("signal {} to pid {}", sig, pid));
}

void ignore_signal(int sig) noexcept {
  std::signal(sig, SIG_IGN);  // NOLINT(cert-err33-c): the previous disposition is of no use to the caller
}

UniqueFd signal_fd(const std::vector<int>& signals) {
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : signals) {
    if (sigaddset(&set, sig) != 0) throw_system("sigaddset", fmt::format("signal {}", sig));
  }
  if (const int err = ::pthread_sigmask(SIG_BLOCK, &set, nullptr); err != 0) {
    throw_system("pthread_sigmask(SIG_BLOCK)", "signal fd", err);
  }
  UniqueFd fd(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK));
  if (!fd) throw_system("signalfd", "signal fd");
  return fd;
}

void unblock_signals(const std::vector<int>& signals) noexcept {
  sigset_t set;
  sigemptyset(&set);
  for (const int sig : signals) sigaddset(&set, sig);
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

void die_by_signal(int sig) noexcept {
  std::signal(sig, SIG_DFL);  // NOLINT(cert-err33-c): nothing to do with the previous disposition
  unblock_signals({sig});
  ::raise(sig);
  std::_Exit(128 + sig);  // (a signal whose default action does not end the process)
}

int read_signal(int sigfd) {
  signalfd_siginfo info{};
  for (;;) {
    const ssize_t n = ::read(sigfd, &info, sizeof(info));
    if (n == static_cast<ssize_t>(sizeof(info))) return static_cast<int>(info.ssi_signo);
    if (n >= 0) {
      throw Error(ErrorCode::System, fmt::format("signal fd {}: read returned {} bytes", sigfd, n), "read");
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) return 0;
    throw_system("read", fmt::format("signal fd {}", sigfd));
  }
}

UniqueFd event_fd() {
  UniqueFd fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd) throw_system("eventfd", "event fd");
  return above_stdio(std::move(fd), "event fd");
}

void event_fd_signal(int efd) noexcept {
  const std::uint64_t one = 1;
  // EAGAIN means the counter is saturated: it is readable anyway, which is all a wake-up needs.
  while (::write(efd, &one, sizeof(one)) < 0 && errno == EINTR) {
  }
}

void event_fd_drain(int efd) noexcept {
  std::uint64_t value = 0;
  while (::read(efd, &value, sizeof(value)) < 0 && errno == EINTR) {
  }
}

UniqueFd try_lock_file(const std::string& path) {
  const std::string what = fmt::format("lock file {}", path);
  // O_NOFOLLOW: a symlink planted in a shared directory must not redirect the lock (or its creation) elsewhere.
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) throw_system("open", what);
  for (;;) {
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) == 0) return fd;
    if (errno == EINTR) continue;
    if (errno == EWOULDBLOCK) return UniqueFd();
    throw_system("flock(LOCK_EX)", what);
  }
}

void ensure_private_dir(const std::string& path, unsigned mode) {
  if (path.empty()) {
    throw Error(ErrorCode::InvalidArgument, "ensure_private_dir: the directory path is empty", "mkdir", EINVAL);
  }
  // mkdir -p: every missing component gets `mode`; existing ones are left alone.
  std::string dir = path;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  bool created = false;
  for (std::size_t pos = dir.find('/', 1);; pos = dir.find('/', pos + 1)) {
    const std::string prefix = dir.substr(0, pos);
    if (prefix.back() != '/') {
      if (::mkdir(prefix.c_str(), static_cast<mode_t>(mode)) == 0) {
        created = pos == std::string::npos;
      } else if (errno != EEXIST) {
        throw_system("mkdir", fmt::format("directory {}", prefix));
      }
    }
    if (pos == std::string::npos) break;
  }
  if (created) {
    // The umask may have removed bits from the directory just made: give it exactly the mode asked for. Through
    // an O_NOFOLLOW fd, so that a symlink swapped in meanwhile is not followed.
    UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!fd) throw_system("open", fmt::format("directory {}", dir));
    if (::fchmod(fd.get(), static_cast<mode_t>(mode)) != 0) throw_system("fchmod", fmt::format("directory {}", dir));
  }

  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) throw_system("lstat", fmt::format("directory {}", path));
  const auto refuse = [&](const std::string& why) {
    throw Error(ErrorCode::PermissionDenied, fmt::format("directory {} is unsafe: {}", path, why), "lstat");
  };
  if (S_ISLNK(st.st_mode)) {
    refuse("it is a symbolic link; remove it, or use a directory that you own");
  }
  if (!S_ISDIR(st.st_mode)) {
    refuse("it exists but is not a directory; remove it, or choose another path");
  }
  const uid_t me = ::getuid();
  if (st.st_uid != me && st.st_uid != 0) {
    refuse(fmt::format("it is owned by uid {}, you are uid {}; use a directory that you own", st.st_uid, me));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    refuse(fmt::format("it is mode {:04o}, writable by group or others and not sticky; run 'chmod go-w {}'",
                       st.st_mode & 07777, path));
  }
}

std::int64_t monotonic_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string self_exe_path() {
  std::string buf(256, '\0');
  for (;;) {
    const ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size());
    if (n < 0) return {};
    if (static_cast<std::size_t>(n) < buf.size()) {
      buf.resize(static_cast<std::size_t>(n));
      return buf;
    }
    buf.resize(buf.size() * 2);
  }
}

namespace {

// What the grandchild reports through the exec-status pipe when it cannot start the program.
struct SpawnFailure {
  int stage;  // one of the Stage values
  int err;    // errno
};

enum Stage : int { kStageSetsid = 1, kStageFork, kStageRedirect, kStageExec };

const char* stage_call(int stage) {
  switch (stage) {
    case kStageSetsid:
      return "setsid";
    case kStageFork:
      return "fork";
    case kStageRedirect:
      return "dup2";
    case kStageExec:
      return "execv";
    default:
      return "spawn";
  }
}

[[noreturn]] void report_and_exit(int pipe_fd, int stage, int err) noexcept {
  const SpawnFailure failure{stage, err};
  while (::write(pipe_fd, &failure, sizeof(failure)) < 0 && errno == EINTR) {
  }
  ::_exit(127);
}

// Runs in the grandchild, after fork in a possibly multi-threaded process: async-signal-safe calls only.
[[noreturn]] void exec_grandchild(char* const* argv, int null_fd, int err_fd, int pipe_fd, int max_fd) noexcept {
  if (::dup2(null_fd, STDIN_FILENO) < 0 || ::dup2(null_fd, STDOUT_FILENO) < 0 || ::dup2(err_fd, STDERR_FILENO) < 0) {
    report_and_exit(pipe_fd, kStageRedirect, errno);
  }
  // Mark every other fd close-on-exec rather than closing it: the status pipe must stay open until execv.
#ifdef SYS_close_range
  const bool ranged = ::syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC) == 0;
#else
  const bool ranged = false;
#endif
  if (!ranged) {
    for (int fd = 3; fd < max_fd; ++fd) {
      if (fd != pipe_fd) ::close(fd);
    }
  }
  // A daemon must not inherit the caller's blocked signals (signal_fd blocks some) or ignored ones (exec keeps
  // SIG_IGN).
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);  // NOLINT(concurrency-mt-unsafe): single-threaded after fork
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) ::sigaction(sig, &dfl, nullptr);
  }
  ::execv(argv[0], argv);
  report_and_exit(pipe_fd, kStageExec, errno);
}

}  // namespace

void spawn_detached(const std::vector<std::string>& argv, const std::string& log_path) {
  if (argv.empty() || argv[0].empty() || argv[0][0] != '/') {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("spawn_detached: the program must be an absolute path, got '{}'",
                            argv.empty() ? std::string() : argv[0]),
                "execv", EINVAL);
  }
  const std::string& program = argv[0];

  // Everything the children need is prepared here: after fork they may only make async-signal-safe calls.
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);

  UniqueFd opened_null(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!opened_null) throw_system("open", "/dev/null");
  UniqueFd null_fd = above_stdio(std::move(opened_null), "/dev/null");
  UniqueFd log_fd;
  if (!log_path.empty()) {
    // Not through a symlink, nor into a FIFO or another user's file: in a sticky directory others may write, anyone
    // can put one there first (a root broker appended its log to whatever file the link named).
    UniqueFd opened(
        ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600));
    if (!opened) throw_system("open", fmt::format("log file {} of {}", log_path, program));
    struct stat st {};
    if (::fstat(opened.get(), &st) != 0) throw_system("fstat", fmt::format("log file {} of {}", log_path, program));
    if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
      throw Error(ErrorCode::PermissionDenied,
                  fmt::format("log file {} of {} is not a regular file of yours (uid {}, mode {:o}); remove it",
                              log_path, program, st.st_uid, st.st_mode),
                  "open");
    }
    log_fd = above_stdio(std::move(opened), "log file");
  }
  const int err_fd = log_fd ? log_fd.get() : null_fd.get();

  int pipe_fds[2] = {-1, -1};
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw_system("pipe2", fmt::format("exec status pipe for {}", program));
  UniqueFd status_read(pipe_fds[0]);
  UniqueFd status_write(pipe_fds[1]);
  status_write = above_stdio(std::move(status_write), "exec status pipe");

  rlimit lim{};
  int max_fd = 65536;
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < rlim_t{1024} * 1024) {
    max_fd = static_cast<int>(lim.rlim_cur);
  }

  const pid_t child = ::fork();
  if (child < 0) throw_system("fork", fmt::format("starting {}", program));
  if (child == 0) {
    const int pipe_fd = status_write.get();
    if (::setsid() < 0) report_and_exit(pipe_fd, kStageSetsid, errno);
    const pid_t grandchild = ::fork();
    if (grandchild < 0) report_and_exit(pipe_fd, kStageFork, errno);
    if (grandchild == 0) exec_grandchild(args.data(), null_fd.get(), err_fd, pipe_fd, max_fd);
    ::_exit(0);  // the grandchild is reparented: nobody has to reap it
  }

  status_write.reset();  // our copy: the read below sees EOF once execv succeeded or every writer exited
  int status = 0;
  while (::waitpid(child, &status, 0) < 0) {
    if (errno == EINTR) continue;
    if (errno == ECHILD) break;  // SIGCHLD is ignored: the kernel reaped it already
    throw_system("waitpid", fmt::format("intermediate child {} starting {}", child, program));
  }

  // The pipe reaches end of file once the program's execv closed it, or with a failure report before that. But a
  // process that another thread of this one forked meanwhile (without exec: a worker pool) holds a copy of the
  // write end for as long as it lives, so wait for the outcome at most kSpawnOutcomeWait: past it, the program
  // most likely started (its failure comes within milliseconds), and a caller that waits for it finds out.
  SpawnFailure failure{0, 0};
  std::size_t got = 0;
  const auto outcome_deadline = std::chrono::steady_clock::now() + kSpawnOutcomeWait;
  while (got < sizeof(failure)) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(outcome_deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0 || !wait_readable(status_read.get(), static_cast<int>(left.count()))) {
      if (got == 0) return;  // no word from the children: the program is taken as started
      break;                 // a report cut short (below)
    }
    const ssize_t n = ::read(status_read.get(), reinterpret_cast<char*>(&failure) + got, sizeof(failure) - got);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      throw_system("read", fmt::format("exec status pipe for {}", program));
    }
  }
  if (got == 0) return;  // execv succeeded: the pipe closed on exec
  if (got != sizeof(failure)) {
    throw Error(ErrorCode::System, fmt::format("{}: could not be started (truncated status from the child)", program),
                "execv");
  }
  const std::string what =
      failure.stage == kStageExec ? fmt::format("program {}", program) : fmt::format("starting {} (detached)", program);
  throw_system(stage_call(failure.stage), what, failure.err);
}

std::uint64_t raise_fd_limit() noexcept {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 1024;
  constexpr rlim_t kCap = rlim_t{1} << 20;
  const rlim_t want = lim.rlim_max == RLIM_INFINITY ? kCap : std::min(lim.rlim_max, kCap);
  if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur < want) {
    rlimit raised = lim;
    raised.rlim_cur = want;
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) lim = raised;
  }
  return lim.rlim_cur == RLIM_INFINITY ? static_cast<std::uint64_t>(kCap) : static_cast<std::uint64_t>(lim.rlim_cur);
}

std::uint64_t fd_limit() noexcept {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return 0;
  return lim.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<std::uint64_t>(lim.rlim_cur);
}

void write_file(const std::string& path, std::string_view text) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) throw_system("open", fmt::format("file {}", path));
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_system("write", fmt::format("file {}", path), n == 0 ? ENOSPC : errno);
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd.get()) != 0 && errno != EINVAL) throw_system("fsync", fmt::format("file {}", path));
  const int fdv = fd.release();
  if (::close(fdv) != 0) throw_system("close", fmt::format("file {}", path));
}

UniqueFd open_append(const std::string& path, unsigned mode) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, static_cast<mode_t>(mode)));
  if (!fd) throw_system("open(O_APPEND)", fmt::format("file {}", path));
  return fd;
}

void append_text(int fd, std::string_view text, bool* cut_left) {
  if (cut_left != nullptr) *cut_left = false;
  struct stat st {};
  const bool sized = ::fstat(fd, &st) == 0;
  for (;;) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n >= 0 && static_cast<std::size_t>(n) == text.size()) return;
    const int err = n < 0 ? errno : ENOSPC;
    // A write the filesystem cut short (a full disk) left part of the text.
    if (n > 0 && (!sized || ::ftruncate(fd, st.st_size) != 0) && cut_left != nullptr) *cut_left = true;
    throw_system("write", fmt::format("fd {}{}", fd, n < 0 ? "" : " (short)"), err);
  }
}

std::string read_text(const std::string& path, std::optional<PathStatus>* status) {
  if (status != nullptr) status->reset();
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (!fd) {
    if (errno == ENOENT) return {};
    throw_system("open", fmt::format("file {}", path));
  }
  if (status != nullptr) {
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw_system("fstat", fmt::format("file {}", path));
    *status = PathStatus{S_ISREG(st.st_mode), st.st_uid, static_cast<unsigned>(st.st_mode & 07777)};
    if (!S_ISREG(st.st_mode)) return {};  // (the caller refuses it; a FIFO or device is not read)
  }
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_system("read", fmt::format("file {}", path));
    if (n == 0) return out;
    out.append(buf, static_cast<std::size_t>(n));
  }
}

void replace_file(const std::string& path, std::string_view text, unsigned mode) {
  const std::string tmp = path + ".tmp";
  (void)::unlink(tmp.c_str());
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, static_cast<mode_t>(mode)));
    if (!fd) throw_system("open", fmt::format("file {}", tmp));
    if (!text.empty()) append_text(fd.get(), text);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw_system("rename", fmt::format("{} to {}", tmp, path));
}

std::string find_in_path(const std::string& program) {
  if (program.empty()) return {};
  if (program.find('/') != std::string::npos) return is_executable(program) ? program : std::string();
  const char* path = std::getenv("PATH");  // NOLINT(concurrency-mt-unsafe): nothing in gpuipc calls setenv
  std::string_view rest = path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin";
  while (!rest.empty()) {
    const std::size_t colon = rest.find(':');
    const std::string_view dir = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view() : rest.substr(colon + 1);
    if (dir.empty()) continue;  // never the current folder by accident
    std::string candidate = fmt::format("{}/{}", dir, program);
    if (is_executable(candidate)) return candidate;
  }
  return {};
}

CapturedRun run_captured(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                         std::string_view input, std::chrono::milliseconds timeout) {
  if (argv.empty()) throw Error(ErrorCode::InvalidArgument, "run_captured: no program", "posix_spawn", EINVAL);
  const std::string program = find_in_path(argv[0]);
  if (program.empty()) {
    throw Error(ErrorCode::NotFound, fmt::format("{} is not on PATH", argv[0]), "posix_spawn", ENOENT);
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // This process's environment, minus the names `env` sets, then `env`.
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    const bool replaced = std::any_of(env.begin(), env.end(), [&](const std::string& x) {
      return x.size() > name.size() && x.compare(0, name.size(), name) == 0 && x[name.size()] == '=';
    });
    if (!replaced) envp.push_back(*e);
  }
  for (const std::string& x : env) envp.push_back(const_cast<char*>(x.c_str()));
  envp.push_back(nullptr);

  // stdin: a memfd holding `input` (no pipe to feed, so neither a SIGPIPE nor a full pipe to handle).
  UniqueFd in = above_stdio(memfd_create("run_captured stdin", 0), "stdin memfd");
  for (std::size_t done = 0; done < input.size();) {
    const ssize_t n = ::write(in.get(), input.data() + done, input.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw_system("write", "stdin of " + program);
    done += static_cast<std::size_t>(n);
  }
  if (::lseek(in.get(), 0, SEEK_SET) != 0) throw_system("lseek", "stdin of " + program);
  int out_fds[2] = {-1, -1};
  if (::pipe2(out_fds, O_CLOEXEC) != 0) throw_system("pipe2", "output of " + program);
  UniqueFd out_read(out_fds[0]);
  UniqueFd out_write = above_stdio(UniqueFd(out_fds[1]), "output pipe");
  // The program starts with no signal blocked and every signal at its default, whatever this process does with
  // them (it may start a daemon: nvidia-cuda-mps-control -d).
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  int rc = posix_spawn_file_actions_init(&actions);
  if (rc == 0) {
    rc = posix_spawnattr_init(&attr);
    if (rc != 0) posix_spawn_file_actions_destroy(&actions);
  }
  if (rc != 0) throw Error(ErrorCode::System, "posix_spawn: out of memory", "posix_spawn", rc);
  pid_t pid = -1;
  for (const int r : {posix_spawn_file_actions_adddup2(&actions, in.get(), 0),
                      posix_spawn_file_actions_adddup2(&actions, out_write.get(), 1),
                      posix_spawn_file_actions_adddup2(&actions, out_write.get(), 2),
                      posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF),
                      posix_spawnattr_setsigmask(&attr, &none), posix_spawnattr_setsigdefault(&attr, &all)}) {
    if (rc == 0) rc = r;
  }
  if (rc == 0) rc = ::posix_spawn(&pid, program.c_str(), &actions, &attr, args.data(), envp.data());
  posix_spawnattr_destroy(&attr);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    throw Error(ErrorCode::System, fmt::format("cannot start {}: {}", program, std::strerror(rc)), "posix_spawn", rc);
  }
  in.reset();
  out_write.reset();

  // Read until the program has exited and its output is drained, not until EOF: a program that starts a daemon
  // may leave it holding the pipe. Everything, draining included, within `timeout`.
  CapturedRun run;
  const std::int64_t deadline = monotonic_ns() + std::chrono::nanoseconds(timeout).count();
  int status = 0;
  bool exited = false;
  bool known = true;  // false when waitpid could not say how it ended
  for (bool open_pipe = true;;) {
    if (!exited) {
      const pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w < 0 && errno != EINTR) known = false;
      exited = w == pid || (w < 0 && errno != EINTR);
    }
    if (monotonic_ns() >= deadline) {
      if (!exited) {
        ::kill(pid, SIGKILL);
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        run.exit_code = -1;
        return run;
      }
      break;  // exited, and whatever still writes to the pipe is not its output
    }
    bool read_some = false;
    pollfd p{out_read.get(), POLLIN, 0};
    if (open_pipe && ::poll(&p, 1, exited ? 0 : 20) > 0) {
      char buf[4096];
      const ssize_t got = ::read(out_read.get(), buf, sizeof buf);
      if (got > 0) {
        run.output.append(buf, static_cast<std::size_t>(got));
        read_some = true;
      } else if (got == 0 || errno != EINTR) {
        open_pipe = false;  // EOF
      }
    }
    if (exited && !read_some) break;
    // The pipe at EOF and the program not gone yet: nothing to poll, so the loop would spin on waitpid.
    if (!open_pipe && !exited) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (known && WIFEXITED(status)) {
    run.exit_code = WEXITSTATUS(status);
  } else if (known && WIFSIGNALED(status)) {
    run.exit_code = 128 + WTERMSIG(status);
  }
  return run;
}

}  // namespace gpuipc::os
