#include "core/client.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <thread>

#include "base/config.hpp"
#include "base/deadline.hpp"
#include "base/log.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/programs.hpp"
#include "gpuipc/version.hpp"
#include "os/identity.hpp"
#include "os/path.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"

namespace gpuipc::core {
namespace {

std::atomic<std::uint64_t> g_generations{0};
// Process-wide, not per client: a forked child's fresh client keeps the hook its parent's library set.
std::atomic<BrokerClient::RebindHook> g_rebind{nullptr};

std::chrono::milliseconds connect_timeout() {
  return config::env_ms("GPUIPC_CONNECT_TIMEOUT_MS", std::chrono::milliseconds(5000));
}

/// GPUIPC_BROKER_POLL_US, in ns: how long a wait for the broker's answer looks for it without sleeping. An answer
/// takes 10-60 us; a client that sleeps meanwhile lets its CPU halt, and on virtual machines the wake-up costs more
/// than the wait (docs/env/GPUIPC_BROKER_POLL_US.md).
std::int64_t reply_poll_ns() {
  static const std::int64_t ns =
      static_cast<std::int64_t>(std::min<std::uint64_t>(config::env_u64("GPUIPC_BROKER_POLL_US", 1000), 1'000'000)) *
      1000;
  return ns;
}

/// How long the reply to a request that may wait `timeout` is waited for: the longer of `timeout` and
/// GPUIPC_CONNECT_TIMEOUT_MS.
std::chrono::milliseconds reply_limit(std::chrono::milliseconds timeout) {
  return std::max(timeout, connect_timeout());
}

/// `limit` from now (saturated).
std::chrono::steady_clock::time_point deadline_in(std::chrono::milliseconds limit) {
  return base::deadline_after(std::chrono::steady_clock::now(), limit);
}

/// Whole ms from now to `deadline` (rounded up), for poll(2): 0..INT_MAX.
int ms_until(std::chrono::steady_clock::time_point deadline) {
  if (deadline == std::chrono::steady_clock::time_point::max()) return INT_MAX;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, INT_MAX));
}

/// The Timeout of a call whose answer did not come within `limit`.
Error no_answer(std::chrono::milliseconds limit) {
  return Error(
      ErrorCode::Timeout,
      fmt::format("the gpuipc broker did not answer within {} ms (the call's wait, or GPUIPC_CONNECT_TIMEOUT_MS); "
                  "the connection stays and the late answer is discarded: see {}/broker.log if the broker "
                  "is stuck",
                  limit.count(), config::runtime_dir()),
      "recv");
}

/// Most requests given up on whose answers the connection waits for: more means the broker answers nothing at all,
/// and the connection is dropped (the broker then repairs what this process holds, as for a process that died).
constexpr std::size_t kMaxAbandoned = 64;

}  // namespace

BrokerClient& BrokerClient::instance() {
  static std::mutex guard;
  static BrokerClient* client = nullptr;
  static pid_t owner = 0;
  std::lock_guard lock(guard);
  const pid_t pid = os::current_pid();
  if (client == nullptr || owner != pid) {
    if (client != nullptr) {
      // A forked child: the parent's connection is not ours. Drop our copy of its fd; the object itself is left
      // behind (its mutex may have been held by a thread that does not exist in this process).
      client->m_sock.reset();
    }
    client = new BrokerClient();  // NOLINT(cppcoreguidelines-owning-memory): process-lifetime singleton
    owner = pid;
  }
  return *client;
}

std::uint64_t BrokerClient::names_generation() const noexcept {
  const proto::StatusPage* page = m_status.load(std::memory_order_acquire);
  if (page == nullptr) return 0;
  return std::atomic_ref<std::uint64_t>(const_cast<std::uint64_t&>(page->names_generation))  // NOLINT: read-only map
      .load(std::memory_order_acquire);
}

bool BrokerClient::broker_has(std::uint32_t feature) const noexcept {
  // Written once before the broker shared the page: a plain read.
  const proto::StatusPage* page = m_status.load(std::memory_order_acquire);
  return page != nullptr && (page->features & feature) != 0;
}

bool BrokerClient::broker_has_connecting(std::uint32_t feature) {
  (void)broker_pid();
  return broker_has(feature);
}

std::uint32_t BrokerClient::broker_pid() {
  std::lock_guard lock(m_mutex);
  if (!m_sock) connect_locked();
  return m_broker_pid;
}

std::uint32_t BrokerClient::broker_pid_here() {
  std::lock_guard lock(m_mutex);
  if (!m_sock) connect_locked();
  return static_cast<std::uint32_t>(os::peer_credentials(m_sock.get()).pid);
}

