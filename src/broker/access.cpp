// Who may open or see a name: the permission check, opens (parked until their name appears when they wait), stat
// and list (docs/segments.md#permissions). Part of the Registry (registry.hpp).
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "broker/registry.hpp"
#include "os/memfd.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc::broker {

unsigned permission_bits(const os::Credentials& creds, std::uint16_t mode, uid_t owner_uid, gid_t owner_gid) noexcept {
  if (creds.uid == 0) return 7;
  if (creds.uid == owner_uid) return (mode >> 6) & 7;
  if (creds.in_group(owner_gid)) return (mode >> 3) & 7;
  return mode & 7;
}

const SegmentAttributes* Registry::named(const std::string& name) const {
  if (auto it = m_names.find(name); it != m_names.end()) return &m_segments.at(it->second);
  if (auto r = m_restore.find(name); r != m_restore.end()) return &r->second.entry;
  return nullptr;
}

std::string Registry::name_refusal(const os::Credentials& creds, const std::string& name) const {
  const std::string_view pool_name = proto::pool_of_chunk(name);
  for (std::size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
    const std::string above = name.substr(0, dot);
    const SegmentAttributes* seg = named(above);
    if (seg == nullptr) continue;
    const bool chunk = above == pool_name && (seg->flags & proto::kFlagPool) != 0;
    const unsigned need = chunk ? 6 : 4;
    if ((permission_bits(creds, seg->mode, seg->owner_uid, seg->owner_gid) & need) == need) continue;
    if (chunk) {
      return fmt::format(
          "'{}' names a chunk of pool '{}', which uid {} may not read and write: only its members "
          "make a pool's chunks; choose another name",
          name, above, creds.uid);
    }
    return fmt::format(
        "'{}' lies under '{}', which uid {} may not read: only those who may use an object make "
        "names under its name (a stream's readers, a pool's chunks); choose another name",
        name, above, creds.uid);
  }
  return {};
}

std::string Registry::pool_chunks_refusal(const os::Credentials& creds, const SegmentRecord& pool) const {
  // Read once more from memory its creator maps writable: check_control's 1..kMaxChunks need not hold now.
  auto& header = *static_cast<shm::PoolHeader*>(pool.block.data);
  const std::uint32_t chunks =
      std::min(proto::atomic(header.max_chunks).load(std::memory_order_relaxed), shm::kMaxChunks);
  for (std::uint32_t c = 0; c < chunks; ++c) {
    const std::string chunk = fmt::format("{}.chunk.{}", pool.name, c);
    const SegmentAttributes* taken = named(chunk);
    if (taken == nullptr || taken->owner_uid == creds.uid) continue;
    return fmt::format(
        "pool '{}': segment '{}' exists, owned by uid {}, and the pool would grow into it; remove it "
        "(gpuipc rm {}, as uid {} or root) or choose another pool name",
        pool.name, chunk, taken->owner_uid, chunk, taken->owner_uid);
  }
  return {};
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
  const bool look = access == proto::Access::Look;  // read-only, and no holder
  if (look) access = proto::Access::ReadOnly;
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
  if (auto why = reference_refusal(seg, conn); !why.empty()) {
    out.push_back(reply(conn, rid, error_reply(rid, ErrorCode::QuotaExceeded, std::move(why)).body));
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
  if (first) note_holding(conn, seg.id, true);
  bool joins = first;
  if (look) {
    if (first) seg.lookers.insert(conn);
    joins = false;
  } else if (seg.lookers.erase(conn) != 0) {
    joins = true;  // it only looked until now and holds it from here on: watchers hear of it now
  }
  if (access == proto::Access::ReadWrite) seg.writers.insert(conn);
  out.push_back(reply(conn, rid, proto::OpenReply{info_of(seg)}, std::move(fd)));
  if (joins) notify(seg, proto::EventKind::Joined, holder_of(seg, conn), conn, out);
}

std::string Registry::reference_refusal(const SegmentRecord& seg, ConnId conn) const {
  if (auto held = seg.refs.find(conn); held != seg.refs.end()) {
    // (The library takes one reference a mapping and shares it between handles: this is a loop of Opens.)
    if (held->second < m_quotas.refs_per_connection) return {};
    return fmt::format(
        "segment '{}': this connection holds {} references to it, the most one connection may; close "
        "some",
        seg.name, held->second);
  }
  return opens_refusal(conn, seg.name);
}

bool Registry::visible_to(const os::Credentials& creds, const SegmentRecord& seg) noexcept {
  return creds.uid == 0 || creds.uid == seg.owner_uid ||
         (permission_bits(creds, seg.mode, seg.owner_uid, seg.owner_gid) & 4U) != 0;
}

SegmentRecord* Registry::find_visible(const os::Credentials& creds, const std::string& name) {
  auto it = m_names.find(name);
  // A name the caller may not open is not there for it, as with a directory entry it cannot read.
  if (it == m_names.end()) return nullptr;
  SegmentRecord& seg = m_segments.at(it->second);
  return visible_to(creds, seg) ? &seg : nullptr;
}

void Registry::stat(const Caller& caller, std::uint32_t rid, const proto::Stat& req, std::vector<Outgoing>& out) {
  const SegmentRecord* seg = find_visible(caller.creds, req.name);
  if (seg == nullptr) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound, fmt::format("no segment named '{}'", req.name)).body));
    return;
  }
  out.push_back(reply(caller.conn, rid, proto::StatReply{info_of(*seg)}));
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

}  // namespace gpuipc::broker
