#include "gpuipc/liveness.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <variant>

#include "base/config.hpp"
#include "base/deadline.hpp"
#include "core/client.hpp"
#include "core/segment_internal.hpp"
#include "cuda/trace.hpp"
#include "os/epoll.hpp"
#include "os/identity.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"

namespace gpuipc {
namespace {

std::chrono::milliseconds connect_timeout() {
  return config::env_ms("GPUIPC_CONNECT_TIMEOUT_MS", std::chrono::milliseconds(5000));
}

Holder holder_of(const proto::HolderInfo& h) {
  Holder out;
  out.pid = h.pid;
  out.uid = h.uid;
  out.references = h.references;
  out.read_write = h.access == static_cast<std::uint8_t>(proto::Access::ReadWrite);
  out.creator = h.creator != 0;
  out.heartbeat = h.beat == static_cast<std::uint8_t>(proto::Beat::Hung)    ? HeartbeatState::Hung
                  : h.beat == static_cast<std::uint8_t>(proto::Beat::Alive) ? HeartbeatState::Alive
                                                                            : HeartbeatState::None;
  out.heartbeat_deadline = std::chrono::milliseconds(h.beat_ms);
  std::string role = out.creator ? "creator" : "";
  auto add = [&](const char* r) { role += role.empty() ? r : fmt::format("+{}", r); };
  const std::pair<proto::Role, const char*> names[] = {{proto::Role::Signaller, "signaller"},
                                                       {proto::Role::Producer, "producer"},
                                                       {proto::Role::Consumer, "consumer"},
                                                       {proto::Role::Holder, "holder"}};
  bool member = false;
  for (const auto& [r, n] : names) {
    if ((h.roles & (1U << static_cast<unsigned>(r))) != 0) {
      add(n);
      member = true;
    }
  }
  if (!member) add(out.read_write ? "read-write" : "read-only");
  out.role = std::move(role);
  return out;
}

/// The name, or Error(InvalidArgument) from `call` with Segment's text: the name escaped and cut short (it may hold
/// control bytes, or be 100000 bytes long), and which names are allowed.
std::string checked_name(std::string_view name, const char* call) {
  try {
    return detail::check_name_or_throw(name);
  } catch (const Error& e) {
    throw Error(e.code(), e.what(), call);
  }
}

}  // namespace

std::string_view to_string(LivenessEvent event) noexcept {
  switch (event) {
    case LivenessEvent::Joined:
      return "joined";
    case LivenessEvent::Left:
      return "left";
    case LivenessEvent::Died:
      return "died";
    case LivenessEvent::Hung:
      return "hung";
    case LivenessEvent::Alive:
      return "alive";
    case LivenessEvent::Lost:
      return "lost";
  }
  return "?";
}

std::string_view to_string(HeartbeatState state) noexcept {
  switch (state) {
    case HeartbeatState::None:
      return "none";
    case HeartbeatState::Alive:
      return "alive";
    case HeartbeatState::Hung:
      return "hung";
  }
  return "?";
}

std::vector<Holder> holders(std::string_view name) {
  GPUIPC_TRACE("gpuipc::holders");
  proto::Holders req;
  req.name = checked_name(name, "holders");
  auto reply = core::BrokerClient::instance().request(req);
  const auto* r = std::get_if<proto::HoldersReply>(&reply.msg.body);
  if (r == nullptr) throw Error(ErrorCode::Protocol, "the broker answered Holders with something else", "holders");
  std::vector<Holder> out;
  out.reserve(r->entries.size());
  for (const auto& h : r->entries) out.push_back(holder_of(h));
  return out;
}

void heartbeat(std::string_view name, std::chrono::milliseconds deadline) {
  GPUIPC_TRACE("gpuipc::heartbeat");
  if (deadline.count() < 0 || deadline.count() > proto::kMaxHeartbeatMs) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("heartbeat deadline {} ms for '{}': it must be 0 (stop) to {} ms", deadline.count(), name,
                            proto::kMaxHeartbeatMs),
                "heartbeat");
  }
  proto::Heartbeat req;
  req.name = checked_name(name, "heartbeat");
  req.deadline_ms = static_cast<std::uint32_t>(deadline.count());
  (void)core::BrokerClient::instance().request(req);
}

struct Watcher::Impl {
  os::ParentOnlyFd sock;  // a forked child does not keep the watch (the broker would send to it for the child's life)
  std::uint32_t next_request = 1;
  std::deque<WatchEvent> queued;  // events that arrived while waiting for a reply
  // fd(): an epoll of the socket and of an eventfd that is set while `queued` holds events, so that it polls
  // readable for events already read off the socket (by add(), waiting for its reply) as for those still on it.
  os::UniqueFd queued_fd = os::event_fd();
  os::Epoll poller;
  std::vector<std::byte> buffer = std::vector<std::byte>(proto::kMaxMessageSize);

