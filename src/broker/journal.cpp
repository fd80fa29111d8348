#include "broker/journal.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string_view>
#include <tuple>

#include "base/errors.hpp"
#include "base/log.hpp"
#include "os/identity.hpp"
#include "os/path.hpp"
#include "os/process.hpp"
#include "proto/shm.hpp"

namespace gpuipc::broker {
namespace {

std::string hex(const proto::Uuid& u) {
  std::string s;
  for (auto b : u) s += fmt::format("{:02x}", b);
  return s;
}

bool unhex(const std::string& s, proto::Uuid& u) {
  if (s.size() != 32) return false;
  for (std::size_t i = 0; i < 16; ++i) {
    unsigned v = 0;
    if (std::sscanf(s.c_str() + 2 * i, "%2x", &v) != 1) return false;  // NOLINT(cert-err34-c): checked
    u[i] = static_cast<std::uint8_t>(v);
  }
  return true;
}

/// A name or an unlinked_key: what the journal's lines may name.
bool key_ok(const std::string& key) { return proto::check_name(key).empty() || is_unlinked_key(key); }

}  // namespace

std::string unlinked_key(std::uint64_t dev, std::uint64_t ino) { return fmt::format("#{}:{}", dev, ino); }

bool is_unlinked_key(std::string_view key) noexcept {
  if (key.size() < 4 || key.front() != '#') return false;
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
  const char* const end = key.data() + key.size();
  const auto d = std::from_chars(key.data() + 1, end, dev);
  if (d.ec != std::errc() || d.ptr == end || *d.ptr != ':') return false;
  const auto i = std::from_chars(d.ptr + 1, end, ino);
  if (i.ec != std::errc() || i.ptr != end) return false;
  try {
    return unlinked_key(dev, ino) == key;  // no sign, no leading zeros: one key for one file
  } catch (...) {
    return false;
  }
}

std::string journal_line(const JournalEntry& e) {
  std::string line = fmt::format("L {} {} {} {} {} {} {} {} {} {} {} {} {}", e.name, static_cast<int>(e.kind), e.mode,
                                 e.size, hex(e.device), e.owner_uid, e.owner_gid, e.flags, e.created_unix_ns,
                                 e.file_dev, e.file_ino, e.view_offset, e.view_size);
  if (e.kind == proto::Kind::DeviceIpc) line += fmt::format(" {} {}", e.exporter_pid, e.exporter_start);
  return line;
}

bool parse_journal_line(const std::string& line, JournalEntry& out) {
  std::istringstream in(line);
  std::string tag;
  std::string uuid;
  int kind = 0;
  JournalEntry e;
  if (!(in >> tag >> e.name >> kind >> e.mode >> e.size >> uuid >> e.owner_uid >> e.owner_gid >> e.flags >>
        e.created_unix_ns >> e.file_dev >> e.file_ino >> e.view_offset >> e.view_size)) {
    return false;
  }
  if (tag != "L" || kind < 1 || kind > 4 || !unhex(uuid, e.device) || !key_ok(e.name)) return false;
  e.kind = static_cast<proto::Kind>(kind);
  if (e.kind == proto::Kind::DeviceIpc &&
      (!(in >> e.exporter_pid >> e.exporter_start) || e.exporter_pid < 0 || e.flags != 0 || e.file_ino == 0)) {
    return false;
  }
  // An unlinked_key names a control block (host memory, flags) or a device_ipc share (its record) held when unlinked.
  const bool keyed_kind = ((e.kind == proto::Kind::Host || e.kind == proto::Kind::HostPinned) && e.flags != 0) ||
                          e.kind == proto::Kind::DeviceIpc;
  if (e.name.front() == '#' && (!keyed_kind || e.name != unlinked_key(e.file_dev, e.file_ino))) {
    return false;
  }
  // Attributes a Create could have given (a key stands for a name here): anything else is what a full disk, a
  // crash of the machine or a bad block left, and a segment restored with it could not be described to a client.
  const proto::Create as_made{.name = e.name.front() == '#' ? "k" : e.name,
                              .kind = e.kind,
                              .mode = e.mode,
                              .size = e.size,
                              .device = e.device,
                              .flags = e.flags,
                              .view_offset = e.view_offset,
                              .view_size = e.view_size};
  if (!proto::check_create(as_made).empty()) return false;
  out = std::move(e);
  return true;
}

std::string journal_member_line(const JournalMember& m) {
  return fmt::format("M {} {} {} {} {} {}{}", m.name, m.member, m.token, m.role, m.pid, m.start, m.left ? " 1" : "");
}

bool parse_journal_member_line(const std::string& line, JournalMember& out) {
  std::istringstream in(line);
  std::string tag;
  JournalMember m;
  if (!(in >> tag >> m.name >> m.member >> m.token >> m.role >> m.pid >> m.start)) return false;
  std::uint32_t left = 0;
  m.left = (in >> left) && left == 1;  // absent: joined
  if (tag != "M" || m.token == 0 || m.member >= proto::kMaxMembers || m.pid < 0 || !key_ok(m.name)) {
    return false;
  }
  out = std::move(m);
  return true;
}

std::string journal_owed_lines(const JournalOwed& o) {
  if (o.writes.empty()) return {};
  std::string s = "O " + o.name;
  for (const auto& w : o.writes) s += fmt::format(" {} {}", w.code, w.after);
  s += "\n";
  for (const auto& [pid, start] : o.processes) s += fmt::format("X {} {} {}\n", o.name, pid, start);
  return s;
}

namespace {

/// The entries of an "R name member token" line.
bool parse_left(const std::string& line, std::string& name, std::uint32_t& member, std::uint32_t& token) {
  std::istringstream in(line);
  std::string tag;
  return (in >> tag >> name >> member >> token) && tag == "R";
}

/// Replays what the stream writes of one name are, across its "O name (code after)..." and "X name pid start"
/// lines: a write or process named twice counts once, and at most kMaxOwed writes are kept (the broker keeps at most
/// kMaxMembers owed tables' worth for a channel, repair.hpp's max_owed_writes; the rest of a longer history has landed
/// long since).
struct OwedReplay {
  static constexpr std::size_t kMaxOwed =
      static_cast<std::size_t>(proto::kMaxMembers) * proto::owed_capacity(proto::kMaxSlots);
  std::set<std::pair<std::uint64_t, std::uint64_t>> writes;
  std::set<std::pair<std::int64_t, std::uint64_t>> processes;

