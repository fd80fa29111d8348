// gpuipcd's event loop: one thread, epoll over the listening socket, a signalfd and the client connections.
// No client can block it: sockets are non-blocking, replies a slow client does not read are queued up to a
// bound and then its connection is closed; a malformed message gets an error reply and the connection closed.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "broker/fd_closer.hpp"
#include "broker/registry.hpp"
#include "os/epoll.hpp"
#include "os/fd.hpp"
#include "os/socket.hpp"
#include "proto/status_page.hpp"

namespace gpuipc::broker {

struct ServerOptions {
  std::string runtime_dir;                    ///< holds broker.sock and broker.lock
  proto::BrokerMode mode = proto::BrokerMode::Manual;  ///< how it was started, shown on the status page
  /// A listening socket passed by the service manager (socket activation): served instead of binding
  /// runtime_dir/broker.sock, and never unlinked (the service manager owns it). Move-only, so ServerOptions is.
  os::UniqueFd listen_fd;
  std::string listen_path;  ///< where listen_fd is bound, when known
  Quotas quotas;
  std::chrono::milliseconds idle_timeout{0};  ///< exit after this long with no client and nothing registered; 0: never
  std::size_t max_connections_per_uid = 512;
  std::size_t max_connections = 8192;
  /// A connection that has not said Hello this long after it was accepted is closed (GPUIPC_HELLO_TIMEOUT_MS): it
  /// would hold one of its uid's connections and one of the broker's fds for nothing. 0: never.
  std::chrono::milliseconds hello_timeout{10000};
  std::size_t max_queued_replies = 256;       ///< per connection, before it is closed as not reading
  /// Per connection, what its unread replies may hold past the socket's own buffer before it is closed as not
  /// reading: bytes (List replies are up to 17 KiB), and fds (an Open's reply carries one; a client sends at most
  /// 64 requests before it reads, and the socket's buffer takes about 200 replies first). The fds are bounded over
  /// all of a uid's connections too: half of an eighth of the broker's fd limit.
  std::size_t max_queued_bytes = std::size_t{1} << 20;
  std::size_t max_queued_fds = 64;
  /// Per watcher connection, events waiting past the socket's buffer before further ones are dropped (and the
  /// watcher told Lost once it has read those): anyone who may open a watched name can make events at will.
  std::size_t max_queued_events = 64;
  /// After a restart, how long names linked when the last broker died wait for a holder to announce them.
  std::chrono::milliseconds restore_grace{30000};
  /// How long a member whose connection closed while its process lives waits for that process to reconnect and
  /// rejoin (GPUIPC_REJOIN_GRACE_MS) before it is repaired as if it had died; it is repaired as soon as its process
  /// exits. A process that exec'd keeps its pid but never rejoins: its peers hear of it this much later. 0: a
  /// connection's close is taken for its process's death at once.
  std::chrono::milliseconds rejoin_grace{5000};
  /// After a request, how long the broker looks for the next one without sleeping (GPUIPC_BROKER_POLL_US): a
  /// client's setup calls come in bursts (an open is several requests), and a broker that sleeps between them
  /// lets its CPU halt, which virtual machines make costly to wake.
  std::chrono::microseconds poll{1000};
};

class Server {
 public:
  /// Creates the runtime directory if needed, takes its instance lock and listens on its socket (or serves
  /// options.listen_fd). Throws Error(AlreadyExists) when another broker holds the lock (naming its pid when
  /// known), Error otherwise.
  explicit Server(ServerOptions options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Serves until SIGTERM or SIGINT (blocked in the calling thread and read from a signalfd), request_stop(), or
  /// the idle timeout. Unlinks the socket on the way out when it bound it itself and the path still names it; a
  /// socket the service manager passed stays, so that the next connection starts the broker again.
  void run();
  /// Thread-safe and async-signal-safe: makes run() return soon.
  void request_stop() noexcept;

  const Registry& registry() const noexcept { return m_registry; }

 private:
  struct Connection {
    os::UniqueFd sock;
    os::Credentials creds;
    bool greeted = false;
    bool closing = false;
    struct Queued {
      std::vector<std::byte> bytes;
      os::UniqueFd fd;
      bool event = false;  ///< an Event for a watcher
    };
    std::deque<Queued> outbox;
    std::size_t outbox_bytes = 0;  ///< of the replies in `outbox`
    std::size_t outbox_fds = 0;
    std::size_t outbox_events = 0;
    /// Names (by segment id) whose events were dropped while this watcher was behind: once `outbox` has drained,
    /// each gets a Lost event. At most the names it watches (64).
    std::map<std::uint64_t, std::string> lost;

    void push_back(Queued q) {
      outbox_bytes += q.bytes.size();
      outbox_fds += q.fd ? 1 : 0;
      outbox_events += q.event ? 1 : 0;
      outbox.push_back(std::move(q));
    }
    void pop_front() noexcept {
      outbox_bytes -= outbox.front().bytes.size();
      outbox_fds -= outbox.front().fd ? 1 : 0;
      outbox_events -= outbox.front().event ? 1 : 0;
      outbox.pop_front();
    }
  };

  /// Accepts waiting connections, at most kAcceptsPerTurn (the rest next turn), refusing those over the limits.
  void accept_some();
  void serve(ConnId id, std::uint32_t events);
  bool handle_message(ConnId id, Connection& c, std::span<const std::byte> bytes, std::vector<os::UniqueFd>& fds);
  void dispatch(std::vector<Outgoing>& out);
  void queue(ConnId id, Connection& c, std::vector<std::byte> bytes, os::UniqueFd fd);
  /// Queues an Event for watcher `c`, or drops it (recording its name in `c.lost`) while the watcher has
  /// kMaxQueuedEvents waiting unread: a watcher that falls behind is told Lost, not cut off.
  void queue_event(ConnId id, Connection& c, const proto::Message& msg);
  void flush(ConnId id, Connection& c);
  /// Fds that replies waiting in the outboxes of `uid`'s connections hold.
  std::size_t queued_fds_of(uid_t uid) const noexcept;
  /// Adds `delta` to the fds that `uid`'s waiting replies hold, and to all of them.
  void count_queued_fds(uid_t uid, std::ptrdiff_t delta);
  /// Pops `c`'s oldest reply, sent.
  void pop_sent(Connection& c);
  /// Closes a client's connection socket, on the closer's thread when messages it has not read are left: they go
  /// with it, and the last close of an fd one carries (a client's file whose close blocks) would run on this loop.
  void close_off_loop(os::UniqueFd sock) noexcept;
  void close_connection(ConnId id, bool repair = true);
  void reap_closing();
  /// Drops the entries of m_ungreeted that said Hello or went, marks those past their time closing (as of `now`),
  /// and returns the next one's deadline.
  std::optional<std::int64_t> expire_ungreeted(std::int64_t now);

  ServerOptions m_options;
  FdCloser m_closer;  // before the rest: destroyed after them
  std::string m_socket_path;
  std::optional<os::FileIdentity> m_socket_file;  // the socket file this broker bound, to unlink on the way out
  os::UniqueFd m_lock;
  os::UniqueFd m_listen;
  os::UniqueFd m_signals;
  os::UniqueFd m_wakeup;
  os::Epoll m_epoll;
  Registry m_registry;
  std::unordered_map<ConnId, Connection> m_connections;
  std::unordered_map<uid_t, std::size_t> m_per_uid;
  std::deque<std::pair<std::int64_t, ConnId>> m_ungreeted;  // (Hello's deadline, connection), in accept order
  ConnId m_next_conn = 16;  // keys below are the listener, the signalfd and the wakeup eventfd
  std::int64_t m_idle_since_ns = 0;
  std::int64_t m_last_request_ns = 0;  // when a client's message was last served: polling goes on until `poll` after
  std::int64_t m_accept_paused_until_ns = 0;  // accept failed for want of fds: listener unwatched until then
  std::uint64_t m_fd_limit = 1024;
  /// Fds that waiting replies may hold in all (an eighth of the limit, at least 16), at most half of them for one
  /// uid's connections; and what they hold, per uid and in all.
  std::uint64_t m_queued_fds_budget = 128;
  std::unordered_map<uid_t, std::size_t> m_queued_fds;
  std::size_t m_queued_fds_total = 0;
  std::vector<std::byte> m_buffer;
};

}  // namespace gpuipc::broker