BrokerClient::BrokerStatus BrokerClient::broker_status() {
  std::lock_guard lock(m_mutex);
  if (!m_sock) connect_locked();
  BrokerStatus s;
  s.pid = m_broker_pid;
  s.version = m_broker_version;
  s.socket_path = config::socket_path();
  // Written once before the broker shared the page: plain reads.
  if (const proto::StatusPage* page = m_status.load(std::memory_order_acquire)) {
    s.mode = static_cast<proto::BrokerMode>(page->mode);
    s.started_unix_ns = page->started_unix_ns;
    s.idle_timeout_ms = page->idle_timeout_ms;
    s.features = page->features;
  }
  return s;
}

bool BrokerClient::broker_listening() {
  // Only "nothing listens there" (no socket file, or one nobody accepts on) is false. Anything else is an error to
  // report: a socket this user may not connect to, a malformed GPUIPC_* variable, a broker too busy to accept in
  // time. All were false, and `gpuipc daemon --stop` said no broker was running, exit 0, while one ran.
  const std::string path = config::socket_path();
  const auto timeout = connect_timeout();
  try {
    os::connect_seqpacket(path, timeout);
    return true;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::NotFound) return false;
    throw;
  }
}

std::string BrokerClient::find_daemon() {
  if (auto env = config::env_raw("GPUIPC_DAEMON")) return *env;
  return program_path("gpuipcd");
}

void BrokerClient::connect_locked() {
  // A dying broker's listener (its process exiting, not all its threads gone yet) still takes a connection and drops
  // it unanswered: the first call after a broker was killed failed with PeerDied when it connected in that window
  // (its retry too). Connect again, within the connect timeout.
  const auto deadline = std::chrono::steady_clock::now() + connect_timeout();
  auto delay = std::chrono::milliseconds(1);
  for (;;) {
    try {
      connect_once_locked();
      return;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::PeerDied || std::chrono::steady_clock::now() >= deadline) throw;
      GPUIPC_LOG_DEBUG(
          "the broker dropped the connection before it answered Hello (a broker going away?): connecting "
          "again in {} ms",
          delay.count());
    }
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::milliseconds(50));
  }
}

namespace {

/// The broker on `sock` runs as this process's uid or as root (the shared broker): another user's broker would get
/// this process's memory fds, and could hand it memory of its choosing under any name. (The same rule as for the
/// runtime directory, which only the broker and `gpuipc daemon` checked: a GPUIPC_RUNTIME_DIR or XDG_RUNTIME_DIR of
/// another user, kept by sudo -E or su, took every call to that user's broker.)
void check_broker_is_trusted(int sock, const std::string& path) {
  const uid_t broker = os::peer_credentials(sock).uid;
  const uid_t me = os::current_uid();
  if (broker == me || broker == 0) return;
  throw Error(ErrorCode::PermissionDenied,
              fmt::format("the gpuipc broker on {} runs as uid {}, and this process as uid {}: it is another user's, "
                          "which would get this process's memory; use a runtime directory of your own "
                          "(GPUIPC_RUNTIME_DIR, or unset it and XDG_RUNTIME_DIR) or the shared broker, root's",
                          path, broker, me),
              "connect");
}

}  // namespace

