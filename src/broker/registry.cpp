#include "base/format.hpp"
#include "broker/registry.hpp"

#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "base/log.hpp"
#include "os/memfd.hpp"
#include "os/identity.hpp"
#include "os/process.hpp"
#include "proto/shm.hpp"
#include "proto/status_page.hpp"

namespace gpuipc::broker {
namespace {


std::string_view kind_name(proto::Kind k) {
  switch (k) {
    case proto::Kind::Device: return "device";
    case proto::Kind::Host: return "host";
    case proto::Kind::HostPinned: return "host_pinned";
    case proto::Kind::DeviceIpc: return "device_ipc";
  }
  return "?";
}

std::uint64_t unix_now_ns() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

Outgoing reply(ConnId conn, std::uint32_t rid, proto::Body body, os::UniqueFd fd = {}) {
  Outgoing o;
  o.conn = conn;
  o.msg.request_id = rid;
  o.msg.body = std::move(body);
  o.fd = std::move(fd);
  return o;
}

}  // namespace

std::uint32_t SegmentRecord::total_refs() const noexcept {
  std::uint32_t n = 0;
  for (const auto& [conn, count] : refs) n += count;
  return n;
}

unsigned permission_bits(const os::Credentials& creds, std::uint16_t mode, uid_t owner_uid, gid_t owner_gid) noexcept {
  if (creds.uid == 0) return 7;
  if (creds.uid == owner_uid) return (mode >> 6) & 7;
  if (creds.in_group(owner_gid)) return (mode >> 3) & 7;
  return mode & 7;
}

proto::Message error_reply(std::uint32_t request_id, ErrorCode code, std::string message, int sys_errno) {
  proto::ErrorReply e;
  e.code = static_cast<std::uint8_t>(code);
  e.sys_errno = sys_errno;
  if (message.size() > proto::kMaxTextLength) message.resize(proto::kMaxTextLength);
  e.message = std::move(message);
  return proto::Message{request_id, std::move(e)};
}

Registry::Registry(Quotas quotas)
    : m_quotas(quotas),
      m_status_fd(os::memfd_create("gpuipc-broker-status", os::page_size())),
      m_status_map(os::Mapping::map(m_status_fd.get(), os::page_size(), true)) {
  // Read-only for everyone but the broker, whose mapping is already made: the inode allows no writable reopen,
  // and F_SEAL_FUTURE_WRITE refuses every writable mapping and write from now on (Linux 5.1; older kernels
  // still have the inode mode).
  os::file_chmod(m_status_fd.get(), 0444);
  try {
    os::memfd_seal(m_status_fd.get(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE);
  } catch (const Error& e) {
    GPUIPC_LOG_WARN("status page: cannot seal future writes ({}); its inode is read-only", e.what());
  }
  os::memfd_seal(m_status_fd.get(), F_SEAL_SEAL);
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  page->magic = proto::kStatusMagic;
  page->version = proto::kStatusVersion;
  page->broker_pid = static_cast<std::uint64_t>(os::current_pid());
  std::atomic_ref<std::uint64_t>(page->names_generation).store(1, std::memory_order_release);
}

void Registry::describe_broker(proto::BrokerMode mode, std::uint64_t idle_timeout_ms) noexcept {
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  page->mode = static_cast<std::uint32_t>(mode);
  page->started_unix_ns = unix_now_ns();
  page->idle_timeout_ms = idle_timeout_ms;
}

void Registry::bump_names_generation() noexcept {
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  std::atomic_ref<std::uint64_t>(page->names_generation).fetch_add(1, std::memory_order_release);
}

void Registry::add_connection(ConnId conn, const os::Credentials& creds) {
  m_connections[conn] = ConnectionInfo{creds, {}, {}};
}

void Registry::repair_for(SegmentRecord& seg, ConnId conn) {
  seg.writers.erase(conn);
  auto [first, last] = seg.joined.equal_range(conn);
  for (auto it = first; it != last; ++it) {
    if (seg.control) remove_member(seg.block, it->second);
  }
  seg.joined.erase(first, last);
}

void Registry::drop_connection(ConnId conn, bool repair, std::vector<Outgoing>* out) {
  std::vector<std::uint64_t> touched;
  for (auto& [id, seg] : m_segments) {
    seg.watchers.erase(conn);
    if (seg.refs.count(conn) != 0) {
      // A connection that goes while holding references: its process exited or was killed without closing them.
      if (out != nullptr && repair) {
        auto gone = holder_of(seg, conn);
        gone.references = 0;  // as Left: the holder after the change
        notify(seg, proto::EventKind::Died, gone, conn, *out);
      }
      seg.refs.erase(conn);
      seg.beats.erase(conn);
      if (repair) {
        repair_for(seg, conn);
      } else {
        seg.writers.erase(conn);
        seg.joined.erase(conn);
      }
      if (seg.creator == conn) exporter_left(seg, proto::PoisonReason::PeerDied);
      touched.push_back(id);
    }
  }
  for (auto id : touched) maybe_destroy(id);
  if (auto c = m_connections.find(conn); c != m_connections.end()) {
    const std::set<std::uint64_t> pending = std::move(c->second.pending);
    c->second.pending.clear();
    for (auto id : pending) unpark(id);
    m_connections.erase(conn);
  }
}

std::size_t Registry::total_references() const noexcept {
  std::size_t n = 0;
  for (const auto& [id, seg] : m_segments) n += seg.total_refs();
  return n;
}

void Registry::handle(const Caller& caller, const proto::Message& request, std::vector<os::UniqueFd>& fds,
                      std::int64_t now_ns, std::vector<Outgoing>& out) {
  const std::uint32_t rid = request.request_id;
  std::visit(
      [&](const auto& body) {
        using T = std::decay_t<decltype(body)>;
        if constexpr (std::is_same_v<T, proto::Create>) {
          create(caller, rid, body, fds, out);
        } else if constexpr (std::is_same_v<T, proto::Open>) {
          open(caller, rid, body, now_ns, out);
        } else if constexpr (std::is_same_v<T, proto::Close>) {
          close(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::Unlink>) {
          unlink(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::Stat>) {
          stat(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::List>) {
          list(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::Join>) {
          join(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::Announce>) {
          announce(caller, rid, body, fds, out);
        } else if constexpr (std::is_same_v<T, proto::Rejoin>) {
          rejoin(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::Holders>) {
          holders(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::Watch>) {
          watch(caller, rid, body, out);
        } else if constexpr (std::is_same_v<T, proto::Heartbeat>) {
          heartbeat(caller, rid, body, now_ns, out);
        } else {
          out.push_back(reply(caller.conn, rid,
                              error_reply(rid, ErrorCode::Protocol,
                                          fmt::format("message type {} is not a request a broker accepts here",
                                                      static_cast<int>(proto::type_of(request.body))))
                                  .body));
        }
      },
      request.body);
}

std::string Registry::check_memory(const proto::Create& req, int fd) {
  if (req.kind == proto::Kind::Device) {
    // The broker cannot call CUDA, but it can tell a driver export from anything else: a socket (the client's
    // own connection, which would keep it alive for ever), a pipe, a memfd or a file.
    if (!os::is_nvidia_export(fd)) {
      return "a device segment's fd must come from cuMemExportToShareableHandle (a file of /dev/nvidiactl); "
             "this one is not";
    }
    return {};
  }
  // Host memory is a memfd the broker can check: exactly the declared size, then sealed so that nobody can
  // shrink it under another process's mapping (which would SIGBUS that process).
  try {
    const std::size_t actual = os::fd_size(fd);
    if (actual != req.size) return fmt::format("the memfd is {} bytes but Create declares {}", actual, req.size);
    // A read-only opener gets a read-only file description; the inode must not let it reopen the file writable
    // through /proc/self/fd/N, so no access for group or other (gpuipc's library creates memfds 0600).
    auto owner = os::file_owner(fd);
    if ((owner.mode & 077) != 0) {
      try {
        os::file_chmod(fd, owner.mode & 0700);
      } catch (const Error&) {
        return fmt::format("the memfd's inode is mode {:04o} (uid {}): another user could reopen it writable "
                           "through /proc; create it with mode 0600 (fchmod)",
                           owner.mode, owner.uid);
      }
    }
    os::memfd_seal(fd, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  } catch (const Error& e) {
    return fmt::format("host segments must be memfds created with MFD_ALLOW_SEALING and not yet sealed against "
                       "sealing: {}",
                       e.what());
  }
  return {};
}

void Registry::create(const Caller& caller, std::uint32_t rid, const proto::Create& req,
                      std::vector<os::UniqueFd>& fds, std::vector<Outgoing>& out) {
  auto fail = [&](ErrorCode code, std::string msg) {
    out.push_back(reply(caller.conn, rid, error_reply(rid, code, std::move(msg)).body));
  };
  if (fds.size() != 1 || !fds[0]) {
    fail(ErrorCode::Protocol, "Create must carry exactly one fd (the segment's memory)");
    return;
  }
  if (auto r = m_restore.find(req.name); r != m_restore.end()) {
    fail(ErrorCode::AlreadyExists,
         fmt::format("segment '{}' was linked when the previous broker died and its holders may still announce it "
                     "(for {} ms more); open it with a wait, or unlink it (gpuipc rm {})",
                     req.name, std::max<std::int64_t>(0, (r->second.deadline_ns - os::monotonic_ns()) / 1'000'000),
                     req.name));
    return;
  }
  if (m_names.count(req.name) != 0) {
    const auto& other = m_segments.at(m_names.at(req.name));
    fail(ErrorCode::AlreadyExists,
         fmt::format("segment '{}' already exists ({} {}, owned by uid {}); open it, or unlink it first (gpuipc rm {})",
                     req.name, kind_name(other.kind), human_bytes(other.size), other.owner_uid, req.name));
    return;
  }
  // Quotas: what this uid already has registered (linked or still referenced), and the broker's fd budget.
  const std::uint64_t bytes = m_bytes_per_uid[caller.creds.uid];
  const std::uint64_t count = m_segments_per_uid[caller.creds.uid];
  const std::uint64_t per_uid_fds = std::max<std::uint64_t>(m_quotas.fds / 2, 1);
  if (count + 1 > m_quotas.segments || count + 1 > per_uid_fds) {
    const bool fds_bound = per_uid_fds < m_quotas.segments;
    fail(ErrorCode::QuotaExceeded,
         fmt::format("quota exceeded: uid {} already has {} segments registered and the broker allows {} ({}); "
                     "unlink segments you no longer need (gpuipc ls, gpuipc rm)",
                     caller.creds.uid, count, fds_bound ? per_uid_fds : m_quotas.segments,
                     fds_bound ? "half of its file descriptor budget" : "GPUIPC_QUOTA_SEGMENTS"));
    return;
  }
  if (m_segments.size() + 1 > m_quotas.fds) {
    fail(ErrorCode::QuotaExceeded,
         fmt::format("the broker holds {} segments, all its file descriptor budget allows; unlink segments you no "
                     "longer need (gpuipc ls, gpuipc rm), or raise gpuipcd's RLIMIT_NOFILE",
                     m_segments.size()));
    return;
  }
  if (req.size > m_quotas.bytes || bytes > m_quotas.bytes - req.size) {
    fail(ErrorCode::QuotaExceeded,
         fmt::format("quota exceeded: uid {} has {} registered; creating '{}' ({}) would pass the broker's limit of {} "
                     "(GPUIPC_QUOTA_BYTES); unlink segments you no longer need (gpuipc ls, gpuipc rm)",
                     caller.creds.uid, human_bytes(bytes), req.name, human_bytes(req.size), human_bytes(m_quotas.bytes)));
    return;
  }
  if ((req.flags & ~proto::kKnownCreateFlags) != 0 || __builtin_popcount(req.flags) > 1) {
    fail(ErrorCode::InvalidArgument, fmt::format("segment '{}': unknown Create flags {:#x}", req.name, req.flags));
    return;
  }
  const std::size_t min_control = min_control_bytes(req.flags);
  if (req.flags != 0 && (req.kind == proto::Kind::Device || req.size < min_control || req.size > (64ULL << 20))) {
    fail(ErrorCode::InvalidArgument,
         fmt::format("segment '{}': a semaphore, channel or pool control block is host memory of {} bytes to 64 MiB",
                     req.name, min_control));
    return;
  }
  os::Mapping record;
  if (req.kind == proto::Kind::DeviceIpc) {
    if (auto why = adopt_device_ipc_record(req, fds[0].get(), record); !why.empty()) {
      fail(ErrorCode::InvalidArgument, fmt::format("segment '{}' (device_ipc): {}", req.name, why));
      return;
    }
  } else if (auto why = check_memory(req, fds[0].get()); !why.empty()) {
    fail(ErrorCode::InvalidArgument, fmt::format("segment '{}': {}", req.name, why));
    return;
  }
  SegmentRecord seg;
  seg.id = m_next_id++;
  seg.name = req.name;
  seg.kind = req.kind;
  seg.mode = req.mode;
  seg.size = req.size;
  seg.device = req.device;
  seg.owner_uid = caller.creds.uid;
  seg.owner_gid = caller.creds.gid;
  seg.created_unix_ns = unix_now_ns();
  seg.flags = req.flags;
  seg.creator = caller.conn;
  seg.view_offset = req.view_offset;
  seg.view_size = req.view_size;
  if (record) seg.control = std::move(record);
  if (req.flags != 0) {
    try {
      seg.control = os::Mapping::map(fds[0].get(), req.size, true);
    } catch (const Error& e) {
      fail(e.code(), fmt::format("segment '{}': cannot map its control block: {}", req.name, e.what()));
      return;
    }
    seg.block = ControlBlock{seg.control.data(), seg.control.size(), req.flags, {}};
    // The creator fills the block in before Create: a name is never visible over a half-made object.
    if (auto why = check_control(seg.block); !why.empty()) {
      fail(ErrorCode::InvalidArgument, fmt::format("segment '{}': {}", req.name, why));
      return;
    }
  }
  seg.memory = std::move(fds[0]);
  seg.refs[caller.conn] = 1;
  seg.writers.insert(caller.conn);
  const std::uint64_t id = seg.id;
  auto& stored = m_segments.emplace(id, std::move(seg)).first->second;
  m_names[req.name] = id;
  ++m_segments_per_uid[caller.creds.uid];
  m_bytes_per_uid[caller.creds.uid] += req.size;
  GPUIPC_LOG_INFO("created segment '{}' id {} ({} {}) for uid {} pid {}", req.name, id, kind_name(req.kind),
                  human_bytes(req.size), caller.creds.uid, caller.creds.pid);
  out.push_back(reply(caller.conn, rid, proto::OpenReply{info_of(stored)}));

  journal_linked(stored);
  wake_waiting(stored, out);
}

void Registry::wake_waiting(SegmentRecord& seg, std::vector<Outgoing>& out) {
  std::vector<std::uint64_t> waiting;
  for (auto [it, end] = m_pending_by_name.equal_range(seg.name); it != end; ++it) waiting.push_back(it->second);
  for (auto pid : waiting) {
    Pending p = unpark(pid);
    open_existing(seg, p.conn, p.creds, p.request_id, p.request.access, out);
  }
}

void Registry::park(const Caller& caller, std::uint32_t rid, const proto::Open& req, std::int64_t now_ns,
                    std::vector<Outgoing>& out) {
  auto& info = m_connections[caller.conn];
  if (info.pending.size() >= m_quotas.pending_opens_per_connection) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::QuotaExceeded,
                                    fmt::format("no segment named '{}', and this connection already waits for {} "
                                                "names, the most it may; wait for fewer at once",
                                                req.name, info.pending.size()))
                            .body));
    return;
  }
  const std::uint64_t id = m_next_pending++;
  const std::int64_t deadline = now_ns + static_cast<std::int64_t>(req.wait_ms) * 1'000'000;
  Pending p{caller.conn, rid, req, caller.creds, m_pending_by_deadline.emplace(deadline, id),
            m_pending_by_name.emplace(req.name, id)};
  m_pending.emplace(id, std::move(p));
  info.pending.insert(id);
}

Registry::Pending Registry::unpark(std::uint64_t id) {
  auto it = m_pending.find(id);
  Pending p = std::move(it->second);
  m_pending.erase(it);
  m_pending_by_deadline.erase(p.by_deadline);
  m_pending_by_name.erase(p.by_name);
  if (auto c = m_connections.find(p.conn); c != m_connections.end()) c->second.pending.erase(id);
  return p;
}

void Registry::open(const Caller& caller, std::uint32_t rid, const proto::Open& req, std::int64_t now_ns,
                    std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  if (it == m_names.end()) {
    if (req.wait_ms > 0) {
      park(caller, rid, req, now_ns, out);
      return;
    }
    const bool held_over = m_restore.count(req.name) != 0;
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound,
                                    held_over ? fmt::format("segment '{}' was linked when the previous broker died; "
                                                            "none of the processes that map it has announced it to "
                                                            "this broker yet (pass a wait timeout to wait for them)",
                                                            req.name)
                                              : fmt::format("no segment named '{}' (gpuipc ls lists them; pass a "
                                                            "wait timeout to wait for its creator)",
                                                            req.name))
                            .body));
    return;
  }
  open_existing(m_segments.at(it->second), caller.conn, caller.creds, rid, req.access, out);
}

void Registry::open_existing(SegmentRecord& seg, ConnId conn, const os::Credentials& creds, std::uint32_t rid,
                             proto::Access access, std::vector<Outgoing>& out) {
  const unsigned have = permission_bits(creds, seg.mode, seg.owner_uid, seg.owner_gid);
  const unsigned need = access == proto::Access::ReadOnly ? 4U : 6U;
  if ((have & need) != need) {
    out.push_back(reply(
        conn, rid,
        error_reply(rid, ErrorCode::PermissionDenied,
                    fmt::format("segment '{}' is mode {:04o} owned by uid {} gid {}; you are uid {} gid {} and need {} "
                                "permission{}",
                                seg.name, seg.mode, seg.owner_uid, seg.owner_gid, creds.uid, creds.gid,
                                need == 4U ? "read (r)" : "read and write (rw)",
                                (need == 6U && (have & 4U) != 0) ? "; open it read-only instead" : ""))
            .body));
    return;
  }
  os::UniqueFd fd;
  try {
    // A read-only opener of host memory gets a read-only file description: it cannot map it writable at all.
    // A device_ipc record is the exporter's to write: every opener gets it read-only.
    const bool read_only = (access == proto::Access::ReadOnly && seg.kind != proto::Kind::Device) ||
                           seg.kind == proto::Kind::DeviceIpc;
    fd = read_only ? os::reopen_readonly(seg.memory.get()) : os::dup_fd(seg.memory.get(), "segment");
  } catch (const Error& e) {
    out.push_back(reply(conn, rid, error_reply(rid, e.code(), fmt::format("segment '{}': {}", seg.name, e.what()), e.sys_errno()).body));
    return;
  }
  const bool first = ++seg.refs[conn] == 1;
  if (access == proto::Access::ReadWrite) seg.writers.insert(conn);
  out.push_back(reply(conn, rid, proto::OpenReply{info_of(seg)}, std::move(fd)));
  if (first) notify(seg, proto::EventKind::Joined, holder_of(seg, conn), conn, out);
}

void Registry::close(const Caller& caller, std::uint32_t rid, const proto::Close& req, std::vector<Outgoing>& out) {
  auto it = m_segments.find(req.id);
  if (it == m_segments.end() || it->second.refs.count(caller.conn) == 0) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::InvalidArgument,
                                    fmt::format("Close of segment id {}: this connection holds no reference to it", req.id))
                            .body));
    return;
  }
  auto& refs = it->second.refs;
  if (--refs[caller.conn] == 0) {
    auto gone = holder_of(it->second, caller.conn);
    gone.references = 0;
    refs.erase(caller.conn);
    it->second.beats.erase(caller.conn);
    notify(it->second, proto::EventKind::Left, gone, caller.conn, out);
    repair_for(it->second, caller.conn);
    if (it->second.creator == caller.conn) exporter_left(it->second, proto::PoisonReason::Closed);
  }
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
  maybe_destroy(req.id);
}