  /// Receives one message, waiting at most `timeout_ms` (negative: forever). False on timeout.
  bool receive(proto::Message& msg, int timeout_ms) {
    if (!os::wait_readable(sock.get(), timeout_ms)) return false;
    std::size_t size = 0;
    std::vector<os::UniqueFd> fds;
    const auto st = os::receive_message(sock.get(), buffer, size, fds);
    if (st == os::IoStatus::WouldBlock) return false;
    if (st != os::IoStatus::Ok) {
      throw Error(ErrorCode::PeerDied, "the gpuipc broker closed the watch connection; watch again", "recv");
    }
    std::string why;
    if (!proto::decode(std::span<const std::byte>(buffer.data(), size), fds.size(), msg, why)) {
      throw Error(ErrorCode::Protocol, "malformed message from the gpuipc broker: " + why, "recv");
    }
    return true;
  }

  void push(const proto::Event& e) {
    WatchEvent w;
    w.event = static_cast<LivenessEvent>(e.kind - 1);
    w.name = e.name;
    if (w.event != LivenessEvent::Lost) w.holder = holder_of(e.holder);  // (a Lost event is about no holder)
    w.unix_ns = e.unix_ns;
    queued.push_back(std::move(w));
    if (queued.size() == 1) os::event_fd_signal(queued_fd.get());
  }

  /// Sends `body` and waits for its reply, queueing events that come first.
  proto::Message request(const proto::Body& body, const char* call) {
    proto::Message msg{next_request++, body};
    if (os::send_message(sock.get(), proto::encode(msg), {}, proto::kMaxMessageSize) != os::IoStatus::Ok) {
      throw Error(ErrorCode::PeerDied, "the gpuipc broker closed the watch connection", call);
    }
    const int wait_ms = static_cast<int>(connect_timeout().count());
    for (;;) {
      proto::Message r;
      if (!receive(r, wait_ms)) {
        throw Error(ErrorCode::Timeout, fmt::format("the gpuipc broker did not answer within {} ms", wait_ms), call);
      }
      if (const auto* e = std::get_if<proto::Event>(&r.body); e != nullptr && r.request_id == 0) {
        push(*e);
        continue;
      }
      if (const auto* err = std::get_if<proto::ErrorReply>(&r.body)) {
        throw core::error_from_reply(*err, call);
      }
      return r;
    }
  }
};

Watcher::Watcher() noexcept = default;
Watcher::Watcher(std::unique_ptr<Impl> impl) noexcept : m_impl(std::move(impl)) {}
Watcher::Watcher(Watcher&&) noexcept = default;
Watcher& Watcher::operator=(Watcher&&) noexcept = default;
Watcher::~Watcher() = default;

Watcher Watcher::watch(std::string_view name) {
  const std::string n = checked_name(name, "watch");
  // Through the process's own connection first: it starts a broker if none runs, and says NotFound plainly.
  (void)holders(n);
  auto impl = std::make_unique<Impl>();
  impl->sock = os::ParentOnlyFd(os::seqpacket_socket);
  os::connect_seqpacket(impl->sock.get(), config::socket_path(), connect_timeout());
  impl->poller.add(impl->sock.get(), EPOLLIN, 0);
  impl->poller.add(impl->queued_fd.get(), EPOLLIN, 1);
  proto::Hello hello;
  hello.pid = static_cast<std::uint32_t>(os::current_pid());
  hello.client_name = "gpuipc-watch";
  (void)impl->request(hello, "hello");
  Watcher w(std::move(impl));
  w.add(n);
  return w;
}

void Watcher::add(std::string_view name) {
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "empty Watcher handle", "watch");
  proto::Watch req;
  req.name = checked_name(name, "watch");
  (void)m_impl->request(req, "watch");
}

std::optional<WatchEvent> Watcher::next(std::chrono::nanoseconds timeout) {
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "empty Watcher handle", "watch");
  using clock = std::chrono::steady_clock;
  const auto deadline = base::deadline_after(clock::now(), timeout);
  const bool forever = deadline == clock::time_point::max();
  while (m_impl->queued.empty()) {
    int wait_ms = -1;
    if (!forever) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()).count();
      wait_ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, 1'000'000));
    }
    proto::Message msg;
    if (!m_impl->receive(msg, wait_ms)) {
      if (!forever && clock::now() >= deadline) return std::nullopt;
      continue;
    }
    if (const auto* e = std::get_if<proto::Event>(&msg.body)) m_impl->push(*e);
  }
  WatchEvent e = std::move(m_impl->queued.front());
  m_impl->queued.pop_front();
  if (m_impl->queued.empty()) os::event_fd_drain(m_impl->queued_fd.get());
  return e;
}

int Watcher::fd() const noexcept { return m_impl ? m_impl->poller.fd() : -1; }

}  // namespace gpuipc
