#include "os/socket.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <system_error>

#include "base/deadline.hpp"
#include "base/errors.hpp"
#include "os/process.hpp"

namespace gpuipc::os {
namespace {

// The most descriptors one message can carry (the kernel's SCM_MAX_FD, for all its SCM_RIGHTS cmsgs together).
constexpr std::size_t kMostFdsInAMessage = 253;

// Control buffer for every descriptor a message can carry, aligned for cmsghdr, plus room for the SCM_CREDENTIALS
// cmsg that the kernel puts before the fds when SO_PASSCRED is on. Not only kMaxFds: the kernel closes the fds that
// do not fit inside recvmsg, on the receiver's thread, and a client's file whose last close blocks (a TCP socket
// lingering with unsent data) held the broker's loop there; every fd that arrives is closed where the receiver
// decides (the broker: its closer thread).
union ControlBuffer {
  char buf[CMSG_SPACE(kMostFdsInAMessage * sizeof(int)) + CMSG_SPACE(sizeof(ucred))];
  cmsghdr align;
};
static_assert(kMaxFds <= kMostFdsInAMessage);

// The most descriptors that can arrive in one ControlBuffer, however the sender split them into cmsgs.
constexpr std::size_t kMaxArrivingFds = sizeof(ControlBuffer) / sizeof(int);

sockaddr_un socket_address(const std::string& path, const char* call) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty()) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("{}: the socket path is empty", call), call);
  }
  if (path.find('\0') != std::string::npos) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("socket path '{}' contains a NUL byte", path), call);
  }
  if (path.size() >= sizeof(addr.sun_path)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("socket path '{}' is {} bytes long; a Unix socket path holds at most {} bytes: choose a "
                            "shorter directory (e.g. set GPUIPC_RUNTIME_DIR)",
                            path, path.size(), sizeof(addr.sun_path) - 1),
                call);
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

std::string socket_what(const std::string& path) { return fmt::format("socket {}", path); }

std::string fd_what(int fd) { return fmt::format("socket fd {}", fd); }

}  // namespace

UniqueFd listen_seqpacket(const std::string& path, unsigned mode, int backlog) {
  const sockaddr_un addr = socket_address(path, "bind");
  const std::string what = socket_what(path);
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock) throw_system("socket", what);

  // Only a stale socket file is removed; anything else at the path makes bind fail with EADDRINUSE.
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw_system("unlink", what);
  }
  if (::bind(sock.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) throw_system("bind", what);

  // From here on the socket file is ours: remove it again if a later step fails. Nobody can connect before
  // listen(2), so setting the mode after bind leaves no window.
  struct Unlinker {
    const std::string& path;
    bool armed = true;
    ~Unlinker() {
      if (armed) ::unlink(path.c_str());
    }
  } unlinker{path};
  if (::chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) throw_system("chmod", what);
  if (::listen(sock.get(), backlog) != 0) throw_system("listen", what);
  unlinker.armed = false;
  return sock;
}

UniqueFd accept_seqpacket(int listen_fd) {
  for (;;) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) return UniqueFd(fd);
    const int err = errno;
    switch (err) {
      case EINTR:
        continue;
      case EAGAIN:
#if EWOULDBLOCK != EAGAIN
      case EWOULDBLOCK:
#endif
      case ECONNABORTED:
        return UniqueFd();
      case EMFILE:
      case ENFILE: {
        rlimit lim{};
        ::getrlimit(RLIMIT_NOFILE, &lim);
        throw Error(ErrorCode::System,
                    fmt::format("listening socket fd {}: accept4 failed: {} (errno {}); the open-file limit is {} "
                                "(ulimit -n): raise it or close connections",
                                listen_fd, std::system_category().message(err), err,
                                static_cast<unsigned long long>(lim.rlim_cur)),
                    "accept4", err);
      }
      default:
        throw_system("accept4", fmt::format("listening socket fd {}", listen_fd), err);
    }
  }
}

UniqueFd seqpacket_socket() {
  // Non-blocking while connecting: a blocking Unix connect to a listener whose backlog is full waits for room
  // with no bound (a stopped broker would hang every client). Non-blocking, it fails with EAGAIN instead.
  UniqueFd sock(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!sock) throw_system("socket", "AF_UNIX SOCK_SEQPACKET");
  return above_stdio(std::move(sock), "AF_UNIX SOCK_SEQPACKET");
}