void Registry::unlink(const Caller& caller, std::uint32_t rid, const proto::Unlink& req, std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  if (auto r = m_restore.find(req.name); it == m_names.end() && r != m_restore.end()) {
    // A name from before a broker restart that nobody announced yet: its owner (or root) may drop it.
    if (caller.creds.uid != 0 && caller.creds.uid != r->second.entry.owner_uid) {
      out.push_back(reply(caller.conn, rid,
                          error_reply(rid, ErrorCode::PermissionDenied,
                                      fmt::format("segment '{}' is owned by uid {}; only its owner or root may unlink "
                                                  "it (you are uid {})",
                                                  req.name, r->second.entry.owner_uid, caller.creds.uid))
                              .body));
      return;
    }
    m_restore.erase(r);
    m_journal.unlinked(req.name);
    out.push_back(reply(caller.conn, rid, proto::OkReply{}));
    return;
  }
  if (it == m_names.end()) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound, fmt::format("no segment named '{}' to unlink", req.name)).body));
    return;
  }
  auto& seg = m_segments.at(it->second);
  if (caller.creds.uid != 0 && caller.creds.uid != seg.owner_uid) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::PermissionDenied,
                                    fmt::format("segment '{}' is owned by uid {}; only its owner or root may unlink it "
                                                "(you are uid {})",
                                                req.name, seg.owner_uid, caller.creds.uid))
                            .body));
    return;
  }
  const std::uint64_t id = seg.id;
  seg.name.clear();
  // Heartbeats and watches go by name: a name that is gone takes no heartbeat, so the deadlines set under it must
  // not expire into Hung events about processes that are alive.
  seg.beats.clear();
  m_names.erase(it);
  m_journal.unlinked(req.name);
  bump_names_generation();
  GPUIPC_LOG_INFO("unlinked segment '{}' id {} ({} references remain)", req.name, id, seg.total_refs());
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
  maybe_destroy(id);
}