void BrokerClient::connect_once_locked() {
  // Checked before anything is sent: a malformed value must not throw between a request and its answer (the
  // request would take effect, and the connection would hold an answer nobody reads).
  (void)reply_poll_ns();
  disconnect_locked();
  const std::string dir = config::runtime_dir();
  const std::string path = config::socket_path();
  const auto deadline = std::chrono::steady_clock::now() + connect_timeout();
  bool spawned = false;
  auto delay = std::chrono::microseconds(200);
  for (;;) {
    try {
      // A ParentOnlyFd from before the connect: a child forked meanwhile (by any thread) must not keep the
      // connection, or the broker would not see this process die while the child lives, and would repair nothing.
      os::ParentOnlyFd sock(os::seqpacket_socket);
      os::connect_seqpacket(sock.get(), path,
                            std::chrono::duration_cast<std::chrono::milliseconds>(std::max(
                                deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration{})));
      check_broker_is_trusted(sock.get(), path);
      m_sock = std::move(sock);
      break;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::NotFound) {
        // A runtime "directory" that is a file: say so, as the broker and the doctor do, not "Not a directory".
        if (e.sys_errno() == ENOTDIR) os::ensure_private_dir(dir, 0755);
        throw;
      }
      if (!spawned) {
        if (config::env_bool("GPUIPC_NO_AUTOSTART", false)) {
          // An unsafe directory is what to mend first (exit 6, as with autostart): the advice below would fail.
          std::error_code ec;
          if (std::filesystem::exists(std::filesystem::symlink_status(dir, ec))) os::ensure_private_dir(dir, 0755);
          throw Error(ErrorCode::NotFound,
                      fmt::format("no gpuipc broker listens on {} and GPUIPC_NO_AUTOSTART=1; start one with "
                                  "`gpuipc daemon --foreground` (or unset GPUIPC_NO_AUTOSTART)",
                                  path),
                      "connect");
        }
        const std::string daemon = find_daemon();
        if (daemon.empty()) {
          throw Error(ErrorCode::NotFound,
                      fmt::format("no gpuipc broker listens on {} and gpuipcd was not found (not in $GPUIPC_DAEMON, "
                                  "next to this program or library, or on $PATH); install it or set GPUIPC_DAEMON",
                                  path),
                      "connect");
        }
        os::ensure_private_dir(dir, 0755);
        GPUIPC_LOG_DEBUG("starting broker {} for {}", daemon, dir);
        try {
          os::spawn_detached({daemon, "--on-demand", "--runtime-dir", dir}, dir + "/broker.log");
        } catch (const Error& failed) {
          // A directory this user may not write (the shared broker's, stopped): the daemon is not what is wrong.
          // Unless execv is what failed: a GPUIPC_DAEMON that is no program this user may run.
          if (failed.call() != "execv" &&
              (failed.sys_errno() == EACCES || failed.code() == ErrorCode::PermissionDenied)) {
            throw Error(ErrorCode::PermissionDenied,
                        fmt::format("no gpuipc broker listens on {}, and this user cannot start one there: {}; start "
                                    "the broker that serves {} (the shared one: systemctl start gpuipcd.socket), or "
                                    "set GPUIPC_RUNTIME_DIR to a directory of your own",
                                    path, failed.what(), dir),
                        "connect", failed.sys_errno());
          }
          // (execv's EACCES: the program may not be run, which is no permission matter of the caller's objects)
          throw Error(failed.code() == ErrorCode::PermissionDenied ? ErrorCode::System : failed.code(),
                      fmt::format("could not start the gpuipc broker {} for {}: {}; check GPUIPC_DAEMON, or install "
                                  "gpuipcd",
                                  daemon, dir, failed.what()),
                      "connect", failed.sys_errno());
        }
        spawned = true;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        throw Error(ErrorCode::Timeout,
                    fmt::format("the gpuipc broker did not start listening on {} within {} ms; see {}/broker.log",
                                path, connect_timeout().count(), dir),
                    "connect");
      }
      std::this_thread::sleep_for(delay);
      delay = std::min(delay * 2, std::chrono::microseconds(20000));
    }
  }
  // The mappings to give back were made on the last connection that said Hello, not on an attempt that failed
  // since (a dying broker's listener can take a connection and drop it).
  const std::uint64_t previous_generation = m_greeted_generation;
  m_generation = ++g_generations;
  proto::Hello hello;
  hello.pid = static_cast<std::uint32_t>(os::current_pid());
  std::string exe = std::filesystem::path(os::self_exe_path()).filename().string();
  for (char& ch : exe) {
    if (ch < 0x20 || ch > 0x7e) ch = '?';
  }
  hello.client_name = exe.substr(0, 64);
  Reply r;
  try {
    r = exchange_locked(hello, {}, connect_timeout());
  } catch (const Error&) {
    disconnect_locked();  // a connection the broker never greeted is of no use (exchange_locked kept it)
    throw;
  }
  const auto* hr = std::get_if<proto::HelloReply>(&r.msg.body);
  if (hr == nullptr) {
    disconnect_locked();
    throw Error(ErrorCode::Protocol, "the broker answered Hello with something else", "hello");
  }
  m_broker_pid = hr->broker_pid;
  m_broker_version = hr->broker_version;
  const std::uint64_t new_generation = m_generation.load();
  m_greeted_generation = new_generation;
  if (m_connected_once) {
    if (auto hook = g_rebind.load(); hook != nullptr) {
      try {
        hook(previous_generation, new_generation,
             [this](const proto::Body& body, std::span<const int> fds) {
               return exchange_locked(body, fds, connect_timeout());
             });
      } catch (const std::exception& e) {
        GPUIPC_LOG_WARN("giving names back to the restarted broker failed: {}", e.what());
      }
    }
  }
  m_connected_once = true;
  if (m_watch_wake) os::event_fd_signal(m_watch_wake.get());  // the watcher takes the new connection
  m_status.store(nullptr, std::memory_order_release);
  if (r.fds.size() == 1) {
    try {
      auto map = os::Mapping::map(r.fds[0].get(), sizeof(proto::StatusPage), false);
      const auto* page = static_cast<const proto::StatusPage*>(map.data());
      if (page->magic == proto::kStatusMagic && page->version == proto::kStatusVersion) {
        m_status.store(page, std::memory_order_release);
        m_status_maps.push_back(std::move(map));
      }
    } catch (const Error& e) {
      GPUIPC_LOG_WARN("cannot map the broker's status page: {}", e.what());
    }
  }
}