void connect_seqpacket(int sock, const std::string& path, std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  const sockaddr_un addr = socket_address(path, "connect");
  const std::string what = socket_what(path);
  const auto deadline = base::deadline_after(clock::now(), timeout);
  auto pause = std::chrono::microseconds(100);
  for (;;) {
    if (::connect(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EISCONN) break;  // an interrupted attempt that completed after all
    if (err == ENOENT || err == ECONNREFUSED) {
      throw Error(ErrorCode::NotFound,
                  fmt::format("{}: connect failed: {} (errno {}): nothing listens there", what,
                              std::system_category().message(err), err),
                  "connect", err);
    }
    if (err != EAGAIN) throw_system("connect", what, err);
    if (clock::now() >= deadline) {
      throw Error(ErrorCode::Timeout,
                  fmt::format("{}: the listener's backlog stayed full for {} ms: it accepts no connections (is the "
                              "broker stopped or swamped? its pid is in broker.pid beside the socket)",
                              what, timeout.count()),
                  "connect", err);
    }
    ::usleep(static_cast<useconds_t>(pause.count()));
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
  const int flags = ::fcntl(sock, F_GETFL);
  if (flags < 0 || ::fcntl(sock, F_SETFL, flags & ~O_NONBLOCK) != 0) throw_system("fcntl(F_SETFL)", what);
}

UniqueFd connect_seqpacket(const std::string& path, std::chrono::milliseconds timeout) {
  UniqueFd sock = seqpacket_socket();
  connect_seqpacket(sock.get(), path, timeout);
  return sock;
}

std::pair<UniqueFd, UniqueFd> seqpacket_pair() {
  int sv[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) throw_system("socketpair", "seqpacket pair");
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

namespace {
/// What a failed sendmsg/recvmsg (other than EINTR) means for the caller: WouldBlock, Closed, or an Error.
IoStatus io_failure(const char* call, int sock, int err) {
  if (err == EAGAIN || err == EWOULDBLOCK) return IoStatus::WouldBlock;
  if (err == EPIPE || err == ECONNRESET) return IoStatus::Closed;
  throw_system(call, fd_what(sock), err);
}
}  // namespace

IoStatus send_message(int sock, std::span<const std::byte> payload, std::span<const int> fds, std::size_t max_bytes,
                      int timeout_ms) {
  if (payload.size() > max_bytes) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("{}: message of {} bytes exceeds the limit of {} bytes", fd_what(sock), payload.size(), max_bytes),
        "sendmsg");
  }
  if (payload.empty()) {
    // A zero-length SOCK_SEQPACKET message reads as end-of-stream (recvmsg returns 0) on the other side.
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{}: empty message (a zero-length seqpacket reads as a closed connection)", fd_what(sock)),
                "sendmsg");
  }
  if (fds.size() > kMaxFds) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("{}: message carries {} fds; at most {} fit in one message", fd_what(sock), fds.size(), kMaxFds),
        "sendmsg");
  }

  iovec iov{const_cast<std::byte*>(payload.data()), payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  ControlBuffer control{};
  if (!fds.empty()) {
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(cmsg), fds.data(), fds.size() * sizeof(int));
  }

  const bool timed = timeout_ms >= 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
  ssize_t n = -1;
  int err = 0;
  for (;;) {
    n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | (timed ? MSG_DONTWAIT : 0));
    if (n >= 0) break;
    err = errno;
    if (err == EINTR) continue;
    if (!timed || (err != EAGAIN && err != EWOULDBLOCK)) break;
    // Full: wait for room until the deadline, then again. (A blocking sendmsg waits the same way: a Unix datagram
    // socket's sender is woken, and polls writable, once the peer has drained its queue to a quarter of the buffer.)
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    wait_writable(sock, static_cast<int>(std::min<long long>(left, INT_MAX)));
  }
  if (n < 0) return io_failure("sendmsg", sock, err);
  if (static_cast<std::size_t>(n) != payload.size()) {
    // SOCK_SEQPACKET sends whole records; a short count means the fd is not such a socket.
    throw Error(
        ErrorCode::System,
        fmt::format("{}: sendmsg sent {} of {} bytes (not a SOCK_SEQPACKET socket?)", fd_what(sock), n, payload.size()),
        "sendmsg");
  }
  return IoStatus::Ok;
}

