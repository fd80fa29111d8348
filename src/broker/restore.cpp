// After a broker restart: names come back from the journal (journal.hpp) when a process that still maps their
// memory announces it, with the owner and mode the journal recorded; memberships come back when their holders
// rejoin. What cannot be proven is refused: a host segment is the same file or nothing; a device segment (whose
// fd carries no identity) only from its owner or root.
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "base/format.hpp"
#include "base/log.hpp"
#include "broker/registry.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"

namespace gpuipc::broker {
namespace {

bool host_kind(proto::Kind k) { return k == proto::Kind::Host || k == proto::Kind::HostPinned; }

}  // namespace

std::string shown(const SegmentRecord& seg) {
  return seg.name.empty() ? fmt::format("unlinked {}", seg.unlinked_key) : seg.name;
}

void Registry::open_journal(const std::string& path, std::int64_t now_ns, std::int64_t grace_ns) {
  JournalState state;
  m_journal = Journal::open(path, state);
  for (auto& m : state.members) {
    std::string name = m.name;
    m_restore_members[name].push_back(std::move(m));
  }
  for (auto& o : state.owed) {
    std::string name = o.name;
    m_restore_owed[name] = std::move(o);
  }
  for (auto& e : state.linked) {
    GPUIPC_LOG_INFO("{} '{}' was {} when the last broker stopped: waiting {} ms for a holder to announce it",
                    is_unlinked_key(e.name) ? "control block" : "segment", e.name,
                    is_unlinked_key(e.name) ? "unlinked but held" : "linked", grace_ns / 1'000'000);
    std::string name = e.name;
    m_restore[name] = Restore{std::move(e), now_ns + grace_ns};
  }
}

namespace {

/// The journal's entry for a linked segment, or nothing when it does not go in the journal (a segment whose file
/// cannot be told later is not promised back). A device_ipc share is its record's memfd and its exporter's process:
/// a broker started after this one died gives the name back while that process lives, and ends the share once it
/// has exited.
std::optional<JournalEntry> journal_entry_of(const SegmentRecord& seg) noexcept {
  if (seg.journal_name().empty()) return std::nullopt;
  JournalEntry e;
  try {
    e.attributes() = seg;
    e.name = seg.journal_name();
    if (host_kind(seg.kind) || seg.kind == proto::Kind::DeviceIpc) {
      const auto id = os::file_id(seg.memory.get());
      e.file_dev = id.dev;
      e.file_ino = id.ino;
    }
    e.exporter_pid = seg.exporter_pid;
    e.exporter_start = seg.exporter_start;
  } catch (...) {
    return std::nullopt;
  }
  return e;
}

}  // namespace

void Registry::journal_linked(const SegmentRecord& seg) noexcept {
  if (!m_journal) return;
  if (auto e = journal_entry_of(seg)) m_journal.linked(*e);
}

std::uint64_t Registry::process_start_of(ConnId conn) noexcept {
  const auto c = m_connections.find(conn);
  if (c == m_connections.end()) return 0;
  if (!c->second.start) c->second.start = os::process_start_ticks(c->second.creds.pid);  // once a connection
  return *c->second.start;
}

void Registry::journal_joined(const SegmentRecord& seg, Joined& member, ConnId conn) noexcept {
  if (auto c = m_connections.find(conn); c != m_connections.end()) {
    member.pid = c->second.creds.pid;
    member.start = process_start_of(conn);
  }
  if (!m_journal || seg.journal_name().empty()) return;
  try {
    m_journal.joined(JournalMember{seg.journal_name(), member.member, member.token,
                                   static_cast<std::uint32_t>(member.role), member.pid, member.start});
  } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory copying the name: not journaled
  }
}

