// pidfd, process_alive, signalfd, eventfd, lock files, private directories, clocks and detached spawning.
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"
#include "support/atfork_probe.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

using namespace std::chrono_literals;

// A child that sleeps until killed (bounded: it leaves by itself after 30 s).
pid_t start_sleeper() {
  return test::start_child([] {
    std::this_thread::sleep_for(30s);
    return 0;
  });
}

TEST(OsProcess, PidfdReportsExit) {
  const pid_t child = start_sleeper();
  os::UniqueFd pidfd;
  try {
    pidfd = os::pidfd_open(child);
  } catch (const Error& e) {
    ::kill(child, SIGKILL);
    test::wait_child(child);
    if (e.code() == ErrorCode::Unsupported) GTEST_SKIP() << e.what();
    throw;
  }
  ASSERT_TRUE(pidfd.valid());
  EXPECT_EQ(::fcntl(pidfd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  EXPECT_TRUE(os::process_alive(child));
  EXPECT_FALSE(os::pidfd_wait_exit(pidfd.get(), 50)) << "the child is still running";

  ASSERT_EQ(::kill(child, SIGKILL), 0);
  EXPECT_TRUE(os::pidfd_wait_exit(pidfd.get(), 10'000));
  EXPECT_TRUE(os::pidfd_wait_exit(pidfd.get(), 0)) << "an exited process stays readable";
  EXPECT_EQ(test::wait_child(child), 128 + SIGKILL);
  EXPECT_FALSE(os::process_alive(child)) << "reaped";
}

TEST(OsProcess, PidfdOpenOfAMissingProcessIsNotFound) {
  const pid_t gone = test::start_child([] { return 0; });
  ASSERT_EQ(test::wait_child(gone), 0);  // reaped: the pid is free (reuse this soon is very unlikely)
  EXPECT_FALSE(os::process_alive(gone));
  try {
    (void)os::pidfd_open(gone);
    FAIL() << "pidfd_open of a reaped pid succeeded";
  } catch (const Error& e) {
    if (e.code() == ErrorCode::Unsupported) GTEST_SKIP() << e.what();
    EXPECT_EQ(e.code(), ErrorCode::NotFound) << e.what();
    EXPECT_EQ(e.call(), "pidfd_open");
    EXPECT_NE(std::string(e.what()).find(std::to_string(gone)), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)os::pidfd_open(0), Error);
}

TEST(OsProcess, ProcessAlive) {
  EXPECT_TRUE(os::process_alive(::getpid()));
  EXPECT_TRUE(os::process_alive(1)) << "init exists (EPERM, if any, counts as existing)";
  EXPECT_FALSE(os::process_alive(0)) << "0 would probe our process group";
  EXPECT_FALSE(os::process_alive(-1));
}

TEST(OsProcess, SignalFdDeliversSignalsSentToSelf) {
  sigset_t old;
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, nullptr, &old), 0);
  {
    const os::UniqueFd sigfd = os::signal_fd({SIGUSR1});
    ASSERT_TRUE(sigfd.valid());
    EXPECT_NE(::fcntl(sigfd.get(), F_GETFL) & O_NONBLOCK, 0);
    EXPECT_EQ(::fcntl(sigfd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
    sigset_t now;
    ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, nullptr, &now), 0);
    EXPECT_EQ(sigismember(&now, SIGUSR1), 1) << "signal_fd blocks the signal in the calling thread";

    EXPECT_EQ(os::read_signal(sigfd.get()), 0) << "nothing pending yet";
    // Without the block the default action of SIGUSR1 would kill the test process here.
    ASSERT_EQ(::raise(SIGUSR1), 0);
    EXPECT_TRUE(os::wait_readable(sigfd.get(), 5'000));
    EXPECT_EQ(os::read_signal(sigfd.get()), SIGUSR1);
    EXPECT_EQ(os::read_signal(sigfd.get()), 0) << "consumed";
  }
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, &old, nullptr), 0);
  EXPECT_THROW((void)os::signal_fd({9999}), Error);
}

namespace fork_counts {
std::atomic<int> prepared{0};
std::atomic<int> in_parent{0};
std::atomic<int> in_child{0};
void prepare() { prepared.fetch_add(1); }
void parent() { in_parent.fetch_add(1); }
void child() { in_child.fetch_add(1); }
}  // namespace fork_counts

TEST(OsProcess, AtForkRegistersWithEverySignalBlockedAndLeavesTheMaskAsItWas) {
  sigset_t before{};
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, nullptr, &before), 0);
  const test::AtforkRegistrations was = test::atfork_registrations();
  os::at_fork(fork_counts::prepare, fork_counts::parent, fork_counts::child);
  const test::AtforkRegistrations now = test::atfork_registrations();
  if (now.count == was.count) GTEST_SKIP() << "pthread_atfork does not reach the probe's __register_atfork here";
  EXPECT_EQ(now.count, was.count + 1);
  EXPECT_EQ(now.with_signals_open, was.with_signals_open) << "registered with a signal unblocked";
  sigset_t after{};
  ASSERT_EQ(::pthread_sigmask(SIG_SETMASK, nullptr, &after), 0);
  for (const int sig : {SIGUSR1, SIGTERM, SIGINT, SIGCHLD})
    EXPECT_EQ(sigismember(&after, sig), sigismember(&before, sig));
  EXPECT_EQ(test::run_child([] { return fork_counts::in_child.load() == 1 ? 0 : 1; }), 0);
  EXPECT_EQ(fork_counts::prepared.load(), 1);
  EXPECT_EQ(fork_counts::in_parent.load(), 1);
  EXPECT_EQ(fork_counts::in_child.load(), 0) << "the child's handler ran in the child only";
}

