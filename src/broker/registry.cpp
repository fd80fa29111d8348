// The Registry's own state: the status page, connections, the request dispatch, Create, Close, Unlink and Join,
// quotas, and the end of a segment. Opens, stat and list live in access.cpp, holders and heartbeats in holders.cpp,
// what comes back after a broker restart in restore.cpp.
#include "broker/registry.hpp"

#include <fcntl.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "base/format.hpp"
#include "base/log.hpp"
#include "os/identity.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"
#include "proto/shm.hpp"
#include "proto/status_page.hpp"
#include "shm/pool_block.hpp"

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

}  // namespace

std::uint64_t unix_now_ns() noexcept {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
}

Outgoing reply(ConnId conn, std::uint32_t rid, proto::Body body, os::UniqueFd fd) {
  Outgoing o;
  o.conn = conn;
  o.msg.request_id = rid;
  o.msg.body = std::move(body);
  o.fd = std::move(fd);
  return o;
}

std::uint32_t SegmentRecord::total_refs() const noexcept {
  std::uint64_t n = 0;  // (saturated: 8192 connections at their cap would wrap a u32)
  for (const auto& [conn, count] : refs) n += count;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(n, UINT32_MAX));
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
  page->features = proto::kFeatureUnlinkId | proto::kFeatureLook;
  page->broker_pid = static_cast<std::uint64_t>(os::current_pid());
  std::atomic_ref<std::uint64_t>(page->names_generation).store(1, std::memory_order_release);
}

void Registry::describe_broker(proto::BrokerMode mode, std::uint64_t idle_timeout_ms) noexcept {
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  page->mode = static_cast<std::uint32_t>(mode);
  page->started_unix_ns = unix_now_ns();
  page->idle_timeout_ms = idle_timeout_ms;
}

void Registry::mark_stopping() noexcept {
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  std::atomic_ref<std::uint32_t>(page->stopping).store(1, std::memory_order_release);
}

void Registry::bump_names_generation() noexcept {
  auto* page = static_cast<proto::StatusPage*>(m_status_map.data());
  std::atomic_ref<std::uint64_t>(page->names_generation).fetch_add(1, std::memory_order_release);
}

void Registry::add_connection(ConnId conn, const os::Credentials& creds) {
  auto& uid = m_uid_opens[creds.uid];
  try {
    ConnectionInfo info;
    info.creds = creds;
    info.uid = &uid;  // (a node's address: stable while it is in the map)
    m_connections[conn] = std::move(info);
  } catch (...) {
    if (uid.connections == 0) m_uid_opens.erase(creds.uid);
    throw;
  }
  ++uid.connections;
}

void Registry::repair_for(SegmentRecord& seg, ConnId conn, bool lost) {
  seg.writers.erase(conn);
  auto [first, last] = seg.joined.equal_range(conn);
  const auto c = m_connections.find(conn);
  const pid_t pid = c == m_connections.end() ? 0 : c->second.creds.pid;
  for (auto it = first; it != last; ++it) {
    // Its process, while it runs (the same watch for all its entries, and for its other connections).
    const ProcessWatch process =
        pid > 0 ? watch_process(pid, it->second.pid == pid ? it->second.start : 0, c->second.creds.uid) : nullptr;
    if (process && seg.control && !exited(process)) {
      // A member killed while its stream may still write memory it held (a channel slot it claimed, pool blocks):
      // that memory goes to the next user only once the process has exited (its contexts torn down).
      if (const auto holding = repair_waits_for_exit(seg.block, it->second); !holding.empty()) {
        GPUIPC_LOG_INFO("'{}': member {} (pid {}) is gone holding {}: repaired once its process has exited", shown(seg),
                        it->second.member, pid, holding);
        repair_later(seg, SegmentRecord::Unclaimed{it->second, process});
        continue;
      }
      // A connection can close while its process lives on: the broker cut it (it read no replies, a request failed),
      // or its library dropped it (the broker left its requests unanswered). Repaired at once, its entry would be
      // taken from a process still using it: a counting semaphore's permits given to another while it holds them, a
      // semaphore poisoned while its signaller runs, a consumer's messages handed to another while it reads them.
      // Its library reconnects at once and rejoins; a process that exec'd (the connection closes, the pid lives on)
      // never does, and is repaired when the grace runs out. A killed process is repaired once it has exited, which
      // is also when its GPU work has stopped writing.
      if (lost && m_rejoin_grace_ns > 0 && check_rejoin(seg.block, it->second).empty()) {
        GPUIPC_LOG_INFO(
            "'{}': member {} (pid {}) lost its connection before its process exited: repaired once it exits, or in "
            "{} ms unless it rejoins",
            shown(seg), it->second.member, pid, m_rejoin_grace_ns / 1'000'000);
        SegmentRecord::Unclaimed u{it->second, process};
        u.rejoin_by_ns = os::monotonic_ns() + m_rejoin_grace_ns;
        repair_later(seg, std::move(u));
        continue;
      }
    }
    repair_member(seg, it->second, process);
  }
  seg.joined.erase(first, last);
}