bool Registry::visible_to(const os::Credentials& creds, const SegmentRecord& seg) noexcept {
  return creds.uid == 0 || creds.uid == seg.owner_uid ||
         (permission_bits(creds, seg.mode, seg.owner_uid, seg.owner_gid) & 4U) != 0;
}

void Registry::stat(const Caller& caller, std::uint32_t rid, const proto::Stat& req, std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  // A name the caller may not open is not there for it, as with a directory entry it cannot read.
  if (it == m_names.end() || !visible_to(caller.creds, m_segments.at(it->second))) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound, fmt::format("no segment named '{}'", req.name)).body));
    return;
  }
  out.push_back(reply(caller.conn, rid, proto::StatReply{info_of(m_segments.at(it->second))}));
}

void Registry::list(const Caller& caller, std::uint32_t rid, const proto::List& req, std::vector<Outgoing>& out) {
  proto::ListReply r;
  for (auto it = m_segments.upper_bound(req.after_id); it != m_segments.end(); ++it) {
    if (!visible_to(caller.creds, it->second)) continue;
    if (r.entries.size() == proto::kMaxListEntries) {
      r.more = true;
      break;
    }
    r.entries.push_back(info_of(it->second));
  }
  out.push_back(reply(caller.conn, rid, std::move(r)));
}

