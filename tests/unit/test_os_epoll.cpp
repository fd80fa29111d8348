// Epoll: add, modify, remove, wait with timeouts.
#include <sys/epoll.h>

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <csignal>
#include <thread>

#include "gpuipc/error.hpp"
#include "os/epoll.hpp"
#include "os/process.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

using namespace std::chrono_literals;

TEST(OsEpoll, AddModifyRemoveWait) {
  os::Epoll ep;
  ASSERT_GE(ep.fd(), 0);
  const os::UniqueFd efd = os::event_fd();
  const os::UniqueFd other = os::event_fd();
  std::array<epoll_event, 4> events{};

  ep.add(efd.get(), EPOLLIN, 42);
  ep.add(other.get(), EPOLLIN, 43);
  EXPECT_EQ(ep.wait(events, 0), 0) << "nothing ready";

  os::event_fd_signal(efd.get());
  ASSERT_EQ(ep.wait(events, 1'000), 1);
  EXPECT_EQ(events[0].data.u64, 42u);
  EXPECT_NE(events[0].events & EPOLLIN, 0u);

  ep.modify(efd.get(), EPOLLIN, 7);  // new key, still ready (level-triggered)
  ASSERT_EQ(ep.wait(events, 1'000), 1);
  EXPECT_EQ(events[0].data.u64, 7u);

  ep.modify(efd.get(), 0, 7);  // interest in nothing: not reported although readable
  EXPECT_EQ(ep.wait(events, 0), 0);

  os::event_fd_signal(other.get());
  ASSERT_EQ(ep.wait(events, 1'000), 1);
  EXPECT_EQ(events[0].data.u64, 43u);

  ep.modify(efd.get(), EPOLLIN, 7);
  ASSERT_EQ(ep.wait(events, 1'000), 2);

  ep.remove(efd.get());
  ep.remove(other.get());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(ep.wait(events, 50), 0) << "removed fds are not reported";
  EXPECT_GE(std::chrono::steady_clock::now() - start, 45ms) << "the timeout was not waited for";
  ep.remove(efd.get());  // not registered: ignored
  ep.remove(-1);         // not an fd: ignored
}

TEST(OsEpoll, WaitSpinningReturnsWhatArrivesWhileItPollsAndKeepsTheTimeout) {
  os::Epoll ep;
  const os::UniqueFd efd = os::event_fd();
  ep.add(efd.get(), EPOLLIN, 9);
  std::array<epoll_event, 2> events{};

  // Nothing arrives: it polls for the spin, then sleeps only for the rest of the timeout (300 ms in all, where
  // spin + timeout would be 550).
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(ep.wait_spinning(events, 300, 250'000'000), 0);
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, 295ms);
  EXPECT_LT(took, 500ms) << "the spin must count against the timeout";

  // A spin longer than the timeout stops at the timeout.
  start = std::chrono::steady_clock::now();
  EXPECT_EQ(ep.wait_spinning(events, 20, 5'000'000'000), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1000ms);

  // An event written by another thread during the spin is returned, with its key.
  std::thread writer([&] {
    std::this_thread::sleep_for(5ms);
    os::event_fd_signal(efd.get());
  });
  ASSERT_EQ(ep.wait_spinning(events, 10'000, 2'000'000'000), 1);
  writer.join();
  EXPECT_EQ(events[0].data.u64, 9u);

  // One that is ready already is returned at once, and a spin of 0 is a plain wait.
  EXPECT_EQ(ep.wait_spinning(events, 0, 1'000'000), 1);
  EXPECT_EQ(ep.wait_spinning(events, -1, 0), 1);
  os::event_fd_drain(efd.get());
  EXPECT_EQ(ep.wait_spinning(events, 0, 0), 0);
}

TEST(OsEpoll, ErrorsNameTheCall) {
  os::Epoll ep;
  const os::UniqueFd efd = os::event_fd();
  ep.add(efd.get(), EPOLLIN, 1);
  try {
    ep.add(efd.get(), EPOLLIN, 1);
    FAIL() << "adding twice succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::AlreadyExists);
    EXPECT_NE(e.call().find("EPOLL_CTL_ADD"), std::string::npos);
  }
  const os::UniqueFd unregistered = os::event_fd();
  try {
    ep.modify(unregistered.get(), EPOLLIN, 1);
    FAIL() << "modifying an unregistered fd succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
  }
  std::array<epoll_event, 1> events{};
  EXPECT_THROW((void)ep.wait(std::span<epoll_event>(events.data(), 0), 0), Error);
}

TEST(OsEpoll, WaitRetriesSignalsAndKeepsItsDeadline) {
  os::Epoll ep;
  const os::UniqueFd efd = os::event_fd();
  ep.add(efd.get(), EPOLLIN, 5);
  std::array<epoll_event, 2> events{};
  const test::ScopedSignalCounter counter(SIGUSR1);
  const auto start = std::chrono::steady_clock::now();
  int n = -1;
  {
    // Five signals 50 ms apart before the deadline: restarting the timeout would end the wait at ~550 ms.
    const test::SignalPulser pulser(::pthread_self(), SIGUSR1, 50ms, 50ms, 5);
    n = ep.wait(events, 300);
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(n, 0);
  EXPECT_GE(elapsed, 295ms) << "a signal cut the wait short";
  EXPECT_LT(elapsed, 500ms) << "the timeout restarted after a signal";
  EXPECT_EQ(counter.count(), 5);

  std::jthread poker([fd = efd.get()] {
    std::this_thread::sleep_for(150ms);
    os::event_fd_signal(fd);
  });
  {
    const test::SignalPulser pulser(::pthread_self(), SIGUSR1, 20ms, 20ms);
    n = ep.wait(events, 10'000);
  }
  poker.join();
  ASSERT_EQ(n, 1);
  EXPECT_EQ(events[0].data.u64, 5u);
}

TEST(OsEpoll, MovesOwnership) {
  os::Epoll a;
  const int fd = a.fd();
  os::Epoll b(std::move(a));
  EXPECT_EQ(b.fd(), fd);
  EXPECT_EQ(a.fd(), -1);  // NOLINT(bugprone-use-after-move): the moved-from state is what is tested
}

}  // namespace
}  // namespace gpuipc
