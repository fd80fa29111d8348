// UniqueFd ownership, dup_fd and count_open_fds.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <utility>

#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

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

}  // namespace
}  // namespace gpuipc