TEST(OsProcess, EventFdSignalsAndDrains) {
  const os::UniqueFd efd = os::event_fd();
  ASSERT_TRUE(efd.valid());
  EXPECT_NE(::fcntl(efd.get(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_FALSE(os::wait_readable(efd.get(), 0));
  os::event_fd_signal(efd.get());
  os::event_fd_signal(efd.get());
  EXPECT_TRUE(os::wait_readable(efd.get(), 0));
  os::event_fd_drain(efd.get());
  EXPECT_FALSE(os::wait_readable(efd.get(), 0)) << "one drain empties the counter";
  os::event_fd_drain(efd.get());  // draining an empty eventfd is harmless
  EXPECT_FALSE(os::wait_readable(efd.get(), 0));
}

TEST(OsProcess, LockFileIsExclusiveAcrossProcessesAndDiesWithItsHolder) {
  const test::TempDir dir;
  const std::string path = dir.file("daemon.lock");
  const test::SyncPipe locked;
  const pid_t holder = test::start_child([&] {
    const os::UniqueFd lock = os::try_lock_file(path);
    GPUIPC_CHILD_CHECK(lock.valid());
    locked.notify();
    std::this_thread::sleep_for(30s);  // until SIGKILLed
    return 0;
  });
  ASSERT_TRUE(locked.wait(10s));
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  EXPECT_FALSE(os::try_lock_file(path).valid()) << "the holder is alive";
  // A second child fails too (a different process, not just a different open file).
  EXPECT_EQ(test::run_child([&] { return os::try_lock_file(path).valid() ? 1 : 0; }), 0);

  ASSERT_EQ(::kill(holder, SIGKILL), 0);
  EXPECT_EQ(test::wait_child(holder), 128 + SIGKILL);
  const os::UniqueFd mine = os::try_lock_file(path);
  EXPECT_TRUE(mine.valid()) << "the lock died with its holder";
  EXPECT_EQ(test::run_child([&] { return os::try_lock_file(path).valid() ? 1 : 0; }), 0) << "now we hold it";
}

TEST(OsProcess, LockFileRefusesSymlinksAndMissingDirectories) {
  const test::TempDir dir;
  const std::string target = dir.file("target");
  const std::string link = dir.file("link");
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0);
  EXPECT_THROW((void)os::try_lock_file(link), Error);
  EXPECT_NE(::access(target.c_str(), F_OK), 0) << "nothing was created through the symlink";
  try {
    (void)os::try_lock_file(dir.file("missing/x.lock"));
    FAIL() << "a lock file in a missing directory was created";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_NE(std::string(e.what()).find("missing/x.lock"), std::string::npos) << e.what();
  }
}

mode_t mode_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::lstat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

TEST(OsProcess, EnsurePrivateDirCreatesWithTheMode) {
  const test::TempDir dir;
  const std::string path = dir.file("a/b/c");
  const mode_t old_umask = ::umask(077);  // the requested mode wins over the umask for the final directory
  os::ensure_private_dir(path, 0750);
  ::umask(old_umask);
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0750u);
  EXPECT_EQ(st.st_uid, ::getuid());
  EXPECT_NO_THROW(os::ensure_private_dir(path, 0750)) << "idempotent";
  EXPECT_NO_THROW(os::ensure_private_dir(path + "/", 0750)) << "a trailing slash is fine";
  EXPECT_NO_THROW(os::ensure_private_dir("/", 0755)) << "root-owned directories are fine";
}

TEST(OsProcess, EnsurePrivateDirRefusesUnsafeDirectories) {
  const test::TempDir dir;
  const auto expect_refused = [](const std::string& path, const char* hint) {
    try {
      os::ensure_private_dir(path, 0700);
      ADD_FAILURE() << path << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::PermissionDenied) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(hint), std::string::npos) << e.what();
    }
  };

  const std::string open_dir = dir.file("world");
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  expect_refused(open_dir, "chmod go-w");
  ASSERT_EQ(::chmod(open_dir.c_str(), 0770), 0);
  expect_refused(open_dir, "chmod go-w");
  ASSERT_EQ(::chmod(open_dir.c_str(), 01777), 0);  // sticky, like /tmp
  EXPECT_NO_THROW(os::ensure_private_dir(open_dir, 0700));
  EXPECT_EQ(mode_of(open_dir), 01777u) << "an existing directory's mode is left alone";

  const std::string link = dir.file("link");
  const std::string real = dir.file("real");
  ASSERT_EQ(::mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(::symlink(real.c_str(), link.c_str()), 0);
  expect_refused(link, "symbolic link");

  const std::string file = dir.file("file");
  test::write_file(file, "");
  expect_refused(file, "not a directory");

  if (::getuid() != 0) {
    // /proc is owned by root: accepted. A directory of another user is refused; find one that exists.
    EXPECT_NO_THROW(os::ensure_private_dir("/proc", 0755));
  }
}

