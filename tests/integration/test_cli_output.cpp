// The CLI's standard output: a write that fails (a full disk, a pipe whose reader went away) is an error, said on
// stderr with exit status 1, not a success; `top` stops at the first frame it cannot write, and `watch` stops when
// its reader goes away even while no event comes. Before, `ls --json > /dev/full` exited 0, `top | head -1` with
// SIGPIPE ignored ran for ever, and `watch NAME | head -1` until the next event. Runs the built binary.
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <string>
#include <vector>

#include "gpuipc/segment.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

extern char** environ;

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

using namespace std::chrono_literals;

/// Starts gpuipc with `args`, its stdout `out_fd` and its stderr the file `err_path`, SIGPIPE ignored when
/// `ignore_sigpipe` (as `trap '' PIPE` leaves it); this process's environment (its private broker). The caller
/// must wait_child the pid.
pid_t start_gpuipc(const std::vector<std::string>& args, int out_fd, const std::string& err_path, bool ignore_sigpipe) {
  const std::string program = build_bin_dir() + "/gpuipc";
  std::vector<std::string> words{program};
  words.insert(words.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (err < 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    struct sigaction sa {};
    sa.sa_handler = ignore_sigpipe ? SIG_IGN : SIG_DFL;
    ::sigaction(SIGPIPE, &sa, nullptr);
    ::dup2(out_fd, 1);
    ::dup2(err, 2);
    ::execve(program.c_str(), argv.data(), environ);
    ::_exit(127);
  }
  ::close(err);
  return pid;
}

/// Reads from `fd` until `text` was seen (true) or `timeout` passed or the writer closed (false).
bool read_until(int fd, const std::string& text, std::chrono::milliseconds timeout) {
  std::string seen;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (seen.find(text) == std::string::npos) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno != EINTR)) return false;
    if (n > 0) seen.append(buf, static_cast<std::size_t>(n));
  }
  return true;
}

TEST(CliOutput, AFailedWriteToStdoutExits1SayingSo) {
  const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  if (full < 0) GTEST_SKIP() << "no /dev/full here";
  const auto name = unique_name("out");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  const TempDir dir("gpuipc-out");
  for (const auto& args : std::vector<std::vector<std::string>>{{"ls", "--json"},
                                                                {"ls"},
                                                                {"stat", name},
                                                                {"who", name},
                                                                {"top", "-n", "2", "--json", "--interval", "0.05"},
                                                                {"watch", name, "--timeout", "10"},
                                                                {"--help"}}) {
    const auto t0 = std::chrono::steady_clock::now();
    const pid_t pid = start_gpuipc(args, full, dir.file("err"), false);
    ASSERT_GT(pid, 0);
    EXPECT_EQ(wait_child(pid, 30s), 1) << args[0];
    const auto err = read_file(dir.file("err")).value_or("");
    EXPECT_NE(err.find("gpuipc: could not write to standard output: No space left on device"), std::string::npos)
        << args[0] << ": " << err;
    EXPECT_EQ(err.find("could not write", err.find("could not write") + 1), std::string::npos)
        << args[0] << ": said once: " << err;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << args[0] << " went on after its first failed write";
  }
  ::close(full);
  Segment::unlink(name);
}

// `trap '' PIPE; gpuipc top --json | head -1`: each write failed with EPIPE, and top went on for ever.
TEST(CliOutput, TopStopsAtTheFirstFrameItCannotWrite) {
  const TempDir dir("gpuipc-out");
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  const pid_t pid = start_gpuipc({"top", "--json", "--interval", "0.05"}, p[1], dir.file("err"), true);
  ::close(p[1]);
  ASSERT_GT(pid, 0);
  EXPECT_TRUE(read_until(p[0], "\n", 20s)) << "no first frame";
  ::close(p[0]);  // the reader goes away
  EXPECT_EQ(wait_child(pid, 10s), 1) << "top went on after its reader went away";
  const auto err = read_file(dir.file("err")).value_or("");
  EXPECT_NE(err.find("gpuipc: could not write to standard output: Broken pipe"), std::string::npos) << err;
}

// `gpuipc watch NAME | head -1` ran until the next event (it only died writing it), however long that was.
TEST(CliOutput, WatchStopsWhenItsReaderGoesAwayWhileNoEventComes) {
  const auto name = unique_name("quiet");
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  const TempDir dir("gpuipc-out");
  for (const bool ignore_sigpipe : {false, true}) {
    int p[2];
    ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
    const pid_t pid = start_gpuipc({"watch", name, "--timeout", "60"}, p[1], dir.file("err"), ignore_sigpipe);
    ::close(p[1]);
    ASSERT_GT(pid, 0);
    EXPECT_TRUE(read_until(p[0], "watching " + name, 20s)) << "no watching line";
    const auto t0 = std::chrono::steady_clock::now();
    ::close(p[0]);
    EXPECT_EQ(wait_child(pid, 10s), 1) << "SIGPIPE ignored: " << ignore_sigpipe << ": watch went on";
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
    const auto err = read_file(dir.file("err")).value_or("");
    EXPECT_NE(err.find("gpuipc: could not write to standard output: Broken pipe"), std::string::npos) << err;
  }
  Segment::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
