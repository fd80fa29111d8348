#include "broker/server.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <climits>
#include <csignal>
#include <fstream>

#include "base/log.hpp"
#include "gpuipc/version.hpp"
#include "os/memfd.hpp"
#include "os/identity.hpp"
#include "os/process.hpp"
#include "proto/messages.hpp"

namespace gpuipc::broker {
namespace {

constexpr std::uint64_t kListenKey = 1;
constexpr std::uint64_t kSignalKey = 2;
constexpr std::uint64_t kWakeupKey = 3;
// Messages served per connection per loop turn, so one busy client cannot starve the others.
constexpr int kMessagesPerTurn = 32;
// How long the broker stops accepting after accept failed for want of fds.
constexpr std::int64_t kAcceptPauseMs = 100;
// Connections accepted per loop turn: the listener stays readable (level-triggered) while more wait. Accepting until
// the queue was empty let a process that connects and closes in a loop keep every other client waiting: `gpuipc ls`
// of another user took up to 1.4-2.9 s under such a flood, at most 0.10-0.20 s with this bound (6 runs each:
// bench/analysis/experiments/connect_flood.py; bench/results/experiments/connect-flood-local-20261130*.json).
constexpr int kAcceptsPerTurn = 32;

std::vector<std::byte> encode_or_error(const proto::Message& msg, std::size_t fds) {
  try {
    return proto::encode(msg, fds);
  } catch (const std::exception& e) {
    // Only reachable through a bug: the registry builds replies from checked values.
    GPUIPC_LOG_ERROR("cannot encode reply: {}", e.what());
    return proto::encode(error_reply(msg.request_id, ErrorCode::Protocol, "broker could not encode its reply"), 0);
  }
}

}  // namespace

Server::Server(ServerOptions options)
    : m_options(std::move(options)), m_registry(m_options.quotas), m_buffer(proto::kMaxMessageSize + 1) {
  os::ensure_private_dir(m_options.runtime_dir, 0755);
  const std::string lock_path = m_options.runtime_dir + "/broker.lock";
  m_lock = os::try_lock_file(lock_path);
  if (!m_lock) {
    std::string pid;
    std::ifstream(m_options.runtime_dir + "/broker.pid") >> pid;
    throw Error(ErrorCode::AlreadyExists,
                fmt::format("another gpuipcd{} already serves {} (it holds {})", pid.empty() ? "" : " (pid " + pid + ")",
                            m_options.runtime_dir, lock_path),
                "flock");
  }
  os::write_file(m_options.runtime_dir + "/broker.pid", fmt::format("{}\n", os::current_pid()));
  // fds are what a broker holds for everyone (one per segment, one per connection, one per reply waiting to be
  // read with an fd): take all the kernel allows, then share it out (connections first, an eighth for replies,
  // the rest for segments; at most half of each of the last two for one uid).
  const std::uint64_t limit = os::raise_fd_limit();
  m_fd_limit = limit;
  constexpr std::uint64_t kReserve = 64;  // listener, signalfd, eventfd, logs, fds in flight
  m_options.max_connections =
      static_cast<std::size_t>(std::min<std::uint64_t>(m_options.max_connections, std::max<std::uint64_t>(limit / 4, 8)));
  m_queued_fds_budget = std::max<std::uint64_t>(limit / 8, 16);
  Quotas q = m_registry.quotas();
  const std::uint64_t taken = kReserve + m_options.max_connections + m_queued_fds_budget;
  q.fds = limit > taken ? limit - taken : 16;
  m_registry.set_quotas(q);
  constexpr std::int64_t kMostGraceMs = std::int64_t{30} * 24 * 3600 * 1000;  // (ns past it would overflow a deadline)
  m_registry.set_rejoin_grace(std::min<std::int64_t>(m_options.rejoin_grace.count(), kMostGraceMs) * 1'000'000);
  m_registry.open_journal(m_options.runtime_dir + "/names.journal", os::monotonic_ns(),
                          std::min<std::int64_t>(m_options.restore_grace.count(), kMostGraceMs) * 1'000'000);
  m_socket_path = m_options.runtime_dir + "/broker.sock";
  if (m_options.listen_fd) {
    m_listen = std::move(m_options.listen_fd);
    if (!m_options.listen_path.empty() && m_options.listen_path != m_socket_path) {
      // Served all the same, but the library looks for DIR/broker.sock: clients of the default directory will
      // not find this broker.
      GPUIPC_LOG_WARN(
          "the socket systemd passed is {}, but clients of {} connect to {}: make the .socket unit's "
          "ListenSequentialPacket= and the service's GPUIPC_RUNTIME_DIR (or --runtime-dir) agree",
          m_options.listen_path, m_options.runtime_dir, m_socket_path);
      m_socket_path = m_options.listen_path;
    }
  } else {
    m_listen = os::listen_seqpacket(m_socket_path, 0666);
    m_socket_file = os::file_identity(m_socket_path);
  }
  m_registry.describe_broker(m_options.mode, static_cast<std::uint64_t>(m_options.idle_timeout.count()));
  m_signals = os::signal_fd({SIGTERM, SIGINT});
  m_wakeup = os::event_fd();
  m_epoll.add(m_listen.get(), EPOLLIN, kListenKey);
  m_epoll.add(m_signals.get(), EPOLLIN, kSignalKey);
  m_epoll.add(m_wakeup.get(), EPOLLIN, kWakeupKey);
  os::ignore_signal(SIGPIPE);  // sends use MSG_NOSIGNAL; this is belt and braces
  GPUIPC_LOG_INFO("gpuipcd {} pid {} ({}) serving {} (fd limit {}: {} connections, {} unread replies, {} segments)",
                  GPUIPC_VERSION_STRING, os::current_pid(), proto::broker_mode_name(m_options.mode), m_socket_path,
                  limit, m_options.max_connections, m_queued_fds_budget, q.fds);
}

Server::~Server() = default;

void Server::request_stop() noexcept { os::event_fd_signal(m_wakeup.get()); }

void Server::run() {
  std::array<epoll_event, 64> events{};
  m_idle_since_ns = os::monotonic_ns();
  bool stop = false;
  while (!stop) {
    const std::int64_t now = os::monotonic_ns();
    std::int64_t timeout_ns = -1;
    if (auto d = m_registry.next_deadline()) timeout_ns = std::max<std::int64_t>(0, *d - now);
    if (auto d = expire_ungreeted(now)) {
      const std::int64_t left = std::max<std::int64_t>(0, *d - now);
      timeout_ns = timeout_ns < 0 ? left : std::min(timeout_ns, left);
    }
    if (m_accept_paused_until_ns != 0) {
      if (now >= m_accept_paused_until_ns) {
        m_accept_paused_until_ns = 0;
        m_epoll.modify(m_listen.get(), EPOLLIN, kListenKey);
      } else {
        const std::int64_t left = m_accept_paused_until_ns - now;
        timeout_ns = timeout_ns < 0 ? left : std::min(timeout_ns, left);
      }
    }
    const bool idle = m_connections.empty() && m_registry.empty();
    if (idle && m_options.idle_timeout.count() > 0) {
      // Saturating: "unlimited" (UINT64_MAX ms) must not overflow into "already expired".
      const std::int64_t idle_ns = m_options.idle_timeout.count() > INT64_MAX / 1'000'000
                                       ? INT64_MAX / 2
                                       : m_options.idle_timeout.count() * 1'000'000;
      const std::int64_t left = m_idle_since_ns + idle_ns - now;
      if (left <= 0) {
        GPUIPC_LOG_INFO("idle for {} ms with nothing registered: exiting", m_options.idle_timeout.count());
        break;
      }
      timeout_ns = timeout_ns < 0 ? left : std::min(timeout_ns, left);
    }
    // Clamped: a deadline over 24.8 days away (an idle timeout of a month) wrapped to a negative int, "for ever".
    const int timeout_ms =
        timeout_ns < 0 ? -1 : static_cast<int>(std::min<std::int64_t>((timeout_ns + 999'999) / 1'000'000, INT_MAX));
    const std::int64_t poll_ns = m_last_request_ns + m_options.poll.count() * 1000 - os::monotonic_ns();
    const int n = m_epoll.wait_spinning(events, timeout_ms, poll_ns);
    for (int i = 0; i < n; ++i) {
      const std::uint64_t key = events[static_cast<std::size_t>(i)].data.u64;
      if (key == kListenKey) {
        accept_some();
      } else if (key == kSignalKey) {
        while (const int sig = os::read_signal(m_signals.get())) {
          GPUIPC_LOG_INFO("signal {}: shutting down", sig);
          stop = true;
        }
      } else if (key == kWakeupKey) {
        os::event_fd_drain(m_wakeup.get());
        stop = true;
      } else {
        serve(key, events[static_cast<std::size_t>(i)].events);
        m_last_request_ns = os::monotonic_ns();
      }
    }
    std::vector<Outgoing> out;
    m_registry.expire(os::monotonic_ns(), out);
    dispatch(out);
    (void)expire_ungreeted(os::monotonic_ns());
    reap_closing();
    if (!(m_connections.empty() && m_registry.empty())) m_idle_since_ns = os::monotonic_ns();
  }
  m_registry.mark_stopping();
  std::vector<ConnId> ids;
  for (const auto& [id, c] : m_connections) ids.push_back(id);
  // Shutting down is not the clients dying: their semaphores and channels keep working without a broker, so
  // nothing is poisoned or repaired here.
  for (auto id : ids) close_connection(id, false);
  // A socket systemd passed is systemd's: it keeps listening while the broker is down and starts it again on the
  // next connection. One this broker bound goes, unless another process has bound that path since (a socket unit
  // started meanwhile replaces the file, and it must not lose it to this broker's exit).
  if (m_socket_file) os::unlink_if_same(m_socket_path, *m_socket_file);
}

void Server::accept_some() {
  for (int i = 0; i < kAcceptsPerTurn; ++i) {
    os::UniqueFd sock;
    try {
      sock = os::accept_seqpacket(m_listen.get());
    } catch (const Error& e) {
      // EMFILE and friends: the pending connection stays queued and the listener stays readable, so looking again
      // at once would spin. Stop watching it for a while; the clients' connect waits meanwhile.
      GPUIPC_LOG_WARN("accept: {}; not accepting for {} ms", e.what(), kAcceptPauseMs);
      m_epoll.modify(m_listen.get(), 0, kListenKey);
      m_accept_paused_until_ns = os::monotonic_ns() + kAcceptPauseMs * 1'000'000;
      return;
    }
    if (!sock) return;
    os::Credentials creds;
    try {
      creds = os::peer_credentials(sock.get());
    } catch (const Error& e) {
      GPUIPC_LOG_WARN("dropping a connection without credentials: {}", e.what());
      close_off_loop(std::move(sock));
      continue;
    }
    const auto per_uid = m_per_uid.find(creds.uid);
    const std::size_t count = per_uid == m_per_uid.end() ? 0 : per_uid->second;
    std::string refusal;
    if (count >= m_options.max_connections_per_uid) {
      refusal = fmt::format("too many connections from uid {} ({} allowed); close some gpuipc clients", creds.uid,
                            m_options.max_connections_per_uid);
    } else if (m_connections.size() >= m_options.max_connections) {
      refusal = fmt::format(
          "the broker serves as many connections as it may ({}, from all users; its file "
          "descriptor limit is {}, at most a quarter of it for connections); close some gpuipc "
          "clients, or raise the broker's limit (LimitNOFILE=)",
          m_options.max_connections, m_fd_limit);
    }
    if (!refusal.empty()) {
      try {
        (void)os::send_message(sock.get(), proto::encode(error_reply(0, ErrorCode::QuotaExceeded, refusal), 0));
      } catch (const std::exception& e) {  // the refusal is a courtesy: it must not end the broker's loop
        GPUIPC_LOG_DEBUG("refusing a connection from uid {}: {}", creds.uid, e.what());
      }
      close_off_loop(std::move(sock));  // a client can send before it is accepted: what it sent goes with it
      continue;
    }
    ++m_per_uid[creds.uid];
    const ConnId id = m_next_conn++;
    m_epoll.add(sock.get(), EPOLLIN, id);
    Connection c;
    c.sock = std::move(sock);
    c.creds = creds;
    m_connections.emplace(id, std::move(c));
    if (m_options.hello_timeout.count() > 0) {
      const std::int64_t limit_ns = m_options.hello_timeout.count() > INT64_MAX / 4'000'000
                                        ? INT64_MAX / 4
                                        : m_options.hello_timeout.count() * 1'000'000;
      m_ungreeted.emplace_back(os::monotonic_ns() + limit_ns, id);
    }
    GPUIPC_LOG_DEBUG("connection {} from pid {} uid {}", id, creds.pid, creds.uid);
  }
}

void Server::serve(ConnId id, std::uint32_t events) {
  auto it = m_connections.find(id);
  if (it == m_connections.end()) return;
  Connection& c = it->second;
  if ((events & EPOLLOUT) != 0) flush(id, c);
  if ((events & (EPOLLIN | EPOLLHUP | EPOLLERR)) == 0) return;
  for (int i = 0; i < kMessagesPerTurn && !c.closing; ++i) {
    std::size_t size = 0;
    std::vector<os::UniqueFd> fds;
    std::vector<os::UniqueFd> refused;
    // Whatever the request left of them is closed on the closer's thread (fd_closer.hpp): never here.
    struct CloseLater {
      FdCloser& closer;
      std::vector<os::UniqueFd>& fds;
      std::vector<os::UniqueFd>& refused;
      ~CloseLater() {
        closer.close_later(fds);
        closer.close_later(refused);
      }
    } close_later{m_closer, fds, refused};
    os::IoStatus st;
    try {
      st = os::receive_message(c.sock.get(), m_buffer, size, fds, os::kMaxFds, &refused);
    } catch (const Error& e) {
      GPUIPC_LOG_WARN("connection {} (pid {}): {}", id, c.creds.pid, e.what());
      c.closing = true;
      break;
    }
    if (st == os::IoStatus::WouldBlock) break;
    if (st == os::IoStatus::Closed) {
      c.closing = true;
      break;
    }
    if (st == os::IoStatus::FdsDropped) {
      // The whole request came but the kernel could not give the broker its fds: the broker is out of them, which
      // is not the client's fault. Its request is refused, saying so, and its connection stays (closing it would
      // repair its members as if its process had died).
      const auto header = proto::peek_header(std::span<const std::byte>(m_buffer.data(), size));
      const std::uint32_t rid = header ? header->request_id : 0;
      queue(id, c,
            proto::encode(error_reply(rid, ErrorCode::QuotaExceeded,
                                      fmt::format("the broker could not take the fds this request carried: it is out "
                                                  "of file descriptors (limit {}); unlink segments you no longer "
                                                  "need and try again",
                                                  m_fd_limit)),
                          0),
            {});
      if (rid == 0 || !c.greeted) {
        c.closing = true;
        break;
      }
      continue;
    }
    if (st == os::IoStatus::Truncated) {
      queue(id, c,
            proto::encode(error_reply(0, ErrorCode::Protocol,
                                      fmt::format("message larger than {} bytes or with more than {} fds: closing",
                                                  proto::kMaxMessageSize, os::kMaxFds)),
                          0),
            {});
      c.closing = true;
      break;
    }
    bool keep = false;
    try {
      keep = handle_message(id, c, std::span<const std::byte>(m_buffer.data(), size), fds);
    } catch (const std::exception& e) {
      // A bug or resource exhaustion while serving this client: it loses its connection, the broker goes on.
      GPUIPC_LOG_ERROR("connection {} (pid {}): request failed: {}", id, c.creds.pid, e.what());
    }
    if (!keep) {
      c.closing = true;
      break;
    }
  }
  // Not everything read this turn: epoll (level-triggered) reports the socket again.
}

bool Server::handle_message(ConnId id, Connection& c, std::span<const std::byte> bytes,
                            std::vector<os::UniqueFd>& fds) {
  if (const auto version = proto::peek_version(bytes); version && *version != proto::kVersion) {
    // Another release, not garbage: say so in words that name both versions and the way out. The reply is in
    // this broker's version; the header and the Error body are the same in every version, so the client reads it.
    GPUIPC_LOG_WARN("connection {} (pid {} uid {}): speaks protocol version {}, this broker {}: refused", id,
                    c.creds.pid, c.creds.uid, *version, proto::kVersion);
    queue(id, c,
          proto::encode(error_reply(0, ErrorCode::Protocol,
                                    fmt::format("protocol version mismatch: the client speaks gpuipc protocol version "
                                                "{}, this broker (gpuipcd {}, pid {}) speaks version {}. The client "
                                                "library and the running broker come from different gpuipc releases: "
                                                "stop the broker (`gpuipc daemon --stop`, or restart gpuipcd.service "
                                                "when systemd runs it) so that a gpuipcd of the client's release "
                                                "serves, or upgrade the older side",
                                                *version, GPUIPC_VERSION_STRING, os::current_pid(), proto::kVersion)),
                        0),
          {});
    return false;
  }
  proto::Message msg;
  std::string why;
  if (!proto::decode(bytes, fds.size(), msg, why)) {
    GPUIPC_LOG_WARN("connection {} (pid {} uid {}): malformed message: {}", id, c.creds.pid, c.creds.uid, why);
    queue(id, c,
          proto::encode(error_reply(0, ErrorCode::Protocol,
                                    fmt::format("malformed message: {}", why)),
                        0),
          {});
    return false;
  }
  if (!c.greeted) {
    const auto* hello = std::get_if<proto::Hello>(&msg.body);
    if (hello == nullptr) {
      queue(id, c, proto::encode(error_reply(msg.request_id, ErrorCode::Protocol, "the first message must be Hello"), 0), {});
      return false;
    }
    c.greeted = true;
    // Hello's pid is only shown; membership and identity come from SO_PEERCRED and broker-chosen tokens.
    m_registry.add_connection(id, c.creds);
    proto::HelloReply r;
    r.broker_pid = static_cast<std::uint32_t>(os::current_pid());
    r.uid = c.creds.uid;
    r.gid = c.creds.gid;
    r.broker_version = GPUIPC_VERSION_STRING;
    os::UniqueFd status;
    try {
      status = os::reopen_readonly(m_registry.status_fd());
    } catch (const Error& e) {
      GPUIPC_LOG_WARN("cannot share the status page: {}", e.what());
    }
    const std::size_t nfds = status ? 1 : 0;
    queue(id, c, encode_or_error(proto::Message{msg.request_id, r}, nfds), std::move(status));
    return true;
  }
  if (std::holds_alternative<proto::Hello>(msg.body)) {
    queue(id, c, proto::encode(error_reply(msg.request_id, ErrorCode::Protocol, "Hello sent twice"), 0), {});
    return false;
  }
  std::vector<Outgoing> out;
  m_registry.handle(Caller{id, c.creds}, msg, fds, os::monotonic_ns(), out);
  dispatch(out);
  return true;
}

void Server::dispatch(std::vector<Outgoing>& out) {
  for (auto& o : out) {
    auto it = m_connections.find(o.conn);
    if (it == m_connections.end() || it->second.closing) continue;  // o.fd closes with o
    if (o.msg.request_id == 0 && std::holds_alternative<proto::Event>(o.msg.body)) {
      queue_event(o.conn, it->second, o.msg);
      continue;
    }
    const std::size_t nfds = o.fd ? 1 : 0;
    queue(o.conn, it->second, encode_or_error(o.msg, nfds), std::move(o.fd));
  }
  out.clear();
}

void Server::queue_event(ConnId id, Connection& c, const proto::Message& msg) {
  const auto& e = std::get<proto::Event>(msg.body);
  // Once one is dropped, the rest are too until the watcher has read what waits and its Lost: it never sees an
  // event of a name after a gap without the Lost between.
  if (!c.lost.empty() || c.outbox_events >= m_options.max_queued_events) {
    if (c.lost.size() < 1024) c.lost.emplace(e.id, e.name);
    return;
  }
  c.push_back(Connection::Queued{encode_or_error(msg, 0), {}, true});
  if (c.outbox.size() == 1) flush(id, c);
}

void Server::queue(ConnId id, Connection& c, std::vector<std::byte> bytes, os::UniqueFd fd) {
  // A reply that waits (the client has not read those before it) holds its fd in the broker: so many a connection,
  // and, over all of a uid's connections, half the broker's budget for them (a uid's 512 connections would hold
  // 32768, more than a broker with a limit of a few thousand fds has). A reply that can go at once is not held.
  const std::size_t uid_fds = fd && !c.outbox.empty() ? queued_fds_of(c.creds.uid) : 0;
  if (c.outbox.size() >= m_options.max_queued_replies || c.outbox_bytes + bytes.size() > m_options.max_queued_bytes ||
      (fd && c.outbox_fds >= m_options.max_queued_fds) ||
      (fd && !c.outbox.empty() && (uid_fds >= m_queued_fds_budget / 2 || m_queued_fds_total >= m_queued_fds_budget))) {
    GPUIPC_LOG_WARN(
        "connection {} (pid {} uid {}) does not read its replies ({} queued, {} bytes, {} fds; its uid's connections "
        "{} fds of {}, all {} of {}): closing",
        id, c.creds.pid, c.creds.uid, c.outbox.size(), c.outbox_bytes, c.outbox_fds, uid_fds, m_queued_fds_budget / 2,
        m_queued_fds_total, m_queued_fds_budget);
    c.closing = true;
    return;
  }
  const bool holds_fd = static_cast<bool>(fd);
  c.push_back(Connection::Queued{std::move(bytes), std::move(fd)});
  if (holds_fd) count_queued_fds(c.creds.uid, 1);
  if (c.outbox.size() == 1) flush(id, c);
}

std::size_t Server::queued_fds_of(uid_t uid) const noexcept {
  const auto it = m_queued_fds.find(uid);
  return it == m_queued_fds.end() ? 0 : it->second;
}

void Server::count_queued_fds(uid_t uid, std::ptrdiff_t delta) {
  // Saturating at 0: a count that missed an increment (out of memory in a map insertion) must not wrap, which
  // would cut off every later reply of the uid that waits.
  const auto add = [delta](std::size_t n) {
    return delta >= 0 ? n + static_cast<std::size_t>(delta) : n - std::min(n, static_cast<std::size_t>(-delta));
  };
  if (delta == 0) return;
  m_queued_fds_total = add(m_queued_fds_total);
  auto it = m_queued_fds.find(uid);
  if (it == m_queued_fds.end()) {
    if (delta > 0) m_queued_fds.emplace(uid, static_cast<std::size_t>(delta));
    return;
  }
  it->second = add(it->second);
  if (it->second == 0) m_queued_fds.erase(it);
}

void Server::pop_sent(Connection& c) {
  if (c.outbox.front().fd) count_queued_fds(c.creds.uid, -1);
  c.pop_front();
}

void Server::flush(ConnId id, Connection& c) {
  for (;;) {
    if (c.outbox.empty()) {
      if (c.lost.empty()) break;
      // A watcher that fell behind has read what waited: one Lost per name whose events were dropped, then its
      // events come again.
      for (const auto& [segment, name] : std::exchange(c.lost, {})) {
        proto::Event lost;
        lost.kind = static_cast<std::uint8_t>(proto::EventKind::Lost);
        lost.id = segment;
        lost.name = name;
        lost.unix_ns = unix_now_ns();
        c.push_back(Connection::Queued{encode_or_error(proto::Message{0, lost}, 0), {}, true});
      }
    }
    auto& q = c.outbox.front();
    const int fd = q.fd.get();
    os::IoStatus st;
    try {
      st = os::send_message(c.sock.get(), q.bytes, fd >= 0 ? std::span<const int>(&fd, 1) : std::span<const int>{},
                            proto::kMaxMessageSize);
    } catch (const Error& e) {
      GPUIPC_LOG_WARN("connection {}: {}", id, e.what());
      c.closing = true;
      return;
    }
    if (st == os::IoStatus::WouldBlock) {
      m_epoll.modify(c.sock.get(), EPOLLIN | EPOLLOUT, id);
      return;
    }
    if (st == os::IoStatus::Closed) {
      c.closing = true;
      return;
    }
    pop_sent(c);
  }
  m_epoll.modify(c.sock.get(), EPOLLIN, id);
}

void Server::close_off_loop(os::UniqueFd sock) noexcept {
  // Most have nothing unread (a client that exited, one refused before it sent anything): closed here at once,
  // so that a flood of refused connections does not hold the broker's fds while the closer catches up.
  if (!os::shut_down_with_unread(sock.get())) return;
  try {
    std::vector<os::UniqueFd> fds;
    fds.push_back(std::move(sock));
    m_closer.close_later(fds);
  } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory: closed here, as before
  }
}

void Server::close_connection(ConnId id, bool repair) {
  auto it = m_connections.find(id);
  if (it == m_connections.end()) return;
  GPUIPC_LOG_DEBUG("connection {} (pid {}) closed", id, it->second.creds.pid);
  m_epoll.remove(it->second.sock.get());
  auto count = m_per_uid.find(it->second.creds.uid);
  if (count != m_per_uid.end() && --count->second == 0) m_per_uid.erase(count);
  count_queued_fds(it->second.creds.uid, -static_cast<std::ptrdiff_t>(it->second.outbox_fds));
  std::vector<Outgoing> out;
  m_registry.drop_connection(id, repair, &out);
  close_off_loop(std::move(it->second.sock));
  m_connections.erase(it);
  dispatch(out);  // watchers hear of the death
}

std::optional<std::int64_t> Server::expire_ungreeted(std::int64_t now) {
  while (!m_ungreeted.empty()) {
    const auto [deadline, id] = m_ungreeted.front();
    auto it = m_connections.find(id);
    if (it != m_connections.end() && !it->second.greeted && !it->second.closing) {
      if (deadline > now) return deadline;
      // Closed without a word: a client that says nothing reads nothing either. The library's Hello follows its
      // connect at once; a process stopped in between gets PeerDied from that call and connects again at the next.
      GPUIPC_LOG_INFO("connection {} (pid {} uid {}) said no Hello within {} ms: closing it", id, it->second.creds.pid,
                      it->second.creds.uid, m_options.hello_timeout.count());
      it->second.closing = true;
    }
    m_ungreeted.pop_front();
  }
  return std::nullopt;
}

void Server::reap_closing() {
  std::vector<ConnId> ids;
  for (auto& [id, c] : m_connections) {
    if (c.closing) ids.push_back(id);
  }
  for (auto id : ids) {
    // Best effort: the last error reply tells a misbehaving client why it is cut off.
    auto& c = m_connections.at(id);
    while (!c.outbox.empty()) {
      const int fd = c.outbox.front().fd.get();
      try {
        if (os::send_message(c.sock.get(), c.outbox.front().bytes,
                             fd >= 0 ? std::span<const int>(&fd, 1) : std::span<const int>{},
                             proto::kMaxMessageSize) != os::IoStatus::Ok) {
          break;
        }
      } catch (const Error&) {
        break;
      }
      pop_sent(c);
    }
    close_connection(id);
  }
}

}  // namespace gpuipc::broker