  /// An "O" or "X" line; false for a malformed one.
  static bool parse(const std::string& line, std::map<std::string, OwedReplay>& into) {
    std::istringstream in(line);
    std::string tag;
    std::string name;
    if (!(in >> tag >> name) || !key_ok(name)) return false;
    if (tag == "X") {
      std::int64_t pid = 0;
      std::uint64_t start = 0;
      if (!(in >> pid >> start) || pid <= 0 || pid > std::numeric_limits<pid_t>::max()) return false;
      into[name].processes.emplace(pid, start);
      return true;
    }
    std::vector<std::pair<std::uint64_t, std::uint64_t>> ws;
    for (std::uint64_t code = 0, after = 0; in >> code;) {
      if (!(in >> after)) return false;
      ws.emplace_back(code, after);
    }
    if (tag != "O" || !in.eof() || ws.empty()) return false;
    auto& r = into[name];
    for (const auto& w : ws) {
      if (r.writes.size() < kMaxOwed) r.writes.insert(w);
    }
    return true;
  }
  JournalOwed take(const std::string& name) const {
    JournalOwed o{name, {}, {processes.begin(), processes.end()}};
    for (const auto& [code, after] : writes) o.writes.push_back(proto::OwedWrite{code, after});
    return o;
  }
};

/// Refuses a journal someone else could have written: its lines name owners and memory that the next broker gives
/// back, so a file planted (or made writable) by another user in a runtime directory they may write (a sticky one,
/// such as /tmp) would forge them.
void check_journal_file(const std::string& path, const std::optional<os::PathStatus>& st) {
  if (!st) return;  // none yet: this broker writes the first
  const auto refuse = [&](const std::string& why) {
    throw Error(ErrorCode::PermissionDenied,
                fmt::format("the broker's journal {} {}: the broker does not replay a journal that another user could "
                            "have written. Remove it (the names it holds are lost) and use a runtime directory only "
                            "the broker's user can write (GPUIPC_RUNTIME_DIR)",
                            path, why),
                "open_journal");
  };
  if (!st->regular) refuse("is not a regular file");
  if (st->owner != os::effective_uid()) {
    refuse(fmt::format("is owned by uid {}, not the broker's uid {}", st->owner, os::effective_uid()));
  }
  if ((st->mode & 022U) != 0) refuse(fmt::format("is mode {:04o}, writable by group or others", st->mode));
}

}  // namespace

Journal Journal::open(const std::string& path, JournalState& state) {
  // Checked on the file read, through its fd: a check of the path, then an open, replayed a file another user put
  // there in between (in a sticky directory).
  std::optional<os::PathStatus> st;
  std::string text = os::read_text(path, &st);
  check_journal_file(path, st);
  std::map<std::string, JournalEntry> names;
  std::map<std::tuple<std::string, std::uint32_t, std::uint32_t>, JournalMember> joined;
  std::map<std::string, OwedReplay> owed;
  std::istringstream in(std::move(text));
  for (std::string line; std::getline(in, line);) {
    if (in.eof()) break;  // no newline: a line torn by a full disk or a crash of the machine is skipped
    if (line.rfind("U ", 0) == 0) {
      const std::string name = line.substr(2);
      names.erase(name);
      std::erase_if(joined, [&](const auto& kv) { return std::get<0>(kv.first) == name; });
      owed.erase(name);
      continue;
    }
    if (line.rfind("O ", 0) == 0 || line.rfind("X ", 0) == 0) {
      (void)OwedReplay::parse(line, owed);
      continue;
    }
    if (line.rfind("R ", 0) == 0) {
      std::string name;
      std::uint32_t member = 0;
      std::uint32_t token = 0;
      if (parse_left(line, name, member, token)) joined.erase({name, member, token});
      continue;
    }
    if (line.rfind("M ", 0) == 0) {
      JournalMember m;
      if (parse_journal_member_line(line, m)) joined[{m.name, m.member, m.token}] = std::move(m);
      continue;
    }
    JournalEntry e;
    if (parse_journal_line(line, e)) names[e.name] = std::move(e);
  }
  std::string compact;
  state = JournalState{};
  for (auto& [name, e] : names) {
    compact += journal_line(e) + "\n";
    state.linked.push_back(std::move(e));
  }
  for (auto& [key, m] : joined) {
    if (names.count(m.name) == 0) continue;  // its name went: nothing to give back, nothing to repair
    compact += journal_member_line(m) + "\n";
    state.members.push_back(std::move(m));
  }
  for (const auto& [name, r] : owed) {
    if (names.count(name) == 0 || r.writes.empty()) continue;
    state.owed.push_back(r.take(name));
    compact += journal_owed_lines(state.owed.back());
  }
  os::replace_file(path, compact, 0600);
  Journal j;
  j.m_fd = os::open_append(path, 0600);
  j.m_path = path;
  j.m_compacted_bytes = compact.size();
  return j;
}

void Journal::append(const std::string& line) noexcept {
  if (!m_fd) return;
  // A write the disk cut short leaves part of the line, which the next line would be glued onto (replay skips only a
  // torn last line: the glued one, an unlink, was lost, and the name came back): append_text takes it back.
  bool cut_left = false;
  try {
    os::append_text(m_fd.get(), line, &cut_left);
    m_appended_bytes += line.size();
  } catch (const std::exception& e) {
    GPUIPC_LOG_WARN("names journal: {}; this change will not survive a broker restart", e.what());
    if (cut_left) {
      // The part stays, as the last line, which replay skips; nothing more is written after it.
      m_fd.reset();
      GPUIPC_LOG_WARN("names journal: cannot take a cut line back; it is no longer written");
    }
  }
}

void Journal::linked(const JournalEntry& e) noexcept {
  try {
    append(journal_line(e) + "\n");
  } catch (...) {  // NOLINT(bugprone-empty-catch): formatting failed (out of memory): the name is not journaled
  }
}

void Journal::unlinked(const std::string& name) noexcept {
  try {
    append("U " + name + "\n");
  } catch (...) {  // NOLINT(bugprone-empty-catch): as above
  }
}

void Journal::record(const std::string& lines) noexcept {
  if (!lines.empty()) append(lines);
}

void Journal::joined(const JournalMember& m) noexcept {
  try {
    append(journal_member_line(m) + "\n");
  } catch (...) {  // NOLINT(bugprone-empty-catch): as above
  }
}

void Journal::left(const std::string& name, std::uint32_t member, std::uint32_t token) noexcept {
  try {
    append(fmt::format("R {} {} {}\n", name, member, token));
  } catch (...) {  // NOLINT(bugprone-empty-catch): as above
  }
}

void Journal::owed(const JournalOwed& o) noexcept {
  try {
    append(journal_owed_lines(o));
  } catch (...) {  // NOLINT(bugprone-empty-catch): as above
  }
}

bool Journal::wants_compaction() const noexcept {
  constexpr std::uint64_t kMinBytes = 1U << 20;
  return m_fd && m_appended_bytes > std::max(kMinBytes, 4 * m_compacted_bytes);
}

void Journal::rewrite(const std::string& text) noexcept {
  if (!m_fd) return;
  try {
    os::replace_file(m_path, text, 0600);
  } catch (const std::exception& e) {
    // The old file stays, and appending goes on to it.
    GPUIPC_LOG_WARN("names journal: cannot compact it: {}", e.what());
    m_appended_bytes = 0;  // try again after as much again
    return;
  }
  m_compacted_bytes = text.size();
  m_appended_bytes = 0;
  try {
    m_fd = os::open_append(m_path, 0600);
  } catch (const std::exception& e) {
    // The fd would name the replaced file, which nobody reads again: better no journal than a silent one.
    m_fd.reset();
    GPUIPC_LOG_WARN(
        "names journal: cannot reopen it after compacting ({}); names and members changed from now on "
        "will not survive a broker restart",
        e.what());
  }
}

}  // namespace gpuipc::broker
