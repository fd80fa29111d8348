// UniqueFd and ParentOnlyFd ownership, dup_fd and count_open_fds.
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <thread>
#include <utility>
#include <vector>

#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "os/socket.hpp"
#include "support/atfork_probe.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

using namespace std::chrono_literals;

bool fd_is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

std::pair<int, int> make_pipe() {
  int fds[2] = {-1, -1};
  EXPECT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  return {fds[0], fds[1]};
}

TEST(OsFd, DestructorClosesAndDefaultIsInvalid) {
  const os::UniqueFd empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_FALSE(static_cast<bool>(empty));
  EXPECT_EQ(empty.get(), -1);

  auto [r, w] = make_pipe();
  {
    const os::UniqueFd owner(r);
    EXPECT_TRUE(owner.valid());
    EXPECT_EQ(owner.get(), r);
    EXPECT_TRUE(fd_is_open(r));
  }
  EXPECT_FALSE(fd_is_open(r));
  ::close(w);
}

TEST(OsFd, MoveTransfersOwnership) {
  auto [r, w] = make_pipe();
  os::UniqueFd a(r);
  os::UniqueFd b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is what is tested
  EXPECT_EQ(b.get(), r);

  os::UniqueFd c(w);
  c = std::move(b);  // closes w, takes r
  EXPECT_FALSE(fd_is_open(w));
  EXPECT_EQ(c.get(), r);
  EXPECT_TRUE(fd_is_open(r));

  os::UniqueFd& alias = c;
  c = std::move(alias);  // self-move keeps the fd
  EXPECT_EQ(c.get(), r);
  EXPECT_TRUE(fd_is_open(r));
}

TEST(OsFd, ReleaseAndReset) {
  auto [r, w] = make_pipe();
  os::UniqueFd a(r);
  const int raw = a.release();
  EXPECT_EQ(raw, r);
  EXPECT_FALSE(a.valid());
  EXPECT_TRUE(fd_is_open(r));  // release does not close

  a.reset(raw);
  a.reset(raw);  // resetting to the owned fd must not close it
  EXPECT_TRUE(fd_is_open(r));
  a.reset(w);
  EXPECT_FALSE(fd_is_open(r));
  EXPECT_TRUE(fd_is_open(w));
  a.reset();
  EXPECT_FALSE(fd_is_open(w));
  EXPECT_FALSE(a.valid());
}