IoStatus receive_message(int sock, std::span<std::byte> buffer, std::size_t& size, std::vector<UniqueFd>& fds,
                         std::size_t max_fds, std::vector<UniqueFd>* refused) {
  fds.clear();
  size = 0;
  iovec iov{buffer.data(), buffer.size()};
  ControlBuffer control{};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.buf;
  msg.msg_controllen = sizeof(control.buf);

  ssize_t n = -1;
  for (;;) {
    n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n >= 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    return io_failure("recvmsg", sock, err);
  }

  // Take ownership of every descriptor that arrived, from every SCM_RIGHTS cmsg, before deciding anything: they
  // are closed on every path that does not hand them to the caller.
  std::array<UniqueFd, kMaxArrivingFds> arrived;
  std::size_t count = 0;
  if (msg.msg_controllen > 0) {
    for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
      if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t bytes = cmsg->cmsg_len - CMSG_LEN(0);
      const unsigned char* data = CMSG_DATA(cmsg);
      for (std::size_t i = 0; i + sizeof(int) <= bytes && count < arrived.size(); i += sizeof(int)) {
        int fd = -1;
        std::memcpy(&fd, data + i, sizeof(int));  // CMSG_DATA need not be aligned for int
        arrived[count++].reset(fd);
      }
    }
  }

  if (n == 0 && count == 0 && (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == 0) return IoStatus::Closed;
  size = std::min(static_cast<std::size_t>(n), buffer.size());
  const auto refuse = [&](IoStatus st) {
    if (refused != nullptr) {
      for (std::size_t i = 0; i < count; ++i) refused->push_back(std::move(arrived[i]));
    }
    return st;
  };
  // The kernel stops installing a message's fds at the receiver's RLIMIT_NOFILE and says only MSG_CTRUNC, as for
  // fds that did not fit the buffer: fewer than fit in it means the first.
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == MSG_CTRUNC && count < kMostFdsInAMessage) {
    return refuse(IoStatus::FdsDropped);
  }
  if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0 || count > max_fds) return refuse(IoStatus::Truncated);
  fds.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    // (Numbers 0..2 only when this process closed its standard streams: moved, or kept there when it cannot be.)
    if (arrived[i].get() < 3) {
      const int moved = ::fcntl(arrived[i].get(), F_DUPFD_CLOEXEC, 3);
      if (moved >= 0) arrived[i].reset(moved);
    }
    fds.push_back(std::move(arrived[i]));
  }
  return IoStatus::Ok;
}

Credentials peer_credentials(int sock) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    throw_system("getsockopt(SO_PEERCRED)", fd_what(sock));
  }
  Credentials c{cred.pid, cred.uid, cred.gid, {}};
  // SO_PEERGROUPS answers ERANGE with the size it needs when the buffer is too small.
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 4; ++attempt) {
    socklen_t glen = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (::getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &glen) == 0) {
      groups.resize(glen / sizeof(gid_t));
      c.groups = std::move(groups);
      break;
    }
    if (errno != ERANGE) break;  // an old kernel without SO_PEERGROUPS: the primary group only
    groups.resize(glen / sizeof(gid_t) + 1);
  }
  return c;
}

bool Credentials::in_group(gid_t g) const noexcept {
  return gid == g || std::find(groups.begin(), groups.end(), g) != groups.end();
}

void close_without_lingering(int fd) noexcept {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return;
  const linger none{1, 0};
  (void)::setsockopt(fd, SOL_SOCKET, SO_LINGER, &none, sizeof none);
}

bool shut_down_with_unread(int sock) noexcept {
  // After shutdown (under the socket's lock, as every send to it takes), nothing more can be queued: the peer's
  // sends fail with EPIPE. Then a peek at the first message: with SO_PASSCRED on and no control buffer, the kernel
  // flags any message MSG_CTRUNC (whether or not it carries fds), and only the end of the stream reads as 0 bytes
  // without it. (The queue's memory cannot tell: a unix socket's queued messages are charged to their sender.)
  (void)::shutdown(sock, SHUT_RDWR);
  const int on = 1;
  if (::setsockopt(sock, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0) return true;
  for (int attempt = 0; attempt < 2; ++attempt) {  // a pending socket error (ECONNRESET) is read once, then gone
    char byte = 0;
    iovec iov{&byte, 1};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    const ssize_t n = ::recvmsg(sock, &msg, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0 && (msg.msg_flags & MSG_CTRUNC) == 0) return false;
    if (n >= 0 || (errno != ECONNRESET && errno != EPIPE && errno != EINTR)) return true;
  }
  return true;
}

void set_nonblocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0) throw_system("fcntl(F_GETFL)", fmt::format("fd {}", fd));
  const int wanted = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
  if (wanted != flags && ::fcntl(fd, F_SETFL, wanted) != 0) throw_system("fcntl(F_SETFL)", fmt::format("fd {}", fd));
}