std::uint32_t BrokerClient::send_locked(const proto::Body& body, std::span<const int> fds,
                                        std::chrono::steady_clock::time_point deadline) {
  proto::Message msg;
  msg.request_id = m_next_request++;
  if (msg.request_id == 0) msg.request_id = m_next_request++;  // 0 is the broker's own (a closing connection)
  msg.body = body;
  const auto bytes = proto::encode(msg, fds.size());
  // Bounded like the wait for the answer: a broker that stopped reading (SIGSTOP, a debugger) fills its queue
  // with this connection's requests, and a blocking send would then hold the client's lock for as long.
  const auto st = os::send_message(m_sock.get(), bytes, fds, proto::kMaxMessageSize, ms_until(deadline));
  if (st == os::IoStatus::WouldBlock) {
    throw Error(ErrorCode::Timeout,
                "the gpuipc broker has stopped reading its requests (its queue stayed full; stopped, or hung?): "
                "the request was not sent. Check gpuipcd; `gpuipc daemon --stop` and a new call restart it",
                "send");
  }
  if (st != os::IoStatus::Ok) {
    disconnect_locked();
    throw Error(ErrorCode::PeerDied, "the gpuipc broker closed the connection", "send");
  }
  return msg.request_id;
}

Reply BrokerClient::receive_locked(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds limit) {
  // The wait is bounded: a broker that stops answering becomes an error, not a hang. The connection stays: the
  // caller abandons its request, whose late answer is then discarded (dropping the connection would make the broker
  // take this process for dead).
  const std::int64_t poll_ns = reply_poll_ns();  // read (and checked) at connect
  for (;;) {
    if (!os::spin_readable(m_sock.get(), poll_ns) && !os::wait_readable(m_sock.get(), ms_until(deadline))) {
      throw no_answer(limit);
    }
    if (auto reply = receive_ready_locked(true)) return std::move(*reply);
  }
}

std::optional<Reply> BrokerClient::receive_ready_locked(bool readable) {
  // The socket blocks: a read with nothing there would wait (and hold the lock) until something comes.
  if (!readable && !os::wait_readable(m_sock.get(), 0)) return std::nullopt;
  if (!m_reply_buffer) m_reply_buffer = std::make_unique_for_overwrite<std::byte[]>(proto::kMaxMessageSize);
  const std::span<std::byte> buffer(m_reply_buffer.get(), proto::kMaxMessageSize);
  Reply reply;
  reply.generation = m_generation.load();
  std::size_t size = 0;
  const auto st = os::receive_message(m_sock.get(), buffer, size, reply.fds);
  if (st == os::IoStatus::WouldBlock) return std::nullopt;
  if (st == os::IoStatus::FdsDropped) return out_of_fds_locked(std::span<const std::byte>(buffer.data(), size));
  if (st != os::IoStatus::Ok) {
    disconnect_locked();
    throw Error(ErrorCode::PeerDied, "the gpuipc broker closed the connection", "recv");
  }
  std::string why;
  const std::span<const std::byte> bytes(buffer.data(), size);
  if (const auto version = proto::peek_version(bytes); version && *version != proto::kVersion) {
    disconnect_locked();
    throw Error(ErrorCode::Protocol,
                fmt::format("protocol version mismatch: the gpuipc broker on {} speaks protocol version {}, this "
                            "library (gpuipc {}) speaks version {}. They come from different gpuipc releases: stop "
                            "the broker (`gpuipc daemon --stop`, or restart gpuipcd.service when systemd runs it) "
                            "so that a gpuipcd of this library's release serves, or upgrade the older side",
                            config::socket_path(), *version, GPUIPC_VERSION_STRING, proto::kVersion),
                "recv");
  }
  if (!proto::decode(bytes, reply.fds.size(), reply.msg, why)) {
    disconnect_locked();
    throw Error(ErrorCode::Protocol, "malformed reply from the gpuipc broker: " + why, "recv");
  }
  if (const auto* err = std::get_if<proto::ErrorReply>(&reply.msg.body); err != nullptr && reply.msg.request_id == 0) {
    // request_id 0: the broker is closing this connection (it could not parse what we sent).
    disconnect_locked();
    throw error_from_reply(*err, "broker");
  }
  return reply;
}

