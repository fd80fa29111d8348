// Unix SOCK_SEQPACKET sockets that carry one message with up to kMaxFds file descriptors (SCM_RIGHTS).
// Every call retries EINTR. No call raises SIGPIPE (MSG_NOSIGNAL).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "os/fd.hpp"

namespace gpuipc::os {

/// Most fds one message may carry, in either direction.
inline constexpr std::size_t kMaxFds = 16;

/// Peer credentials of a connected Unix socket (SO_PEERCRED): as of connect(2), not of later setuid.
struct Credentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;  ///< supplementary groups (SO_PEERGROUPS), as of connect(2)

  /// Whether the peer is in group `g` (primary or supplementary).
  bool in_group(gid_t g) const noexcept;
};

/// Outcome of a send or receive that did not throw.
enum class IoStatus {
  Ok,          ///< the whole message went / came
  WouldBlock,  ///< non-blocking socket and nothing could be done now
  Closed,      ///< the peer closed (EOF, EPIPE, ECONNRESET)
  Truncated,   ///< received message or its control data did not fit; every fd that came with it is closed
  /// The whole message came, but the kernel could not install every fd that came with it (MSG_CTRUNC with fewer
  /// than kMaxFds fds: the receiver is out of file descriptors, RLIMIT_NOFILE): not the sender's fault, and the
  /// message can still be answered. The fds that did arrive are closed (or given to the caller, as for Truncated).
  FdsDropped,
};

/// Creates, binds and listens on a SOCK_SEQPACKET socket at `path` (an existing socket file there is unlinked
/// first: the caller holds the instance lock). The socket file gets `mode` (default 0666: access control is
/// per request, from SO_PEERCRED). The socket is CLOEXEC and non-blocking. Throws Error naming path and call.
UniqueFd listen_seqpacket(const std::string& path, unsigned mode = 0666, int backlog = 256);

/// The identity of a file (device and inode, as lstat(2) sees the path), to tell later whether the path still
/// names the same file.
struct FileIdentity {
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
  bool operator==(const FileIdentity&) const = default;
};

/// lstat(2) of `path`; nullopt when nothing is there (or it cannot be read).
std::optional<FileIdentity> file_identity(const std::string& path) noexcept;

/// Unlinks `path` only while it still names the file `id` (the socket this process bound): a socket that another
/// process bound there since (a service manager's, a newer broker's) is left alone. Best effort; never throws.
void unlink_if_same(const std::string& path, const FileIdentity& id) noexcept;

/// First fd a service manager passes (SD_LISTEN_FDS_START of sd_listen_fds(3)).
inline constexpr int kActivationFirstFd = 3;

/// A listening socket a service manager passed to this process (systemd socket activation).
struct ActivationSocket {
  UniqueFd fd;       ///< listening AF_UNIX SOCK_SEQPACKET, now CLOEXEC and non-blocking
  std::string name;  ///< its entry of LISTEN_FDNAMES ("" when the variable is absent)
  std::string path;  ///< the path it is bound to ("" when unnamed or abstract)
};

/// Takes the socket of systemd's socket-activation protocol, read by hand (sd_listen_fds(3)): when LISTEN_PID is
/// this process's pid, LISTEN_FDS must be 1 and fd 3 must be a listening AF_UNIX SOCK_SEQPACKET socket (checked
/// with SO_DOMAIN, SO_TYPE and SO_ACCEPTCONN). Unsets LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES in every case, so
/// nothing this process starts inherits them. Returns nullopt when LISTEN_PID is absent or names another process
/// (not activated). Throws Error(InvalidArgument) naming the variable or the fd and what is wrong, e.g. a stream
/// socket (ListenStream= instead of ListenSequentialPacket=) or a connected one (Accept=yes).
/// Not thread-safe (unsetenv): call it from main before any thread starts.
std::optional<ActivationSocket> take_activation_socket();

/// accept4 (CLOEXEC | NONBLOCK). Returns an invalid UniqueFd when no connection is pending (EAGAIN) or the
/// pending one vanished (ECONNABORTED); throws on other errors (EMFILE: Error(System) naming the limit).
UniqueFd accept_seqpacket(int listen_fd);

/// A new AF_UNIX SOCK_SEQPACKET socket (CLOEXEC | NONBLOCK), for connect_seqpacket(int, ...). Throws Error(System).
UniqueFd seqpacket_socket();

/// Connects `sock` (from seqpacket_socket) to `path` and makes it blocking, waiting and failing as
/// connect_seqpacket(path, timeout) does. For a caller that must own the socket before it connects (ParentOnlyFd).
void connect_seqpacket(int sock, const std::string& path, std::chrono::milliseconds timeout);