std::string Registry::journal_lines(const SegmentRecord& seg) const {
  const auto e = journal_entry_of(seg);
  if (!e) return {};
  std::string text = journal_line(*e) + "\n";
  auto members = [&](const Joined& j, bool left) {
    text += journal_member_line(
                JournalMember{e->name, j.member, j.token, static_cast<std::uint32_t>(j.role), j.pid, j.start, left}) +
            "\n";
  };
  for (const auto& [conn, j] : seg.joined) members(j, false);
  for (const auto& u : seg.unclaimed) members(u.joined, false);
  for (const auto& u : seg.exiting) members(u.joined, u.left);
  return text + journal_owed_lines(owed_of(seg));
}

void Registry::journal_unlinked(SegmentRecord& seg, const std::string& name) noexcept {
  // Its holders keep using it (a common way: unlink once everyone has opened it, so that no name outlives them), and
  // after a broker restart their watchers give it back by its fd: what the journal knows of it moves to its file's
  // identity. Its lines go in before the name's removal, so that a broker killed between the two writes loses nothing.
  // A device_ipc share too: its exporter's death must still reach its openers, and an exporter whose connection
  // closed while it ran (exporter_away) gives it back by its record's identity, having no name to give.
  const bool kept = seg.control && (host_kind(seg.kind) || seg.kind == proto::Kind::DeviceIpc) &&
                    (!seg.refs.empty() || seg.exporter_away);
  if (kept) {
    try {
      const auto id = os::file_id(seg.memory.get());
      std::string key = unlinked_key(id.dev, id.ino);
      if (m_unlinked_keys.emplace(key, seg.id).second) {
        seg.unlinked_key = std::move(key);
        if (m_journal) m_journal.record(journal_lines(seg));
      }
    } catch (const std::exception& e) {
      GPUIPC_LOG_WARN("{} '{}' (id {}) unlinked while held: not journaled ({}); a broker restart loses it",
                      seg.kind == proto::Kind::DeviceIpc ? "share" : "control block", name, seg.id, e.what());
    }
  }
  m_journal.unlinked(name);
}

void Registry::drop_restore(const std::string& name, bool keep) {
  auto r = m_restore.find(name);
  if (r == m_restore.end()) return;
  Restore kept = std::move(r->second);
  m_restore.erase(r);
  std::vector<JournalMember> members;
  if (auto m = m_restore_members.find(name); m != m_restore_members.end()) {
    members = std::move(m->second);
    m_restore_members.erase(m);
  }
  JournalOwed owed;
  if (auto o = m_restore_owed.find(name); o != m_restore_owed.end()) {
    owed = std::move(o->second);
    m_restore_owed.erase(o);
  }
  const JournalEntry& e = kept.entry;
  if (keep && m_journal && ((e.flags != 0 && host_kind(e.kind)) || e.kind == proto::Kind::DeviceIpc) &&
      !is_unlinked_key(name)) {
    std::string key = unlinked_key(e.file_dev, e.file_ino);
    if (m_restore.count(key) == 0 && m_unlinked_keys.count(key) == 0) {
      kept.entry.name = key;
      std::string text = journal_line(kept.entry) + "\n";
      for (auto& m : members) {
        m.name = key;
        text += journal_member_line(m) + "\n";
      }
      owed.name = key;
      text += journal_owed_lines(owed);
      m_journal.record(text);
      if (!members.empty()) m_restore_members[key] = std::move(members);
      if (!owed.writes.empty()) m_restore_owed[key] = std::move(owed);
      m_restore[key] = std::move(kept);
    }
  }
  // (A key of a file gone and its inode reused by a live block unlinked since: the live one's lines stay.)
  if (!is_unlinked_key(name) || m_unlinked_keys.count(name) == 0) m_journal.unlinked(name);
}

void Registry::maybe_compact_journal() noexcept {
  if (!m_journal.wants_compaction()) return;
  try {
    std::string text;
    for (const auto& [id, seg] : m_segments) text += journal_lines(seg);
    for (const auto& [name, r] : m_restore) {
      text += journal_line(r.entry) + "\n";
      if (auto m = m_restore_members.find(name); m != m_restore_members.end()) {
        for (const auto& jm : m->second) text += journal_member_line(jm) + "\n";
      }
      if (auto o = m_restore_owed.find(name); o != m_restore_owed.end()) text += journal_owed_lines(o->second);
    }
    m_journal.rewrite(text);
  } catch (const std::exception& e) {
    GPUIPC_LOG_WARN("names journal: cannot compact it: {}", e.what());
  }
}

