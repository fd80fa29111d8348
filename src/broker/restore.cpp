// After a broker restart: names come back from the journal (journal.hpp) when a process that still maps their
// memory announces it, with the owner and mode the journal recorded; memberships come back when their holders
// rejoin. What cannot be proven is refused: a host segment is the same file or nothing; a device segment (whose
// fd carries no identity) only from its owner or root.
#include <fmt/format.h>

#include <algorithm>

#include "base/format.hpp"
#include "base/log.hpp"
#include "broker/registry.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"

namespace gpuipc::broker {
namespace {

bool host_kind(proto::Kind k) { return k == proto::Kind::Host || k == proto::Kind::HostPinned; }

}  // namespace

void Registry::open_journal(const std::string& path, std::int64_t now_ns, std::int64_t grace_ns) {
  std::vector<JournalEntry> linked;
  m_journal = Journal::open(path, linked);
  for (auto& e : linked) {
    GPUIPC_LOG_INFO("segment '{}' was linked when the last broker stopped: waiting {} ms for a holder to announce it",
                    e.name, grace_ns / 1'000'000);
    std::string name = e.name;
    m_restore[name] = Restore{std::move(e), now_ns + grace_ns};
  }
}

void Registry::journal_linked(const SegmentRecord& seg) noexcept {
  if (!m_journal || seg.kind == proto::Kind::DeviceIpc || seg.name.empty()) return;
  JournalEntry e;
  e.attributes() = seg;
  if (host_kind(seg.kind)) {
    try {
      const auto id = os::file_id(seg.memory.get());
      e.file_dev = id.dev;
      e.file_ino = id.ino;
    } catch (const Error&) {
      return;  // cannot tell its file later: do not promise it back
    }
  }
  m_journal.linked(e);
}

void Registry::expire_restores(std::int64_t now_ns) {
  for (auto it = m_restore.begin(); it != m_restore.end();) {
    if (it->second.deadline_ns > now_ns) {
      ++it;
      continue;
    }
    GPUIPC_LOG_INFO("segment '{}': nobody announced it after the broker restart; the name is gone", it->first);
    m_journal.unlinked(it->first);
    it = m_restore.erase(it);
  }
}

void Registry::announce(const Caller& caller, std::uint32_t rid, const proto::Announce& req,
                        std::vector<os::UniqueFd>& fds, std::vector<Outgoing>& out) {
  auto fail = [&](ErrorCode code, std::string msg) {
    out.push_back(reply(caller.conn, rid, error_reply(rid, code, std::move(msg)).body));
  };
  if (fds.size() != 1 || !fds[0]) {
    fail(ErrorCode::Protocol, "Announce must carry exactly one fd (the segment's memory)");
    return;
  }
  const int fd = fds[0].get();
  const unsigned need = req.access == proto::Access::ReadOnly ? 4U : 6U;
  // Already given back by another holder: the same memory gets a reference too.
  if (auto live = m_names.find(req.name); live != m_names.end()) {
    auto& seg = m_segments.at(live->second);
    bool same = false;
    try {
      same = host_kind(seg.kind) ? os::file_id(fd) == os::file_id(seg.memory.get())
                                 : seg.kind == proto::Kind::Device && os::is_nvidia_export(fd) && seg.size == req.size;
    } catch (const Error&) {
    }
    if (!same || (permission_bits(caller.creds, seg.mode, seg.owner_uid, seg.owner_gid) & need) != need) {
      fail(ErrorCode::AlreadyExists,
           fmt::format("segment '{}' names other memory now (or you may not hold it): yours stays mapped, unnamed",
                       req.name));
      return;
    }
    ++seg.refs[caller.conn];
    if (req.access == proto::Access::ReadWrite) seg.writers.insert(caller.conn);
    out.push_back(reply(caller.conn, rid, proto::OpenReply{info_of(seg)}));
    return;
  }
  auto r = m_restore.find(req.name);
  if (r == m_restore.end()) {
    fail(ErrorCode::NotFound, fmt::format("no segment named '{}' to give back: it was not linked when the previous "
                                          "broker died (or it was unlinked, or its time ran out)",
                                          req.name));
    return;
  }
  const JournalEntry& e = r->second.entry;
  if ((permission_bits(caller.creds, e.mode, e.owner_uid, e.owner_gid) & need) != need) {
    fail(ErrorCode::PermissionDenied, fmt::format("segment '{}' is mode {:04o} owned by uid {}: you may not hold it "
                                                  "as announced",
                                                  req.name, e.mode, e.owner_uid));
    return;
  }
  os::UniqueFd memory;
  try {
    if (host_kind(e.kind)) {
      if (os::file_id(fd) != os::FileId{e.file_dev, e.file_ino}) {
        fail(ErrorCode::InvalidArgument, fmt::format("segment '{}': that fd is not its memory", req.name));
        return;
      }
      // A read-only holder's fd would let no later opener write: the broker keeps a writable description.
      memory = req.access == proto::Access::ReadWrite ? std::move(fds[0]) : os::reopen_readwrite(fd);
    } else if (e.kind == proto::Kind::Device) {
      // A driver export carries no identity: only the owner (or root) may say which memory the name is.
      if (!os::is_nvidia_export(fd) || req.size != e.size || (caller.creds.uid != 0 && caller.creds.uid != e.owner_uid)) {
        fail(ErrorCode::PermissionDenied,
             fmt::format("segment '{}' is device memory: only its owner (uid {}) or root can give its name back",
                         req.name, e.owner_uid));
        return;
      }
      memory = std::move(fds[0]);
    } else {
      fail(ErrorCode::Unsupported, fmt::format("segment '{}': a {} segment cannot be given back", req.name,
                                               static_cast<int>(e.kind)));
      return;
    }
  } catch (const Error& err) {
    fail(err.code(), fmt::format("segment '{}': cannot take its memory back ({}); a read-write holder or its owner "
                                 "can",
                                 req.name, err.what()));
    return;
  }
  SegmentRecord seg;
  seg.id = m_next_id++;
  seg.attributes() = e;
  if (seg.flags != 0) {
    ErrorCode code{};
    if (auto why = map_control(seg, memory.get(), false, code); !why.empty()) {
      fail(code, std::move(why));
      return;
    }
  }
  seg.memory = std::move(memory);
  seg.refs[caller.conn] = 1;
  if (req.access == proto::Access::ReadWrite) seg.writers.insert(caller.conn);
  m_restore.erase(r);
  auto& stored = link(std::move(seg));
  GPUIPC_LOG_INFO("segment '{}' ({}) given back by pid {} after the broker restart: id {}", stored.name,
                  human_bytes(stored.size), caller.creds.pid, stored.id);
  out.push_back(reply(caller.conn, rid, proto::OpenReply{info_of(stored)}));
  wake_waiting(stored, out);
}

void Registry::rejoin(const Caller& caller, std::uint32_t rid, const proto::Rejoin& req, std::vector<Outgoing>& out) {
  auto it = m_segments.find(req.id);
  std::string why;
  const Joined joined{req.member, req.token, static_cast<proto::Role>(req.role)};
  if (it == m_segments.end() || it->second.writers.count(caller.conn) == 0 || !it->second.control) {
    why = "this connection holds no read-write reference to that control block";
  } else {
    why = check_rejoin(it->second.block, joined);
  }
  if (!why.empty()) {
    out.push_back(reply(caller.conn, rid,
                         error_reply(rid, ErrorCode::InvalidArgument,
                                     fmt::format("Rejoin of member {} of segment id {}: {}", req.member, req.id, why))
                             .body));
    return;
  }
  it->second.joined.emplace(caller.conn, joined);
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
}

}  // namespace gpuipc::broker