TEST(OsProcess, RunCapturedFeedsInputSetsTheEnvironmentAndCollectsBothStreams) {
  const os::CapturedRun r = os::run_captured({"sh", "-c", "cat; echo \"$GPUIPC_T\" >&2; exit 3"},
                                             {"GPUIPC_T=replaced", "HOME=/nowhere"}, "from stdin\n", 10s);
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.output, "from stdin\nreplaced\n");
  EXPECT_EQ(os::run_captured({"sh", "-c", "echo $HOME"}, {"HOME=/nowhere"}, {}, 10s).output, "/nowhere\n");
  // A program that never reads its input does not block or kill the caller.
  EXPECT_EQ(os::run_captured({"true"}, {}, std::string(1 << 20, 'x'), 10s).exit_code, 0);
}

// A program that closes its output and runs on: the pipe is at EOF, so there is nothing to poll, and the loop spun on
// waitpid, a whole core, until the program exited.
TEST(OsProcess, RunCapturedWaitsWithoutSpinningForAProgramThatClosedItsOutput) {
  rusage before{};
  ASSERT_EQ(::getrusage(RUSAGE_THREAD, &before), 0);
  EXPECT_EQ(os::run_captured({"sh", "-c", "exec >&- 2>&-; sleep 1"}, {}, {}, 10s).exit_code, 0);
  rusage after{};
  ASSERT_EQ(::getrusage(RUSAGE_THREAD, &after), 0);
  const auto cpu = [](const rusage& r) {
    return std::chrono::seconds(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
           std::chrono::microseconds(r.ru_utime.tv_usec + r.ru_stime.tv_usec);
  };
  EXPECT_LT(cpu(after) - cpu(before), 300ms) << "CPU time spent waiting for a 1 s program";
}

TEST(OsProcess, RunCapturedKillsAtTheLimitAndSaysWhatIsMissing) {
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(os::run_captured({"sleep", "30"}, {}, {}, 200ms).exit_code, -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  EXPECT_EQ(os::run_captured({"sh", "-c", "kill -9 $$"}, {}, {}, 10s).exit_code, 128 + SIGKILL);
  try {
    (void)os::run_captured({"gpuipc-no-such-program"}, {}, {}, 10s);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_NE(std::string(e.what()).find("gpuipc-no-such-program is not on PATH"), std::string::npos);
  }
}

TEST(OsProcess, FindInPathTakesExecutableFilesOnlyAndNeverTheCurrentFolder) {
  EXPECT_FALSE(os::find_in_path("sh").empty());
  EXPECT_EQ(os::find_in_path("gpuipc-no-such-program"), "");
  EXPECT_EQ(os::find_in_path("/"), "");  // a folder is not a program
  test::TempDir dir;
  test::write_file(dir.file("prog"), "#!/bin/sh\n");
  ASSERT_EQ(::chmod(dir.file("prog").c_str(), 0700), 0);
  EXPECT_EQ(os::find_in_path(dir.file("prog")), dir.file("prog"));
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof cwd), nullptr);
  ASSERT_EQ(::chdir(dir.path().c_str()), 0);
  const char* old = std::getenv("PATH");
  const std::string saved = old != nullptr ? old : "";
  ::setenv("PATH", ":/nonexistent", 1);  // an empty entry: not "."
  EXPECT_EQ(os::find_in_path("prog"), "");
  ::setenv("PATH", saved.c_str(), 1);
  ASSERT_EQ(::chdir(cwd), 0);
}