void Registry::repair_later(SegmentRecord& seg, SegmentRecord::Unclaimed u) {
  if (u.left) {
    m_frees_interval_ns = kExitingLookNs;
    m_frees_check_ns = os::monotonic_ns() + kExitingLookNs;
  }
  seg.exiting.push_back(std::move(u));
  look_at_exiting_soon(seg);
}

void Registry::look_at_exiting_soon(const SegmentRecord& seg) {
  const std::int64_t soon = os::monotonic_ns() + kExitingLookNs;
  const bool first = m_exiting.insert(seg.id).second && m_exiting.size() == 1;
  m_exiting_check_ns = first ? soon : std::min(m_exiting_check_ns, soon);
  m_exiting_interval_ns = kExitingLookNs;
}

void Registry::repair_exited(std::int64_t now_ns) {
  if (m_exiting.empty() || now_ns < m_exiting_check_ns) return;
  const bool look_at_frees = now_ns >= m_frees_check_ns;
  bool any_landed = false;
  bool any_gone = false;
  bool any_left = false;  // pool members that left owing frees wait on
  std::vector<std::uint64_t> ended;  // device_ipc shares whose exporter is gone: maybe_destroy after the loop
  for (auto it = m_exiting.begin(); it != m_exiting.end();) {
    auto s = m_segments.find(*it);
    if (s == m_segments.end()) {
      it = m_exiting.erase(it);
      continue;
    }
    auto& seg = s->second;
    if (exporter_back_or_gone(seg, now_ns)) {
      any_gone = true;
      ended.push_back(seg.id);
    }
    std::vector<std::pair<Joined, ProcessWatch>> gone;
    std::optional<std::uint64_t> pending;  // one pass over the pool's records for all its leavers
    std::erase_if(seg.exiting, [&](const SegmentRecord::Unclaimed& u) {
      bool landed = false;
      if (u.left && seg.control && look_at_frees) {
        if (!pending) pending = shm::pool_members_with_frees_pending(seg.block.data, seg.block.size);
        landed = u.joined.member < proto::kMaxMembers && (*pending & (std::uint64_t{1} << u.joined.member)) == 0;
        any_landed = any_landed || landed;
      }
      const bool exited_now = exited(u.process);
      const bool grace_over = u.rejoin_by_ns != 0 && now_ns >= u.rejoin_by_ns;
      if (!landed && !exited_now && !grace_over) {
        any_left = any_left || u.left;
        return false;
      }
      if (!exited_now && grace_over) {
        GPUIPC_LOG_INFO(
            "'{}': member {} (pid {}) has neither rejoined nor exited within {} ms of losing its connection (it may "
            "have exec'd): repaired as if it had died",
            shown(seg), u.joined.member, u.process ? u.process->pid : 0, m_rejoin_grace_ns / 1'000'000);
      }
      // An exited process's GPU work has stopped too; a live one's stream may still make what it owes: the broker
      // makes those writes once it exits.
      gone.emplace_back(u.joined, exited_now ? nullptr : u.process);
      return true;
    });
    any_gone = any_gone || !gone.empty();
    for (const auto& [j, process] : gone) repair_member(seg, j, process);  // exited, frees landed, or grace over
    it = seg.exiting.empty() && !seg.exporter_away ? m_exiting.erase(it) : std::next(it);
  }
  for (const std::uint64_t id : ended) maybe_destroy(id);
  if (look_at_frees) {
    m_frees_interval_ns = any_landed ? kExitingLookNs : std::min(2 * m_frees_interval_ns, kFreesLookMaxNs);
    m_frees_check_ns = now_ns + m_frees_interval_ns;
  }
  // Every 1 ms while processes exit, backing off to 32 ms while none does: each pass looks at every entry (one uid
  // may have thousands waiting), and a killed process exits within milliseconds.
  m_exiting_interval_ns = any_gone ? kExitingLookNs : std::min(2 * m_exiting_interval_ns, kExitingLookMaxNs);
  m_exiting_check_ns = now_ns + m_exiting_interval_ns;
  if (any_left) m_exiting_check_ns = std::min(m_exiting_check_ns, m_frees_check_ns);
}