Reply BrokerClient::out_of_fds_locked(std::span<const std::byte> bytes) {
  const auto header = proto::peek_header(bytes);
  proto::Message msg;
  std::string why;
  if (!header || header->version != proto::kVersion || !proto::decode(bytes, header->fd_count, msg, why)) {
    disconnect_locked();
    throw Error(ErrorCode::Protocol, "malformed reply from the gpuipc broker: " + why, "recv");
  }
  if (const auto* open = std::get_if<proto::OpenReply>(&msg.body)) {
    GPUIPC_LOG_DEBUG("answer to request {} lost its fd: giving back its reference to segment {}", msg.request_id,
                     open->info.id);
    m_abandoned.emplace(send_locked(proto::Close{open->info.id}, {}, deadline_in(connect_timeout())), Abandoned{});
  }
  Reply reply;
  reply.generation = m_generation.load();
  reply.msg.request_id = msg.request_id;
  reply.msg.body = proto::ErrorReply{
      static_cast<std::uint8_t>(ErrorCode::QuotaExceeded), EMFILE,
      fmt::format("this process is out of file descriptors (its limit is {}): the broker's answer carried one it "
                  "could not receive; close files it no longer needs or raise the limit (ulimit -n, LimitNOFILE=)",
                  os::fd_limit())};
  return reply;
}

void BrokerClient::route_locked(Reply&& reply) {
  const std::uint32_t id = reply.msg.request_id;
  if (auto p = m_parked.find(id); p != m_parked.end()) {
    p->second.reply = std::move(reply);
    os::event_fd_signal(p->second.wake);
    return;
  }
  if (const auto abandoned = m_abandoned.find(id); abandoned != m_abandoned.end()) {
    const Abandoned undo = abandoned->second;
    m_abandoned.erase(abandoned);
    // Its caller had its Timeout.
    undo_locked(reply, undo);
    return;
  }
  m_reconnect_now.store(true, std::memory_order_release);
  disconnect_locked();
  throw Error(ErrorCode::Protocol, fmt::format("reply {} answers no request that waits for one", id), "recv");
}

void BrokerClient::undo_locked(const Reply& reply, const Abandoned& undo) {
  const std::uint32_t id = reply.msg.request_id;
  // A reference the answer counted is this connection's: give it back, unanswered too (its own answer is
  // discarded the same way).
  if (const auto* open = std::get_if<proto::OpenReply>(&reply.msg.body)) {
    // A Create's name would keep its memory (a GPU allocation, for a device segment) registered for ever, and
    // the name taken, with nobody holding either. Removed by id: the name may be someone else's by now.
    if (undo.create && broker_has(proto::kFeatureUnlinkId)) {
      GPUIPC_LOG_DEBUG("late answer to request {}: unlinking the segment {} it created", id, open->info.id);
      m_abandoned.emplace(send_locked(proto::UnlinkId{open->info.id}, {}, deadline_in(connect_timeout())), Abandoned{});
    }
    GPUIPC_LOG_DEBUG("late answer to request {}: giving back its reference to segment {}", id, open->info.id);
    const std::uint32_t close = send_locked(proto::Close{open->info.id}, {}, deadline_in(connect_timeout()));
    m_abandoned.emplace(close, Abandoned{});
  }
  // So is a member entry: a member nobody uses would keep a semaphore from being poisoned when its last real
  // signaller leaves (its waiters would wait until this process exits), and would be repaired as dead then.
  if (const auto* join = std::get_if<proto::JoinReply>(&reply.msg.body); join != nullptr && undo.join_segment != 0) {
    GPUIPC_LOG_DEBUG("late answer to request {}: leaving member {} of segment {}", id, join->member, undo.join_segment);
    const std::uint32_t leave =
        send_locked(proto::Leave{undo.join_segment, join->member, join->token}, {}, deadline_in(connect_timeout()));
    m_abandoned.emplace(leave, Abandoned{});
  }
}