proto::SegmentInfo Registry::info_of(const SegmentRecord& seg) const {
  proto::SegmentInfo info;
  info.id = seg.id;
  info.name = seg.name;
  info.kind = seg.kind;
  info.mode = seg.mode;
  info.size = seg.size;
  info.device = seg.device;
  info.view_offset = seg.view_offset;
  info.view_size = seg.view_size;
  info.owner_uid = seg.owner_uid;
  info.owner_gid = seg.owner_gid;
  info.created_unix_ns = seg.created_unix_ns;
  info.references = seg.total_refs();
  info.mapper_count = static_cast<std::uint32_t>(seg.refs.size());
  std::set<std::uint32_t> pids;
  for (const auto& [conn, count] : seg.refs) {
    auto c = m_connections.find(conn);
    if (c != m_connections.end()) pids.insert(static_cast<std::uint32_t>(c->second.creds.pid));
  }
  for (auto pid : pids) {
    if (info.mapper_pids.size() == proto::kMaxMapperPids) break;
    info.mapper_pids.push_back(pid);
  }
  return info;
}

void Registry::maybe_destroy(std::uint64_t id) {
  auto it = m_segments.find(id);
  if (it == m_segments.end() || !it->second.name.empty() || !it->second.refs.empty()) return;
  GPUIPC_LOG_INFO("freed segment id {} ({})", id, human_bytes(it->second.size));
  const uid_t owner = it->second.owner_uid;
  if (auto c = m_segments_per_uid.find(owner); c != m_segments_per_uid.end() && --c->second == 0) {
    m_segments_per_uid.erase(c);
  }
  if (auto b = m_bytes_per_uid.find(owner); b != m_bytes_per_uid.end()) {
    b->second -= std::min(b->second, it->second.size);
    if (b->second == 0) m_bytes_per_uid.erase(b);
  }
  for (const ConnId w : it->second.watchers) {
    if (auto c = m_connections.find(w); c != m_connections.end()) c->second.watching.erase(id);
  }
  m_segments.erase(it);
}

