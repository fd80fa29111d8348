// The broker wire format: encode and decode of the messages in messages.hpp. Byte layouts: docs/protocol.md.
//
// One set of validation functions serves both directions: decode parses the bytes structurally (every read
// bounds-checked, every array count checked against its limit before anything is reserved) and then runs the
// same checks encode runs before writing, so whatever encode emits, decode accepts, and the error strings are
// the same on both sides. Error strings are composed only on failure: the success path allocates nothing but
// the decoded strings and vectors themselves.
#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "gpuipc/error.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"
#include "proto/wire.hpp"

namespace gpuipc::proto {
namespace {

// The variant's alternatives are in MessageType order, so type_of is index + 1.
template <MessageType T, class B>
constexpr bool kAt = std::is_same_v<std::variant_alternative_t<static_cast<std::size_t>(T) - 1, Body>, B>;
static_assert(
    kAt<MessageType::Hello, Hello> && kAt<MessageType::HelloReply, HelloReply> && kAt<MessageType::Create, Create> &&
    kAt<MessageType::Open, Open> && kAt<MessageType::OpenReply, OpenReply> && kAt<MessageType::Close, Close> &&
    kAt<MessageType::Unlink, Unlink> && kAt<MessageType::Stat, Stat> && kAt<MessageType::StatReply, StatReply> &&
    kAt<MessageType::List, List> && kAt<MessageType::ListReply, ListReply> && kAt<MessageType::Ok, OkReply> &&
    kAt<MessageType::Error, ErrorReply> && kAt<MessageType::Join, Join> && kAt<MessageType::JoinReply, JoinReply> &&
    kAt<MessageType::Announce, Announce> && kAt<MessageType::Rejoin, Rejoin> && kAt<MessageType::Holders, Holders> &&
    kAt<MessageType::HoldersReply, HoldersReply> && kAt<MessageType::Watch, Watch> && kAt<MessageType::Event, Event> &&
    kAt<MessageType::Heartbeat, Heartbeat> && std::variant_size_v<Body> == 22);

// u32 magic + u16 version + u16 type + u32 request_id, then the u16 body_length.
constexpr std::size_t kBodyLengthOffset = 12;
constexpr std::uint16_t kFirstType = 1;
constexpr std::uint16_t kLastType = 22;
constexpr std::size_t kMaxClientNameLength = 64;
constexpr std::size_t kMaxBrokerVersionLength = 64;
constexpr std::uint16_t kModeMask = 0777;
constexpr std::uint8_t kFirstErrorCode = static_cast<std::uint8_t>(ErrorCode::InvalidArgument);
// The last ErrorCode enumerator: widen when one is added (a unit test compares with to_string(ErrorCode)).
constexpr std::uint8_t kLastErrorCode = static_cast<std::uint8_t>(ErrorCode::InvalidState);

constexpr std::string_view message_name(MessageType type) noexcept {
  switch (type) {
    case MessageType::Hello:
      return "Hello";
    case MessageType::HelloReply:
      return "HelloReply";
    case MessageType::Create:
      return "Create";
    case MessageType::Open:
      return "Open";
    case MessageType::OpenReply:
      return "OpenReply";
    case MessageType::Close:
      return "Close";
    case MessageType::Unlink:
      return "Unlink";
    case MessageType::Stat:
      return "Stat";
    case MessageType::StatReply:
      return "StatReply";
    case MessageType::List:
      return "List";
    case MessageType::ListReply:
      return "ListReply";
    case MessageType::Ok:
      return "OkReply";
    case MessageType::Error:
      return "ErrorReply";
    case MessageType::Join:
      return "Join";
    case MessageType::JoinReply:
      return "JoinReply";
    case MessageType::Announce:
      return "Announce";
    case MessageType::Rejoin:
      return "Rejoin";
    case MessageType::Holders:
      return "Holders";
    case MessageType::HoldersReply:
      return "HoldersReply";
    case MessageType::Watch:
      return "Watch";
    case MessageType::Event:
      return "Event";
    case MessageType::Heartbeat:
      return "Heartbeat";
  }
  return "?";
}

// Where a field sits ("ListReply.entries[3]"), formatted only when an error names it.
struct Path {
  std::string_view message;
  std::string_view member{};
  int index = -1;

