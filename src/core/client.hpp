// The process's connection to the broker: connects (starting gpuipcd on demand), says Hello, and runs one
// request at a time. Thread-safe. Survives fork (the child gets a fresh connection) and a broker restart
// (the next request reconnects; references held through the old broker are gone with it: `generation()` tells).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "os/fd.hpp"
#include "os/memfd.hpp"
#include "proto/status_page.hpp"
#include "gpuipc/error.hpp"
#include "proto/messages.hpp"

namespace gpuipc::core {

/// A reply and the fds that came with it.
struct Reply {
  proto::Message msg;
  std::vector<os::UniqueFd> fds;
  std::uint64_t generation = 0;  ///< the connection it came on, which holds any reference it counted
};

class BrokerClient {
 public:
  /// The process-wide client (created on first use; replaced in a forked child).
  static BrokerClient& instance();

  /// Sends `body` (with `fds`, borrowed) and waits for its reply, at most `timeout` (at least
  /// GPUIPC_CONNECT_TIMEOUT_MS). An ErrorReply becomes a thrown gpuipc::Error with the broker's code and message.
  /// Reconnects once if the broker went away. Other threads' calls wait meanwhile: for requests the broker answers
  /// at once. A broker that does not answer in time gives Error(Timeout) and the connection stays: the late answer
  /// is discarded when it comes, and a reference it counted is given back (a dropped connection would make the
  /// broker take this process for dead, and repair its semaphores, channels and pools).
  Reply request(const proto::Body& body, std::span<const int> fds = {},
                std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  /// As `request`, for a body that names segments by the broker's ids (Join, Leave): `build` makes it under the
  /// connection's lock, given the generation of the connection it goes out on (after any reconnect, and again if
  /// it reconnects once), so the ids it reads are that broker's. A body made before could carry a dead broker's id
  /// to its successor, which numbers from 1 again: another segment's. `build` throws to send nothing.
  Reply request_built(const std::function<proto::Body(std::uint64_t generation)>& build);

  /// As `request`, for a request the broker may hold for up to `timeout` before it answers (an Open that waits for
  /// its name): the connection is not held meanwhile, so other threads' calls go on, their replies and this one's
  /// told apart by request id. Sends no fds.
  Reply request_waiting(const proto::Body& body, std::chrono::milliseconds timeout);

  /// What the broker answered one request of a batch: its reply, or the Error its ErrorReply stands for.
  struct Answer {
    std::optional<Reply> reply;
    std::optional<Error> error;
  };
  /// Most requests sent before their answers are read: the broker closes a connection with more replies queued
  /// than it allows (ServerOptions::max_queued_replies, 256), so larger batches go in several.
  static constexpr std::size_t kMaxBatch = 64;
  /// Sends `bodies` (no fds) back to back on one connection, then reads their answers: one round trip's latency
  /// for all, as the broker serves a connection's requests in order. Each answer is the reply or the Error the
  /// broker gave for that request alone, all on one connection. Throws (and returns nothing) when the connection
  /// fails or the broker does not answer within `timeout`; reconnects once when the broker went away before any of
  /// them was sent.
  std::vector<Answer> request_batch(std::span<const proto::Body> bodies,
                                    std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  /// Sends `body` on the current connection only if it is still generation `generation`: never reconnects and
  /// never starts a broker (a reference taken through a broker that is gone is not another broker's to drop).
  /// For destructors: returns false instead of throwing when it could not be delivered.
  bool request_on(std::uint64_t generation, const proto::Body& body) noexcept;

  /// Whether the connected broker's status page has `feature` (a proto::kFeature* bit): false without a page.
  bool broker_has(std::uint32_t feature) const noexcept;
  /// The same after connecting (starting a broker) if there is no connection.
  bool broker_has_connecting(std::uint32_t feature);

  /// Changes whenever the connection is replaced (fork, broker restart): references taken under an older
  /// generation are not this connection's to drop.
  std::uint64_t generation() const noexcept { return m_generation.load(std::memory_order_acquire); }

  /// The broker's names generation from its status page (bumped on every unlink), or 0 when unknown. Lock-free:
  /// a cache hit reads it instead of asking the broker.
  std::uint64_t names_generation() const noexcept;

  /// Sends a request on the connection being set up and returns its reply (ErrorReply thrown as Error).
  using Exchange = std::function<Reply(const proto::Body&, std::span<const int>)>;
  /// Called after the connection was replaced by a new one to a broker that came back (the old one died), with
  /// the old and new generations and a way to send requests on the new connection: src/core gives names and
  /// memberships back with it (Announce, Rejoin). Runs under this client's lock: it must use `exchange` only.
  using RebindHook = void (*)(std::uint64_t old_generation, std::uint64_t new_generation, const Exchange& exchange);
  void set_rebind_hook(RebindHook hook) noexcept;
  /// The hook set last (null before any): lets a test wrap it.
  static RebindHook rebind_hook() noexcept;

  /// From now on, keeps this process connected on its own: a thread watches the connection, and when the broker
  /// dies (the connection closes and the status page does not say it stopped on purpose) it connects again at
  /// once, starting a new broker, so that the rebind hook gives names and memberships back without waiting for
  /// this process's next call; a member of this process's objects that dies meanwhile is then repaired. src/core
  /// calls it when the process first maps a segment or joins an object. Idempotent; cheap after the first call.
  void keep_connected();

  /// The broker's pid as it reported it in HelloReply (connects if needed): a pid in the broker's PID namespace.
  std::uint32_t broker_pid();
  /// The broker's pid as the kernel gives it to this process (SO_PEERCRED of the connection, connects if needed):
  /// a pid of this process's PID namespace, 0 when the broker runs in a namespace this process cannot see. The
  /// one to signal.
  std::uint32_t broker_pid_here();

  /// What the running broker says of itself: HelloReply and its status page.
  struct BrokerStatus {
    std::uint32_t pid = 0;
    std::string version;  ///< its release (HelloReply.broker_version)
    proto::BrokerMode mode = proto::BrokerMode::Unknown;
    std::uint64_t started_unix_ns = 0;  ///< 0 when unknown
    std::uint64_t idle_timeout_ms = 0;  ///< 0: it never exits when idle
    std::uint32_t features = 0;         ///< proto::kFeature* bits (0 from a broker that predates them)
    std::string socket_path;            ///< where this client connected
  };
  /// The broker's status (connects if needed, starting a broker on demand like any call; see broker_listening).
  BrokerStatus broker_status();

  /// Whether a broker listens on this process's socket path now (connects and disconnects; never starts one): false
  /// only when nothing listens there. Throws Error for anything else (PermissionDenied, Timeout, a malformed
  /// GPUIPC_* variable).
  static bool broker_listening();

  /// The path of the gpuipcd the library would start: $GPUIPC_DAEMON, else next to the executable, else next
  /// to the library, else on $PATH. Empty when none is found.
  static std::string find_daemon();

 private:
  BrokerClient() = default;
  void connect_locked();
  /// One attempt of connect_locked: connect (starting a broker when none listens), Hello, and the rebind hook.
  void connect_once_locked();
  /// `send()`'s reply, connecting first when there is no connection, and once more when the broker went away
  /// (PeerDied with the connection dropped). Under m_mutex.
  template <class Send>
  Reply retrying_locked(const Send& send);
  Reply exchange_locked(const proto::Body& body, std::span<const int> fds, std::chrono::milliseconds timeout);
  /// Sends one request and returns its id (never 0). Throws Timeout, with nothing sent and the connection kept,
  /// when the broker's queue stays full (it stopped reading) until `deadline`; PeerDied with the connection dropped.
  std::uint32_t send_locked(const proto::Body& body, std::span<const int> fds,
                            std::chrono::steady_clock::time_point deadline);
  /// The next message from the broker, decoded (an ErrorReply too, unless it is the broker's own: request id 0,
  /// the connection is closing, thrown). Throws PeerDied or Protocol with the connection dropped, or Timeout
  /// (`deadline` passed; `limit`, the wait it stands for, is in the message) with the connection kept.
  Reply receive_locked(std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds limit);
  /// One message if one is waiting (receive_locked's checks), else nullopt. `readable`: poll(2) has just said so.
  std::optional<Reply> receive_ready_locked(bool readable);
  /// A reply (`bytes`) whose fd this process could not take (it is at its RLIMIT_NOFILE): an ErrorReply
  /// (QuotaExceeded, saying so) for its request instead, with the reference an Open's answer counted given back. The
  /// connection stays: the broker did nothing wrong.
  Reply out_of_fds_locked(std::span<const std::byte> bytes);
  /// A reply that does not answer the request its reader waits for: stashed for the thread waiting in
  /// request_waiting, or an abandoned request's (discarded, and a reference it counted given back). Any other is a
  /// protocol error: the connection is dropped and Error(Protocol) thrown.
  void route_locked(Reply&& reply);
  struct Abandoned;
  /// What an answer given to nobody counted is given back (an Open's or Create's reference, a Create's name, a
  /// Join's member entry), as `undo` says. Sends on the connection; throws what send_locked throws.
  void undo_locked(const Reply& reply, const Abandoned& undo);
  /// undo_locked of every answer in `answers` (to `bodies`, one each) of a batch that failed; each is reset.
  void undo_answered_locked(std::span<const proto::Body> bodies, std::vector<Answer>& answers) noexcept;
  /// request_batch's work, its answers put in `out` as they come (the caller undoes them when this throws).
  void request_batch_locked(std::span<const proto::Body> bodies, std::chrono::milliseconds timeout,
                            std::vector<Answer>& out);
  /// Request `id` (`body`, when known) timed out: its answer, when it comes, is discarded, and what it did undone.
  /// Drops the connection when too many are outstanding (a broker that answers nothing).
  void abandon_locked(std::uint32_t id, const proto::Body* body = nullptr);

  /// Drops the connection (m_sock) and tells the watcher, which holds a copy of it, to let go too.
  void disconnect_locked() noexcept;
  /// What the watcher waits on: a copy of the connection (none when there is none), its generation, its status page.
  struct Watched {
    os::ParentOnlyFd sock;
    std::uint64_t generation = 0;
    const proto::StatusPage* page = nullptr;
  };
  /// Takes the watcher's copy of the current connection. Under m_mutex.
  Watched watched_locked();
  /// The watcher thread (keep_connected), from its first copy (taken before keep_connected returned, so the
  /// process's fds do not change behind its back): waits for the connection to hang up, then connects again.
  void watch(Watched first);

  // Recursive: giving names back (the rebind hook) runs under it and may drop the last handle of a mapping, whose
  // destructor sends its Close on the connection being set up (request_on) from the same thread.
  mutable std::recursive_mutex m_mutex;
  os::ParentOnlyFd m_sock;              // a forked child gets /dev/null in its place
  os::UniqueFd m_watch_wake;            // eventfd: the connection was replaced or dropped (the watcher looks again)
  std::atomic<bool> m_watching{false};  // the watcher thread runs
  // This process dropped the connection of a broker that lives (it left requests unanswered, it sent garbage): the
  // watcher reconnects at once, as after a broker's death. Until this process rejoins, the broker takes its members
  // for gone, and repairs them after a grace (GPUIPC_REJOIN_GRACE_MS).
  std::atomic<bool> m_reconnect_now{false};
  std::atomic<std::uint64_t> m_generation{0};
  std::atomic<const proto::StatusPage*> m_status{nullptr};
  std::vector<os::Mapping> m_status_maps;  // kept for the process's life: lock-free readers may hold old pointers
  std::unique_ptr<std::byte[]> m_reply_buffer;  // one reply's bytes (kMaxMessageSize), reused: no 60 KB zeroed per call
  std::uint32_t m_next_request = 1;
  /// Requests whose thread waits for the answer without holding m_mutex (request_waiting): whoever reads the answer
  /// puts it here and signals `wake`. disconnect_locked signals every one.
  struct Parked {
    int wake = -1;
    std::optional<Reply> reply;
  };
  std::map<std::uint32_t, Parked> m_parked;
  /// A request given up on (timed out): what its late answer must undo.
  struct Abandoned {
    bool create = false;             ///< a Create: its name is removed too (UnlinkId), where the broker can
    std::uint64_t join_segment = 0;  ///< a Join: its segment id (the member entry it took is left); else 0
  };
  /// Requests given up on, by request id: their answers are discarded when they come, the reference an OpenReply
  /// counted (Open, Create, Announce) is given back, a Create's name removed, and the member entry a Join took
  /// left. Emptied when the connection goes (its answers never come).
  std::map<std::uint32_t, Abandoned> m_abandoned;
  std::uint32_t m_broker_pid = 0;
  std::string m_broker_version;
  std::uint64_t m_greeted_generation = 0;  // the last connection the broker answered Hello on
  bool m_connected_once = false;  // a later connect is a reconnection: names and memberships are given back
};

/// The Error a broker's ErrorReply stands for, raised by `call` (proto::decode has checked that its code is an
/// ErrorCode).
Error error_from_reply(const proto::ErrorReply& reply, const char* call);

}  // namespace gpuipc::core