void Registry::expire(std::int64_t now_ns, std::vector<Outgoing>& out) {
  expire_restores(now_ns);
  expire_beats(now_ns, out);
  while (!m_pending_by_deadline.empty() && m_pending_by_deadline.begin()->first <= now_ns) {
    Pending p = unpark(m_pending_by_deadline.begin()->second);
    out.push_back(reply(p.conn, p.request_id,
                        error_reply(p.request_id, ErrorCode::Timeout,
                                    fmt::format("no segment named '{}' appeared within {} ms", p.request.name,
                                                p.request.wait_ms))
                            .body));
  }
}

std::optional<std::int64_t> Registry::next_deadline() const {
  std::optional<std::int64_t> d;
  if (!m_pending_by_deadline.empty()) d = m_pending_by_deadline.begin()->first;
  for (const auto& [name, r] : m_restore) d = d ? std::min(*d, r.deadline_ns) : r.deadline_ns;
  for (const auto id : m_beating) {
    auto it = m_segments.find(id);
    if (it == m_segments.end()) continue;
    for (const auto& [conn, b] : it->second.beats) {
      if (!b.hung) d = d ? std::min(*d, b.deadline_ns) : b.deadline_ns;
    }
  }
  return d;
}

proto::HolderInfo Registry::holder_of(const SegmentRecord& seg, ConnId conn) const {
  proto::HolderInfo h;
  if (auto c = m_connections.find(conn); c != m_connections.end()) {
    h.pid = static_cast<std::uint32_t>(c->second.creds.pid);
    h.uid = c->second.creds.uid;
  }
  if (auto r = seg.refs.find(conn); r != seg.refs.end()) h.references = r->second;
  h.access =
      static_cast<std::uint8_t>(seg.writers.count(conn) != 0 ? proto::Access::ReadWrite : proto::Access::ReadOnly);
  h.creator = seg.creator == conn ? 1 : 0;
  for (auto [it, end] = seg.joined.equal_range(conn); it != end; ++it) {
    const auto role = static_cast<unsigned>(it->second.role);
    if (role < 8) h.roles = static_cast<std::uint8_t>(h.roles | (1U << role));
  }
  if (auto b = seg.beats.find(conn); b != seg.beats.end()) {
    h.beat = static_cast<std::uint8_t>(b->second.hung ? proto::Beat::Hung : proto::Beat::Alive);
    h.beat_ms = b->second.ms;
  }
  return h;
}