/// Connects to `path` and returns a blocking CLOEXEC socket. A listener whose backlog is full (it accepts nothing:
/// stopped, or swamped) is retried until `timeout`, then Error(Timeout). Throws Error(NotFound) when nothing
/// listens there (ENOENT, ECONNREFUSED), other codes as errno maps.
UniqueFd connect_seqpacket(const std::string& path,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));

/// A connected pair (socketpair AF_UNIX SOCK_SEQPACKET, CLOEXEC).
std::pair<UniqueFd, UniqueFd> seqpacket_pair();

/// Sends `payload` (at most `max_bytes`) plus `fds` (at most kMaxFds) as one message. Throws
/// Error(InvalidArgument) for an oversized message or an empty payload (a zero-length SOCK_SEQPACKET message reads
/// as end-of-stream on the other side), Error(System) for other failures. Returns Ok, WouldBlock or Closed.
/// `timeout_ms` >= 0: waits at most that long for room in the peer's queue (a peer that stopped reading; on a
/// blocking socket too), then returns WouldBlock with nothing sent. < 0: as the socket's mode says.
IoStatus send_message(int sock, std::span<const std::byte> payload, std::span<const int> fds = {},
                      std::size_t max_bytes = 65536, int timeout_ms = -1);

/// Receives one message into `buffer`; `size` gets its length and `fds` (cleared first) the fds that came with it
/// (at most `max_fds` are accepted; a message with more counts as Truncated). On Truncated (MSG_TRUNC or
/// MSG_CTRUNC) and FdsDropped every received fd is closed before returning, so nothing leaks, or handed to
/// `refused` when given (the broker closes a client's fds on a thread of its own: closing a FUSE file can wait for
/// ever). Throws Error(System) on other failures.
IoStatus receive_message(int sock, std::span<std::byte> buffer, std::size_t& size, std::vector<UniqueFd>& fds,
                         std::size_t max_fds = kMaxFds, std::vector<UniqueFd>* refused = nullptr);

/// SO_PEERCRED and SO_PEERGROUPS of a connected socket. Throws Error(System).
Credentials peer_credentials(int sock);

/// Sets or clears O_NONBLOCK.
void set_nonblocking(int fd, bool on);

/// If `fd` is a socket, sets it to close at once (SO_LINGER 0): a TCP socket someone set to linger over unsent data
/// would make its last close wait for the peer, for as long as they chose. Anything else is left as it is.
void close_without_lingering(int fd) noexcept;

/// Shuts both directions of a connected SOCK_SEQPACKET socket down (the peer can send nothing more to it) and says
/// whether any message it was sent is still unread, whose fds its close would close: true also where it cannot
/// tell. A zero-length message counts (it may carry fds). Leaves SO_PASSCRED on.
bool shut_down_with_unread(int sock) noexcept;

/// poll(2) for POLLIN on one fd, retrying EINTR with the remaining time. timeout_ms < 0 waits forever.
/// Returns true when readable (or hung up), false on timeout.
bool wait_readable(int fd, int timeout_ms);

/// poll(2) for POLLOUT on one fd, retrying EINTR with the remaining time (< 0: for ever). Returns true when
/// writable (or hung up, or erred: the next send reports which), false on timeout. A Unix datagram or seqpacket
/// socket polls writable once its peer has drained the queue to a quarter of the send buffer.
bool wait_writable(int fd, int timeout_ms);

/// poll(2) for POLLIN on `fd` or `wake`, for at most `timeout_ms` (< 0: for ever), retrying EINTR: true when either
/// is readable (or `fd` hung up, erred or is no longer open: the caller looks again under the lock that owns `fd`),
/// false on timeout. For a thread that waits for a socket another thread may close: the closer signals `wake`.
bool wait_readable_or_woken(int fd, int wake, int timeout_ms);

/// Sleeps until the peer of connected socket `sock` hangs up (or the socket errs), or until `wake` becomes readable,
/// whichever comes first; `sock` -1 waits for `wake` alone. Data arriving on `sock` does not end the wait (another
/// thread reads it). Returns true when `sock` hung up. Retries EINTR.
bool wait_hangup(int sock, int wake);

/// Polls one fd for POLLIN without sleeping for up to `spin_ns`, yielding the CPU between looks (sched_yield):
/// true as soon as it is readable (or hung up), false when the time is up. For waits that usually end within
/// microseconds, where sleeping would let a virtual CPU halt and cost its wake-up (tens to hundreds of us).
bool spin_readable(int fd, std::int64_t spin_ns);

}  // namespace gpuipc::os