ProcessWatch Registry::watch_process(pid_t pid, std::uint64_t start, uid_t uid) noexcept {
  const auto segments = m_segments_per_uid.find(uid);
  const std::uint64_t used = segments == m_segments_per_uid.end() ? 0 : segments->second;
  return m_exits.watch(pid, start, uid, static_cast<std::size_t>(fds_per_uid() - std::min(used, fds_per_uid())));
}

void Registry::repair_member(SegmentRecord& seg, const Joined& member, const ProcessWatch& process) {
  std::vector<proto::OwedWrite> kept;
  limit_owed(seg);
  const bool removed = seg.control && remove_member(seg.block, member, process, &kept);
  if (seg.journal_name().empty()) return;
  // What is still owed goes into the journal before the entry's "left" line: a broker killed from here on leaves
  // the next one the writes to make (repeats are harmless: a write that has landed is skipped).
  if (removed && !seg.block.owed.empty()) journal_owed(seg, std::move(kept), process);
  m_journal.left(seg.journal_name(), member.member, member.token);
  watch_owed(seg);
}

void Registry::journal_owed(const SegmentRecord& seg, std::vector<proto::OwedWrite> writes,
                            const ProcessWatch& process) {
  // Only what this member added: the replay takes the union of a name's lines since the journal's last compaction,
  // which writes them all (owed_of). Each repair wrote every write the channel owed, up to 64 tables' worth (8 MB
  // of lines), however little it added.
  JournalOwed o{seg.journal_name(), std::move(writes), {}};
  if (process && process->pid > 0) o.processes.emplace_back(process->pid, process->start);
  m_journal.owed(o);
}

JournalOwed Registry::owed_of(const SegmentRecord& seg) const {
  JournalOwed o{seg.journal_name(), seg.block.owed, {}};
  for (const auto& d : seg.block.dying) {
    if (d && d->pid > 0) o.processes.emplace_back(d->pid, d->start);
  }
  // A leaver's writes too: a broker started after this one makes them once every process listed has exited.
  for (const auto& l : seg.block.leavers) {
    o.writes.insert(o.writes.end(), l.writes.begin(), l.writes.end());
    if (l.process && l.process->pid > 0) o.processes.emplace_back(l.process->pid, l.process->start);
  }
  return o;
}

void Registry::charge_owed(SegmentRecord& seg) {
  const std::size_t now = owed_kept(seg.block);
  if (now > seg.owed_charged) {
    m_owed_per_uid[seg.owner_uid] += now - seg.owed_charged;  // (bad_alloc: nothing changed)
  } else if (auto it = m_owed_per_uid.find(seg.owner_uid); it != m_owed_per_uid.end()) {
    it->second -= std::min(it->second, seg.owed_charged - now);
    if (it->second == 0) m_owed_per_uid.erase(it);
  }
  seg.owed_charged = now;
}

void Registry::limit_owed(SegmentRecord& seg) noexcept {
  const auto it = m_owed_per_uid.find(seg.owner_uid);
  const std::size_t used = it == m_owed_per_uid.end() ? 0 : it->second;
  const std::size_t room = m_quotas.owed_writes - std::min(used, m_quotas.owed_writes);
  seg.block.most_owed = seg.owed_charged + room;
}

void Registry::watch_owed(SegmentRecord& seg) {
  charge_owed(seg);
  if ((!seg.block.owed.empty() || !seg.block.leavers.empty()) && m_owing.insert(seg.id).second && m_owing.size() == 1) {
    m_owed_interval_ns = kOwedFirstLookNs;
    m_owed_check_ns = os::monotonic_ns() + m_owed_interval_ns;
  }
}