namespace {

/// Whether the process of an unclaimed member entry is gone: its watch says it exited, or (without one) its
/// pid names no process, or another one than the journal's (a later start).
bool process_gone(const SegmentRecord::Unclaimed& u) {
  if (u.process) return exited(u.process);
  if (u.joined.pid <= 0) return false;  // not visible to this broker: wait for its Rejoin
  if (u.joined.start == 0) return !os::process_alive(u.joined.pid);
  return os::process_start_ticks(u.joined.pid) != u.joined.start;
}

}  // namespace

void Registry::repair_gone(SegmentRecord& seg, const Joined& member) {
  GPUIPC_LOG_INFO("member {} of '{}' (pid {}) died while no broker watched it: repairing it after the broker restart",
                  member.member, shown(seg), member.pid);
  // Its process has exited, so its GPU work has too: what its stream owed is written as the turns come (no process
  // to wait for).
  repair_member(seg, member);
}

void Registry::restore_owed(SegmentRecord& seg) {
  auto it = m_restore_owed.find(seg.journal_name());
  if (it == m_restore_owed.end()) return;
  const JournalOwed o = std::move(it->second);
  m_restore_owed.erase(it);
  if (!seg.control || (seg.flags & proto::kFlagChannel) == 0) return;
  for (const auto& [pid, start] : o.processes) {
    // As when the last broker took the writes: none is made before these processes have exited. One gone, a pid
    // another process has now, or one whose start the last broker did not know (it could be another process by now,
    // which would hold the writes back for as long as it runs) is not waited for.
    if (start == 0) continue;
    if (auto process = watch_process(static_cast<pid_t>(pid), start, seg.owner_uid);
        process && std::find(seg.block.dying.begin(), seg.block.dying.end(), process) == seg.block.dying.end()) {
      seg.block.dying.push_back(std::move(process));
    }
  }
  seg.block.owed.insert(seg.block.owed.end(), o.writes.begin(), o.writes.end());
  reserve_owed(seg.block);
  if (settle_owed(seg.block)) {
    GPUIPC_LOG_INFO(
        "channel '{}': {} stream writes dead members owed when the last broker died are made as their "
        "turns come",
        shown(seg), seg.block.owed.size());
  }
  watch_owed(seg);
}

void Registry::adopt_unclaimed(SegmentRecord& seg) {
  auto it = m_restore_members.find(seg.journal_name());
  if (it == m_restore_members.end()) return;
  const std::vector<JournalMember> members = std::move(it->second);
  m_restore_members.erase(it);
  bool watch = false;
  for (const auto& m : members) {
    SegmentRecord::Unclaimed u{
        Joined{m.member, m.token, static_cast<proto::Role>(m.role), static_cast<pid_t>(m.pid), m.start}, {}};
    if (!check_rejoin(seg.block, u.joined).empty()) {
      m_journal.left(seg.journal_name(), m.member, m.token);  // it left (cleanly) while no broker watched
      continue;
    }
    u.process = watch_process(u.joined.pid, u.joined.start, seg.owner_uid);  // none: process_gone tells
    if (process_gone(u)) {
      repair_gone(seg, u.joined);
      continue;
    }
    if (m.left && (seg.flags & proto::kFlagPool) != 0 && u.process) {
      // It left owing stream frees: removed once they have landed or its process has exited, as before the restart.
      u.left = true;
      repair_later(seg, std::move(u));
      continue;
    }
    if (u.joined.pid > 0) {
      watch = true;
      GPUIPC_LOG_INFO(
          "member {} of '{}' (pid {}) has not rejoined after the broker restart: repaired if its process "
          "exits first",
          m.member, shown(seg), m.pid);
    } else {
      GPUIPC_LOG_INFO(
          "member {} of '{}' (a process this broker cannot see) has not rejoined after the broker "
          "restart: it is not repaired unless it rejoins",
          m.member, shown(seg));
    }
    seg.unclaimed.push_back(std::move(u));
  }
  if (watch && m_unclaimed.insert(seg.id).second && m_unclaimed.size() == 1) {
    m_unclaimed_check_ns = os::monotonic_ns() + kUnclaimedLookNs;
  }
}