void Registry::notify(const SegmentRecord& seg, proto::EventKind kind, const proto::HolderInfo& holder, ConnId conn,
                      std::vector<Outgoing>& out) {
  if (seg.watchers.empty()) return;
  proto::Event e;
  e.kind = static_cast<std::uint8_t>(kind);
  e.id = seg.id;
  e.name = seg.name;
  e.holder = holder;
  e.unix_ns = unix_now_ns();
  for (const ConnId w : seg.watchers) {
    if (w == conn) continue;
    out.push_back(reply(w, 0, e));
  }
}

void Registry::expire_beats(std::int64_t now_ns, std::vector<Outgoing>& out) {
  for (auto it = m_beating.begin(); it != m_beating.end();) {
    auto seg = m_segments.find(*it);
    if (seg == m_segments.end() || seg->second.beats.empty()) {
      it = m_beating.erase(it);
      continue;
    }
    for (auto& [conn, b] : seg->second.beats) {
      if (b.hung || b.deadline_ns > now_ns) continue;
      b.hung = true;
      notify(seg->second, proto::EventKind::Hung, holder_of(seg->second, conn), conn, out);
    }
    ++it;
  }
}

void Registry::holders(const Caller& caller, std::uint32_t rid, const proto::Holders& req, std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  if (it == m_names.end() || !visible_to(caller.creds, m_segments.at(it->second))) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound, fmt::format("no segment named '{}'", req.name)).body));
    return;
  }
  const auto& seg = m_segments.at(it->second);
  proto::HoldersReply r;
  for (const auto& [conn, count] : seg.refs) {
    if (r.entries.size() == proto::kMaxHolders) {
      r.more = true;
      break;
    }
    r.entries.push_back(holder_of(seg, conn));
  }
  std::sort(r.entries.begin(), r.entries.end(), [](const auto& a, const auto& b) { return a.pid < b.pid; });
  out.push_back(reply(caller.conn, rid, std::move(r)));
}

