#include "base/format.hpp"
#include "broker/registry.hpp"

#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "base/log.hpp"
#include "os/memfd.hpp"
#include "os/module.hpp"
#include "proto/shm.hpp"
#include "proto/status_page.hpp"
#include "broker/repair.hpp"

namespace gpuipc::broker {
namespace {


std::string_view kind_name(proto::Kind k) {
  switch (k) {
    case proto::Kind::Device: return "device";
    case proto::Kind::Host: return "host";
    case proto::Kind::HostPinned: return "host_pinned";
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
  if (creds.gid == owner_gid) return (mode >> 3) & 7;
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
  os::memfd_seal(m_status_fd.get(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  page->magic = proto::kStatusMagic;
  page->version = proto::kStatusVersion;
  page->broker_pid = static_cast<std::uint64_t>(os::current_pid());
  std::atomic_ref<std::uint64_t>(page->names_generation).store(1, std::memory_order_release);
}

void Registry::bump_names_generation() noexcept {
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  std::atomic_ref<std::uint64_t>(page->names_generation).fetch_add(1, std::memory_order_release);
}

void Registry::add_connection(ConnId conn, const os::Credentials& creds, std::uint32_t hello_pid) {
  m_connections[conn] = ConnectionInfo{creds, hello_pid};
}

void Registry::repair_for(SegmentRecord& seg, ConnId conn) {
  if (!seg.control) return;
  auto c = m_connections.find(conn);
  if (c == m_connections.end()) return;
  const auto pid = static_cast<pid_t>(c->second.hello_pid);
  if ((seg.flags & proto::kFlagSemaphore) != 0) repair_semaphore(seg.control.data(), seg.control.size(), pid);
  if ((seg.flags & proto::kFlagChannel) != 0) repair_channel(seg.control.data(), seg.control.size(), pid);
  if ((seg.flags & proto::kFlagPool) != 0) repair_pool(seg.control.data(), seg.control.size(), pid);
}

void Registry::drop_connection(ConnId conn, bool repair) {
  std::vector<std::uint64_t> touched;
  for (auto& [id, seg] : m_segments) {
    if (seg.refs.erase(conn) > 0) {
      if (repair) repair_for(seg, conn);
      touched.push_back(id);
    }
  }
  for (auto id : touched) maybe_destroy(id);
  std::erase_if(m_pending, [&](const Pending& p) { return p.conn == conn; });
  m_connections.erase(conn);
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

void Registry::create(const Caller& caller, std::uint32_t rid, const proto::Create& req,
                      std::vector<os::UniqueFd>& fds, std::vector<Outgoing>& out) {
  auto fail = [&](ErrorCode code, std::string msg) { out.push_back(reply(caller.conn, rid, error_reply(rid, code, std::move(msg)).body)); };
  if (fds.size() != 1 || !fds[0]) {
    fail(ErrorCode::Protocol, "Create must carry exactly one fd (the segment's memory)");
    return;
  }
  if (m_names.count(req.name) != 0) {
    const auto& other = m_segments.at(m_names.at(req.name));
    fail(ErrorCode::AlreadyExists,
         fmt::format("segment '{}' already exists ({} {}, owned by uid {}); open it, or unlink it first (gpuipc rm {})",
                     req.name, kind_name(other.kind), human_bytes(other.size), other.owner_uid, req.name));
    return;
  }
  // Quotas: what this uid already has registered (linked or still referenced).
  std::uint64_t bytes = 0;
  std::uint64_t count = 0;
  for (const auto& [id, seg] : m_segments) {
    if (seg.owner_uid == caller.creds.uid) {
      bytes += seg.size;
      ++count;
    }
  }
  if (count + 1 > m_quotas.segments) {
    fail(ErrorCode::QuotaExceeded,
         fmt::format("quota exceeded: uid {} already has {} segments registered and the broker allows {} "
                     "(GPUIPC_QUOTA_SEGMENTS); unlink segments you no longer need (gpuipc ls, gpuipc rm)",
                     caller.creds.uid, count, m_quotas.segments));
    return;
  }
  if (req.size > m_quotas.bytes || bytes > m_quotas.bytes - req.size) {
    fail(ErrorCode::QuotaExceeded,
         fmt::format("quota exceeded: uid {} has {} registered; creating '{}' ({}) would pass the broker's limit of {} "
                     "(GPUIPC_QUOTA_BYTES); unlink segments you no longer need (gpuipc ls, gpuipc rm)",
                     caller.creds.uid, human_bytes(bytes), req.name, human_bytes(req.size), human_bytes(m_quotas.bytes)));
    return;
  }
  // At most one of the flags: a segment is one kind of control block.
  if ((req.flags & ~proto::kKnownCreateFlags) != 0 || (req.flags & (req.flags - 1)) != 0) {
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
  if (req.kind != proto::Kind::Device) {
    // Host memory is a memfd the broker can check: exactly the declared size, then sealed so that nobody can
    // shrink it under another process's mapping (which would SIGBUS that process).
    try {
      const std::size_t actual = os::fd_size(fds[0].get());
      if (actual != req.size) {
        fail(ErrorCode::InvalidArgument,
             fmt::format("segment '{}': the memfd is {} bytes but Create declares {}", req.name, actual, req.size));
        return;
      }
      os::memfd_seal(fds[0].get(), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    } catch (const Error& e) {
      fail(ErrorCode::InvalidArgument,
           fmt::format("segment '{}': host segments must be memfds created with MFD_ALLOW_SEALING and not yet sealed "
                       "against sealing: {}",
                       req.name, e.what()));
      return;
    }
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
  if (req.flags != 0) {
    try {
      seg.control = os::Mapping::map(fds[0].get(), req.size, true);
    } catch (const Error& e) {
      fail(e.code(), fmt::format("segment '{}': cannot map its control block: {}", req.name, e.what()));
      return;
    }
  }
  seg.memory = std::move(fds[0]);
  seg.refs[caller.conn] = 1;
  const std::uint64_t id = seg.id;
  auto& stored = m_segments.emplace(id, std::move(seg)).first->second;
  m_names[req.name] = id;
  GPUIPC_LOG_INFO("created segment '{}' id {} ({} {}) for uid {} pid {}", req.name, id, kind_name(req.kind),
                  human_bytes(req.size), caller.creds.uid, caller.creds.pid);
  out.push_back(reply(caller.conn, rid, proto::OpenReply{info_of(stored)}));

  // Openers that were waiting for this name.
  std::vector<Pending> waiting;
  std::erase_if(m_pending, [&](Pending& p) {
    if (p.request.name != req.name) return false;
    waiting.push_back(std::move(p));
    return true;
  });
  for (auto& p : waiting) open_existing(stored, p.conn, p.creds, p.request_id, p.request.access, out);
}

void Registry::open(const Caller& caller, std::uint32_t rid, const proto::Open& req, std::int64_t now_ns,
                    std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  if (it == m_names.end()) {
    if (req.wait_ms > 0) {
      m_pending.push_back(Pending{caller.conn, rid, req, caller.creds,
                                  now_ns + static_cast<std::int64_t>(req.wait_ms) * 1'000'000});
      return;
    }
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound,
                                    fmt::format("no segment named '{}' (gpuipc ls lists them; pass a wait timeout "
                                                "to wait for its creator)",
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
    fd = (access == proto::Access::ReadOnly && seg.kind != proto::Kind::Device) ? os::reopen_readonly(seg.memory.get())
                                                                                : os::dup_fd(seg.memory.get(), "segment");
  } catch (const Error& e) {
    out.push_back(reply(conn, rid, error_reply(rid, e.code(), fmt::format("segment '{}': {}", seg.name, e.what()), e.sys_errno()).body));
    return;
  }
  ++seg.refs[conn];
  out.push_back(reply(conn, rid, proto::OpenReply{info_of(seg)}, std::move(fd)));
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
    refs.erase(caller.conn);
    repair_for(it->second, caller.conn);
  }
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
  maybe_destroy(req.id);
}

void Registry::unlink(const Caller& caller, std::uint32_t rid, const proto::Unlink& req, std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
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
  m_names.erase(it);
  bump_names_generation();
  GPUIPC_LOG_INFO("unlinked segment '{}' id {} ({} references remain)", req.name, id, seg.total_refs());
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
  maybe_destroy(id);
}

void Registry::stat(const Caller& caller, std::uint32_t rid, const proto::Stat& req, std::vector<Outgoing>& out) {
  auto it = m_names.find(req.name);
  if (it == m_names.end()) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound, fmt::format("no segment named '{}'", req.name)).body));
    return;
  }
  out.push_back(reply(caller.conn, rid, proto::StatReply{info_of(m_segments.at(it->second))}));
}

void Registry::list(const Caller& caller, std::uint32_t rid, const proto::List& req, std::vector<Outgoing>& out) {
  proto::ListReply r;
  for (auto it = m_segments.upper_bound(req.after_id); it != m_segments.end(); ++it) {
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
  m_segments.erase(it);
}

void Registry::expire(std::int64_t now_ns, std::vector<Outgoing>& out) {
  std::erase_if(m_pending, [&](const Pending& p) {
    if (p.deadline_ns > now_ns) return false;
    out.push_back(reply(p.conn, p.request_id,
                        error_reply(p.request_id, ErrorCode::Timeout,
                                    fmt::format("no segment named '{}' appeared within {} ms", p.request.name,
                                                p.request.wait_ms))
                            .body));
    return true;
  });
}

std::optional<std::int64_t> Registry::next_deadline() const {
  std::optional<std::int64_t> d;
  for (const auto& p : m_pending) d = d ? std::min(*d, p.deadline_ns) : p.deadline_ns;
  return d;
}

}  // namespace gpuipc::broker