void Registry::settle_owing(std::int64_t now_ns) {
  if (m_owing.empty() || now_ns < m_owed_check_ns) return;
  bool progress = false;
  for (auto it = m_owing.begin(); it != m_owing.end();) {
    auto seg = m_segments.find(*it);
    const std::size_t before = seg == m_segments.end() ? 0 : seg->second.block.owed.size();
    const bool left = seg != m_segments.end() && settle_owed(seg->second.block);
    if (seg != m_segments.end()) charge_owed(seg->second);
    if (!left) {
      progress = true;
      it = m_owing.erase(it);
      continue;
    }
    progress = progress || seg->second.block.owed.size() < before;
    ++it;
  }
  // Soon again while writes land; less often while a survivor's stream keeps a write waiting.
  m_owed_interval_ns = progress ? kOwedFirstLookNs : std::min(m_owed_interval_ns * 2, kOwedLastLookNs);
  m_owed_check_ns = now_ns + m_owed_interval_ns;
}

void Registry::note_holding(ConnId conn, std::uint64_t id, bool holds) noexcept {
  auto c = m_connections.find(conn);
  if (c == m_connections.end()) return;  // (then drop_connection looks at every segment)
  if (c->second.uid != nullptr && holds) {
    ++c->second.held;
    ++c->second.uid->held;
    ++m_opens_held;
  } else if (c->second.uid != nullptr) {
    --c->second.held;
    --c->second.uid->held;
    --m_opens_held;
  }
  try {
    if (holds) {
      c->second.holding.insert(id);
    } else {
      c->second.holding.erase(id);
    }
  } catch (...) {  // out of memory: not indexed; the connection's close then looks at every segment
    c->second.holding_complete = false;
  }
}

std::string Registry::opens_refusal(ConnId conn, const std::string& name) const {
  const auto c = m_connections.find(conn);
  if (c == m_connections.end() || c->second.uid == nullptr) return {};
  if (m_opens_held >= m_quotas.opens_total) {
    return fmt::format(
        "quota exceeded: the processes of every uid hold {} segments open together (each process's counted apart), "
        "the most the broker allows in all (GPUIPC_QUOTA_OPENS_TOTAL); close segments you no longer use before "
        "opening '{}', or ask whoever runs the broker to raise it",
        m_opens_held, name);
  }
  if (c->second.uid->held < m_quotas.opens) return {};
  return fmt::format(
      "quota exceeded: the processes of uid {} hold {} segments open together (each process's counted "
      "apart), the most the broker allows (GPUIPC_QUOTA_OPENS); close segments you no longer use "
      "before opening '{}'",
      c->second.creds.uid, c->second.uid->held, name);
}

void Registry::drop_connection(ConnId conn, bool repair, std::vector<Outgoing>* out) {
  const ExitWatch::Pass pass(m_exits);  // its process is looked at once for all its entries
  // The segments this connection holds or watches, when they are known: a connection's close does not cost the
  // broker a walk over every segment (a loop of connects and closes would keep it busy).
  std::set<std::uint64_t> ids;
  if (const auto info = m_connections.find(conn); info != m_connections.end() && info->second.holding_complete) {
    ids = info->second.holding;
    ids.insert(info->second.watching.begin(), info->second.watching.end());
  } else {
    for (const auto& [id, seg] : m_segments) ids.insert(id);
  }
  std::vector<std::uint64_t> touched;
  for (const std::uint64_t id : ids) {
    auto found = m_segments.find(id);
    if (found == m_segments.end()) continue;
    auto& seg = found->second;
    seg.watchers.erase(conn);
    if (seg.refs.count(conn) != 0) {
      // A connection that goes while holding references: its process exited or was killed without closing them.
      if (out != nullptr && repair) report_death(seg, conn, *out);
      seg.refs.erase(conn);
      seg.lookers.erase(conn);
      drop_beats(seg, conn);
      if (repair) {
        repair_for(seg, conn, true);
      } else {
        seg.writers.erase(conn);
        seg.joined.erase(conn);
      }
      if (seg.creator == conn) {
        // A broker stopping (no repair) says nothing of a creator's death: a device_ipc exporter lives on, and its
        // openers' memory with it. A counting semaphore's grant goes back all the same (nobody else holds it).
        if (repair) {
          if (!await_exporter(seg)) creator_left(seg, proto::PoisonReason::PeerDied);
        } else if (seg.control) {
          creator_gone(seg.block);
        }
      }
      touched.push_back(id);
    }
  }
  for (auto id : touched) maybe_destroy(id);
  if (auto c = m_connections.find(conn); c != m_connections.end()) {
    const std::set<std::uint64_t> pending = std::move(c->second.pending);
    c->second.pending.clear();
    for (auto id : pending) unpark(id);
    if (UidOpens* uid = c->second.uid; uid != nullptr) {
      uid->held -= c->second.held;  // (its references were dropped above, without note_holding)
      m_opens_held -= c->second.held;
      if (--uid->connections == 0) m_uid_opens.erase(c->second.creds.uid);
    }
    m_connections.erase(conn);
  }
}