TEST(OsProcess, MonotonicClockAndSelfExe) {
  const std::int64_t a = os::monotonic_ns();
  std::this_thread::sleep_for(10ms);
  const std::int64_t b = os::monotonic_ns();
  EXPECT_GE(b - a, 9'000'000);
  EXPECT_LT(b - a, 5'000'000'000);

  const std::string exe = os::self_exe_path();
  ASSERT_FALSE(exe.empty());
  EXPECT_EQ(exe[0], '/');
  EXPECT_NE(exe.find("unit_test_os_process"), std::string::npos) << exe;
}

TEST(OsProcess, SpawnDetachedRunsTheProgramInItsOwnSession) {
  const test::TempDir dir;
  const std::string out = dir.file("out");
  const std::string log = dir.file("log");
  // A descriptor without CLOEXEC that the detached program must not inherit (numbered high, away from the ones
  // the shell and ls open themselves).
  const int low = ::open("/dev/null", O_RDONLY);
  ASSERT_GE(low, 0);
  const int leaky = ::fcntl(low, F_DUPFD, 100);
  ::close(low);
  ASSERT_GE(leaky, 100);
  const std::string script = "ls /proc/self/fd > " + out + ".fds; readlink /proc/self/fd/0 > " + out +
                             ".stdin; echo to-stderr >&2; " + "cat /proc/$$/stat > " + out + ".tmp && mv " + out +
                             ".tmp " + out;
  os::spawn_detached({"/bin/sh", "-c", script}, log);
  ::close(leaky);

  // The intermediate child was reaped: this process has no child left.
  int status = 0;
  errno = 0;
  EXPECT_EQ(::waitpid(-1, &status, WNOHANG), -1);
  EXPECT_EQ(errno, ECHILD);

  ASSERT_TRUE(test::wait_until([&] { return ::access(out.c_str(), F_OK) == 0; }, 10s)) << "the script never ran";
  const auto stat = test::read_file(out);
  ASSERT_TRUE(stat.has_value());
  // "pid (sh) state ppid pgrp session ...": the shell runs in a session that is not ours.
  std::istringstream fields(stat->substr(stat->rfind(')') + 2));
  char state = 0;
  long ppid = 0, pgrp = 0, session = 0;
  fields >> state >> ppid >> pgrp >> session;
  EXPECT_GT(session, 0);
  EXPECT_NE(session, static_cast<long>(::getsid(0))) << "setsid did not run";
  const long shell_pid = std::stol(*stat);
  EXPECT_NE(shell_pid, static_cast<long>(::getpid()));
  EXPECT_NE(shell_pid, session) << "the program must not be a session leader (double fork)";

  const auto fds = test::read_file(out + ".fds");
  ASSERT_TRUE(fds.has_value());
  std::set<std::string> listed;
  std::istringstream lines(*fds);
  for (std::string line; std::getline(lines, line);) listed.insert(line);
  EXPECT_EQ(listed.count(std::to_string(leaky)), 0u) << "fd " << leaky << " leaked into the program: " << *fds;
  EXPECT_LE(listed.size(), 4u) << *fds;  // 0, 1, 2 and the one ls reads the directory with
  EXPECT_EQ(test::read_file(out + ".stdin"), "/dev/null\n");
  ASSERT_TRUE(
      test::wait_until([&] { return test::read_file(log).value_or("").find("to-stderr") != std::string::npos; }, 5s))
      << "stderr does not go to the log";
}

TEST(OsProcess, SpawnDetachedReportsAMissingProgram) {
  const test::TempDir dir;
  const std::string missing = dir.file("no-such-program");
  try {
    os::spawn_detached({missing, "--flag"}, "");
    FAIL() << "spawning a missing program did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound) << e.what();
    EXPECT_EQ(e.call(), "execv");
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  int status = 0;
  EXPECT_EQ(::waitpid(-1, &status, WNOHANG), -1) << "no zombie left";

  const std::string not_executable = dir.file("plain");
  test::write_file(not_executable, "#!/bin/sh\n");
  try {
    os::spawn_detached({not_executable}, "");
    FAIL() << "spawning a non-executable file did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::PermissionDenied) << e.what();
  }
  EXPECT_THROW(os::spawn_detached({"sh", "-c", "true"}, ""), Error) << "relative paths are refused";
  EXPECT_THROW(os::spawn_detached({}, ""), Error);
  EXPECT_THROW(os::spawn_detached({"/bin/true"}, dir.file("missing-dir/log")), Error) << "an unopenable log";
}

TEST(OsProcess, SpawnDetachedReturnsWhileAnotherThreadsForksHoldItsStatusPipe) {
  // A process that forks without exec (a worker pool) while spawn_detached runs: the children inherit the exec
  // status pipe, so its end of file comes only when they exit. spawn_detached waited for it, holding the client's
  // lock while the library started a broker: every call of the process hung as long as those children lived.
  constexpr int kSleepers = 300;
  std::atomic<bool> done{false};
  std::vector<pid_t> sleepers;
  sleepers.reserve(kSleepers);
  std::thread forker([&] {
    for (int i = 0; i < kSleepers; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::sleep(60);  // async-signal-safe only: this process has other threads
        ::_exit(0);
      }
      if (pid > 0) sleepers.push_back(pid);
    }
    done.store(true);
  });
  auto longest = std::chrono::steady_clock::duration::zero();
  int spawned = 0;
  while (!done.load()) {
    const auto start = std::chrono::steady_clock::now();
    os::spawn_detached({"/bin/true"}, "");
    longest = std::max(longest, std::chrono::steady_clock::now() - start);
    ++spawned;
  }
  forker.join();
  for (const pid_t pid : sleepers) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  EXPECT_GT(spawned, 0);
  // A bound on a wait that used to last as long as the sleepers (60 s), not a measure of speed.
  EXPECT_LT(longest, 20s) << "spawn_detached waited for processes it did not start";
}

}  // namespace
}  // namespace gpuipc
