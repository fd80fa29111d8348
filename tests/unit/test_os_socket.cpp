// SOCK_SEQPACKET sockets with fd passing: messages, fd leaks on truncation, limits, peer exit, credentials,
// listen/accept/connect, EINTR.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "os/memfd.hpp"
#include "os/socket.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

using namespace std::chrono_literals;
using os::IoStatus;

std::span<const std::byte> bytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

std::string text(std::span<const std::byte> buf, std::size_t size) {
  return std::string(reinterpret_cast<const char*>(buf.data()), size);
}

// A memfd holding `content`.
os::UniqueFd memfd_with(const std::string& content) {
  os::UniqueFd fd = os::memfd_create("test", content.size());
  EXPECT_EQ(::pwrite(fd.get(), content.data(), content.size(), 0), static_cast<ssize_t>(content.size()));
  return fd;
}

std::string content_of(int fd) {
  std::string out(os::fd_size(fd), '\0');
  EXPECT_EQ(::pread(fd, out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
  return out;
}

std::vector<int> raw(const std::vector<os::UniqueFd>& fds) {
  std::vector<int> out;
  for (const auto& fd : fds) out.push_back(fd.get());
  return out;
}

// sendmsg with the fds split into one SCM_RIGHTS cmsg per group: what a foreign (or hostile) peer may send,
// beyond what send_message allows.
ssize_t raw_send(int sock, std::string_view payload, const std::vector<std::vector<int>>& groups) {
  std::size_t space = 0;
  for (const auto& g : groups) space += CMSG_SPACE(g.size() * sizeof(int));
  std::vector<char> control(space);
  iovec iov{const_cast<char*>(payload.data()), payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = space ? control.data() : nullptr;
  msg.msg_controllen = space;
  cmsghdr* cmsg = space ? CMSG_FIRSTHDR(&msg) : nullptr;
  for (const auto& g : groups) {
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(g.size() * sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), g.data(), g.size() * sizeof(int));
    cmsg = CMSG_NXTHDR(&msg, cmsg);
  }
  return ::sendmsg(sock, &msg, MSG_NOSIGNAL);
}

TEST(OsSocket, FiveMemfdsInOneMessageAcrossFork) {
  auto [parent_end, child_end] = os::seqpacket_pair();
  const pid_t child = test::start_child([&, &child_sock = child_end] {
    std::vector<os::UniqueFd> memfds;
    std::vector<int> fds;
    for (int i = 0; i < 5; ++i) {
      memfds.push_back(
          memfd_with("segment number " + std::to_string(i) + std::string(static_cast<std::size_t>(i), '*')));
      fds.push_back(memfds.back().get());
    }
    GPUIPC_CHILD_CHECK(os::send_message(child_sock.get(), bytes("five"), fds) == IoStatus::Ok);
    return 0;
  });
  child_end.reset();

  ASSERT_TRUE(os::wait_readable(parent_end.get(), 10'000));
  std::array<std::byte, 64> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(parent_end.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "five");
  ASSERT_EQ(fds.size(), 5u);
  for (std::size_t i = 0; i < fds.size(); ++i) {
    EXPECT_EQ(content_of(fds[i].get()), "segment number " + std::to_string(i) + std::string(i, '*'));
    EXPECT_EQ(::fcntl(fds[i].get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC) << "received fds must be CLOEXEC";
  }
  EXPECT_EQ(test::wait_child(child), 0);
}

TEST(OsSocket, FdsAfterAnotherCmsgAreCollected) {
  // With SO_PASSCRED the kernel puts an SCM_CREDENTIALS cmsg before the SCM_RIGHTS one: a receiver that looks at
  // the first cmsg only would miss (and leak) the fds. The sender splits its fds over two SCM_RIGHTS cmsgs too.
  auto [a, b] = os::seqpacket_pair();
  const int on = 1;
  ASSERT_EQ(::setsockopt(b.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof(on)), 0);
  std::vector<os::UniqueFd> memfds;
  std::vector<std::vector<int>> groups(2);
  for (int i = 0; i < 5; ++i) {
    memfds.push_back(memfd_with("fd" + std::to_string(i)));
    groups[i < 2 ? 0 : 1].push_back(memfds.back().get());
  }
  ASSERT_EQ(raw_send(a.get(), "split", groups), 5);
  const int before = os::count_open_fds();
  std::array<std::byte, 16> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "split");
  ASSERT_EQ(fds.size(), 5u);
  for (std::size_t i = 0; i < fds.size(); ++i) EXPECT_EQ(content_of(fds[i].get()), "fd" + std::to_string(i));
  EXPECT_EQ(os::count_open_fds(), before + 5);

  // kMaxFds fds still fit behind the credentials cmsg.
  const std::vector<int> max_fds(os::kMaxFds, memfds[0].get());
  ASSERT_EQ(os::send_message(a.get(), bytes("max"), max_fds), IoStatus::Ok);
  fds.clear();
  ASSERT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(fds.size(), os::kMaxFds);
  fds.clear();

  // Truncated behind a credentials cmsg: still nothing leaks.
  ASSERT_EQ(raw_send(a.get(), "again", groups), 5);
  fds.clear();
  EXPECT_EQ(os::receive_message(b.get(), buf, size, fds, 4), IoStatus::Truncated);
  EXPECT_EQ(os::count_open_fds(), before) << test::describe_open_fds();
}

std::vector<int> first(const std::vector<os::UniqueFd>& fds, std::size_t n) {
  std::vector<int> out = raw(fds);
  out.resize(n);
  return out;
}

TEST(OsSocket, MoreFdsThanAllowedIsTruncatedAndLeaksNothing) {
  auto [a, b] = os::seqpacket_pair();
  std::vector<os::UniqueFd> memfds;
  for (int i = 0; i < 5; ++i) memfds.push_back(memfd_with("content " + std::to_string(i)));
  ASSERT_EQ(os::send_message(a.get(), bytes("too many"), raw(memfds)), IoStatus::Ok);

  const int before = os::count_open_fds();
  std::array<std::byte, 64> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  fds.push_back(memfd_with("stale"));  // receive_message clears (and closes) what the vector held
  EXPECT_EQ(os::count_open_fds(), before + 1);
  EXPECT_EQ(os::receive_message(b.get(), buf, size, fds, /*max_fds=*/2), IoStatus::Truncated);
  EXPECT_TRUE(fds.empty());
  EXPECT_EQ(os::count_open_fds(), before) << test::describe_open_fds();

  // The socket stays usable: the next message arrives whole, with max_fds fds exactly.
  ASSERT_EQ(os::send_message(a.get(), bytes("next"), first(memfds, 2)), IoStatus::Ok);
  ASSERT_EQ(os::receive_message(b.get(), buf, size, fds, 2), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "next");
  ASSERT_EQ(fds.size(), 2u);
  EXPECT_EQ(content_of(fds[1].get()), "content 1");
  EXPECT_EQ(os::count_open_fds(), before + 2);
}

TEST(OsSocket, OversizedPayloadIsTruncatedAndLeaksNothing) {
  auto [a, b] = os::seqpacket_pair();
  std::vector<os::UniqueFd> memfds;
  for (int i = 0; i < 3; ++i) memfds.push_back(memfd_with("y"));
  const std::string big(100, 'b');
  ASSERT_EQ(os::send_message(a.get(), bytes(big), raw(memfds)), IoStatus::Ok);

  const int before = os::count_open_fds();
  std::array<std::byte, 10> small{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  EXPECT_EQ(os::receive_message(b.get(), small, size, fds), IoStatus::Truncated);
  EXPECT_TRUE(fds.empty());
  EXPECT_LE(size, small.size());
  EXPECT_EQ(os::count_open_fds(), before) << test::describe_open_fds();
}

TEST(OsSocket, TruncatedControlDataLeaksNothing) {
  // 64 fds do not fit the receiver's control buffer (room for about kMaxFds): the kernel installs what fits and
  // sets MSG_CTRUNC; receive_message must close those.
  auto [a, b] = os::seqpacket_pair();
  const os::UniqueFd memfd = memfd_with("z");
  const std::vector<int> many(64, memfd.get());
  ASSERT_EQ(raw_send(a.get(), "ctrunc", {many}), 6);

  const int before = os::count_open_fds();
  std::array<std::byte, 64> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  EXPECT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::Truncated);
  EXPECT_TRUE(fds.empty());
  EXPECT_EQ(os::count_open_fds(), before) << test::describe_open_fds();
}

// The kernel stops installing a message's fds at the receiver's RLIMIT_NOFILE and says only MSG_CTRUNC, as for a
// control buffer too small: taken for "too large", a broker closed the connection of a client that did nothing wrong
// (and repaired its members as if it had died), and a client that hit its own limit took the broker for gone.
TEST(OsSocket, FdsTheReceiverHasNoRoomForAreSaidSoAndTheMessageStillComes) {
  auto [a, b] = os::seqpacket_pair();
  const os::UniqueFd memfd = memfd_with("m");
  ASSERT_EQ(raw_send(a.get(), "request", {{memfd.get()}}), 7);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    (void)test::use_up_fds();
    std::array<std::byte, 64> buf{};
    std::size_t size = 0;
    std::vector<os::UniqueFd> fds;
    std::vector<os::UniqueFd> refused;
    const auto st = os::receive_message(b.get(), buf, size, fds, os::kMaxFds, &refused);
    const bool ok = st == IoStatus::FdsDropped && size == 7 && fds.empty() && refused.empty() &&
                    std::memcmp(buf.data(), "request", 7) == 0;
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST(OsSocket, OversizedMessagesAreRefusedBeforeSending) {
  auto [a, b] = os::seqpacket_pair();
  os::set_nonblocking(b.get(), true);

  const std::string over_default(65537, 'o');
  try {
    os::send_message(a.get(), bytes(over_default));
    FAIL() << "a 65537-byte message was not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("65537"), std::string::npos) << e.what();
  }
  EXPECT_THROW(os::send_message(a.get(), bytes("eleven byte"), {}, 10), Error);
  EXPECT_EQ(os::send_message(a.get(), bytes("ten bytes!"), {}, 10), IoStatus::Ok);  // the limit itself is fine

  const os::UniqueFd memfd = memfd_with("f");
  const std::vector<int> too_many(os::kMaxFds + 1, memfd.get());
  try {
    os::send_message(a.get(), bytes("fds"), too_many);
    FAIL() << "kMaxFds + 1 fds were not refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
  }
  const std::vector<int> max_fds(os::kMaxFds, memfd.get());
  EXPECT_EQ(os::send_message(a.get(), bytes("max"), max_fds), IoStatus::Ok);

  // Only the two accepted messages went out.
  std::array<std::byte, 64> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "ten bytes!");
  ASSERT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "max");
  EXPECT_EQ(fds.size(), os::kMaxFds);
  EXPECT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::WouldBlock);
}

TEST(OsSocket, EmptyPayloadIsRefused) {
  // A zero-length seqpacket would read as end-of-stream on the other side.
  auto [a, b] = os::seqpacket_pair();
  EXPECT_THROW(os::send_message(a.get(), {}), Error);
}

TEST(OsSocket, ClosedWhenThePeerProcessExits) {
  auto [mine, theirs] = os::seqpacket_pair();
  const pid_t child = test::start_child([] { return 0; });  // exits holding its copy of `theirs`
  theirs.reset();
  EXPECT_EQ(test::wait_child(child), 0);

  ASSERT_TRUE(os::wait_readable(mine.get(), 5'000));
  std::array<std::byte, 16> buf{};
  std::size_t size = 99;
  std::vector<os::UniqueFd> fds;
  EXPECT_EQ(os::receive_message(mine.get(), buf, size, fds), IoStatus::Closed);
  EXPECT_EQ(size, 0u);
  // Sending to a closed peer reports Closed and raises no SIGPIPE (which would kill this test process).
  EXPECT_EQ(os::send_message(mine.get(), bytes("anyone?")), IoStatus::Closed);
}

TEST(OsSocket, SpinReadableSeesAMessageThatArrivesWhileItLooksAndGivesUpAfterItsTime) {
  auto [a, b] = os::seqpacket_pair();
  EXPECT_FALSE(os::spin_readable(a.get(), 0)) << "no time: no look";
  auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(os::spin_readable(a.get(), 20'000'000));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(19));

  std::thread sender([&b] {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(os::send_message(b.get(), bytes("late")), IoStatus::Ok);
  });
  EXPECT_TRUE(os::spin_readable(a.get(), 5'000'000'000));
  sender.join();
  std::array<std::byte, 16> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(a.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "late");

  b.reset();  // a hang-up is readable too: the next read reports it
  EXPECT_TRUE(os::spin_readable(a.get(), 1'000'000));
}

TEST(OsSocket, WouldBlockOnEmptyAndFullNonBlockingSockets) {
  auto [a, b] = os::seqpacket_pair();
  os::set_nonblocking(a.get(), true);
  os::set_nonblocking(b.get(), true);
  EXPECT_NE(::fcntl(a.get(), F_GETFL) & O_NONBLOCK, 0);
  std::array<std::byte, 16> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  EXPECT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::WouldBlock);

  const std::string chunk(4096, 'c');
  int sent = 0;
  IoStatus status = IoStatus::Ok;
  for (; sent < 100'000 && (status = os::send_message(a.get(), bytes(chunk))) == IoStatus::Ok; ++sent) {
  }
  EXPECT_EQ(status, IoStatus::WouldBlock) << "the socket never filled after " << sent << " messages";
  EXPECT_GT(sent, 0);

  os::set_nonblocking(a.get(), false);
  EXPECT_EQ(::fcntl(a.get(), F_GETFL) & O_NONBLOCK, 0);
}

TEST(OsSocket, ASendWithATimeoutOnABlockingSocketWaitsForRoomAtMostThatLong) {
  auto [a, b] = os::seqpacket_pair();  // both blocking
  const std::string chunk(4096, 'c');
  int sent = 0;
  IoStatus status = IoStatus::Ok;
  for (; sent < 100'000 && (status = os::send_message(a.get(), bytes(chunk), {}, 65536, 0)) == IoStatus::Ok; ++sent) {
  }
  ASSERT_EQ(status, IoStatus::WouldBlock) << "the socket never filled after " << sent << " messages";
  EXPECT_EQ(::fcntl(a.get(), F_GETFL) & O_NONBLOCK, 0);  // still a blocking socket

  // Full and nobody reads: WouldBlock once the time is up, nothing sent.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(os::send_message(a.get(), bytes(chunk), {}, 65536, 100), IoStatus::WouldBlock);
  EXPECT_GE(std::chrono::steady_clock::now() - start, 100ms);

  // The queue drained while it waits: sent, well before its time.
  std::thread reader([fd = b.get(), sent] {
    std::this_thread::sleep_for(50ms);
    std::array<std::byte, 4096> buf{};
    std::size_t size = 0;
    std::vector<os::UniqueFd> fds;
    for (int i = 0; i < sent; ++i) (void)os::receive_message(fd, buf, size, fds);
  });
  const auto drained = std::chrono::steady_clock::now();
  EXPECT_EQ(os::send_message(a.get(), bytes(chunk), {}, 65536, 10000), IoStatus::Ok);
  EXPECT_LT(std::chrono::steady_clock::now() - drained, 5s);
  reader.join();

  // The peer gone while it waits: Closed.
  while (os::send_message(a.get(), bytes(chunk), {}, 65536, 0) == IoStatus::Ok) {
  }
  std::thread closer([&b] {
    std::this_thread::sleep_for(50ms);
    b.reset();
  });
  EXPECT_EQ(os::send_message(a.get(), bytes(chunk), {}, 65536, 10000), IoStatus::Closed);
  closer.join();
}

TEST(OsSocket, PeerCredentialsAcrossFork) {
  const test::TempDir dir;
  const std::string path = dir.file("broker.sock");
  const os::UniqueFd listener = os::listen_seqpacket(path);
  const pid_t child = test::start_child([&] {
    const os::UniqueFd sock = os::connect_seqpacket(path);
    GPUIPC_CHILD_CHECK(os::send_message(sock.get(), bytes("hello")) == IoStatus::Ok);
    std::array<std::byte, 16> buf{};
    std::size_t size = 0;
    std::vector<os::UniqueFd> fds;
    GPUIPC_CHILD_CHECK(os::receive_message(sock.get(), buf, size, fds) == IoStatus::Ok);
    GPUIPC_CHILD_CHECK(text(buf, size) == "welcome");
    return 0;
  });

  ASSERT_TRUE(os::wait_readable(listener.get(), 10'000));
  const os::UniqueFd conn = os::accept_seqpacket(listener.get());
  ASSERT_TRUE(conn.valid());
  const os::Credentials cred = os::peer_credentials(conn.get());
  EXPECT_EQ(cred.pid, child);
  EXPECT_NE(cred.pid, ::getpid());
  EXPECT_EQ(cred.uid, ::getuid());
  EXPECT_EQ(cred.gid, ::getgid());

  ASSERT_TRUE(os::wait_readable(conn.get(), 10'000));
  std::array<std::byte, 16> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(conn.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "hello");
  EXPECT_EQ(os::send_message(conn.get(), bytes("welcome")), IoStatus::Ok);
  EXPECT_EQ(test::wait_child(child), 0);
}

TEST(OsSocket, ListenAcceptConnectThroughAPath) {
  const test::TempDir dir;
  const std::string path = dir.file("s.sock");
  const os::UniqueFd listener = os::listen_seqpacket(path, 0600);
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_NE(::fcntl(listener.get(), F_GETFL) & O_NONBLOCK, 0) << "the listening socket must be non-blocking";
  EXPECT_EQ(::fcntl(listener.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);

  EXPECT_FALSE(os::accept_seqpacket(listener.get()).valid()) << "nothing is pending yet";
  const os::UniqueFd client = os::connect_seqpacket(path);
  EXPECT_EQ(::fcntl(client.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  EXPECT_EQ(::fcntl(client.get(), F_GETFL) & O_NONBLOCK, 0) << "connect_seqpacket returns a blocking socket";
  ASSERT_TRUE(os::wait_readable(listener.get(), 5'000));
  const os::UniqueFd server = os::accept_seqpacket(listener.get());
  ASSERT_TRUE(server.valid());
  EXPECT_NE(::fcntl(server.get(), F_GETFL) & O_NONBLOCK, 0) << "accepted sockets are non-blocking";
  EXPECT_EQ(::fcntl(server.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);

  std::array<std::byte, 32> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::send_message(client.get(), bytes("ping")), IoStatus::Ok);
  ASSERT_EQ(os::receive_message(server.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "ping");
  ASSERT_EQ(os::send_message(server.get(), bytes("pong")), IoStatus::Ok);
  ASSERT_EQ(os::receive_message(client.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "pong");
}

TEST(OsSocket, ConnectToAMissingPathIsNotFound) {
  const test::TempDir dir;
  const std::string path = dir.file("nobody.sock");
  try {
    (void)os::connect_seqpacket(path);
    FAIL() << "connect to a missing path did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_EQ(e.call(), "connect");
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  // A socket file whose listener is gone (ECONNREFUSED) is NotFound too.
  { const os::UniqueFd gone = os::listen_seqpacket(path); }
  ASSERT_EQ(::access(path.c_str(), F_OK), 0);
  try {
    (void)os::connect_seqpacket(path);
    FAIL() << "connect to a stale socket did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound) << e.what();
  }
}

/// A listener that accepts nothing (a stopped broker) fills its backlog; connect then gives up at its timeout
/// with Timeout instead of blocking forever, and succeeds again once the listener takes a connection.
TEST(OsSocket, ConnectToAListenerWithAFullBacklogTimesOut) {
  const test::TempDir dir;
  const std::string path = dir.file("full.sock");
  const os::UniqueFd listener(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(listener.valid());
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  ASSERT_EQ(::bind(listener.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener.get(), 0), 0);  // room for one pending connection
  std::vector<os::UniqueFd> pending;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    for (int i = 0; i < 64; ++i) pending.push_back(os::connect_seqpacket(path, std::chrono::milliseconds(200)));
    FAIL() << "64 connections to a listener that accepts none all went through";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
    EXPECT_EQ(e.call(), "connect");
    EXPECT_NE(std::string(e.what()).find("backlog"), std::string::npos) << e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_FALSE(pending.empty());
  EXPECT_GE(waited, std::chrono::milliseconds(190));
  EXPECT_LT(waited, std::chrono::seconds(5));
  // Room again: the next connect goes through, and the socket it returns blocks as usual.
  const os::UniqueFd taken(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(taken.valid());
  const os::UniqueFd again = os::connect_seqpacket(path, std::chrono::milliseconds(2000));
  EXPECT_EQ(::fcntl(again.get(), F_GETFL) & O_NONBLOCK, 0);
}

TEST(OsSocket, ListenReplacesAStaleSocketButNoOtherFile) {
  const test::TempDir dir;
  const std::string path = dir.file("s.sock");
  { const os::UniqueFd old = os::listen_seqpacket(path); }
  const os::UniqueFd listener = os::listen_seqpacket(path);  // unlinks the stale socket file
  const os::UniqueFd client = os::connect_seqpacket(path);
  EXPECT_TRUE(client.valid());

  const std::string regular = dir.file("regular");
  test::write_file(regular, "keep me");
  EXPECT_THROW((void)os::listen_seqpacket(regular), Error);
  EXPECT_EQ(test::read_file(regular), "keep me");
}

TEST(OsSocket, PathLongerThanSunPathIsRefused) {
  const std::string path = "/tmp/" + std::string(103, 'p');  // 108 bytes: one too many
  ASSERT_EQ(path.size(), 108u);
  for (const bool listening : {true, false}) {
    try {
      if (listening) {
        (void)os::listen_seqpacket(path);
      } else {
        (void)os::connect_seqpacket(path);
      }
      FAIL() << "a 108-byte socket path was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("107"), std::string::npos) << e.what();
    }
  }
  // 107 bytes fit (bind then fails for the missing directory, not for the length).
  const std::string fits = "/tmp/gpuipc-no-such-dir/" + std::string(107 - 24, 'q');
  ASSERT_EQ(fits.size(), 107u);
  try {
    (void)os::listen_seqpacket(fits);
    FAIL() << "bind in a missing directory succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound) << e.what();
    EXPECT_EQ(e.call(), "bind");
  }
}

TEST(OsSocket, WaitReadableTimesOutAndSeesDataAndHangup) {
  auto [a, b] = os::seqpacket_pair();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(os::wait_readable(b.get(), 50));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 45ms);
  EXPECT_FALSE(os::wait_readable(b.get(), 0));
  ASSERT_EQ(os::send_message(a.get(), bytes("d")), IoStatus::Ok);
  EXPECT_TRUE(os::wait_readable(b.get(), 0));
  a.reset();
  std::array<std::byte, 4> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::Ok);
  EXPECT_TRUE(os::wait_readable(b.get(), 1'000));  // hang-up counts as readable
  EXPECT_EQ(os::receive_message(b.get(), buf, size, fds), IoStatus::Closed);
}

// EINTR: a no-op handler without SA_RESTART makes blocking calls fail with EINTR; the os layer must retry.

TEST(OsSocketEintr, BlockingReceiveRetriesAfterSignals) {
  auto [a, b] = os::seqpacket_pair();
  const test::ScopedSignalCounter counter(SIGUSR1);
  std::jthread sender([fd = a.get()] {
    std::this_thread::sleep_for(250ms);
    (void)os::send_message(fd, bytes("late"));
  });
  std::array<std::byte, 16> buf{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  IoStatus status = IoStatus::Closed;
  {
    const test::SignalPulser pulser(::pthread_self(), SIGUSR1, 50ms, 30ms);
    status = os::receive_message(b.get(), buf, size, fds);
  }
  sender.join();
  EXPECT_EQ(status, IoStatus::Ok);
  EXPECT_EQ(text(buf, size), "late");
  EXPECT_GE(counter.count(), 1) << "no signal arrived during the blocking receive: the test proves nothing";
}

TEST(OsSocketEintr, WaitReadableKeepsItsDeadlineAcrossSignals) {
  auto [a, b] = os::seqpacket_pair();
  const test::ScopedSignalCounter counter(SIGUSR1);
  const auto start = std::chrono::steady_clock::now();
  bool readable = true;
  {
    // Five signals, 50 ms apart, all before the deadline: restarting the full timeout after the last one would
    // end the wait at ~550 ms instead of 300.
    const test::SignalPulser pulser(::pthread_self(), SIGUSR1, 50ms, 50ms, 5);
    readable = os::wait_readable(b.get(), 300);
  }
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_FALSE(readable);
  EXPECT_GE(elapsed, 295ms) << "a signal cut the wait short";
  EXPECT_LT(elapsed, 500ms) << "the timeout restarted after a signal";
  EXPECT_EQ(counter.count(), 5);

  // And with data arriving after the signals.
  std::jthread sender([fd = a.get()] {
    std::this_thread::sleep_for(200ms);
    (void)os::send_message(fd, bytes("x"));
  });
  {
    const test::SignalPulser pulser(::pthread_self(), SIGUSR1, 20ms, 20ms);
    readable = os::wait_readable(b.get(), 10'000);
  }
  sender.join();
  EXPECT_TRUE(readable);
}

TEST(OsSocketEintr, BlockingAcceptRetriesAfterSignals) {
  const test::TempDir dir;
  const std::string path = dir.file("a.sock");
  const os::UniqueFd listener = os::listen_seqpacket(path);
  os::set_nonblocking(listener.get(), false);  // make accept4 block, so that signals interrupt it
  const test::ScopedSignalCounter counter(SIGUSR1);
  const pid_t child = test::start_child([&] {
    std::this_thread::sleep_for(250ms);
    const os::UniqueFd sock = os::connect_seqpacket(path);
    GPUIPC_CHILD_CHECK(os::send_message(sock.get(), bytes("in")) == IoStatus::Ok);
    return 0;
  });
  os::UniqueFd conn;
  {
    const test::SignalPulser pulser(::pthread_self(), SIGUSR1, 50ms, 30ms);
    conn = os::accept_seqpacket(listener.get());
  }
  EXPECT_TRUE(conn.valid());
  EXPECT_GE(counter.count(), 1) << "no signal arrived during the blocking accept: the test proves nothing";
  if (conn.valid()) {
    EXPECT_EQ(os::peer_credentials(conn.get()).pid, child);
  }
  EXPECT_EQ(test::wait_child(child), 0);
}

// What the broker asks before it closes a client's connection on its loop: whether a message (which could carry a
// client's fd whose close blocks) is still unread. A zero-length message counts, with or without fds; the end of
// the stream, with the peer gone or still there, does not; and after it nothing more can arrive.
TEST(OsSocket, ShutDownWithUnreadSeesEveryMessageLeft) {
  // (send_message refuses an empty message: the peer's side of an attacker is raw sendmsg.)
  const auto send_raw = [](int sock, std::size_t bytes, int fd) {
    char data = 7;
    iovec iov{&data, bytes};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    return ::sendmsg(sock, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes);
  };
  const auto pair = [] {
    int sv[2] = {-1, -1};
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    return std::array<os::UniqueFd, 2>{os::UniqueFd(sv[0]), os::UniqueFd(sv[1])};
  };
  const auto memfd = os::memfd_create("unread", 4096);
  const int fd = memfd.get();
  {  // nothing sent, the peer still there: and then it cannot send
    auto s = pair();
    EXPECT_FALSE(os::shut_down_with_unread(s[0].get()));
    EXPECT_EQ(::send(s[1].get(), "x", 1, MSG_NOSIGNAL | MSG_DONTWAIT), -1);
  }
  {  // nothing sent, the peer gone
    auto s = pair();
    s[1].reset();
    EXPECT_FALSE(os::shut_down_with_unread(s[0].get()));
  }
  {  // a message read already
    auto s = pair();
    ASSERT_TRUE(send_raw(s[1].get(), 1, -1));
    char b = 0;
    ASSERT_EQ(::recv(s[0].get(), &b, 1, 0), 1);
    EXPECT_FALSE(os::shut_down_with_unread(s[0].get()));
  }
  for (const bool with_fd : {false, true}) {
    for (const bool empty : {false, true}) {
      SCOPED_TRACE(fmt::format("{} message, {}", empty ? "a zero-length" : "a 1-byte", with_fd ? "an fd" : "no fd"));
      auto s = pair();
      ASSERT_TRUE(send_raw(s[1].get(), empty ? 0 : 1, with_fd ? fd : -1));
      s[1].reset();  // gone too: the message stays
      EXPECT_TRUE(os::shut_down_with_unread(s[0].get()));
    }
  }
  {  // an empty message first, one with an fd behind it
    auto s = pair();
    ASSERT_TRUE(send_raw(s[1].get(), 0, -1));
    ASSERT_TRUE(send_raw(s[1].get(), 1, fd));
    EXPECT_TRUE(os::shut_down_with_unread(s[0].get()));
  }
}

// The broker's closer sets every socket a client sent to close at once; anything else it leaves alone.
TEST(OsSocket, CloseWithoutLingeringUnsetsSoLingerOnSocketsOnly) {
  const os::UniqueFd tcp(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(tcp);
  const linger lingering{1, 30};
  ASSERT_EQ(::setsockopt(tcp.get(), SOL_SOCKET, SO_LINGER, &lingering, sizeof lingering), 0);
  os::close_without_lingering(tcp.get());
  linger now{};
  socklen_t len = sizeof now;
  ASSERT_EQ(::getsockopt(tcp.get(), SOL_SOCKET, SO_LINGER, &now, &len), 0);
  EXPECT_EQ(now.l_onoff, 1);
  EXPECT_EQ(now.l_linger, 0);
  const auto memfd = os::memfd_create("not-a-socket", 4096);
  os::close_without_lingering(memfd.get());  // nothing to do, nothing broken
  EXPECT_EQ(os::fd_size(memfd.get()), 4096U);
}

}  // namespace
}  // namespace gpuipc