void Registry::creator_left(SegmentRecord& seg, proto::PoisonReason why) {
  if (seg.control) creator_gone(seg.block);
  exporter_left(seg, why);
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
        } else if constexpr (std::is_same_v<T, proto::UnlinkId>) {
          unlink_id(caller, rid, body, out);
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
        } else if constexpr (std::is_same_v<T, proto::Leave>) {
          leave(caller, rid, body, out);
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

std::string keep_to_owner(int fd) {
  // A read-only opener gets a read-only file description; the inode must not let it reopen the file writable
  // through /proc/self/fd/N, so no access for group or other (gpuipc's library creates memfds 0600).
  auto owner = os::file_owner(fd);
  if ((owner.mode & 077) == 0) return {};
  try {
    os::file_chmod(fd, owner.mode & 0700);
  } catch (const Error&) {
    return fmt::format(
        "the memfd's inode is mode {:04o} (uid {}): another user could reopen it writable through "
        "/proc; create it with mode 0600 (fchmod)",
        owner.mode, owner.uid);
  }
  return {};
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
    // First of all a memfd that can still be sealed: F_GET_SEALS fails on any other file, and a tmpfs file that is
    // no such memfd has F_SEAL_SEAL. Nothing below may touch another file: a broker run as root would chmod
    // whatever file or directory a client can open (/tmp, a setuid program) before the seal refused it.
    if ((os::memfd_seals(fd) & F_SEAL_SEAL) != 0) {
      return "host segments must be memfds created with MFD_ALLOW_SEALING; this fd is sealed against sealing (a "
             "memfd without MFD_ALLOW_SEALING, or a tmpfs file)";
    }
    const std::size_t actual = os::fd_size(fd);
    if (actual != req.size) return fmt::format("the memfd is {} bytes but Create declares {}", actual, req.size);
    if (auto why = keep_to_owner(fd); !why.empty()) return why;
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
  if (auto why = name_refusal(caller.creds, req.name); !why.empty()) {
    fail(ErrorCode::PermissionDenied, std::move(why));
    return;
  }
  // Quotas: what this uid already has registered (linked or still referenced), and the broker's fd budget.
  const std::uint64_t bytes = m_bytes_per_uid[caller.creds.uid];
  const std::uint64_t count = m_segments_per_uid[caller.creds.uid];
  const std::uint64_t per_uid_fds = fds_per_uid();
  // (The processes of the uid the broker waits for the exit of take a pidfd each from the same share.)
  const std::uint64_t watched = m_exits.watched(caller.creds.uid);
  if (count + 1 > m_quotas.segments || count + watched + 1 > per_uid_fds) {
    const bool fds_bound = count + watched + 1 > per_uid_fds;
    fail(ErrorCode::QuotaExceeded,
         fmt::format("quota exceeded: uid {} already has {} segments registered{} and the broker allows {} ({}); "
                     "unlink segments you no longer need (gpuipc ls, gpuipc rm)",
                     caller.creds.uid, count,
                     watched == 0 ? std::string()
                                  : fmt::format(" (and {} of its processes are waited for, a pidfd each)", watched),
                     fds_bound ? per_uid_fds : m_quotas.segments,
                     fds_bound ? "half of its file descriptor budget" : "GPUIPC_QUOTA_SEGMENTS"));
    return;
  }
  if (auto why = opens_refusal(caller.conn, req.name); !why.empty()) {
    fail(ErrorCode::QuotaExceeded, std::move(why));
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
  seg.attributes() = {.name = req.name,
                      .kind = req.kind,
                      .mode = req.mode,
                      .size = req.size,
                      .device = req.device,
                      .owner_uid = caller.creds.uid,
                      .owner_gid = caller.creds.gid,
                      .flags = req.flags,
                      .created_unix_ns = unix_now_ns(),
                      .view_offset = req.view_offset,
                      .view_size = req.view_size};
  seg.creator = caller.conn;
  if (record) {
    seg.control = std::move(record);
    seg.exporter_pid = caller.creds.pid;
    seg.exporter_start = process_start_of(caller.conn);
  }
  // The creator fills the block in before Create: a name is never visible over a half-made object.
  if (req.flags != 0) {
    ErrorCode code{};
    if (auto why = map_control(seg, fds[0].get(), true, code); !why.empty()) {
      fail(code, std::move(why));
      return;
    }
    if ((req.flags & proto::kFlagPool) != 0) {
      if (auto why = pool_chunks_refusal(caller.creds, seg); !why.empty()) {
        fail(ErrorCode::AlreadyExists, std::move(why));
        return;
      }
    }
  }
  seg.memory = std::move(fds[0]);
  seg.refs[caller.conn] = 1;
  seg.writers.insert(caller.conn);
  auto& stored = link(std::move(seg));
  note_holding(caller.conn, stored.id, true);
  GPUIPC_LOG_INFO("created segment '{}' id {} ({} {}) for uid {} pid {}", req.name, stored.id, kind_name(req.kind),
                  human_bytes(req.size), caller.creds.uid, caller.creds.pid);
  out.push_back(reply(caller.conn, rid, proto::OpenReply{info_of(stored)}));
  wake_waiting(stored, out);
}

std::string map_control(SegmentRecord& seg, int fd, bool fresh, ErrorCode& code) {
  try {
    seg.control = os::Mapping::map(fd, seg.size, true);
  } catch (const Error& e) {
    code = e.code();
    return fmt::format("segment '{}': cannot map its control block: {}", seg.name, e.what());
  }
  seg.block = ControlBlock{seg.control.data(), seg.control.size(), seg.flags, {}};
  if (auto why = check_control(seg.block, fresh); !why.empty()) {
    code = ErrorCode::InvalidArgument;
    return fmt::format("segment '{}': {}", seg.name, why);
  }
  return {};
}

SegmentRecord& Registry::link(SegmentRecord seg) {
  const std::uint64_t id = seg.id;
  auto& stored = m_segments.emplace(id, std::move(seg)).first->second;
  if (!stored.name.empty()) m_names[stored.name] = id;
  if (!stored.unlinked_key.empty()) m_unlinked_keys[stored.unlinked_key] = id;
  ++m_segments_per_uid[stored.owner_uid];
  m_bytes_per_uid[stored.owner_uid] += stored.size;
  journal_linked(stored);
  return stored;
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
    note_holding(caller.conn, req.id, false);
    drop_beats(it->second, caller.conn);
    notify(it->second, proto::EventKind::Left, gone, caller.conn, out);  // (not for a look)
    it->second.lookers.erase(caller.conn);
    repair_for(it->second, caller.conn, false);
    if (it->second.creator == caller.conn) creator_left(it->second, proto::PoisonReason::Closed);
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
    drop_restore(req.name, true);  // a control block or a share waits on under its file's identity (holders may live)
    out.push_back(reply(caller.conn, rid, proto::OkReply{}));
    return;
  }
  if (it == m_names.end()) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound, fmt::format("no segment named '{}' to unlink", req.name)).body));
    return;
  }
  unlink_segment(caller, rid, m_segments.at(it->second), out);
}

