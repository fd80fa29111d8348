// What the three files of the broker wire codec share; internal to src/proto. codec.cpp frames messages (the
// header, encode, decode), codec_validate.cpp holds the checks both directions run, codec_body.cpp the byte layout of
// every body (docs/protocol.md).
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

#include "proto/messages.hpp"
#include "proto/wire.hpp"

namespace gpuipc::proto::detail {

/// "Hello", "ListReply", ...: the message's name in errors.
std::string_view message_name(MessageType type) noexcept;

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

/// "<path>.<field>: <why>".
std::string fail(const Path& path, std::string_view field, std::string_view why);

/// Empty when `body` passes every check encode and decode run, else "<Path>.<field>: why" (codec_validate.cpp).
std::string validate(const Body& body, const Path& path);

/// Appends the bytes of `body`, which validate() accepted (codec_body.cpp).
void put_body(wire::Writer& w, const Body& body);

/// Reads a body of `type` that fills `bytes` exactly, then validates it (codec_body.cpp). On failure leaves its
/// one-line reason in `error` and `out` unspecified.
bool decode_body(std::span<const std::byte> bytes, MessageType type, Body& out, std::string& error);

}  // namespace gpuipc::proto::detail