void BrokerClient::undo_answered_locked(std::span<const proto::Body> bodies, std::vector<Answer>& answers) noexcept {
  for (std::size_t k = 0; k < answers.size() && m_sock; ++k) {
    if (!answers[k].reply) continue;
    const auto* join = std::get_if<proto::Join>(&bodies[k]);
    try {
      undo_locked(*answers[k].reply, Abandoned{.create = std::holds_alternative<proto::Create>(bodies[k]),
                                               .join_segment = join != nullptr ? join->id : 0});
    } catch (const std::exception& e) {
      // The connection failed too: what it counted goes with it.
      GPUIPC_LOG_DEBUG("an answer of a failed batch not undone: {}", e.what());
    }
    answers[k].reply.reset();
  }
}

void BrokerClient::abandon_locked(std::uint32_t id, const proto::Body* body) {
  if (!m_sock) return;  // its answer will never come
  const auto* join = body != nullptr ? std::get_if<proto::Join>(body) : nullptr;
  m_abandoned.emplace(id, Abandoned{.create = body != nullptr && std::holds_alternative<proto::Create>(*body),
                                    .join_segment = join != nullptr ? join->id : 0});
  if (m_abandoned.size() > kMaxAbandoned) {
    GPUIPC_LOG_WARN("the gpuipc broker has left {} requests unanswered: dropping the connection", m_abandoned.size());
    m_reconnect_now.store(true, std::memory_order_release);
    disconnect_locked();
  }
}

Reply BrokerClient::exchange_locked(const proto::Body& body, std::span<const int> fds,
                                    std::chrono::milliseconds timeout) {
  const auto limit = reply_limit(timeout);
  const auto deadline = deadline_in(limit);
  const std::uint32_t id = send_locked(body, fds, deadline);
  for (;;) {
    Reply reply;
    try {
      reply = receive_locked(deadline, limit);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::Timeout) abandon_locked(id, &body);
      throw;
    }
    if (reply.msg.request_id != id) {
      route_locked(std::move(reply));
      continue;
    }
    if (const auto* err = std::get_if<proto::ErrorReply>(&reply.msg.body)) throw error_from_reply(*err, "broker");
    return reply;
  }
}

std::vector<BrokerClient::Answer> BrokerClient::request_batch(std::span<const proto::Body> bodies,
                                                              std::chrono::milliseconds timeout) {
  std::vector<Answer> out(bodies.size());
  std::lock_guard lock(m_mutex);
  try {
    request_batch_locked(bodies, timeout, out);
  } catch (...) {
    // A batch that fails (a Timeout, a dropped connection) after some answers came: what those counted (an Open's
    // reference, a Join's member entry) is given back as for a late answer, since its caller gets only the error.
    undo_answered_locked(bodies, out);
    throw;
  }
  return out;
}

void BrokerClient::request_batch_locked(std::span<const proto::Body> bodies, std::chrono::milliseconds timeout,
                                        std::vector<Answer>& out) {
  for (std::size_t first = 0; first < bodies.size(); first += kMaxBatch) {
    const std::size_t n = std::min(kMaxBatch, bodies.size() - first);
    for (int attempt = 0;; ++attempt) {
      if (!m_sock) connect_locked();
      std::size_t sent = 0;
      std::vector<std::uint32_t> ids(n);
      std::vector<bool> answered(n, false);
      try {
        const auto limit = reply_limit(timeout);
        const auto deadline = deadline_in(limit);
        try {
          for (; sent < n; ++sent) ids[sent] = send_locked(bodies[first + sent], {}, deadline);
        } catch (const Error& e) {
          if (e.code() == ErrorCode::Timeout) {
            for (std::size_t k = 0; k < sent; ++k) abandon_locked(ids[k], &bodies[first + k]);
          }
          throw;
        }
        for (std::size_t got = 0; got < n;) {
          Reply reply;
          try {
            reply = receive_locked(deadline, limit);
          } catch (const Error& e) {
            if (e.code() == ErrorCode::Timeout) {
              for (std::size_t k = 0; k < n; ++k) {
                if (!answered[k]) abandon_locked(ids[k], &bodies[first + k]);
              }
            }
            throw;
          }
          // The broker answers a connection's requests in order, except an Open that waits for its name: match by id.
          std::size_t k = 0;
          while (k < n && (answered[k] || ids[k] != reply.msg.request_id)) ++k;
          if (k == n) {
            route_locked(std::move(reply));  // another thread's, or a late one
            continue;
          }
          ++got;
          answered[k] = true;
          Answer& a = out[first + k];
          if (const auto* err = std::get_if<proto::ErrorReply>(&reply.msg.body)) {
            a.error = error_from_reply(*err, "broker");
          } else {
            a.reply = std::move(reply);
          }
        }
        break;
      } catch (const Error& e) {
        // The broker went away before it saw any of these (restart, crash): reconnect once, as request() does, but
        // only when no answer came yet: every answer comes on one connection, whose references they are.
        if (attempt == 0 && first == 0 && sent == 0 && e.code() == ErrorCode::PeerDied && !m_sock) continue;
        throw;
      }
    }
  }
}