void Registry::unlink_id(const Caller& caller, std::uint32_t rid, const proto::UnlinkId& req,
                         std::vector<Outgoing>& out) {
  auto it = m_segments.find(req.id);
  // A segment the caller may not read is NotFound, as for Stat: an id must not tell its name.
  if (it == m_segments.end() || it->second.name.empty() || !visible_to(caller.creds, it->second)) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::NotFound,
                                    fmt::format("segment id {} has no name to unlink (unlinked, or gone)", req.id))
                            .body));
    return;
  }
  unlink_segment(caller, rid, it->second, out);
}

void Registry::unlink_segment(const Caller& caller, std::uint32_t rid, SegmentRecord& seg, std::vector<Outgoing>& out) {
  if (caller.creds.uid != 0 && caller.creds.uid != seg.owner_uid) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::PermissionDenied,
                                    fmt::format("segment '{}' is owned by uid {}; only its owner or root may unlink it "
                                                "(you are uid {})",
                                                seg.name, seg.owner_uid, caller.creds.uid))
                            .body));
    return;
  }
  const std::uint64_t id = seg.id;
  const std::string name = std::move(seg.name);
  seg.name.clear();
  // Heartbeats and watches go by name: a name that is gone takes no heartbeat, so the deadlines set under it must
  // not expire into Hung events about processes that are alive.
  drop_beats(seg);
  m_names.erase(name);
  journal_unlinked(seg, name);
  bump_names_generation();
  GPUIPC_LOG_INFO("unlinked segment '{}' id {} ({} references remain)", name, id, seg.total_refs());
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
  maybe_destroy(id);
}

