// The broker's journal of names (names.journal in the runtime directory, written only by the broker): what a
// broker started after another one died needs to give each name back to the memory its holders still map, with
// the owner, group and mode the dead broker had recorded, never what a client claims. One line per change,
// appended; replayed and compacted when a broker starts. Without a journal (a Registry made in a test) nothing is
// written.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "os/fd.hpp"
#include "proto/messages.hpp"

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

/// A linked name as the journal records it.
struct JournalEntry : SegmentAttributes {
  std::uint64_t file_dev = 0;  ///< host kinds: the memfd's identity (st_dev, st_ino); 0 for device kinds
  std::uint64_t file_ino = 0;
};

class Journal {
 public:
  Journal() = default;
  /// Opens (creating, mode 0600) the journal at `path`, replays it into `linked` (the names still linked when the
  /// last broker stopped writing), and compacts it to exactly those. Throws Error(System).
  static Journal open(const std::string& path, std::vector<JournalEntry>& linked);

  /// Records that `e.name` is linked. Never throws: a failed write is logged (the name then does not survive a
  /// broker restart).
  void linked(const JournalEntry& e) noexcept;
  /// Records that `name` is no longer linked. Never throws.
  void unlinked(const std::string& name) noexcept;

  explicit operator bool() const noexcept { return static_cast<bool>(m_fd); }

 private:
  void append(const std::string& line) noexcept;
  os::UniqueFd m_fd;
};

/// The line `linked` writes for `e` (without the newline), and its parse (false for a malformed line).
std::string journal_line(const JournalEntry& e);
bool parse_journal_line(const std::string& line, JournalEntry& out);

}  // namespace gpuipc::broker