Reply BrokerClient::request_waiting(const proto::Body& body, std::chrono::milliseconds timeout) {
  const auto limit = reply_limit(timeout);
  const auto deadline = deadline_in(limit);
  const os::UniqueFd wake = os::event_fd();
  std::unique_lock lock(m_mutex);
  for (int attempt = 0;; ++attempt) {
    if (!m_sock) connect_locked();
    std::uint32_t id = 0;
    try {
      id = send_locked(body, {}, deadline);
    } catch (const Error& e) {
      if (attempt == 0 && e.code() == ErrorCode::PeerDied && !m_sock) continue;  // as request()
      throw;
    }
    const std::uint64_t generation = m_generation.load();
    m_parked[id].wake = wake.get();
    struct Unpark {
      std::map<std::uint32_t, Parked>& parked;
      std::uint32_t id;
      ~Unpark() { parked.erase(id); }  // under m_mutex: every exit below holds it
    } unpark{m_parked, id};
    bool lost = false;
    for (;;) {
      if (auto& got = m_parked[id].reply) {
        Reply reply = std::move(*got);
        if (const auto* err = std::get_if<proto::ErrorReply>(&reply.msg.body)) throw error_from_reply(*err, "broker");
        return reply;
      }
      if (!m_sock || m_generation.load() != generation) {
        lost = true;  // the connection went (another thread saw it): the broker never answers on it
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        abandon_locked(id);
        throw no_answer(limit);
      }
      // Waits without the lock: other threads' calls go on meanwhile, and whichever reads this answer parks it
      // here. The fd may be closed and its number reused while we wait: whoever closes it signals `wake` first.
      const int sock = m_sock.get();
      lock.unlock();
      try {
        os::wait_readable_or_woken(sock, wake.get(), ms_until(deadline));
      } catch (...) {
        lock.lock();  // `unpark` erases under it
        throw;
      }
      lock.lock();
      os::event_fd_drain(wake.get());
      if (!m_sock || m_generation.load() != generation) continue;
      std::optional<Reply> reply;
      try {
        reply = receive_ready_locked(false);
      } catch (const Error& e) {
        if (e.code() == ErrorCode::PeerDied && !m_sock) continue;  // the connection went: looked at above
        throw;
      }
      if (!reply) continue;
      if (reply->msg.request_id == id) {
        m_parked[id].reply = std::move(*reply);
      } else {
        route_locked(std::move(*reply));
      }
    }
    if (lost && attempt == 0) continue;  // sent to a broker that went away: once more, as request() does
    throw Error(ErrorCode::PeerDied, "the gpuipc broker closed the connection", "recv");
  }
}

bool BrokerClient::request_on(std::uint64_t generation, const proto::Body& body) noexcept {
  std::lock_guard lock(m_mutex);
  if (!m_sock || m_generation.load() != generation) return false;
  try {
    exchange_locked(body, {}, std::chrono::milliseconds(0));
    return true;
  } catch (const std::exception& e) {
    GPUIPC_LOG_DEBUG("request on generation {}: {}", generation, e.what());
    return false;
  }
}

void BrokerClient::set_rebind_hook(RebindHook hook) noexcept { g_rebind.store(hook); }
BrokerClient::RebindHook BrokerClient::rebind_hook() noexcept { return g_rebind.load(); }

void BrokerClient::disconnect_locked() noexcept {
  m_sock.reset();
  m_abandoned.clear();  // their answers never come
  for (const auto& [id, parked] : m_parked) os::event_fd_signal(parked.wake);
  if (m_watch_wake) os::event_fd_signal(m_watch_wake.get());
}

void BrokerClient::keep_connected() {
  if (m_watching.load(std::memory_order_acquire)) return;
  std::lock_guard lock(m_mutex);
  if (m_watching.load(std::memory_order_relaxed)) return;
  std::shared_ptr<Watched> first;
  try {
    m_watch_wake = os::event_fd();
    first = std::make_shared<Watched>(watched_locked());
    os::start_thread_without_signals([this, first] { watch(std::move(*first)); });
    m_watching.store(true, std::memory_order_release);
  } catch (const std::exception& e) {
    m_watch_wake.reset();
    GPUIPC_LOG_WARN(
        "cannot watch the broker connection ({}): after a broker restart, names and memberships come "
        "back at this process's next call",
        e.what());
  }
}