void Registry::maybe_destroy(std::uint64_t id) {
  auto it = m_segments.find(id);
  // A device_ipc share whose exporter is away stays for its Announce (unlinked, it has no reference meanwhile).
  if (it == m_segments.end() || !it->second.name.empty() || !it->second.refs.empty() || it->second.exporter_away) {
    return;
  }
  GPUIPC_LOG_INFO("freed segment id {} ({})", id, human_bytes(it->second.size));
  if (const auto& key = it->second.unlinked_key; !key.empty()) {
    m_journal.unlinked(key);
    m_unlinked_keys.erase(key);
  }
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
  it->second.block.owed.clear();
  it->second.block.leavers.clear();
  charge_owed(it->second);  // gives its share back
  m_unclaimed.erase(id);
  m_exiting.erase(id);
  m_segments.erase(it);
}

void Registry::expire(std::int64_t now_ns, std::vector<Outgoing>& out) {
  // One poll a process for all the repairs and writes that wait for it (thousands may wait for one process).
  const ExitWatch::Pass pass(m_exits);
  repair_unclaimed(now_ns);
  repair_exited(now_ns);
  settle_owing(now_ns);
  expire_restores(now_ns);
  expire_beats(now_ns, out);
  report_pending_deaths(now_ns, out);
  while (!m_pending_by_deadline.empty() && m_pending_by_deadline.begin()->first <= now_ns) {
    Pending p = unpark(m_pending_by_deadline.begin()->second);
    out.push_back(reply(p.conn, p.request_id,
                        error_reply(p.request_id, ErrorCode::Timeout,
                                    fmt::format("no segment named '{}' appeared within {} ms", p.request.name,
                                                p.request.wait_ms))
                            .body));
  }
  maybe_compact_journal();
}

std::optional<std::int64_t> Registry::next_deadline() const {
  std::optional<std::int64_t> d;
  if (!m_pending_by_deadline.empty()) d = m_pending_by_deadline.begin()->first;
  if (!m_owing.empty()) d = d ? std::min(*d, m_owed_check_ns) : m_owed_check_ns;
  if (!m_unclaimed.empty()) d = d ? std::min(*d, m_unclaimed_check_ns) : m_unclaimed_check_ns;
  if (!m_exiting.empty()) d = d ? std::min(*d, m_exiting_check_ns) : m_exiting_check_ns;
  if (!m_pending_deaths.empty()) d = d ? std::min(*d, m_deaths_check_ns) : m_deaths_check_ns;
  for (const auto& [name, r] : m_restore) d = d ? std::min(*d, r.deadline_ns) : r.deadline_ns;
  if (!m_beat_deadlines.empty()) {
    const std::int64_t b = std::get<0>(*m_beat_deadlines.begin());
    d = d ? std::min(*d, b) : b;
  }
  return d;
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
  // The entry was free, so a record of that index is stale: its member left without the broker (a semaphore's
  // close clears its own entry). Kept, such records would pile up for a process that opens and closes again.
  for (auto e = seg.joined.begin(); e != seg.joined.end();) {
    if (e->second.member != member) {
      ++e;
      continue;
    }
    if (!seg.journal_name().empty()) m_journal.left(seg.journal_name(), e->second.member, e->second.token);
    e = seg.joined.erase(e);
  }
  auto& joined = seg.joined.emplace(caller.conn, Joined{member, token, role})->second;
  journal_joined(seg, joined, caller.conn);
  out.push_back(reply(caller.conn, rid, proto::JoinReply{member, token}));
}