namespace {

/// poll(2) of `fds` for at most `timeout_ms` (< 0: for ever), retrying EINTR with the time left: its count of
/// ready fds, 0 on timeout. Throws Error(System) naming the fds.
int poll_retrying(std::span<pollfd> fds, int timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  int remaining = timeout_ms;
  for (;;) {
    const int rc = ::poll(fds.data(), fds.size(), remaining);
    if (rc >= 0) return rc;
    const int err = errno;
    if (err != EINTR) {
      std::string what = "fd";
      for (const pollfd& p : fds) what += fmt::format(" {}", p.fd);
      throw_system("poll", what, err);
    }
    if (timeout_ms >= 0) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      remaining = static_cast<int>(std::clamp<long long>(left, 0, INT_MAX));
    }
  }
}

}  // namespace

bool wait_readable(int fd, int timeout_ms) {
  std::array<pollfd, 1> pfd{{{fd, POLLIN, 0}}};
  if (poll_retrying(pfd, timeout_ms) == 0) return false;
  if ((pfd[0].revents & POLLNVAL) != 0) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("fd {}: poll failed: not an open file descriptor", fd), "poll",
                EBADF);
  }
  return true;  // POLLIN, POLLHUP or POLLERR: the next read reports which
}

bool wait_writable(int fd, int timeout_ms) {
  std::array<pollfd, 1> pfd{{{fd, POLLOUT, 0}}};
  return poll_retrying(pfd, timeout_ms) > 0;
}

bool wait_readable_or_woken(int fd, int wake, int timeout_ms) {
  std::array<pollfd, 2> pfd{{{wake, POLLIN, 0}, {fd, POLLIN, 0}}};
  return poll_retrying(pfd, timeout_ms) > 0;
}

bool wait_hangup(int sock, int wake) {
  for (;;) {
    std::array<pollfd, 2> pfd{{{wake, POLLIN, 0}, {sock, POLLRDHUP, 0}}};
    const int rc = ::poll(pfd.data(), sock >= 0 ? 2 : 1, -1);
    if (rc < 0) {
      if (errno == EINTR) continue;
      throw_system("poll", fmt::format("fds {} and {}", wake, sock));
    }
    if ((pfd[1].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0) return true;
    if (pfd[0].revents != 0) return false;
  }
}

bool spin_readable(int fd, std::int64_t spin_ns) {
  if (spin_ns <= 0) return false;
  const std::int64_t end = monotonic_ns() + spin_ns;
  do {
    if (wait_readable(fd, 0)) return true;
    ::sched_yield();
  } while (monotonic_ns() < end);
  return false;
}

std::optional<FileIdentity> file_identity(const std::string& path) noexcept {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return std::nullopt;
  return FileIdentity{static_cast<std::uint64_t>(st.st_dev), static_cast<std::uint64_t>(st.st_ino)};
}

void unlink_if_same(const std::string& path, const FileIdentity& id) noexcept {
  // A window remains between the lstat and the unlink; only a process of the same uid (or root) can rebind there,
  // and losing that race costs a restart, not data.
  if (file_identity(path) == id) (void)::unlink(path.c_str());
}

namespace {

// sd_listen_fds(3) parses these as plain decimal numbers; anything else is a broken unit, said as such.
std::optional<long long> env_number(const char* name, const char* value) {
  if (value == nullptr) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v < 0) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("socket activation: {}='{}' is not a number", name, value),
                "getenv");
  }
  return v;
}

int socket_option(int fd, int option) {
  int value = 0;
  socklen_t len = sizeof(value);
  if (::getsockopt(fd, SOL_SOCKET, option, &value, &len) != 0) return -errno;
  return value;
}

const char* socket_type_name(int type) {
  switch (type) {
    case SOCK_STREAM:
      return "SOCK_STREAM (ListenStream=)";
    case SOCK_DGRAM:
      return "SOCK_DGRAM (ListenDatagram=)";
    case SOCK_SEQPACKET:
      return "SOCK_SEQPACKET";
    default:
      return "of an unknown type";
  }
}

}  // namespace

