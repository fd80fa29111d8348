// The byte layout of every message body of the broker wire format (docs/protocol.md): put() writes one, BodyReader
// reads one back structurally (every read bounds-checked, every array count checked against its limit before
// anything is reserved); the checks both run live in codec_validate.cpp.
#include <fmt/format.h>

#include <array>
#include <type_traits>
#include <utility>
#include <variant>

#include "proto/codec_detail.hpp"
#include "proto/messages.hpp"
#include "proto/wire.hpp"

namespace gpuipc::proto {
namespace {

using detail::fail;
using detail::Path;

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
void put(wire::Writer& w, const UnlinkId& m) { w.u64(m.id); }
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
void put(wire::Writer& w, const Leave& m) {
  w.u64(m.id);
  w.u32(m.member);
  w.u32(m.token);
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

  // A page of a reply: the count of `entries` (at most `limit`), each read by `read`, then the bool `more`.
  template <class T>
  bool page(const Path& p, std::size_t limit, bool (BodyReader::*read)(const Path&, T&), std::vector<T>& entries,
            bool& more) {
    std::uint16_t n = 0;
    if (!count(p, "entries", limit, n)) return false;
    entries.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      if (!(this->*read)(Path{p.message, "entries", static_cast<int>(i)}, entries[i])) return false;
    }
    return boolean(p, "more", more);
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
  bool body(const Path& p, UnlinkId& m) { return u64(p, "id", m.id); }
  bool body(const Path& p, Unlink& m) { return string(p, "name", m.name); }
  bool body(const Path& p, Stat& m) { return string(p, "name", m.name); }
  bool body(const Path& p, StatReply& m) { return info(Path{p.message, "info"}, m.info); }
  bool body(const Path& p, List& m) { return u64(p, "after_id", m.after_id); }
  bool body(const Path& p, ListReply& m) { return page(p, kMaxListEntries, &BodyReader::info, m.entries, m.more); }
  bool body(const Path& /*p*/, OkReply& /*m*/) { return true; }
  bool body(const Path& p, Join& m) { return u64(p, "id", m.id) && u8(p, "role", m.role); }
  bool body(const Path& p, JoinReply& m) { return u32(p, "member", m.member) && u32(p, "token", m.token); }
  bool body(const Path& p, Announce& m) {
    return string(p, "name", m.name) && enum8(p, "access", m.access) && u64(p, "size", m.size);
  }
  bool body(const Path& p, Rejoin& m) {
    return u64(p, "id", m.id) && u32(p, "member", m.member) && u32(p, "token", m.token) && u8(p, "role", m.role);
  }
  bool body(const Path& p, Leave& m) {
    return u64(p, "id", m.id) && u32(p, "member", m.member) && u32(p, "token", m.token);
  }
  bool holder(const Path& p, HolderInfo& m) {
    return u32(p, "pid", m.pid) && u32(p, "uid", m.uid) && u32(p, "references", m.references) &&
           u8(p, "access", m.access) && u8(p, "creator", m.creator) && u8(p, "roles", m.roles) &&
           u8(p, "beat", m.beat) && u32(p, "beat_ms", m.beat_ms);
  }
  bool body(const Path& p, Holders& m) { return string(p, "name", m.name); }
  bool body(const Path& p, HoldersReply& m) { return page(p, kMaxHolders, &BodyReader::holder, m.entries, m.more); }
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

// Reads a body of type B, checks nothing trails it, and validates it.
template <class B>
bool decode_as(std::span<const std::byte> bytes, const Path& path, Body& out, std::string& error) {
  B body{};
  BodyReader reader(bytes, error);
  if (!reader.body(path, body)) return false;
  if (reader.remaining() != 0) {
    error = fmt::format("{}: {} trailing bytes after the body", path.message, reader.remaining());
    return false;
  }
  out = std::move(body);
  if (std::string e = detail::validate(out, path); !e.empty()) {
    error = std::move(e);
    return false;
  }
  return true;
}

using Decoder = bool (*)(std::span<const std::byte>, const Path&, Body&, std::string&);

// One decoder per alternative of Body, in MessageType order (codec.cpp checks that order): type T is at T - 1.
template <std::size_t... I>
constexpr std::array<Decoder, sizeof...(I)> decoders(std::index_sequence<I...> /*alternatives*/) {
  return {&decode_as<std::variant_alternative_t<I, Body>>...};
}
constexpr auto kDecoders = decoders(std::make_index_sequence<std::variant_size_v<Body>>());

}  // namespace

namespace detail {

void put_body(wire::Writer& w, const Body& body) {
  std::visit([&](const auto& b) { put(w, b); }, body);
}

bool decode_body(std::span<const std::byte> bytes, MessageType type, Body& out, std::string& error) {
  return kDecoders[static_cast<std::size_t>(type) - 1](bytes, Path{message_name(type)}, out, error);
}

}  // namespace detail
}  // namespace gpuipc::proto