  std::string operator()(std::string_view field) const {
    std::string s(message);
    if (!member.empty()) {
      s += '.';
      s += member;
      if (index >= 0) s += fmt::format("[{}]", index);
    }
    if (!field.empty()) {
      s += '.';
      s += field;
    }
    return s;
  }
};

std::string fail(const Path& path, std::string_view field, std::string_view why) {
  return fmt::format("{}: {}", path(field), why);
}

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
  if (a < 1 || a > 2) return fail(p, "access", fmt::format("invalid Access {} (valid: 1 ReadOnly, 2 ReadWrite)", a));
  return {};
}

std::string validate(const OpenReply& m, const Path& p) { return validate_info(m.info, Path{p.message, "info"}); }

std::string validate(const Close& m, const Path& p) {
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
  if (m.kind < static_cast<std::uint8_t>(EventKind::Joined) || m.kind > static_cast<std::uint8_t>(EventKind::Alive)) {
    return fail(p, "kind", fmt::format("invalid EventKind {} (1 Joined to 5 Alive)", m.kind));
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

// ---- encode ----

void put_string(wire::Writer& w, std::string_view s) {
  // Lengths were validated (all limits are far below 65535) before anything is written.
  w.u16(static_cast<std::uint16_t>(s.size()));
  w.raw(s.data(), s.size());
}

void put_info(wire::Writer& w, const SegmentInfo& m) {
  w.u64(m.id);
  put_string(w, m.name);
  w.u8(static_cast<std::uint8_t>(m.kind));
  w.u16(m.mode);
  w.u64(m.size);
  w.raw(m.device.data(), m.device.size());
  w.u32(m.owner_uid);
  w.u32(m.owner_gid);
  w.u64(m.created_unix_ns);
  w.u32(m.references);
  w.u32(m.mapper_count);
  w.u16(static_cast<std::uint16_t>(m.mapper_pids.size()));
  for (const std::uint32_t pid : m.mapper_pids) w.u32(pid);
  w.u64(m.view_offset);
  w.u64(m.view_size);
}

void put(wire::Writer& w, const Hello& m) {
  w.u32(m.pid);
  put_string(w, m.client_name);
}
void put(wire::Writer& w, const HelloReply& m) {
  w.u32(m.broker_pid);
  w.u32(m.uid);
  w.u32(m.gid);
  put_string(w, m.broker_version);
}
void put(wire::Writer& w, const Create& m) {
  put_string(w, m.name);
  w.u8(static_cast<std::uint8_t>(m.kind));
  w.u16(m.mode);
  w.u64(m.size);
  w.raw(m.device.data(), m.device.size());
  w.u32(m.flags);
  w.u64(m.view_offset);
  w.u64(m.view_size);
}
void put(wire::Writer& w, const Open& m) {
  put_string(w, m.name);
  w.u8(static_cast<std::uint8_t>(m.access));
  w.u32(m.wait_ms);
}
void put(wire::Writer& w, const OpenReply& m) { put_info(w, m.info); }
void put(wire::Writer& w, const Close& m) { w.u64(m.id); }
void put(wire::Writer& w, const Unlink& m) { put_string(w, m.name); }
void put(wire::Writer& w, const Stat& m) { put_string(w, m.name); }
void put(wire::Writer& w, const StatReply& m) { put_info(w, m.info); }
void put(wire::Writer& w, const List& m) { w.u64(m.after_id); }
void put(wire::Writer& w, const ListReply& m) {
  w.u16(static_cast<std::uint16_t>(m.entries.size()));
  for (const SegmentInfo& e : m.entries) put_info(w, e);
  w.u8(m.more ? 1 : 0);
}
void put(wire::Writer& /*w*/, const OkReply& /*m*/) {}
void put(wire::Writer& w, const Join& m) {
  w.u64(m.id);
  w.u8(m.role);
}
void put(wire::Writer& w, const JoinReply& m) {
  w.u32(m.member);
  w.u32(m.token);
}
void put(wire::Writer& w, const Announce& m) {
  put_string(w, m.name);
  w.u8(static_cast<std::uint8_t>(m.access));
  w.u64(m.size);
}
void put(wire::Writer& w, const Rejoin& m) {
  w.u64(m.id);
  w.u32(m.member);
  w.u32(m.token);
  w.u8(m.role);
}
void put_holder(wire::Writer& w, const HolderInfo& m) {
  w.u32(m.pid);
  w.u32(m.uid);
  w.u32(m.references);
  w.u8(m.access);
  w.u8(m.creator);
  w.u8(m.roles);
  w.u8(m.beat);
  w.u32(m.beat_ms);
}
void put(wire::Writer& w, const Holders& m) { put_string(w, m.name); }
void put(wire::Writer& w, const HoldersReply& m) {
  w.u16(static_cast<std::uint16_t>(m.entries.size()));
  for (const HolderInfo& e : m.entries) put_holder(w, e);
  w.u8(m.more ? 1 : 0);
}
void put(wire::Writer& w, const Watch& m) { put_string(w, m.name); }
void put(wire::Writer& w, const Event& m) {
  w.u8(m.kind);
  w.u64(m.id);
  put_string(w, m.name);
  put_holder(w, m.holder);
  w.u64(m.unix_ns);
}
void put(wire::Writer& w, const Heartbeat& m) {
  put_string(w, m.name);
  w.u32(m.deadline_ms);
}
void put(wire::Writer& w, const ErrorReply& m) {
  w.u8(m.code);
  w.i32(m.sys_errno);
  put_string(w, m.message);
}

// ---- decode ----

// Structural reads over the body; the first failure leaves its one-line reason in `error`.
class BodyReader {
 public:
  BodyReader(std::span<const std::byte> body, std::string& error) noexcept : m_r(body), m_error(error) {}

  bool u8(const Path& p, std::string_view field, std::uint8_t& v) { return m_r.u8(v) || truncated(p, field, 1); }
  bool u16(const Path& p, std::string_view field, std::uint16_t& v) { return m_r.u16(v) || truncated(p, field, 2); }
  bool u32(const Path& p, std::string_view field, std::uint32_t& v) { return m_r.u32(v) || truncated(p, field, 4); }
  bool u64(const Path& p, std::string_view field, std::uint64_t& v) { return m_r.u64(v) || truncated(p, field, 8); }
  bool i32(const Path& p, std::string_view field, std::int32_t& v) { return m_r.i32(v) || truncated(p, field, 4); }

  template <class E>
  bool enum8(const Path& p, std::string_view field, E& v) {
    static_assert(std::is_same_v<std::underlying_type_t<E>, std::uint8_t>);
    std::uint8_t raw = 0;
    if (!u8(p, field, raw)) return false;
    v = static_cast<E>(raw);  // fixed underlying type: every byte value is representable; validate() checks range
    return true;
  }

  bool boolean(const Path& p, std::string_view field, bool& v) {
    std::uint8_t raw = 0;
    if (!u8(p, field, raw)) return false;
    if (raw > 1) return error(fail(p, field, fmt::format("{} is not a bool (0 or 1)", raw)));
    v = raw == 1;
    return true;
  }

  bool uuid(const Path& p, std::string_view field, Uuid& v) {
    return m_r.raw(v.data(), v.size()) || truncated(p, field, v.size());
  }

  // Length-prefixed; the string's own limit is checked by validate(). The allocation is bounded by the
  // datagram, which is at most kMaxMessageSize.
  bool string(const Path& p, std::string_view field, std::string& v) {
    std::uint16_t len = 0;
    if (!u16(p, field, len)) return false;
    std::string_view bytes;
    if (!m_r.view(len, bytes)) return truncated(p, field, len);
    v.assign(bytes);
    return true;
  }

  // A u16 count, checked against `limit` before the caller reserves anything.
  bool count(const Path& p, std::string_view field, std::size_t limit, std::uint16_t& n) {
    if (!u16(p, field, n)) return false;
    if (n > limit) return error(fail(p, field, fmt::format("{} elements, at most {}", n, limit)));
    return true;
  }

  bool info(const Path& p, SegmentInfo& m) {
    if (!u64(p, "id", m.id) || !string(p, "name", m.name) || !enum8(p, "kind", m.kind) || !u16(p, "mode", m.mode) ||
        !u64(p, "size", m.size) || !uuid(p, "device", m.device) || !u32(p, "owner_uid", m.owner_uid) ||
        !u32(p, "owner_gid", m.owner_gid) || !u64(p, "created_unix_ns", m.created_unix_ns) ||
        !u32(p, "references", m.references) || !u32(p, "mapper_count", m.mapper_count)) {
      return false;
    }
    std::uint16_t n = 0;
    if (!count(p, "mapper_pids", kMaxMapperPids, n)) return false;
    m.mapper_pids.resize(n);
    for (std::uint32_t& pid : m.mapper_pids) {
      if (!u32(p, "mapper_pids", pid)) return false;
    }
    return u64(p, "view_offset", m.view_offset) && u64(p, "view_size", m.view_size);
  }

  bool body(const Path& p, Hello& m) { return u32(p, "pid", m.pid) && string(p, "client_name", m.client_name); }
  bool body(const Path& p, HelloReply& m) {
    return u32(p, "broker_pid", m.broker_pid) && u32(p, "uid", m.uid) && u32(p, "gid", m.gid) &&
           string(p, "broker_version", m.broker_version);
  }
  bool body(const Path& p, Create& m) {
    return string(p, "name", m.name) && enum8(p, "kind", m.kind) && u16(p, "mode", m.mode) && u64(p, "size", m.size) &&
           uuid(p, "device", m.device) && u32(p, "flags", m.flags) && u64(p, "view_offset", m.view_offset) &&
           u64(p, "view_size", m.view_size);
  }
  bool body(const Path& p, Open& m) {
    return string(p, "name", m.name) && enum8(p, "access", m.access) && u32(p, "wait_ms", m.wait_ms);
  }
  bool body(const Path& p, OpenReply& m) { return info(Path{p.message, "info"}, m.info); }
  bool body(const Path& p, Close& m) { return u64(p, "id", m.id); }
  bool body(const Path& p, Unlink& m) { return string(p, "name", m.name); }
  bool body(const Path& p, Stat& m) { return string(p, "name", m.name); }
  bool body(const Path& p, StatReply& m) { return info(Path{p.message, "info"}, m.info); }
  bool body(const Path& p, List& m) { return u64(p, "after_id", m.after_id); }
  bool body(const Path& p, ListReply& m) {
    std::uint16_t n = 0;
    if (!count(p, "entries", kMaxListEntries, n)) return false;
    m.entries.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (!info(Path{p.message, "entries", static_cast<int>(i)}, m.entries[i])) return false;
    }
    return boolean(p, "more", m.more);
  }
  bool body(const Path& /*p*/, OkReply& /*m*/) { return true; }
  bool body(const Path& p, Join& m) { return u64(p, "id", m.id) && u8(p, "role", m.role); }
  bool body(const Path& p, JoinReply& m) { return u32(p, "member", m.member) && u32(p, "token", m.token); }
  bool body(const Path& p, Announce& m) {
    return string(p, "name", m.name) && enum8(p, "access", m.access) && u64(p, "size", m.size);
  }
  bool body(const Path& p, Rejoin& m) {
    return u64(p, "id", m.id) && u32(p, "member", m.member) && u32(p, "token", m.token) && u8(p, "role", m.role);
  }
  bool holder(const Path& p, HolderInfo& m) {
    return u32(p, "pid", m.pid) && u32(p, "uid", m.uid) && u32(p, "references", m.references) &&
           u8(p, "access", m.access) && u8(p, "creator", m.creator) && u8(p, "roles", m.roles) &&
           u8(p, "beat", m.beat) && u32(p, "beat_ms", m.beat_ms);
  }
  bool body(const Path& p, Holders& m) { return string(p, "name", m.name); }
  bool body(const Path& p, HoldersReply& m) {
    std::uint16_t n = 0;
    if (!count(p, "entries", kMaxHolders, n)) return false;
    m.entries.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (!holder(Path{p.message, "entries", static_cast<int>(i)}, m.entries[i])) return false;
    }
    return boolean(p, "more", m.more);
  }
  bool body(const Path& p, Watch& m) { return string(p, "name", m.name); }
  bool body(const Path& p, Event& m) {
    return u8(p, "kind", m.kind) && u64(p, "id", m.id) && string(p, "name", m.name) &&
           holder(Path{p.message, "holder"}, m.holder) && u64(p, "unix_ns", m.unix_ns);
  }
  bool body(const Path& p, Heartbeat& m) { return string(p, "name", m.name) && u32(p, "deadline_ms", m.deadline_ms); }
  bool body(const Path& p, ErrorReply& m) {
    return u8(p, "code", m.code) && i32(p, "sys_errno", m.sys_errno) && string(p, "message", m.message);
  }

  std::size_t remaining() const noexcept { return m_r.remaining(); }

 private:
  bool truncated(const Path& p, std::string_view field, std::size_t need) {
    return error(
        fail(p, field,
             fmt::format("truncated: needs {} bytes at body offset {}, {} left", need, m_r.offset(), m_r.remaining())));
  }
  bool error(std::string why) {
    m_error = std::move(why);
    return false;
  }

  wire::Reader m_r;
  std::string& m_error;
};

template <class B>
bool decode_body(std::span<const std::byte> bytes, MessageType type, Body& out, std::string& error) {
  const Path path{message_name(type)};
  B body{};
  BodyReader reader(bytes, error);
  if (!reader.body(path, body)) return false;
  if (reader.remaining() != 0) {
    error = fmt::format("{}: {} trailing bytes after the body", path.message, reader.remaining());
    return false;
  }
  if (std::string e = validate(body, path); !e.empty()) {
    error = std::move(e);
    return false;
  }
  out = std::move(body);
  return true;
}

std::string check_fd_count(MessageType type, std::size_t fd_count) {
  if ((type == MessageType::Create || type == MessageType::Announce) && fd_count != 1) {
    return fmt::format("{} carries exactly 1 fd (the memory), not {}", message_name(type), fd_count);
  }
  if (fd_count > max_fds(type)) {
    return fmt::format("{} carries at most {} fds, not {}", message_name(type), max_fds(type), fd_count);
  }
  return {};
}

}  // namespace