std::optional<ActivationSocket> take_activation_socket() {
  // Copies first: unsetenv invalidates what getenv returned.
  const char* raw_pid = std::getenv("LISTEN_PID");        // NOLINT(concurrency-mt-unsafe): documented: before threads
  const char* raw_fds = std::getenv("LISTEN_FDS");        // NOLINT(concurrency-mt-unsafe)
  const char* raw_names = std::getenv("LISTEN_FDNAMES");  // NOLINT(concurrency-mt-unsafe)
  const std::optional<std::string> pid_text = raw_pid ? std::optional<std::string>(raw_pid) : std::nullopt;
  const std::optional<std::string> fds_text = raw_fds ? std::optional<std::string>(raw_fds) : std::nullopt;
  const std::string names = raw_names ? raw_names : "";
  // Whatever they said, they were meant for this process only: a child must not take them for its own.
  ::unsetenv("LISTEN_PID");      // NOLINT(concurrency-mt-unsafe)
  ::unsetenv("LISTEN_FDS");      // NOLINT(concurrency-mt-unsafe)
  ::unsetenv("LISTEN_FDNAMES");  // NOLINT(concurrency-mt-unsafe)

  const auto pid = env_number("LISTEN_PID", pid_text ? pid_text->c_str() : nullptr);
  if (!pid || *pid != static_cast<long long>(::getpid())) return std::nullopt;
  const auto count = env_number("LISTEN_FDS", fds_text ? fds_text->c_str() : nullptr);
  if (!count || *count != 1) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("socket activation: LISTEN_FDS={} but gpuipcd takes exactly one socket (fd {}); give its "
                            ".socket unit one ListenSequentialPacket= line{}",
                            fds_text ? *fds_text : "(unset)", kActivationFirstFd,
                            names.empty() ? "" : fmt::format(" (LISTEN_FDNAMES={})", names)),
                "getenv");
  }
  const int fd = kActivationFirstFd;
  const std::string what =
      fmt::format("socket activation: fd {} (LISTEN_FDS=1{})", fd, names.empty() ? "" : ", LISTEN_FDNAMES=" + names);
  if (::fcntl(fd, F_GETFD) < 0) {
    const int err = errno;
    throw Error(ErrorCode::InvalidArgument, fmt::format("{} is not open", what), "fcntl", err);
  }
  const int domain = socket_option(fd, SO_DOMAIN);
  if (domain == -ENOTSOCK) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} is not a socket; gpuipcd needs a listening AF_UNIX SOCK_SEQPACKET socket "
                            "(ListenSequentialPacket= in the .socket unit)",
                            what),
                "getsockopt", ENOTSOCK);
  }
  if (domain < 0) throw_system("getsockopt", what);
  if (domain != AF_UNIX) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} is not an AF_UNIX socket (domain {}); gpuipcd needs a listening AF_UNIX "
                            "SOCK_SEQPACKET socket: give ListenSequentialPacket= a path",
                            what, domain),
                "getsockopt");
  }
  const int type = socket_option(fd, SO_TYPE);
  if (type < 0) throw_system("getsockopt", what);
  if (type != SOCK_SEQPACKET) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} is {}; gpuipcd needs SOCK_SEQPACKET (ListenSequentialPacket= in the .socket unit)",
                            what, socket_type_name(type)),
                "getsockopt");
  }
  const int listening = socket_option(fd, SO_ACCEPTCONN);
  if (listening < 0) throw_system("getsockopt", what);
  if (listening == 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} is not listening (a connection? gpuipcd needs Accept=no in the .socket unit, the "
                            "default)",
                            what),
                "getsockopt");
  }
  UniqueFd sock(fd);
  // systemd hands fds over without FD_CLOEXEC and, unless NonBlocking=yes, blocking; the event loop needs
  // O_NONBLOCK. The file description is shared with systemd, which only polls it while the broker is down.
  if (::fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) throw_system("fcntl", what);
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) throw_system("fcntl", what);

  ActivationSocket out;
  out.name = names.substr(0, names.find(':'));
  sockaddr_un addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 && len > offsetof(sockaddr_un, sun_path) &&
      addr.sun_path[0] != '\0') {
    out.path.assign(addr.sun_path, ::strnlen(addr.sun_path, len - offsetof(sockaddr_un, sun_path)));
  }
  out.fd = std::move(sock);
  return out;
}

}  // namespace gpuipc::os