BrokerClient::Watched BrokerClient::watched_locked() {
  Watched w;
  // A copy of the connection: the caller threads may replace m_sock at any time (they signal the watcher).
  if (m_sock) w.sock = os::ParentOnlyFd([this] { return os::dup_fd(m_sock.get(), "broker connection"); });
  w.generation = m_generation.load();
  w.page = m_status.load(std::memory_order_acquire);
  return w;
}

void BrokerClient::watch(Watched first) {
  // The eventfd lives as long as this client: the watcher of a fork's parent is not in the child, and the child's
  // client is another object.
  const int wake = m_watch_wake.get();
  for (bool first_turn = true;; first_turn = false) {
    std::uint64_t generation = 0;
    const proto::StatusPage* page = nullptr;
    bool dropped = false;  // this process dropped the connection of a broker that lives
    try {
      Watched w;
      if (first_turn) {
        w = std::move(first);  // NOLINT(bugprone-use-after-move): moved once, on the first turn only
      } else {
        std::lock_guard lock(m_mutex);
        w = watched_locked();
      }
      generation = w.generation;
      page = w.page;
      const bool hung_up = os::wait_hangup(w.sock ? w.sock.get() : -1, wake);
      w.sock.reset();
      if (!hung_up) {
        os::event_fd_drain(wake);
        dropped = m_reconnect_now.exchange(false, std::memory_order_acq_rel);
        if (!dropped) continue;
      }
    } catch (const std::exception& e) {
      GPUIPC_LOG_WARN("the broker connection's watcher stops: {}", e.what());
      m_watching.store(false, std::memory_order_release);
      return;
    }
    if (page != nullptr &&
        std::atomic_ref<std::uint32_t>(const_cast<std::uint32_t&>(page->stopping))  // NOLINT: read-only map
                .load(std::memory_order_acquire) != 0) {
      // Stopped on purpose: start no broker behind its back. The next call connects, as it would have.
      GPUIPC_LOG_DEBUG("the broker stopped; reconnecting at the next call");
      std::lock_guard lock(m_mutex);
      if (m_generation.load() == generation) disconnect_locked();
      continue;
    }
    // Died (or dropped): connect again now (starting a broker), which gives names and memberships back (the rebind
    // hook). A broker that lives but does not answer (stopped) makes each attempt wait for its Hello; once it answers
    // again, this process must rejoin within its grace (GPUIPC_REJOIN_GRACE_MS, 5 s), so those attempts stay close.
    auto delay = std::chrono::milliseconds(50);
    const auto most = dropped ? std::chrono::milliseconds(1000) : std::chrono::milliseconds(30000);
    for (;;) {
      {
        std::lock_guard lock(m_mutex);
        // A caller (or an attempt of ours whose Hello failed: a dying broker's listener may still take a
        // connection) may have moved the generation on: done only once connected.
        if (m_generation.load() != generation && m_sock) break;
        try {
          disconnect_locked();
          connect_locked();
          GPUIPC_LOG_INFO("{}; reconnected and gave back what this process holds",
                          dropped ? "this process dropped the broker connection" : "the broker died");
          break;
        } catch (const std::exception& e) {
          GPUIPC_LOG_DEBUG("reconnecting after the broker died: {}; trying again in {} ms", e.what(), delay.count());
        }
      }
      std::this_thread::sleep_for(delay);
      delay = std::min(delay * 2, most);
    }
  }
}

template <class Send>
Reply BrokerClient::retrying_locked(const Send& send) {
  for (int attempt = 0;; ++attempt) {
    if (!m_sock) connect_locked();
    try {
      return send();
    } catch (const Error& e) {
      // The broker went away (restart, crash): reconnect once. Its references are gone with it.
      if (attempt == 0 && e.code() == ErrorCode::PeerDied && !m_sock) continue;
      throw;
    }
  }
}

Reply BrokerClient::request(const proto::Body& body, std::span<const int> fds, std::chrono::milliseconds timeout) {
  std::lock_guard lock(m_mutex);
  return retrying_locked([&] { return exchange_locked(body, fds, timeout); });
}

Reply BrokerClient::request_built(const std::function<proto::Body(std::uint64_t generation)>& build) {
  std::lock_guard lock(m_mutex);
  return retrying_locked([&] { return exchange_locked(build(m_generation.load()), {}, std::chrono::milliseconds(0)); });
}

Error error_from_reply(const proto::ErrorReply& reply, const char* call) {
  return Error(static_cast<ErrorCode>(reply.code), reply.message, call, reply.sys_errno);
}

}  // namespace gpuipc::core