MessageType type_of(const Body& body) noexcept { return static_cast<MessageType>(body.index() + 1); }

std::size_t max_fds(MessageType type) noexcept {
  switch (type) {
    case MessageType::Create:
    case MessageType::Announce:
    case MessageType::OpenReply:
    case MessageType::HelloReply:
      return 1;
    default:
      return 0;
  }
}

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

std::vector<std::byte> encode(const Message& msg, std::size_t fd_count) {
  const MessageType type = type_of(msg.body);
  if (std::string e = check_fd_count(type, fd_count); !e.empty()) {
    throw std::invalid_argument(fmt::format("encode: header.fd_count: {}", e));
  }
  std::vector<std::byte> out;
  std::visit(
      [&](const auto& body) {
        if (std::string e = validate(body, Path{message_name(type)}); !e.empty()) {
          throw std::invalid_argument(fmt::format("encode: {}", e));
        }
        out.reserve(kHeaderSize + 64);
        wire::Writer w(out);
        w.u32(kMagic);
        w.u16(kVersion);
        w.u16(static_cast<std::uint16_t>(type));
        w.u32(msg.request_id);
        w.u16(0);  // body_length, patched below
        w.u8(static_cast<std::uint8_t>(fd_count));
        w.u8(0);
        put(w, body);
      },
      msg.body);
  // Unreachable with the current limits (the largest ListReply is ~16 KiB); kept so a future limit change
  // cannot emit something decode refuses.
  if (out.size() > kMaxMessageSize) {
    throw std::invalid_argument(fmt::format("encode: {}: {} bytes exceeds the message limit of {}", message_name(type),
                                            out.size(), kMaxMessageSize));
  }
  wire::Writer(out).patch_u16(kBodyLengthOffset, static_cast<std::uint16_t>(out.size() - kHeaderSize));
  return out;
}

