// The checks of the broker wire codec (docs/protocol.md): one set of validation functions for both directions, so
// whatever encode emits, decode accepts, and the error strings are the same on both sides. Error strings are
// composed only on failure.
#include <fmt/format.h>

#include <algorithm>
#include <variant>

#include "gpuipc/error.hpp"
#include "proto/codec_detail.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"

namespace gpuipc::proto {
namespace {

using detail::fail;
using detail::Path;

constexpr std::size_t kMaxClientNameLength = 64;
constexpr std::size_t kMaxBrokerVersionLength = 64;
constexpr std::uint16_t kModeMask = 0777;
constexpr std::uint8_t kFirstErrorCode = static_cast<std::uint8_t>(ErrorCode::InvalidArgument);
// The last ErrorCode enumerator: widen when one is added (a unit test compares with to_string(ErrorCode)).
constexpr std::uint8_t kLastErrorCode = static_cast<std::uint8_t>(ErrorCode::InvalidState);

// A byte as it may appear in a one-line error: printable ASCII quoted, anything else in hex.
std::string show_byte(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (u >= 0x20 && u < 0x7f) return fmt::format("'{}'", c);
  return fmt::format("0x{:02x}", u);
}

// Empty when `s` is at most `max` bytes of printable ASCII, else why not.
std::string check_printable(std::string_view s, std::size_t max) {
  if (s.size() > max) return fmt::format("{} bytes, longer than the limit of {}", s.size(), max);
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto u = static_cast<unsigned char>(s[i]);
    if (u < 0x20 || u >= 0x7f) return fmt::format("non-printable byte {} at {}", show_byte(s[i]), i);
  }
  return {};
}

std::string check_kind(Kind kind) {
  const auto v = static_cast<std::uint8_t>(kind);
  if (v < 1 || v > 4) {
    return fmt::format("invalid Kind {} (valid: 1 Device, 2 Host, 3 HostPinned, 4 DeviceIpc)", v);
  }
  return {};
}

std::string check_mode(std::uint16_t mode) {
  if ((mode & ~kModeMask) != 0) return fmt::format("mode {:#o} has bits outside 0777", mode);
  return {};
}

std::string check_size(std::uint64_t size) {
  if (size == 0) return "size 0; a segment has at least 1 byte";
  if (size > kMaxSegmentSize) return fmt::format("size {} exceeds the limit of {} (1 TiB)", size, kMaxSegmentSize);
  return {};
}

std::string check_device(const Uuid& device, Kind kind) {
  if (is_device_kind(kind)) return {};
  if (std::all_of(device.begin(), device.end(), [](std::uint8_t b) { return b == 0; })) return {};
  return "must be all zero for host kinds";
}

// Empty when the view (Create.view_offset/view_size, SegmentInfo's) is valid, else why not; `field` gets the name.
std::string check_view(std::uint64_t offset, std::uint64_t size, std::uint64_t whole, Kind kind,
                       std::string_view& field) {
  field = "view_size";
  if (size == 0) {
    if (offset == 0) return {};
    field = "view_offset";
    return fmt::format("{} with view_size 0; a whole segment starts at 0", offset);
  }
  if (kind != Kind::Device) return fmt::format("{}; only Device segments (adopted VMM memory) have a view", size);
  if (size > whole || offset > whole - size) {
    return fmt::format("[{}, {} + {}) does not lie inside the {} bytes of the segment", offset, offset, size, whole);
  }
  return {};
}

std::string check_id(std::uint64_t id) {
  if (id == 0) return "segment id 0 is never assigned (ids start at 1)";
  return {};
}

// Empty when valid, else "<Path>.<field>: why".
std::string validate_info(const SegmentInfo& m, const Path& p) {
  std::string e;
  if (!(e = check_id(m.id)).empty()) return fail(p, "id", e);
  if (!m.name.empty() && !(e = check_name(m.name)).empty()) return fail(p, "name", e);
  if (!(e = check_kind(m.kind)).empty()) return fail(p, "kind", e);
  if (!(e = check_mode(m.mode)).empty()) return fail(p, "mode", e);
  if (!(e = check_size(m.size)).empty()) return fail(p, "size", e);
  if (!(e = check_device(m.device, m.kind)).empty()) return fail(p, "device", e);
  std::string_view view_field;
  if (!(e = check_view(m.view_offset, m.view_size, m.size, m.kind, view_field)).empty()) {
    return fail(p, view_field, e);
  }
  if (m.mapper_count > m.references) {
    return fail(p, "mapper_count",
                fmt::format("{} connections cannot hold only {} references", m.mapper_count, m.references));
  }
  if (m.mapper_pids.size() > kMaxMapperPids) {
    return fail(p, "mapper_pids", fmt::format("{} elements, at most {}", m.mapper_pids.size(), kMaxMapperPids));
  }
  if (m.mapper_pids.size() > m.mapper_count) {
    return fail(p, "mapper_pids", fmt::format("{} pids but mapper_count is {}", m.mapper_pids.size(), m.mapper_count));
  }
  return {};
}

std::string validate(const Hello& m, const Path& p) {
  if (auto e = check_printable(m.client_name, kMaxClientNameLength); !e.empty()) return fail(p, "client_name", e);
  return {};
}

std::string validate(const HelloReply& m, const Path& p) {
  if (auto e = check_printable(m.broker_version, kMaxBrokerVersionLength); !e.empty()) {
    return fail(p, "broker_version", e);
  }
  return {};
}

std::string validate(const Create& m, const Path& p) {
  std::string e;
  if (!(e = check_name(m.name)).empty()) return fail(p, "name", e);
  if (!(e = check_kind(m.kind)).empty()) return fail(p, "kind", e);
  if (!(e = check_mode(m.mode)).empty()) return fail(p, "mode", e);
  if (!(e = check_size(m.size)).empty()) return fail(p, "size", e);
  if (!(e = check_device(m.device, m.kind)).empty()) return fail(p, "device", e);
  // One object kind at most: a plain segment (0), a semaphore, a channel or a pool control block (proto/shm.hpp).
  if (m.flags != 0 && m.flags != kFlagSemaphore && m.flags != kFlagChannel && m.flags != kFlagPool &&
      m.flags != kFlagCounting) {
    return fail(p, "flags",
                fmt::format("{:#x}; must be 0, {:#x} (semaphore), {:#x} (channel), {:#x} (pool) or {:#x} (counting "
                            "semaphore)",
                            m.flags, kFlagSemaphore, kFlagChannel, kFlagPool, kFlagCounting));
  }
  if (m.flags != 0 && is_device_kind(m.kind)) {
    return fail(p, "flags", fmt::format("{:#x}; semaphores and channels are host memory, not kind {}", m.flags,
                                        static_cast<int>(m.kind)));
  }
  std::string_view view_field;
  if (!(e = check_view(m.view_offset, m.view_size, m.size, m.kind, view_field)).empty()) {
    return fail(p, view_field, e);
  }
  return {};
}

std::string validate(const Open& m, const Path& p) {
  if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  const auto a = static_cast<std::uint8_t>(m.access);
  if (a < 1 || a > 3) {
    return fail(p, "access", fmt::format("invalid Access {} (valid: 1 ReadOnly, 2 ReadWrite, 3 Look)", a));
  }
  return {};
}

std::string validate(const OpenReply& m, const Path& p) { return validate_info(m.info, Path{p.message, "info"}); }

std::string validate(const Close& m, const Path& p) {
  if (auto e = check_id(m.id); !e.empty()) return fail(p, "id", e);
  return {};
}

std::string validate(const UnlinkId& m, const Path& p) {
  if (auto e = check_id(m.id); !e.empty()) return fail(p, "id", e);
  return {};
}

std::string validate(const Unlink& m, const Path& p) {
  if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  return {};
}

std::string validate(const Stat& m, const Path& p) {
  if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  return {};
}

std::string validate(const StatReply& m, const Path& p) { return validate_info(m.info, Path{p.message, "info"}); }

std::string validate(const List& /*m*/, const Path& /*p*/) { return {}; }

std::string validate(const ListReply& m, const Path& p) {
  if (m.entries.size() > kMaxListEntries) {
    return fail(p, "entries", fmt::format("{} elements, at most {}", m.entries.size(), kMaxListEntries));
  }
  for (std::size_t i = 0; i < m.entries.size(); ++i) {
    const Path entry{p.message, "entries", static_cast<int>(i)};
    if (auto e = validate_info(m.entries[i], entry); !e.empty()) return e;
    // Paging (List::after_id = entries.back().id) is only correct when the ids ascend.
    if (i > 0 && m.entries[i].id <= m.entries[i - 1].id) {
      return fail(entry, "id", fmt::format("{} does not ascend (previous {})", m.entries[i].id, m.entries[i - 1].id));
    }
  }
  if (m.more && m.entries.empty()) return fail(p, "more", "set with no entries: the client could not page on");
  return {};
}

std::string validate(const OkReply& /*m*/, const Path& /*p*/) { return {}; }

std::string validate(const Join& m, const Path& p) {
  if (auto e = check_id(m.id); !e.empty()) return fail(p, "id", e);
  if (m.role < static_cast<std::uint8_t>(Role::Signaller) || m.role > static_cast<std::uint8_t>(Role::kLast)) {
    return fail(p, "role", fmt::format("invalid Role {} (valid: 1 Signaller to {})", m.role,
                                       static_cast<std::uint8_t>(Role::kLast)));
  }
  return {};
}

std::string validate(const Announce& m, const Path& p) {
  if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  const auto a = static_cast<std::uint8_t>(m.access);
  if (a < 1 || a > 2) return fail(p, "access", fmt::format("invalid Access {} (valid: 1 ReadOnly, 2 ReadWrite)", a));
  if (auto e = check_size(m.size); !e.empty()) return fail(p, "size", e);
  return {};
}

std::string validate(const Rejoin& m, const Path& p) {
  if (auto e = check_id(m.id); !e.empty()) return fail(p, "id", e);
  if (m.member >= kMaxMembers) return fail(p, "member", fmt::format("{} is not below {}", m.member, kMaxMembers));
  if (m.token == 0) return fail(p, "token", "0 marks a free entry; a member's token is never 0");
  if (m.role < static_cast<std::uint8_t>(Role::Signaller) || m.role > static_cast<std::uint8_t>(Role::kLast)) {
    return fail(p, "role", fmt::format("invalid Role {} (valid: 1 Signaller to {})", m.role,
                                       static_cast<std::uint8_t>(Role::kLast)));
  }
  return {};
}

std::string validate(const Leave& m, const Path& p) {
  if (auto e = check_id(m.id); !e.empty()) return fail(p, "id", e);
  if (m.member >= kMaxMembers) return fail(p, "member", fmt::format("{} is not below {}", m.member, kMaxMembers));
  if (m.token == 0) return fail(p, "token", "0 marks a free entry; a member's token is never 0");
  return {};
}

std::string validate_holder(const HolderInfo& m, const Path& p) {
  if (m.access != static_cast<std::uint8_t>(Access::ReadOnly) &&
      m.access != static_cast<std::uint8_t>(Access::ReadWrite)) {
    return fail(p, "access", fmt::format("invalid Access {} (1 ReadOnly, 2 ReadWrite)", m.access));
  }
  if (m.creator > 1) return fail(p, "creator", fmt::format("{}; must be 0 or 1", m.creator));
  if (m.beat > static_cast<std::uint8_t>(Beat::Hung)) {
    return fail(p, "beat", fmt::format("invalid Beat {} (0 None, 1 Alive, 2 Hung)", m.beat));
  }
  if (m.beat_ms > kMaxHeartbeatMs)
    return fail(p, "beat_ms", fmt::format("{} ms; at most {}", m.beat_ms, kMaxHeartbeatMs));
  return {};
}

std::string validate(const Holders& m, const Path& p) {
  if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  return {};
}

std::string validate(const HoldersReply& m, const Path& p) {
  if (m.entries.size() > kMaxHolders) {
    return fail(p, "entries", fmt::format("{} entries; at most {}", m.entries.size(), kMaxHolders));
  }
  for (std::size_t i = 0; i < m.entries.size(); ++i) {
    if (auto e = validate_holder(m.entries[i], Path{p.message, "entries", static_cast<int>(i)}); !e.empty()) return e;
  }
  return {};
}

std::string validate(const Watch& m, const Path& p) {
  if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  return {};
}

std::string validate(const Event& m, const Path& p) {
  if (m.kind < static_cast<std::uint8_t>(EventKind::Joined) || m.kind > static_cast<std::uint8_t>(EventKind::Lost)) {
    return fail(p, "kind", fmt::format("invalid EventKind {} (1 Joined to 6 Lost)", m.kind));
  }
  if (!m.name.empty()) {
    if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  }
  return validate_holder(m.holder, Path{p.message, "holder"});
}

std::string validate(const Heartbeat& m, const Path& p) {
  if (auto e = check_name(m.name); !e.empty()) return fail(p, "name", e);
  if (m.deadline_ms > kMaxHeartbeatMs) {
    return fail(p, "deadline_ms", fmt::format("{} ms; at most {} (one hour)", m.deadline_ms, kMaxHeartbeatMs));
  }
  return {};
}

std::string validate(const JoinReply& m, const Path& p) {
  if (m.member >= kMaxMembers) return fail(p, "member", fmt::format("{} is not below {}", m.member, kMaxMembers));
  if (m.token == 0) return fail(p, "token", "0 marks a free entry; a member's token is never 0");
  return {};
}

std::string validate(const ErrorReply& m, const Path& p) {
  if (m.code < kFirstErrorCode || m.code > kLastErrorCode) {
    return fail(p, "code",
                fmt::format("{} is not a gpuipc::ErrorCode ({}..{})", m.code, kFirstErrorCode, kLastErrorCode));
  }
  if (m.sys_errno < 0) return fail(p, "sys_errno", fmt::format("{} is negative", m.sys_errno));
  if (m.message.size() > kMaxTextLength) {
    return fail(p, "message", fmt::format("{} bytes, longer than the limit of {}", m.message.size(), kMaxTextLength));
  }
  return {};
}

}  // namespace

namespace detail {

std::string fail(const Path& path, std::string_view field, std::string_view why) {
  return fmt::format("{}: {}", path(field), why);
}

std::string validate(const Body& body, const Path& path) {
  return std::visit([&](const auto& b) { return proto::validate(b, path); }, body);
}

}  // namespace detail

std::string check_create(const Create& create) { return validate(create, Path{"Create"}); }

std::string check_name(std::string_view name) {
  if (name.empty()) return "empty name";
  if (name.size() > kMaxNameLength) {
    return fmt::format("{} bytes, longer than the limit of {}", name.size(), kMaxNameLength);
  }
  if (name.front() == '.' || name.front() == '-') return fmt::format("starts with {}", show_byte(name.front()));
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (!ok) return fmt::format("invalid character {} at {} (allowed: A-Z a-z 0-9 . _ -)", show_byte(c), i);
  }
  return {};
}

std::string_view pool_of_chunk(std::string_view name) noexcept {
  constexpr std::string_view kChunk = ".chunk.";
  const auto at = name.rfind(kChunk);
  if (at == std::string_view::npos || at == 0) return {};
  const std::string_view digits = name.substr(at + kChunk.size());
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string_view::npos) return {};
  return name.substr(0, at);
}

}  // namespace gpuipc::proto
