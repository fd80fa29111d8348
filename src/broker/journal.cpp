#include "broker/journal.hpp"

#include <fmt/format.h>

#include <map>
#include <sstream>

#include "base/log.hpp"
#include "os/process.hpp"

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

}  // namespace

std::string journal_line(const JournalEntry& e) {
  return fmt::format("L {} {} {} {} {} {} {} {} {} {} {} {} {}", e.name, static_cast<int>(e.kind), e.mode, e.size,
                     hex(e.device), e.owner_uid, e.owner_gid, e.flags, e.created_unix_ns, e.file_dev, e.file_ino,
                     e.view_offset, e.view_size);
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
  if (tag != "L" || kind < 1 || kind > 4 || !unhex(uuid, e.device) || !proto::check_name(e.name).empty()) {
    return false;
  }
  e.kind = static_cast<proto::Kind>(kind);
  out = std::move(e);
  return true;
}

Journal Journal::open(const std::string& path, std::vector<JournalEntry>& linked) {
  std::map<std::string, JournalEntry> names;
  std::istringstream in(os::read_text(path));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("U ", 0) == 0) {
      names.erase(line.substr(2));
      continue;
    }
    JournalEntry e;
    if (parse_journal_line(line, e)) names[e.name] = std::move(e);  // a torn last line is skipped
  }
  std::string compact;
  linked.clear();
  for (auto& [name, e] : names) {
    compact += journal_line(e) + "\n";
    linked.push_back(std::move(e));
  }
  os::replace_file(path, compact, 0600);
  Journal j;
  j.m_fd = os::open_append(path, 0600);
  return j;
}

void Journal::append(const std::string& line) noexcept {
  if (!m_fd) return;
  try {
    os::append_text(m_fd.get(), line);
  } catch (const std::exception& e) {
    GPUIPC_LOG_WARN("names journal: {}; names changed now will not survive a broker restart", e.what());
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

}  // namespace gpuipc::broker