bool decode(std::span<const std::byte> bytes, std::size_t fds_received, Message& out, std::string& error) {
  if (bytes.size() < kHeaderSize) {
    error = fmt::format("header: truncated: {} bytes, a message has at least {}", bytes.size(), kHeaderSize);
    return false;
  }
  if (bytes.size() > kMaxMessageSize) {
    error = fmt::format("message: {} bytes exceeds the limit of {}", bytes.size(), kMaxMessageSize);
    return false;
  }
  wire::Reader r(bytes);
  std::uint32_t magic = 0;
  std::uint16_t version = 0;
  std::uint16_t type_raw = 0;
  std::uint32_t request_id = 0;
  std::uint16_t body_length = 0;
  std::uint8_t fd_count = 0;
  std::uint8_t reserved = 0;
  // Cannot fail: 16 bytes are there.
  r.u32(magic);
  r.u16(version);
  r.u16(type_raw);
  r.u32(request_id);
  r.u16(body_length);
  r.u8(fd_count);
  r.u8(reserved);

  if (magic != kMagic) {
    error = fmt::format("header.magic: {:#010x} is not 'GIPC' ({:#010x}): not a gpuipc peer", magic, kMagic);
    return false;
  }
  if (version != kVersion) {
    error = fmt::format("header.version: version {} is not supported; this side speaks version {}", version, kVersion);
    return false;
  }
  if (type_raw < kFirstType || type_raw > kLastType) {
    error = fmt::format("header.type: unknown message type {}", type_raw);
    return false;
  }
  const auto type = static_cast<MessageType>(type_raw);
  if (reserved != 0) {
    error = fmt::format("header.reserved: {}, must be 0", reserved);
    return false;
  }
  if (bytes.size() - kHeaderSize != body_length) {
    error = fmt::format("header.body_length: {} but the datagram carries {} body bytes", body_length,
                        bytes.size() - kHeaderSize);
    return false;
  }
  if (fd_count != fds_received) {
    error = fmt::format("header.fd_count: {} announced but {} fds arrived", fd_count, fds_received);
    return false;
  }
  if (std::string e = check_fd_count(type, fd_count); !e.empty()) {
    error = fmt::format("header.fd_count: {}", e);
    return false;
  }

  const auto body = bytes.subspan(kHeaderSize);
  Message msg;
  msg.request_id = request_id;
  bool ok = false;
  switch (type) {
    case MessageType::Hello:
      ok = decode_body<Hello>(body, type, msg.body, error);
      break;
    case MessageType::HelloReply:
      ok = decode_body<HelloReply>(body, type, msg.body, error);
      break;
    case MessageType::Create:
      ok = decode_body<Create>(body, type, msg.body, error);
      break;
    case MessageType::Open:
      ok = decode_body<Open>(body, type, msg.body, error);
      break;
    case MessageType::OpenReply:
      ok = decode_body<OpenReply>(body, type, msg.body, error);
      break;
    case MessageType::Close:
      ok = decode_body<Close>(body, type, msg.body, error);
      break;
    case MessageType::Unlink:
      ok = decode_body<Unlink>(body, type, msg.body, error);
      break;
    case MessageType::Stat:
      ok = decode_body<Stat>(body, type, msg.body, error);
      break;
    case MessageType::StatReply:
      ok = decode_body<StatReply>(body, type, msg.body, error);
      break;
    case MessageType::List:
      ok = decode_body<List>(body, type, msg.body, error);
      break;
    case MessageType::ListReply:
      ok = decode_body<ListReply>(body, type, msg.body, error);
      break;
    case MessageType::Ok:
      ok = decode_body<OkReply>(body, type, msg.body, error);
      break;
    case MessageType::Error:
      ok = decode_body<ErrorReply>(body, type, msg.body, error);
      break;
    case MessageType::Join:
      ok = decode_body<Join>(body, type, msg.body, error);
      break;
    case MessageType::JoinReply:
      ok = decode_body<JoinReply>(body, type, msg.body, error);
      break;
    case MessageType::Announce:
      ok = decode_body<Announce>(body, type, msg.body, error);
      break;
    case MessageType::Rejoin:
      ok = decode_body<Rejoin>(body, type, msg.body, error);
      break;
    case MessageType::Holders:
      ok = decode_body<Holders>(body, type, msg.body, error);
      break;
    case MessageType::HoldersReply:
      ok = decode_body<HoldersReply>(body, type, msg.body, error);
      break;
    case MessageType::Watch:
      ok = decode_body<Watch>(body, type, msg.body, error);
      break;
    case MessageType::Event:
      ok = decode_body<Event>(body, type, msg.body, error);
      break;
    case MessageType::Heartbeat:
      ok = decode_body<Heartbeat>(body, type, msg.body, error);
      break;
  }
  if (!ok) return false;
  out = std::move(msg);
  return true;
}

std::optional<std::uint16_t> peek_version(std::span<const std::byte> bytes) noexcept {
  if (bytes.size() < kHeaderSize) return std::nullopt;
  wire::Reader r(bytes);
  std::uint32_t magic = 0;
  std::uint16_t version = 0;
  r.u32(magic);
  r.u16(version);
  if (magic != kMagic) return std::nullopt;
  return version;
}

}  // namespace gpuipc::proto
