// Who holds a name and whether it is alive: Holders, Watch and the Events sent to watchers, heartbeats and their
// deadlines (docs/liveness.md). Part of the Registry (registry.hpp).
#include <fmt/format.h>

#include <algorithm>

#include "broker/registry.hpp"
#include "os/process.hpp"

namespace gpuipc::broker {

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
  if (seg.watchers.empty() || seg.lookers.count(conn) != 0) return;  // a look is no holder
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

void Registry::report_death(const SegmentRecord& seg, ConnId conn, std::vector<Outgoing>& out) {
  if (seg.watchers.empty() || seg.lookers.count(conn) != 0) return;
  auto gone = holder_of(seg, conn);
  gone.references = 0;  // as Left: the holder after the change
  // A connection can close while its process lives on (the broker cut it, its library dropped it): its library
  // reconnects at once and gives its segments back. Told at once, watchers took a live process for dead (and a
  // supervisor restarted it). A killed process's connection closes before it exits: told at its exit.
  const auto c = m_connections.find(conn);
  if (m_rejoin_grace_ns > 0 && c != m_connections.end() && c->second.creds.pid > 0) {
    ProcessWatch process = watch_process(c->second.creds.pid, process_start_of(conn), c->second.creds.uid);
    if (process && !exited(process)) {
      const std::int64_t now = os::monotonic_ns();
      try {
        m_pending_deaths.push_back(PendingDeath{seg.id, gone, std::move(process), now + m_rejoin_grace_ns});
        m_deaths_interval_ns = kExitingLookNs;
        m_deaths_check_ns =
            m_pending_deaths.size() == 1 ? now + kExitingLookNs : std::min(m_deaths_check_ns, now + kExitingLookNs);
        return;
      } catch (const std::bad_alloc&) {  // NOLINT(bugprone-empty-catch): told now, as before
      }
    }
  }
  notify(seg, proto::EventKind::Died, gone, conn, out);
}

void Registry::report_pending_deaths(std::int64_t now_ns, std::vector<Outgoing>& out) {
  if (m_pending_deaths.empty() || now_ns < m_deaths_check_ns) return;
  bool any = false;
  std::erase_if(m_pending_deaths, [&](const PendingDeath& d) {
    const auto seg = m_segments.find(d.id);
    if (seg == m_segments.end()) return true;  // gone, and its watchers with it
    if (!exited(d.process) && now_ns < d.report_by_ns) return false;
    notify(seg->second, proto::EventKind::Died, d.holder, 0, out);
    any = true;
    return true;
  });
  m_deaths_interval_ns = any ? kExitingLookNs : std::min(2 * m_deaths_interval_ns, kExitingLookMaxNs);
  m_deaths_check_ns = now_ns + m_deaths_interval_ns;
}

void Registry::expire_beats(std::int64_t now_ns, std::vector<Outgoing>& out) {
  while (!m_beat_deadlines.empty() && std::get<0>(*m_beat_deadlines.begin()) <= now_ns) {
    const auto [deadline, id, conn] = *m_beat_deadlines.begin();
    m_beat_deadlines.erase(m_beat_deadlines.begin());
    auto seg = m_segments.find(id);
    if (seg == m_segments.end()) continue;
    auto b = seg->second.beats.find(conn);
    if (b == seg->second.beats.end() || b->second.hung || b->second.deadline_ns != deadline) continue;
    b->second.hung = true;
    notify(seg->second, proto::EventKind::Hung, holder_of(seg->second, conn), conn, out);
  }
}

void Registry::drop_beats(SegmentRecord& seg, ConnId conn) noexcept {
  for (auto b = conn == 0 ? seg.beats.begin() : seg.beats.find(conn); b != seg.beats.end();) {
    if (!b->second.hung) m_beat_deadlines.erase({b->second.deadline_ns, seg.id, b->first});
    b = seg.beats.erase(b);
    if (conn != 0) break;
  }
}

void Registry::holders(const Caller& caller, std::uint32_t rid, const proto::Holders& req, std::vector<Outgoing>& out) {
  const SegmentRecord* found = find_visible(caller.creds, req.name);
  if (found == nullptr) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound, fmt::format("no segment named '{}'", req.name)).body));
    return;
  }
  const SegmentRecord& seg = *found;
  proto::HoldersReply r;
  for (const auto& [conn, count] : seg.refs) {
    if (seg.lookers.count(conn) != 0) continue;  // a look is no holder
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
  SegmentRecord* seg = find_visible(caller.creds, req.name);
  if (seg == nullptr) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound,
                                    fmt::format("no segment named '{}' to watch (gpuipc ls lists them)", req.name))
                            .body));
    return;
  }
  auto& info = m_connections[caller.conn];
  constexpr std::size_t kMaxWatched = 64;
  if (info.watching.count(seg->id) == 0 && info.watching.size() >= kMaxWatched) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::QuotaExceeded,
                                    fmt::format("this connection already watches {} names, the most it may; watch "
                                                "'{}' from another connection",
                                                kMaxWatched, req.name))
                            .body));
    return;
  }
  info.watching.insert(seg->id);
  seg->watchers.insert(caller.conn);
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
    drop_beats(seg, caller.conn);
  } else {
    const auto [b, fresh] = seg.beats.try_emplace(caller.conn);
    const bool was_hung = !fresh && b->second.hung;
    if (!fresh && !was_hung) m_beat_deadlines.erase({b->second.deadline_ns, seg.id, caller.conn});
    b->second.deadline_ns = now_ns + static_cast<std::int64_t>(req.deadline_ms) * 1'000'000;
    b->second.ms = req.deadline_ms;
    b->second.hung = false;
    m_beat_deadlines.emplace(b->second.deadline_ns, seg.id, caller.conn);
    if (was_hung) notify(seg, proto::EventKind::Alive, holder_of(seg, caller.conn), caller.conn, out);
  }
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
}

}  // namespace gpuipc::broker