void Registry::watch(const Caller& caller, std::uint32_t rid, const proto::Watch& req, std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  if (it == m_names.end() || !visible_to(caller.creds, m_segments.at(it->second))) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound,
                                    fmt::format("no segment named '{}' to watch (gpuipc ls lists them)", req.name))
                            .body));
    return;
  }
  auto& info = m_connections[caller.conn];
  constexpr std::size_t kMaxWatched = 64;
  if (info.watching.count(it->second) == 0 && info.watching.size() >= kMaxWatched) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::QuotaExceeded,
                                    fmt::format("this connection already watches {} names, the most it may; watch "
                                                "'{}' from another connection",
                                                kMaxWatched, req.name))
                            .body));
    return;
  }
  info.watching.insert(it->second);
  m_segments.at(it->second).watchers.insert(caller.conn);
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
}

void Registry::heartbeat(const Caller& caller, std::uint32_t rid, const proto::Heartbeat& req, std::int64_t now_ns,
                         std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  if (it == m_names.end() || m_segments.at(it->second).refs.count(caller.conn) == 0) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::InvalidArgument,
                                    fmt::format("Heartbeat for '{}': this process holds no reference to a segment of "
                                                "that name; open it first",
                                                req.name))
                            .body));
    return;
  }
  auto& seg = m_segments.at(it->second);
  if (req.deadline_ms == 0) {
    seg.beats.erase(caller.conn);
  } else {
    auto& b = seg.beats[caller.conn];
    const bool was_hung = b.hung;
    b.deadline_ns = now_ns + static_cast<std::int64_t>(req.deadline_ms) * 1'000'000;
    b.ms = req.deadline_ms;
    b.hung = false;
    m_beating.insert(seg.id);
    if (was_hung) notify(seg, proto::EventKind::Alive, holder_of(seg, caller.conn), caller.conn, out);
  }
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
}