void Registry::leave(const Caller& caller, std::uint32_t rid, const proto::Leave& req, std::vector<Outgoing>& out) {
  auto fail = [&](std::string msg) {
    out.push_back(reply(caller.conn, rid,
                        error_reply(rid, ErrorCode::InvalidArgument,
                                    fmt::format("Leave of member {} of segment id {}: {}", req.member, req.id, msg))
                            .body));
  };
  auto it = m_segments.find(req.id);
  if (it == m_segments.end() || !it->second.control ||
      (it->second.flags & (proto::kFlagChannel | proto::kFlagPool | proto::kFlagSemaphore | proto::kFlagCounting)) ==
          0) {
    fail("no semaphore, channel, pool or counting semaphore has that id");
    return;
  }
  auto& seg = it->second;
  // Semaphores and counting semaphores: no stream work to wait for.
  const bool semaphore = (seg.flags & (proto::kFlagSemaphore | proto::kFlagCounting)) != 0;
  auto [first, last] = seg.joined.equal_range(caller.conn);
  const auto j = std::find_if(
      first, last, [&](const auto& e) { return e.second.member == req.member && e.second.token == req.token; });
  if (j == last) {
    fail("this connection did not join that entry with that token");
    return;
  }
  // Its stream's writes are waited for until the process exits: one this broker cannot see (another PID
  // namespace) has no exit to wait for. It leaves on its own then (its library waits, bounded, for its stream).
  if (!semaphore && caller.creds.pid <= 0) {
    fail("this broker cannot see the process (another PID namespace): leave without the broker");
    return;
  }
  // What the broker keeps for members that left owing stream work (a pidfd, their writes, journal lines) is bounded:
  // Join and Leave in a loop, with writes that never land, grew it without end. Past kMaxMembers such leavers of
  // one object, a member leaves on its own (its library waits, bounded, for its stream).
  const bool pool = (seg.flags & proto::kFlagPool) != 0;
  const std::size_t waiting =
      pool ? static_cast<std::size_t>(std::count_if(seg.exiting.begin(), seg.exiting.end(),
                                                    [](const SegmentRecord::Unclaimed& u) { return u.left; }))
           : seg.block.leavers.size();
  if (waiting >= proto::kMaxMembers) {
    fail(fmt::format("{} members that left still owe stream work, the most the broker keeps: leave without the broker",
                     waiting));
    return;
  }
  const Joined member = j->second;
  ProcessWatch process;  // what its stream owes waits for it (a semaphore's member owes none)
  if (!semaphore) {
    process = watch_process(caller.creds.pid, member.pid == caller.creds.pid ? member.start : 0, caller.creds.uid);
    if (!process) {
      fail("its process cannot be waited for: leave without the broker");
      return;
    }
  }
  if (pool) {
    // A pool member whose stream has not reached some of its frees (it released its holds itself): its entry, and
    // those blocks, go once the frees have landed or the process has exited. The journal keeps its entry until then,
    // marked as having left: a broker started after this one died waits for its frees too, not for a Rejoin.
    seg.joined.erase(j);
    repair_later(seg, SegmentRecord::Unclaimed{member, std::move(process), true});
    if (m_journal && !seg.journal_name().empty()) {
      try {
        m_journal.joined(JournalMember{seg.journal_name(), member.member, member.token,
                                       static_cast<std::uint32_t>(member.role), member.pid, member.start, true});
      } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory copying the name: journaled as joined
      }
    }
    out.push_back(reply(caller.conn, rid, proto::OkReply{}));
    return;
  }
  seg.joined.erase(j);
  std::vector<proto::OwedWrite> kept;
  limit_owed(seg);
  const bool removed = leave_member(seg.block, member, process, &kept);
  if (!seg.journal_name().empty()) {
    if (removed && !seg.block.leavers.empty()) journal_owed(seg, std::move(kept), process);
    m_journal.left(seg.journal_name(), member.member, member.token);
  }
  watch_owed(seg);
  out.push_back(reply(caller.conn, rid, proto::OkReply{}));
}

}  // namespace gpuipc::broker