TEST(OsFd, DupFdIsCloexecAndSharesTheFile) {
  auto [r, w] = make_pipe();
  const os::UniqueFd read_end(r);
  const os::UniqueFd write_end(w);
  // Clear CLOEXEC on the original so the copy's flag is dup_fd's doing.
  ASSERT_EQ(::fcntl(w, F_SETFD, 0), 0);
  const os::UniqueFd copy = os::dup_fd(w, "pipe");
  ASSERT_TRUE(copy.valid());
  EXPECT_NE(copy.get(), w);
  EXPECT_EQ(::fcntl(copy.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  ASSERT_EQ(::write(copy.get(), "z", 1), 1);
  char c = 0;
  ASSERT_EQ(::read(r, &c, 1), 1);
  EXPECT_EQ(c, 'z');
}

TEST(OsFd, DupOfBadFdThrowsNamingWhat) {
  try {
    (void)os::dup_fd(-1, "the thing");
    FAIL() << "dup_fd(-1) did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::System);
    EXPECT_EQ(e.sys_errno(), EBADF);
    EXPECT_NE(std::string(e.what()).find("the thing"), std::string::npos) << e.what();
    EXPECT_NE(e.call().find("fcntl"), std::string::npos);
  }
}

TEST(OsFd, CountOpenFdsTracksOpenAndClose) {
  const int before = os::count_open_fds();
  EXPECT_GE(before, 0);
  int fds[2] = {-1, -1};
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  EXPECT_EQ(os::count_open_fds(), before + 2) << test::describe_open_fds();
  ::close(fds[0]);
  ::close(fds[1]);
  EXPECT_EQ(os::count_open_fds(), before) << test::describe_open_fds();
}

bool is_dev_null(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == 1 && minor(st.st_rdev) == 3;
}

/// Whether poll says the pipe's read end `r` has hung up (every write end closed) within `timeout_ms`.
bool hung_up(int r, int timeout_ms) {
  pollfd p{r, POLLIN, 0};
  return ::poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLHUP) != 0;
}

TEST(ParentOnlyFd, AForkedChildHoldsDevNullInItsPlace) {
  // The point: the parent closing its end is the end of it, whatever children it forked live on.
  auto [r, w] = make_pipe();
  const os::UniqueFd read_end(r);
  os::ParentOnlyFd write_end([w = w] { return os::UniqueFd(w); });
  ASSERT_TRUE(write_end.recorded());
  EXPECT_EQ(write_end.get(), w);
  test::SyncPipe checked;
  const pid_t child = test::start_child([&] {
    GPUIPC_CHILD_CHECK(is_dev_null(w));  // the same number, another file
    checked.notify();
    ::pause();  // lives on, holding what it inherited
    return 0;
  });
  ASSERT_TRUE(checked.wait(10s));
  EXPECT_FALSE(is_dev_null(w));  // the parent's is still the pipe
  write_end.reset();
  EXPECT_FALSE(write_end.valid());
  EXPECT_TRUE(hung_up(r, 5000));  // the child's copy was not the pipe's
  ::kill(child, SIGKILL);
  EXPECT_EQ(test::wait_child(child), 128 + SIGKILL);
}

TEST(ParentOnlyFd, MovesKeepTheRecordAndAnEmptyMakeRecordsNothing) {
  auto [r, w] = make_pipe();
  const os::UniqueFd read_end(r);
  os::ParentOnlyFd a([w = w] { return os::UniqueFd(w); });
  os::ParentOnlyFd b(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is what is tested
  EXPECT_TRUE(b.recorded());
  os::ParentOnlyFd c;
  c = std::move(b);
  EXPECT_EQ(c.get(), w);
  EXPECT_EQ(test::run_child([&] {
              GPUIPC_CHILD_CHECK(is_dev_null(w));
              return 0;
            }),
            0);
  c.reset();
  EXPECT_FALSE(fd_is_open(w));
  const os::ParentOnlyFd none([] { return os::UniqueFd(); });
  EXPECT_FALSE(none.valid());
  EXPECT_FALSE(none.recorded());
  EXPECT_THROW(os::ParentOnlyFd([]() -> os::UniqueFd { throw Error(ErrorCode::System, "made nothing"); }), Error);
}

TEST(ParentOnlyFd, AnyNumberIsRecordedAndEachIsDevNullInAChild) {
  // The record grows: a process with many watchers' connections keeps every one of them from its children (the
  // record used to stop at 64, and a child kept the rest open).
  constexpr int kCount = 300;
  std::vector<os::ParentOnlyFd> fds;
  for (int i = 0; i < kCount; ++i) fds.emplace_back(os::seqpacket_socket);
  for (int i = 0; i < kCount; ++i) EXPECT_TRUE(fds[static_cast<std::size_t>(i)].recorded()) << i;
  fds[5].reset();  // a slot comes free, and is taken again
  fds[5] = os::ParentOnlyFd(os::seqpacket_socket);
  EXPECT_TRUE(fds[5].recorded());
  EXPECT_EQ(test::run_child([&] {
              for (const auto& fd : fds) GPUIPC_CHILD_CHECK(is_dev_null(fd.get()));
              return 0;
            }),
            0);
  for (const auto& fd : fds) EXPECT_FALSE(is_dev_null(fd.get()));
}

TEST(ParentOnlyFd, AChildsLeftoverCopyClosingDoesNotForgetTheChildsOwn) {
  // In the child the parent's objects still exist (over /dev/null); the child's own may take their slots, and
  // the leftovers' close must not clear those.
  auto [r, w] = make_pipe();
  const os::UniqueFd read_end(r);
  os::ParentOnlyFd parents([w = w] { return os::UniqueFd(w); });
  EXPECT_EQ(test::run_child([&] {
              auto [r2, w2] = make_pipe();
              const os::ParentOnlyFd own([w2 = w2] { return os::UniqueFd(w2); });
              parents.reset();  // the leftover: closes its /dev/null
              const int grandchild = test::run_child([w2 = w2] { return is_dev_null(w2) ? 0 : 1; });
              GPUIPC_CHILD_CHECK(grandchild == 0);
              ::close(r2);
              return 0;
            }),
            0);
}

extern "C" void fork_in_handler(int /*sig*/) {
  const int saved = errno;
  const pid_t kid = ::fork();
  if (kid == 0) ::_exit(0);
  if (kid > 0) (void)::waitpid(kid, nullptr, 0);
  errno = saved;
}

TEST(ParentOnlyFd, ASignalHandlerThatForksWhileItsThreadHoldsTheGateDoesNotHang) {
  // The gate blocks signals in the thread that holds it: a handler run inside it that forked would wait for the
  // gate its own thread holds, for ever.
  EXPECT_EQ(test::run_child(
                [] {
                  struct sigaction sa {};
                  sa.sa_handler = fork_in_handler;
                  ::sigaction(SIGUSR1, &sa, nullptr);
                  std::atomic<bool> stop{false};
                  std::thread maker([&] {
                    while (!stop.load()) os::ParentOnlyFd sock(os::seqpacket_socket);
                  });
                  for (int i = 0; i < 500; ++i) {
                    ::pthread_kill(maker.native_handle(), SIGUSR1);
                    std::this_thread::sleep_for(200us);
                  }
                  stop = true;
                  maker.join();
                  return 0;
                },
                20s),
            0);
}

TEST(ParentOnlyFd, TheFirstGateRegistersItsForkHandlersWithEverySignalBlocked) {
  // The first gate in a process registers the fork handlers: pthread_atfork, under glibc's atfork lock, which fork(2)
  // takes too. A handler that forked inside the registration waited for the lock its own thread held, for ever. The
  // test above hung so, now and then, under load: each of its children makes its first gate while signals arrive,
  // and gdb showed the forking handler on top of __register_atfork. The window is a few instructions wide; the probe
  // sees the mask the registration runs under instead.
  constexpr int kNoProbe = 2;
  const int code = test::run_child([] {
    const os::ParentOnlyFd sock(os::seqpacket_socket);  // the first gate in this process, if none came before
    const test::AtforkRegistrations seen = test::atfork_registrations();
    if (seen.count == 0) return kNoProbe;
    GPUIPC_CHILD_CHECK(seen.with_signals_open == 0);
    return 0;
  });
  if (code == kNoProbe) GTEST_SKIP() << "pthread_atfork does not reach the probe's __register_atfork in this build";
  EXPECT_EQ(code, 0);
}

TEST(ParentOnlyFd, ForksInOtherThreadsNeverSeeOneHalfMadeOrHalfClosed) {
  // One thread makes and closes sockets as ParentOnlyFds in a loop while this one forks: a child must never hold
  // one of them as a socket, which it would if a fork fell between socket() and its record, or between the
  // record's removal and close().
  const auto sockets_held = [] {
    int n = 0;
    for (int fd = 0; fd < 1024; ++fd) {
      struct stat st {};
      if (::fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) ++n;
    }
    return n;
  };
  ASSERT_EQ(sockets_held(), 0) << "this test needs a process with no sockets open; it has: "
                               << test::describe_open_fds();
  std::atomic<bool> stop{false};
  std::atomic<long> made{0};
  std::thread maker([&] {
    while (!stop.load()) {
      os::ParentOnlyFd sock(os::seqpacket_socket);
      made.fetch_add(1);
    }
  });
  int leaked = 0;
  constexpr int kForks = 300;
  for (int i = 0; i < kForks; ++i) {
    const int code = test::run_child([&] { return sockets_held() == 0 ? 0 : 1; });
    ASSERT_TRUE(code == 0 || code == 1) << code;
    leaked += code;
  }
  stop = true;
  maker.join();
  EXPECT_EQ(leaked, 0) << "of " << kForks << " children, while " << made.load() << " sockets were made";
  EXPECT_GT(made.load(), 0);
}

}  // namespace
}  // namespace gpuipc