void Registry::repair_unclaimed(std::int64_t now_ns) {
  if (m_unclaimed.empty() || now_ns < m_unclaimed_check_ns) return;
  for (auto it = m_unclaimed.begin(); it != m_unclaimed.end();) {
    auto s = m_segments.find(*it);
    if (s == m_segments.end()) {
      it = m_unclaimed.erase(it);
      continue;
    }
    auto& seg = s->second;
    std::vector<Joined> gone;
    std::erase_if(seg.unclaimed, [&](const SegmentRecord::Unclaimed& u) {
      if (!process_gone(u)) return false;
      gone.push_back(u.joined);
      return true;
    });
    for (const auto& j : gone) repair_gone(seg, j);
    const bool watched =
        std::any_of(seg.unclaimed.begin(), seg.unclaimed.end(), [](const auto& u) { return u.joined.pid > 0; });
    it = watched ? std::next(it) : m_unclaimed.erase(it);
  }
  m_unclaimed_check_ns = now_ns + kUnclaimedLookNs;
}

void Registry::expire_restores(std::int64_t now_ns) {
  for (auto it = m_restore.begin(); it != m_restore.end();) {
    if (it->second.deadline_ns > now_ns) {
      ++it;
      continue;
    }
    GPUIPC_LOG_INFO("{} '{}': nobody announced it after the broker restart; {}",
                    is_unlinked_key(it->first) ? "unlinked control block" : "segment", it->first,
                    is_unlinked_key(it->first) ? "the journal forgets it" : "the name is gone");
    const std::string name = it->first;
    ++it;
    drop_restore(name, false);
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
  // A control block unlinked while held comes back by its file's identity (whatever its old name stands for now):
  // `key` is what the journal (or the broker, once one holder gave it back) knows it by; else the name.
  std::string key;
  try {
    const auto id = os::file_id(fd);
    key = unlinked_key(id.dev, id.ino);
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): no identity: announced by its name
  }
  if (m_unlinked_keys.count(key) == 0 && m_restore.count(key) == 0) key = req.name;
  const bool unlinked = key != req.name;
  // Already given back by another holder: the same memory gets a reference too.
  const auto live = unlinked ? m_unlinked_keys.find(key) : m_names.find(req.name);
  if (live != (unlinked ? m_unlinked_keys.end() : m_names.end())) {
    auto& seg = m_segments.at(live->second);
    bool same = false;
    try {
      // A device_ipc share's memory is its record's memfd (the exporter's, and each opener's read-only copy).
      same = host_kind(seg.kind) || seg.kind == proto::Kind::DeviceIpc
                 ? os::file_id(fd) == os::file_id(seg.memory.get())
                 : seg.kind == proto::Kind::Device && os::is_nvidia_export(fd) && seg.size == req.size;
    } catch (const Error&) {
    }
    // The exporter of a device_ipc share whose connection closed while it ran, back on a new one: the share is its
    // own again (whatever the mode says of writing, as at its Create).
    const bool exporter =
        same && seg.exporter_away && seg.exporter_away->pid == caller.creds.pid && !exited(seg.exporter_away->process);
    if (!same ||
        (!exporter && (permission_bits(caller.creds, seg.mode, seg.owner_uid, seg.owner_gid) & need) != need)) {
      fail(ErrorCode::AlreadyExists,
           fmt::format("segment '{}' names other memory now (or you may not hold it): yours stays mapped, unnamed",
                       req.name));
      return;
    }
    if (auto why = reference_refusal(seg, caller.conn); !why.empty()) {  // as an Open's
      fail(ErrorCode::QuotaExceeded, std::move(why));
      return;
    }
    if (++seg.refs[caller.conn] == 1) note_holding(caller.conn, seg.id, true);
    if (req.access == proto::Access::ReadWrite) seg.writers.insert(caller.conn);
    // A holder whose connection closed while it ran, back: its watchers are told nothing (it did not die).
    std::erase_if(m_pending_deaths, [&](const PendingDeath& d) {
      return d.id == seg.id && d.holder.pid == static_cast<std::uint32_t>(caller.creds.pid) && !exited(d.process);
    });
    if (exporter) {
      GPUIPC_LOG_INFO("segment '{}' id {}: its exporter (pid {}) announced it again on a new connection", shown(seg),
                      seg.id, caller.creds.pid);
      seg.exporter_away.reset();
      seg.creator = caller.conn;
    }
    out.push_back(reply(caller.conn, rid, proto::OpenReply{info_of(seg)}));
    return;
  }
  auto r = m_restore.find(key);
  if (r == m_restore.end()) {
    fail(ErrorCode::NotFound, fmt::format("no segment named '{}' to give back: it was not linked when the previous "
                                          "broker died (or it was unlinked, or its time ran out)",
                                          req.name));
    return;
  }
  const JournalEntry& e = r->second.entry;
  if (auto why = opens_refusal(caller.conn, req.name); !why.empty()) {  // as an Open's
    fail(ErrorCode::QuotaExceeded, std::move(why));
    return;
  }
  // A device_ipc share's exporter (the process the journal names: its pid and its start) holds it as at its Create,
  // whatever the mode says of writing. A start the broker could not read (0) does not tell that process from a later
  // one given its pid: then only one of the owner's uid (the exporter's, at its Create) is taken for it.
  const bool exporter =
      e.kind == proto::Kind::DeviceIpc && e.exporter_pid > 0 && caller.creds.pid == e.exporter_pid &&
      (e.exporter_start != 0 ? process_start_of(caller.conn) == e.exporter_start : caller.creds.uid == e.owner_uid);
  if (!exporter && (permission_bits(caller.creds, e.mode, e.owner_uid, e.owner_gid) & need) != need) {
    fail(ErrorCode::PermissionDenied, fmt::format("segment '{}' is mode {:04o} owned by uid {}: you may not hold it "
                                                  "as announced",
                                                  req.name, e.mode, e.owner_uid));
    return;
  }
  os::UniqueFd memory;
  os::Mapping record;
  try {
    if (host_kind(e.kind)) {
      if (os::file_id(fd) != os::FileId{e.file_dev, e.file_ino}) {
        fail(ErrorCode::InvalidArgument, fmt::format("segment '{}': that fd is not its memory", req.name));
        return;
      }
      // A read-only description (a read-only holder's, or one sent as read-write) would let no later opener
      // write: the broker keeps a writable one of its own.
      memory = os::reopen_readwrite(fd);
    } else if (e.kind == proto::Kind::Device) {
      // A driver export carries no identity: only the owner (or root) may say which memory the name is.
      if (!os::is_nvidia_export(fd) || req.size != e.size || (caller.creds.uid != 0 && caller.creds.uid != e.owner_uid)) {
        fail(ErrorCode::PermissionDenied,
             fmt::format("segment '{}' is device memory: only its owner (uid {}) or root can give its name back",
                         req.name, e.owner_uid));
        return;
      }
      memory = std::move(fds[0]);
    } else if (e.kind == proto::Kind::DeviceIpc) {
      if (os::file_id(fd) != os::FileId{e.file_dev, e.file_ino}) {
        fail(ErrorCode::InvalidArgument, fmt::format("segment '{}': that fd is not its device_ipc record", req.name));
        return;
      }
      // Openers hold a read-only description; the broker writes exporter_gone into the record when the share ends.
      memory = os::reopen_readwrite(fd);
      if (os::fd_size(memory.get()) != proto::kDeviceIpcRecordBytes) {  // sealed at its Create: cannot differ
        fail(ErrorCode::InvalidArgument,
             fmt::format("segment '{}': its record is not {} bytes", req.name, proto::kDeviceIpcRecordBytes));
        return;
      }
      record = os::Mapping::map(memory.get(), proto::kDeviceIpcRecordBytes, true);
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
  if (unlinked) {
    seg.name.clear();
    seg.unlinked_key = key;
  }
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
  if (record) {
    seg.control = std::move(record);
    seg.exporter_pid = static_cast<pid_t>(e.exporter_pid);
    seg.exporter_start = e.exporter_start;
    if (exporter) seg.creator = caller.conn;
  }
  m_restore.erase(r);
  auto& stored = link(std::move(seg));
  note_holding(caller.conn, stored.id, true);
  if (stored.control && stored.flags != 0) {
    restore_owed(stored);
    adopt_unclaimed(stored);
  }
  GPUIPC_LOG_INFO("segment '{}' ({}) given back by pid {} after the broker restart: id {}", shown(stored),
                  human_bytes(stored.size), caller.creds.pid, stored.id);
  // An opener gave a device_ipc share back before its exporter did: the share waits for the exporter as after a
  // lost connection, or ends now if its process has exited meanwhile (nobody was there to tell its openers).
  if (stored.kind == proto::Kind::DeviceIpc && !exporter && !await_exporter(stored)) {
    exporter_left(stored, proto::PoisonReason::PeerDied);
  }
  out.push_back(reply(caller.conn, rid, proto::OpenReply{info_of(stored)}));
  if (!unlinked && !stored.name.empty()) wake_waiting(stored, out);
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
  const auto same = [&](const Joined& j) { return j.member == joined.member && j.token == joined.token; };
  if (why.empty()) {
    // A connection's entry is not taken again: by that connection, a second record (a journal line, a repair at
    // close, each time); by another, a takeover. An entry waiting for its process to exit (its connection closed,
    // or it left owing frees) comes back only to that process, and then waits no more: Leave and Rejoin in a loop
    // added a wait (a pidfd, a look at the pool's records) each time.
    const auto& seg = it->second;
    if (std::any_of(seg.joined.begin(), seg.joined.end(), [&](const auto& e) { return same(e.second); })) {
      why = "a connection holds that entry already";
    } else if (std::any_of(seg.exiting.begin(), seg.exiting.end(), [&](const SegmentRecord::Unclaimed& u) {
                 // Its process's pid, and that process still running: one that has exited (its repair not made yet,
                 // at the next look) may have left its pid to another process by now.
                 return same(u.joined) && (u.joined.pid != caller.creds.pid || exited(u.process));
               })) {
      why = "that entry is another process's, removed once it has exited";
    } else if (std::any_of(seg.unclaimed.begin(), seg.unclaimed.end(), [&](const SegmentRecord::Unclaimed& u) {
                 // The journal names its process: only that process takes it back (any read-write holder can read a
                 // token; one that took another's entry kept its owner from rejoining, and its death from repair).
                 return same(u.joined) && u.joined.pid != 0 && u.joined.pid != caller.creds.pid;
               })) {
      why = "the journal gives that entry to another process";
    }
  }
  if (!why.empty()) {
    out.push_back(reply(caller.conn, rid,
                         error_reply(rid, ErrorCode::InvalidArgument,
                                     fmt::format("Rejoin of member {} of segment id {}: {}", req.member, req.id, why))
                             .body));
    return;
  }
  auto& seg = it->second;
  std::erase_if(seg.unclaimed, [&](const SegmentRecord::Unclaimed& u) { return same(u.joined); });
  std::erase_if(seg.exiting, [&](const SegmentRecord::Unclaimed& u) { return same(u.joined); });
  auto& stored = seg.joined.emplace(caller.conn, joined)->second;
  journal_joined(seg, stored, caller.conn);
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
}

}  // namespace gpuipc::broker
