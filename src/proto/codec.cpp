// The broker wire format: framing of the messages in messages.hpp (the header, encode, decode). Byte layouts:
// docs/protocol.md.
//
// One set of validation functions serves both directions (codec_validate.cpp): decode parses the body structurally
// (codec_body.cpp: every read bounds-checked, every array count checked against its limit before anything is
// reserved) and then runs the same checks encode runs before writing, so whatever encode emits, decode accepts,
// and the error strings are the same on both sides. Error strings are composed only on failure: the success path
// allocates nothing but the decoded strings and vectors themselves.
#include <fmt/format.h>

#include <stdexcept>
#include <type_traits>
#include <utility>

#include "proto/codec_detail.hpp"
#include "proto/messages.hpp"
#include "proto/wire.hpp"

namespace gpuipc::proto {
namespace {

using detail::message_name;

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
    kAt<MessageType::Heartbeat, Heartbeat> && kAt<MessageType::Leave, Leave> && kAt<MessageType::UnlinkId, UnlinkId> &&
    std::variant_size_v<Body> == 24);

// u32 magic + u16 version + u16 type + u32 request_id, then the u16 body_length.
constexpr std::size_t kBodyLengthOffset = 12;
constexpr std::uint16_t kFirstType = 1;
constexpr std::uint16_t kLastType = 24;

struct Header {
  std::uint32_t magic = 0;
  std::uint16_t version = 0;
  std::uint16_t type = 0;
  std::uint32_t request_id = 0;
  std::uint16_t body_length = 0;
  std::uint8_t fd_count = 0;
  std::uint8_t reserved = 0;
};

// The header at the start of `bytes`, which holds at least kHeaderSize bytes (so no read can fail).
Header read_header(std::span<const std::byte> bytes) noexcept {
  wire::Reader r(bytes);
  Header h;
  (void)(r.u32(h.magic) && r.u16(h.version) && r.u16(h.type) && r.u32(h.request_id) && r.u16(h.body_length) &&
         r.u8(h.fd_count) && r.u8(h.reserved));
  return h;
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

namespace detail {

std::string_view message_name(MessageType type) noexcept {
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
    case MessageType::Leave:
      return "Leave";
    case MessageType::UnlinkId:
      return "UnlinkId";
  }
  return "?";
}

}  // namespace detail

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

std::vector<std::byte> encode(const Message& msg, std::size_t fd_count) {
  const MessageType type = type_of(msg.body);
  if (std::string e = check_fd_count(type, fd_count); !e.empty()) {
    throw std::invalid_argument(fmt::format("encode: header.fd_count: {}", e));
  }
  if (std::string e = detail::validate(msg.body, detail::Path{message_name(type)}); !e.empty()) {
    throw std::invalid_argument(fmt::format("encode: {}", e));
  }
  std::vector<std::byte> out;
  out.reserve(kHeaderSize + 64);
  wire::Writer w(out);
  w.u32(kMagic);
  w.u16(kVersion);
  w.u16(static_cast<std::uint16_t>(type));
  w.u32(msg.request_id);
  w.u16(0);  // body_length, patched below
  w.u8(static_cast<std::uint8_t>(fd_count));
  w.u8(0);
  detail::put_body(w, msg.body);
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
  const auto [magic, version, type_raw, request_id, body_length, fd_count, reserved] = read_header(bytes);
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
  if (!detail::decode_body(body, type, msg.body, error)) return false;
  out = std::move(msg);
  return true;
}

std::optional<std::uint16_t> peek_version(std::span<const std::byte> bytes) noexcept {
  if (const auto h = peek_header(bytes)) return h->version;
  return std::nullopt;
}

std::optional<PeekedHeader> peek_header(std::span<const std::byte> bytes) noexcept {
  if (bytes.size() < kHeaderSize) return std::nullopt;
  const Header h = read_header(bytes);
  if (h.magic != kMagic) return std::nullopt;
  return PeekedHeader{h.version, h.request_id, h.fd_count};
}

}  // namespace gpuipc::proto
