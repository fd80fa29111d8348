// The broker's closer of client fds (src/broker/fd_closer.hpp): what it is given is closed, off the caller's thread,
// and its threads take no signal (the broker reads its stop signals from a signalfd).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <span>
#include <thread>
#include <vector>

#include "broker/fd_closer.hpp"
#include "os/memfd.hpp"
#include "os/socket.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using namespace std::chrono_literals;

TEST(BrokerFdCloser, ClosesWhatItIsGivenAndLeavesTheCallerNone) {
  broker::FdCloser closer;
  std::vector<os::UniqueFd> fds;
  std::vector<int> numbers;
  for (int i = 0; i < 8; ++i) {
    int p[2];
    ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
    fds.emplace_back(p[0]);
    fds.emplace_back(p[1]);
  }
  fds.emplace_back();  // an empty one is skipped
  for (const auto& fd : fds) numbers.push_back(fd.get());
  closer.close_later(fds);
  EXPECT_TRUE(fds.empty());
  ASSERT_TRUE(wait_until([&] { return closer.pending() == 0; }, 10s));
  for (const int n : numbers) {
    if (n >= 0) {
      EXPECT_EQ(::fcntl(n, F_GETFD), -1) << "fd " << n << " still open";
    }
  }
}

TEST(BrokerFdCloser, ItsThreadsAreMadeWithEverySignalBlocked) {
  // Made while this thread takes SIGTERM: a closer thread that took it would end the process.
  sigset_t none;
  sigemptyset(&none);
  sigset_t before;
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, &none, &before), 0);
  {
    broker::FdCloser closer;
    sigset_t term;
    sigemptyset(&term);
    sigaddset(&term, SIGTERM);
    ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &term, nullptr), 0);
    // Pending for the process, SIGTERM goes to a thread that does not block it: none does now, so it stays pending.
    ASSERT_EQ(::kill(::getpid(), SIGTERM), 0);
    std::this_thread::sleep_for(50ms);
    sigset_t pending;
    ASSERT_EQ(sigpending(&pending), 0);
    EXPECT_EQ(sigismember(&pending, SIGTERM), 1);
    int sig = 0;
    ASSERT_EQ(sigwait(&term, &sig), 0);  // taken back
  }
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, &before, nullptr), 0);
}

// A close that cannot be ended (a TCP socket lingering over unsent data, sent inside a unix socket's unread message,
// where the broker cannot unset SO_LINGER first) held every fd queued after it: the broker's fd count grew to its
// limit. Another thread closes what follows.
TEST(BrokerFdCloser, AStuckCloseDoesNotHoldUpTheFdsAfterIt) {
  os::UniqueFd peer;
  os::UniqueFd slow = lingering_socket(30, peer);
  int pair[2] = {-1, -1};
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  os::UniqueFd sender(pair[0]);
  os::UniqueFd carrier(pair[1]);
  const std::vector<std::byte> byte(1, std::byte{1});
  const int inside = slow.get();
  ASSERT_EQ(os::send_message(sender.get(), byte, std::span<const int>(&inside, 1), 16), os::IoStatus::Ok);
  slow.reset();
  sender.reset();
  broker::FdCloser closer;
  std::vector<os::UniqueFd> first;
  first.push_back(std::move(carrier));  // its close closes the lingering socket's last reference
  closer.close_later(first);
  std::vector<os::UniqueFd> later;
  for (int i = 0; i < 4; ++i) later.push_back(os::memfd_create("after-the-stuck-one", 4096));
  closer.close_later(later);
  EXPECT_TRUE(wait_until([&] { return closer.pending() == 1; }, 10s)) << closer.pending() << " not closed";
  // The one left is the stuck close (its linger is 30 s): else the test would pass testing nothing.
  EXPECT_FALSE(wait_until([&] { return closer.pending() == 0; }, 500ms)) << "the carrier's close did not block";
  peer.reset();  // the lingering close ends (the peer resets the connection)
  EXPECT_TRUE(wait_until([&] { return closer.pending() == 0; }, 10s)) << closer.pending();
}

}  // namespace
}  // namespace gpuipc::test