void Registry::join(const Caller& caller, std::uint32_t rid, const proto::Join& req, std::vector<Outgoing>& out) {
  auto fail = [&](ErrorCode code, std::string msg) {
    out.push_back(reply(caller.conn, rid, error_reply(rid, code, std::move(msg)).body));
  };
  auto it = m_segments.find(req.id);
  if (it == m_segments.end() || it->second.writers.count(caller.conn) == 0) {
    fail(ErrorCode::PermissionDenied,
         fmt::format("Join of segment id {}: this connection holds no read-write reference to it; open it "
                     "read-write first",
                     req.id));
    return;
  }
  auto& seg = it->second;
  if (!seg.control) {
    fail(ErrorCode::InvalidArgument, fmt::format("segment '{}' is not a semaphore or a channel", seg.name));
    return;
  }
  const std::uint32_t token = m_next_token++;
  if (m_next_token == 0) m_next_token = 1;  // 0 marks a free entry
  std::string why;
  ErrorCode code = ErrorCode::InvalidArgument;
  const auto role = static_cast<proto::Role>(req.role);
  const std::uint32_t member = join_member(seg.block, role, token, seg.creator == caller.conn, code, why);
  if (member == proto::kNoMember) {
    fail(code, fmt::format("cannot join '{}': {}", seg.name, why));
    return;
  }
  seg.joined.emplace(caller.conn, Joined{member, token, role});
  out.push_back(reply(caller.conn, rid, proto::JoinReply{member, token}));
}

}  // namespace gpuipc::broker
