// The broker's journal of names (names.journal in the runtime directory, written only by the broker): what a
// broker started after another one died needs to give each name back to the memory its holders still map, with
// the owner, group and mode the dead broker had recorded, never what a client claims, and to tell which member
// entries of the names' semaphores and channels belonged to processes that died while no broker watched, and which
// stream writes dead channel members still owed (the last broker made them as their turns came). One line per
// change, appended; replayed and compacted when a broker starts, and compacted again whenever it has grown
// well past what it holds. Without a journal (a Registry made in a test) nothing is written.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "os/fd.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"

namespace gpuipc::broker {

/// What a name stands for: the attributes the registry keeps of a segment (SegmentRecord) and the journal records.
struct SegmentAttributes {
  std::string name;  ///< in the registry: empty once unlinked
  proto::Kind kind = proto::Kind::Host;
  std::uint16_t mode = 0;
  std::uint64_t size = 0;
  proto::Uuid device{};
  uid_t owner_uid = 0;
  gid_t owner_gid = 0;
  std::uint32_t flags = 0;  ///< proto::kFlagSemaphore, kFlagChannel, kFlagPool, kFlagCounting or 0
  std::uint64_t created_unix_ns = 0;
  std::uint64_t view_offset = 0;  ///< adopted VMM memory: Create.view_offset / view_size
  std::uint64_t view_size = 0;

  SegmentAttributes& attributes() noexcept { return *this; }
  const SegmentAttributes& attributes() const noexcept { return *this; }
};

/// The journal's key for a control block (semaphore, channel, pool, counting semaphore), or a device_ipc share's
/// record, unlinked while processes still use it (a share: or while its exporter is away): "#<st_dev>:<st_ino>" of its
/// memfd. The broker keeps journaling it, its members and what they owe under this key, so that a broker started after
/// the last one died takes it back from a holder's fd (Announce), as it takes a name back: with no name to go by (the
/// name may stand for another object by then), and with its members' deaths repaired as ever. No name can be a key ('#'
/// and ':' are not a name's characters).
std::string unlinked_key(std::uint64_t dev, std::uint64_t ino);
/// Whether `key` is what unlinked_key makes (its two numbers in their shortest form).
bool is_unlinked_key(std::string_view key) noexcept;

/// A linked name as the journal records it (or an unlinked control block, with `name` its unlinked_key).
struct JournalEntry : SegmentAttributes {
  std::uint64_t file_dev = 0;  ///< host kinds and device_ipc (its record): the memfd's identity; 0 for device kinds
  std::uint64_t file_ino = 0;
  /// device_ipc: the exporter's process (pid as SO_PEERCRED gave it, 0 unknown; os::process_start_ticks, 0 unknown),
  /// whose exit ends the share.
  std::int64_t exporter_pid = 0;
  std::uint64_t exporter_start = 0;
};

/// A member entry of a named (or unlinked_key'd) control block (semaphore, channel, pool, counting semaphore) as the
/// journal records it: which entry, with which token and role, and the process that joined it (its pid as SO_PEERCRED
/// gave it to the broker, and its start time: os::process_start_ticks). A broker started after the last one died
/// repairs the entries whose process is gone and which nobody rejoined.
struct JournalMember {
  std::string name;
  std::uint32_t member = 0;
  std::uint32_t token = 0;
  std::uint32_t role = 0;   ///< a proto::Role
  std::int64_t pid = 0;     ///< 0: unknown (another PID namespace)
  std::uint64_t start = 0;  ///< 0: unknown
  /// A pool member that left (Leave) while its stream had not reached some of its frees: it never rejoins; the
  /// broker removes it once they have landed or its process has exited (an eighth field, "1", on its line).
  bool left = false;
};

/// The stream writes dead members of channel `name` owed when the last broker stopped writing (what it kept in
/// ControlBlock::owed, maybe some it made since: a write that has landed is skipped), and the processes whose exit
/// they wait for (ControlBlock::dying: pid and start; a killed process's GPU work runs until it has exited).
struct JournalOwed {
  std::string name;
  std::vector<proto::OwedWrite> writes;
  std::vector<std::pair<std::int64_t, std::uint64_t>> processes;
};

/// What a journal replays: the names still linked when the last broker stopped writing, their member entries then,
/// and the stream writes their channels' dead members still owed.
struct JournalState {
  std::vector<JournalEntry> linked;
  std::vector<JournalMember> members;
  std::vector<JournalOwed> owed;
};

class Journal {
 public:
  Journal() = default;
  /// Opens (creating, mode 0600) the journal at `path`, replays it into `state`, and compacts it to exactly that.
  /// Throws Error(System).
  static Journal open(const std::string& path, JournalState& state);

  /// Records that `e.name` is linked. Never throws: a failed write is logged (the name then does not survive a
  /// broker restart).
  void linked(const JournalEntry& e) noexcept;
  /// Records that `name` is no longer linked (its member entries go with it). Never throws.
  void unlinked(const std::string& name) noexcept;
  /// Appends `lines` (journal_line, journal_member_line and journal_owed_lines, each with its newline) as one write.
  /// Never throws.
  void record(const std::string& lines) noexcept;
  /// Records that a process joined member entry `m.member` of `m.name` with token `m.token`. Never throws.
  void joined(const JournalMember& m) noexcept;
  /// Records that the entry `member` of `name` holding `token` was left or repaired. Never throws.
  void left(const std::string& name, std::uint32_t member, std::uint32_t token) noexcept;
  /// Records that dead members of channel `o.name` owe the stream writes `o.writes`, to be made once the processes
  /// `o.processes` have exited (as a broker that dies before it made them cannot). Never throws.
  void owed(const JournalOwed& o) noexcept;

  /// Whether the lines appended since the journal was last compacted outweigh what it holds (4 times, and 1 MiB
  /// at least): a broker that runs for long compacts it (rewrite) so that it does not grow without bound.
  bool wants_compaction() const noexcept;
  /// Replaces the journal with `text`, the lines of what is linked, joined and owed now (journal_line,
  /// journal_member_line, journal_owed_lines). Never throws: when the file cannot be replaced it keeps appending to the
  /// old one; when the new one cannot be reopened it journals nothing more (both logged).
  void rewrite(const std::string& text) noexcept;

  explicit operator bool() const noexcept { return static_cast<bool>(m_fd); }

 private:
  void append(const std::string& line) noexcept;
  os::UniqueFd m_fd;
  std::string m_path;
  std::uint64_t m_compacted_bytes = 0;  // its size when last compacted
  std::uint64_t m_appended_bytes = 0;   // appended since
};

/// The line `linked` writes for `e` (without the newline), and its parse (false for a malformed line; an
/// unlinked_key must be a host control block's, and name the file it records).
std::string journal_line(const JournalEntry& e);
bool parse_journal_line(const std::string& line, JournalEntry& out);
/// The line `joined` writes for `m` (without the newline), and its parse (false for a malformed line).
std::string journal_member_line(const JournalMember& m);
bool parse_journal_member_line(const std::string& line, JournalMember& out);
/// The lines `owed` writes for `o` (each with its newline; empty when `o` has no writes).
std::string journal_owed_lines(const JournalOwed& o);

}  // namespace gpuipc::broker
