// Unit tests of the broker wire format (src/proto): round trips at the limits, every validation rule named in
// docs/protocol.md, every prefix and every single-byte mutation of valid messages. Also writes the fuzz seed
// corpus when GPUIPC_WRITE_CORPUS=<dir> is set (see docs/protocol.md).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpuipc/error.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"

namespace gpuipc::proto {
namespace {

using Bytes = std::vector<std::byte>;

// Header offsets: u32 magic, u16 version, u16 type, u32 request_id, u16 body_length, u8 fd_count, u8 reserved.
constexpr std::size_t kBodyLength = 12;
constexpr std::size_t kFdCount = 14;

// ---- An independent little-endian serializer with no validation ----
// It restates the layout of docs/protocol.md, so the codec is checked against the document rather than
// against itself, and it can build the invalid messages the codec refuses to encode.
class Raw {
 public:
  Raw& u8(std::uint64_t v) { return le(v, 1); }
  Raw& u16(std::uint64_t v) { return le(v, 2); }
  Raw& u32(std::uint64_t v) { return le(v, 4); }
  Raw& u64(std::uint64_t v) { return le(v, 8); }
  Raw& str(const std::string& s) {
    u16(s.size());
    for (char c : s) m_b.push_back(static_cast<std::byte>(c));
    return *this;
  }
  Raw& uuid(const Uuid& u) {
    for (std::uint8_t c : u) m_b.push_back(static_cast<std::byte>(c));
    return *this;
  }
  Raw& info(const SegmentInfo& m) {
    u64(m.id).str(m.name).u8(static_cast<std::uint8_t>(m.kind)).u16(m.mode).u64(m.size).uuid(m.device);
    u32(m.owner_uid).u32(m.owner_gid).u64(m.created_unix_ns).u32(m.references).u32(m.mapper_count);
    u16(m.mapper_pids.size());
    for (auto pid : m.mapper_pids) u32(pid);
    u64(m.view_offset).u64(m.view_size);
    return *this;
  }
  // HolderInfo as docs/protocol.md lays it out (20 bytes).
  Raw& holder(const HolderInfo& m) {
    return u32(m.pid).u32(m.uid).u32(m.references).u8(m.access).u8(m.creator).u8(m.roles).u8(m.beat).u32(m.beat_ms);
  }
  Bytes take() { return std::move(m_b); }

 private:
  Raw& le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) m_b.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
    return *this;
  }
  Bytes m_b;
};

Bytes raw_body(const Body& body) {
  Raw r;
  std::visit(
      [&](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, Hello>) {
          r.u32(m.pid).str(m.client_name);
        } else if constexpr (std::is_same_v<T, HelloReply>) {
          r.u32(m.broker_pid).u32(m.uid).u32(m.gid).str(m.broker_version);
        } else if constexpr (std::is_same_v<T, Create>) {
          r.str(m.name).u8(static_cast<std::uint8_t>(m.kind)).u16(m.mode).u64(m.size).uuid(m.device).u32(m.flags);
          r.u64(m.view_offset).u64(m.view_size);
        } else if constexpr (std::is_same_v<T, Open>) {
          r.str(m.name).u8(static_cast<std::uint8_t>(m.access)).u32(m.wait_ms);
        } else if constexpr (std::is_same_v<T, OpenReply> || std::is_same_v<T, StatReply>) {
          r.info(m.info);
        } else if constexpr (std::is_same_v<T, Close> || std::is_same_v<T, UnlinkId>) {
          r.u64(m.id);
        } else if constexpr (std::is_same_v<T, Unlink> || std::is_same_v<T, Stat>) {
          r.str(m.name);
        } else if constexpr (std::is_same_v<T, List>) {
          r.u64(m.after_id);
        } else if constexpr (std::is_same_v<T, ListReply>) {
          r.u16(m.entries.size());
          for (const auto& e : m.entries) r.info(e);
          r.u8(m.more ? 1 : 0);
        } else if constexpr (std::is_same_v<T, OkReply>) {
        } else if constexpr (std::is_same_v<T, ErrorReply>) {
          r.u8(m.code).u32(static_cast<std::uint32_t>(m.sys_errno)).str(m.message);
        } else if constexpr (std::is_same_v<T, Join>) {
          r.u64(m.id).u8(m.role);
        } else if constexpr (std::is_same_v<T, JoinReply>) {
          r.u32(m.member).u32(m.token);
        } else if constexpr (std::is_same_v<T, Announce>) {
          r.str(m.name).u8(static_cast<std::uint8_t>(m.access)).u64(m.size);
        } else if constexpr (std::is_same_v<T, Rejoin>) {
          r.u64(m.id).u32(m.member).u32(m.token).u8(m.role);
        } else if constexpr (std::is_same_v<T, Leave>) {
          r.u64(m.id).u32(m.member).u32(m.token);
        } else if constexpr (std::is_same_v<T, Holders> || std::is_same_v<T, Watch>) {
          r.str(m.name);
        } else if constexpr (std::is_same_v<T, HoldersReply>) {
          r.u16(m.entries.size());
          for (const auto& e : m.entries) r.holder(e);
          r.u8(m.more ? 1 : 0);
        } else if constexpr (std::is_same_v<T, Event>) {
          r.u8(m.kind).u64(m.id).str(m.name).holder(m.holder).u64(m.unix_ns);
        } else if constexpr (std::is_same_v<T, Heartbeat>) {
          r.str(m.name).u32(m.deadline_ms);
        }
      },
      body);
  return r.take();
}

Bytes raw_header(std::uint64_t type, std::uint64_t body_length, std::uint64_t fd_count, std::uint64_t request_id = 7,
                 std::uint64_t magic = kMagic, std::uint64_t version = kVersion, std::uint64_t reserved = 0) {
  return Raw().u32(magic).u16(version).u16(type).u32(request_id).u16(body_length).u8(fd_count).u8(reserved).take();
}

Bytes raw_message(const Body& body, std::size_t fds, std::uint32_t request_id = 7) {
  Bytes body_bytes = raw_body(body);
  Bytes out = raw_header(static_cast<std::uint16_t>(type_of(body)), body_bytes.size(), fds, request_id);
  out.insert(out.end(), body_bytes.begin(), body_bytes.end());
  return out;
}

Bytes encode_unchecked_error(std::uint8_t code) { return raw_message(ErrorReply{code, 0, "m"}, 0); }

void put_u16(Bytes& b, std::size_t at, std::uint16_t v) {
  b[at] = static_cast<std::byte>(v & 0xff);
  b[at + 1] = static_cast<std::byte>(v >> 8);
}

// ---- Messages ----

Uuid some_uuid() {
  Uuid u{};
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = static_cast<std::uint8_t>(0xA0 + i);
  return u;
}

std::string max_name() {
  std::string s;
  const std::string alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-";
  for (std::size_t i = 0; i < kMaxNameLength; ++i) s += alphabet[i % alphabet.size()];
  return s;
}

SegmentInfo small_info(std::uint64_t id = 1) {
  SegmentInfo i;
  i.id = id;
  i.name = "weights-" + std::to_string(id);
  i.kind = Kind::Host;
  i.mode = 0640;
  i.size = 4096;
  i.owner_uid = 1000;
  i.owner_gid = 1000;
  i.created_unix_ns = 1'700'000'000'123'456'789ULL;
  i.references = 2;
  i.mapper_count = 2;
  i.mapper_pids = {4242, 4343};
  return i;
}

// Every field at its widest: the longest name, all 16 pids, maximal integers.
SegmentInfo max_info(std::uint64_t id) {
  SegmentInfo i;
  i.id = id;
  i.name = max_name();
  i.kind = Kind::Device;
  i.mode = 0777;
  i.size = kMaxSegmentSize;
  i.device = some_uuid();
  i.owner_uid = 0xFFFFFFFF;
  i.owner_gid = 0xFFFFFFFE;
  i.created_unix_ns = ~0ULL;
  i.references = 0xFFFFFFFF;
  i.mapper_count = 0xFFFFFFFF;
  i.view_offset = kMaxSegmentSize - 1;
  i.view_size = 1;
  for (std::size_t k = 0; k < kMaxMapperPids; ++k) i.mapper_pids.push_back(0xFFFFFF00U + static_cast<std::uint32_t>(k));
  return i;
}

ListReply max_list_reply() {
  ListReply r;
  for (std::size_t k = 0; k < kMaxListEntries; ++k) r.entries.push_back(max_info(~0ULL - kMaxListEntries + k + 1));
  r.more = true;
  return r;
}

struct Example {
  std::string label;
  Message msg;
  std::size_t fds = 0;
};

// Valid messages of every type, at typical values and at the boundaries.
std::vector<Example> examples() {
  std::vector<Example> v;
  auto add = [&](std::string label, Body body, std::size_t fds = 0, std::uint32_t rid = 7) {
    v.push_back(Example{std::move(label), Message{rid, std::move(body)}, fds});
  };
  add("hello", Hello{1234, "python3"});
  add("hello_empty_name", Hello{0, ""}, 0, 0);
  add("hello_max", Hello{0xFFFFFFFF, std::string(64, '~')}, 0, 0xFFFFFFFF);
  add("hello_reply", HelloReply{99, 1000, 100, "0.1.0"}, 1);
  add("hello_reply_no_status", HelloReply{99, 1000, 100, "0.1.0"}, 0);
  add("hello_reply_max", HelloReply{0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, std::string(64, ' ')});
  add("create", Create{"frames", Kind::Device, 0600, 1 << 20, some_uuid(), 0}, 1);
  add("create_host", Create{"a", Kind::Host, 0, 1, Uuid{}, 0}, 1);
  add("create_pinned_max", Create{max_name(), Kind::HostPinned, 0777, kMaxSegmentSize, Uuid{}, 0}, 1);
  add("create_device_ipc", Create{"tensor", Kind::DeviceIpc, 0640, 1000, some_uuid(), 0}, 1);
  // Adopted VMM memory: bytes [4096, 4096 + 100) of a 2 MiB allocation; and a view reaching its very end.
  add("create_view", Create{"w", Kind::Device, 0600, 2 << 20, some_uuid(), 0, 4096, 100}, 1);
  add("create_view_to_end", Create{"w", Kind::Device, 0600, kMaxSegmentSize, some_uuid(), 0, kMaxSegmentSize - 1, 1},
      1);
  add("open", Open{"frames", Access::ReadOnly, 0});
  add("open_wait", Open{max_name(), Access::ReadWrite, 0xFFFFFFFF});
  add("open_reply", OpenReply{small_info()}, 1);
  add("open_reply_to_create", OpenReply{small_info()}, 0);
  add("open_reply_max", OpenReply{max_info(~0ULL)}, 1);
  SegmentInfo unlinked = small_info(5);
  unlinked.name.clear();
  unlinked.mapper_pids.clear();
  unlinked.references = 0;
  unlinked.mapper_count = 0;
  add("open_reply_unlinked", OpenReply{unlinked}, 1);
  add("close", Close{1});
  add("close_max", Close{~0ULL});
  add("unlink", Unlink{"frames"});
  add("unlink_max", Unlink{max_name()});
  add("unlink_id", UnlinkId{7});
  add("unlink_id_max", UnlinkId{~0ULL});
  add("stat", Stat{"a.b_c-9"});
  add("stat_reply", StatReply{small_info(3)});
  add("stat_reply_max", StatReply{max_info(77)});
  SegmentInfo ipc = small_info(11);
  ipc.kind = Kind::DeviceIpc;
  ipc.device = some_uuid();
  add("stat_reply_device_ipc", StatReply{ipc});
  SegmentInfo view = small_info(12);
  view.kind = Kind::Device;
  view.device = some_uuid();
  view.size = 20 << 20;
  view.view_offset = (20 << 20) - 8;
  view.view_size = 8;
  add("open_reply_view", OpenReply{view}, 1);
  add("list", List{0});
  add("list_after", List{~0ULL});
  add("list_reply_empty", ListReply{{}, false});
  add("list_reply", ListReply{{small_info(1), small_info(2), unlinked}, true});
  add("list_reply_max", max_list_reply());
  add("ok", OkReply{});
  add("error", ErrorReply{static_cast<std::uint8_t>(ErrorCode::PermissionDenied), 13,
                          "segment 'x' is mode 0600 owned by uid 1000; you are uid 1001"});
  add("error_empty", ErrorReply{static_cast<std::uint8_t>(ErrorCode::InvalidArgument), 0, ""});
  add("error_max",
      ErrorReply{static_cast<std::uint8_t>(ErrorCode::Protocol), 0x7FFFFFFF, std::string(kMaxTextLength, 'x')});
  add("join", Join{7, static_cast<std::uint8_t>(Role::Producer)});
  add("join_holder", Join{~0ULL, static_cast<std::uint8_t>(Role::Holder)});
  add("join_reply", JoinReply{3, 0xDEADBEEF});
  add("announce", Announce{"weights", Access::ReadOnly, 1 << 30}, 1);
  add("rejoin", Rejoin{9, 63, 77, static_cast<std::uint8_t>(Role::Consumer)});
  add("leave", Leave{9, 63, 77});
  add("holders", Holders{"frames"});
  const HolderInfo holder{4242, 1000, 2, 2, 1, static_cast<std::uint8_t>(1U << 4), 2, 100};
  add("holders_reply", HoldersReply{{holder, HolderInfo{}}, false});
  add("holders_reply_max", HoldersReply{std::vector<HolderInfo>(kMaxHolders, holder), true});
  add("watch", Watch{max_name()});
  add("event", Event{3, 7, "frames", holder, 1'795'449'731'901'000'000ULL});
  add("event_unlinked", Event{1, 7, "", HolderInfo{}, 0});
  add("heartbeat", Heartbeat{"frames", kMaxHeartbeatMs});
  add("heartbeat_stop", Heartbeat{"frames", 0});
  return v;
}

Message decode_ok(const Bytes& bytes, std::size_t fds) {
  Message out;
  std::string error;
  EXPECT_TRUE(decode(bytes, fds, out, error)) << error;
  EXPECT_TRUE(error.empty()) << error;
  return out;
}

// Decodes bytes that must be refused; returns the reason.
std::string decode_error(const Bytes& bytes, std::size_t fds) {
  Message out;
  std::string error;
  const bool ok = decode(bytes, fds, out, error);
  EXPECT_FALSE(ok) << "accepted a bad message";
  EXPECT_FALSE(error.empty());
  EXPECT_EQ(error.find('\n'), std::string::npos) << "error is not one line: " << error;
  return error;
}

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// ---- Basics ----

TEST(Proto, TypeOfFollowsTheVariant) {
  EXPECT_EQ(type_of(Hello{}), MessageType::Hello);
  EXPECT_EQ(type_of(HelloReply{}), MessageType::HelloReply);
  EXPECT_EQ(type_of(Create{}), MessageType::Create);
  EXPECT_EQ(type_of(Open{}), MessageType::Open);
  EXPECT_EQ(type_of(OpenReply{}), MessageType::OpenReply);
  EXPECT_EQ(type_of(Close{}), MessageType::Close);
  EXPECT_EQ(type_of(Unlink{}), MessageType::Unlink);
  EXPECT_EQ(type_of(Stat{}), MessageType::Stat);
  EXPECT_EQ(type_of(StatReply{}), MessageType::StatReply);
  EXPECT_EQ(type_of(List{}), MessageType::List);
  EXPECT_EQ(type_of(ListReply{}), MessageType::ListReply);
  EXPECT_EQ(type_of(OkReply{}), MessageType::Ok);
  EXPECT_EQ(type_of(ErrorReply{}), MessageType::Error);
}

// A side tells "another release" from garbage by the header alone, whatever the version (docs/protocol.md).
TEST(Proto, PeekVersionReadsAnyVersionOfAGpuipcHeader) {
  Bytes hello = encode(Message{1, Hello{1, "x"}});
  EXPECT_EQ(peek_version(hello), kVersion);
  hello[4] = std::byte{7};
  hello[5] = std::byte{1};
  EXPECT_EQ(peek_version(hello), 0x107);
  std::string why;
  Message out;
  EXPECT_FALSE(decode(hello, 0, out, why));
  EXPECT_NE(why.find("header.version"), std::string::npos) << why;
  hello[0] = std::byte{0};
  EXPECT_EQ(peek_version(hello), std::nullopt);                       // not 'GIPC'
  EXPECT_EQ(peek_version(Bytes(15, std::byte{0x47})), std::nullopt);  // shorter than a header
}

TEST(Proto, MaxFds) {
  EXPECT_EQ(max_fds(MessageType::Create), 1u);
  EXPECT_EQ(max_fds(MessageType::OpenReply), 1u);
  EXPECT_EQ(max_fds(MessageType::HelloReply), 1u);  // the status page
  for (auto t :
       {MessageType::Hello, MessageType::Open, MessageType::Close, MessageType::Unlink, MessageType::Stat,
        MessageType::StatReply, MessageType::List, MessageType::ListReply, MessageType::Ok, MessageType::Error}) {
    EXPECT_EQ(max_fds(t), 0u) << static_cast<int>(t);
  }
  EXPECT_EQ(max_fds(static_cast<MessageType>(999)), 0u);
}

TEST(Proto, CheckNameAccepts) {
  for (const std::string& n : {std::string("a"), std::string("A.b_c-9"), std::string("a..b"), std::string("x-"),
                               std::string("_"), std::string("0"), max_name()}) {
    EXPECT_EQ(check_name(n), "") << n;
  }
}

TEST(Proto, CheckNameRefuses) {
  EXPECT_NE(check_name("").find("empty"), std::string::npos);
  EXPECT_NE(check_name(".").find("starts with '.'"), std::string::npos);
  EXPECT_NE(check_name("..").find("starts with '.'"), std::string::npos);
  EXPECT_NE(check_name(".hidden").find("starts with '.'"), std::string::npos);
  EXPECT_NE(check_name("-rf").find("starts with '-'"), std::string::npos);
  EXPECT_TRUE(starts_with(check_name("abc/def"), "invalid character '/' at 3")) << check_name("abc/def");
  EXPECT_TRUE(starts_with(check_name("a b"), "invalid character ' ' at 1"));
  EXPECT_TRUE(starts_with(check_name(std::string("ab\0", 3)), "invalid character 0x00 at 2"));
  EXPECT_TRUE(starts_with(check_name("a\n"), "invalid character 0x0a at 1"));
  EXPECT_TRUE(starts_with(check_name("caf\xc3\xa9"), "invalid character 0xc3 at 3"));
  EXPECT_NE(check_name(max_name() + "x").find("129 bytes"), std::string::npos);
}

TEST(Proto, ErrorCodeRangeMatchesTheEnum) {
  // decode accepts exactly the ErrorCode values gpuipc knows; a new enumerator must widen the codec's range.
  for (int code = 0; code < 256; ++code) {
    const bool known = to_string(static_cast<ErrorCode>(code)) != "Unknown";
    Message out;
    std::string error;
    const bool accepted = decode(encode_unchecked_error(static_cast<std::uint8_t>(code)), 0, out, error);
    EXPECT_EQ(accepted, known) << "code " << code << ": " << error;
  }
}

// ---- Round trips ----

TEST(Proto, RoundTripEveryExample) {
  std::vector<bool> seen(std::variant_size_v<Body> + 1, false);
  for (const Example& ex : examples()) {
    SCOPED_TRACE(ex.label);
    const Bytes bytes = encode(ex.msg, ex.fds);
    seen[static_cast<std::size_t>(type_of(ex.msg.body))] = true;
    // Exactly the layout of docs/protocol.md (as restated by Raw).
    EXPECT_EQ(bytes, raw_message(ex.msg.body, ex.fds, ex.msg.request_id));
    ASSERT_GE(bytes.size(), kHeaderSize);
    EXPECT_LE(bytes.size(), kMaxMessageSize);
    EXPECT_EQ(static_cast<std::size_t>(bytes[kBodyLength]) | (static_cast<std::size_t>(bytes[kBodyLength + 1]) << 8),
              bytes.size() - kHeaderSize);
    EXPECT_EQ(static_cast<std::size_t>(bytes[kFdCount]), ex.fds);
    const Message back = decode_ok(bytes, ex.fds);
    EXPECT_EQ(back, ex.msg);
    EXPECT_EQ(encode(back, ex.fds), bytes);
  }
  for (std::size_t t = 1; t <= std::variant_size_v<Body>; ++t) EXPECT_TRUE(seen[t]) << "no example of type " << t;
}

TEST(Proto, GoldenBytes) {
  // Hello{pid 0x01020304, "ab"}, request 0x0A0B0C0D: pins the header and the little-endian order.
  const Bytes hello = encode(Message{0x0A0B0C0D, Hello{0x01020304, "ab"}});
  const std::vector<int> want = {'G', 'I', 'P', 'C', 2,    0,    1,    0,    0x0D, 0x0C, 0x0B, 0x0A,
                                 8,   0,   0,   0,   0x04, 0x03, 0x02, 0x01, 2,    0,    'a',  'b'};
  ASSERT_EQ(hello.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(static_cast<int>(hello[i]), want[i]) << "byte " << i;

  // Create body: 2+len name, 1 kind, 2 mode, 8 size, 16 device, 4 flags, 8 view_offset, 8 view_size.
  const Bytes create = encode(Message{1, Create{"x", Kind::Host, 0644, 0x1122334455, Uuid{}, 0}}, 1);
  ASSERT_EQ(create.size(), kHeaderSize + 2 + 1 + 1 + 2 + 8 + 16 + 4 + 8 + 8);
  EXPECT_EQ(static_cast<int>(create[kFdCount]), 1);
  EXPECT_EQ(static_cast<int>(create[16 + 3]), 2);  // kind Host
  EXPECT_EQ(static_cast<int>(create[16 + 4]), 0644 & 0xff);
  EXPECT_EQ(static_cast<int>(create[16 + 5]), 0644 >> 8);
  EXPECT_EQ(static_cast<int>(create[16 + 6]), 0x55);  // size, low byte first
  EXPECT_EQ(static_cast<int>(create[16 + 10]), 0x11);

  // ErrorReply: negative values never appear, but the i32 is two's complement little-endian.
  const Bytes err = encode(Message{2, ErrorReply{14, 0x01000002, "m"}});
  const std::vector<int> want_err = {14, 2, 0, 0, 1, 1, 0, 'm'};
  ASSERT_EQ(err.size(), kHeaderSize + want_err.size());
  for (std::size_t i = 0; i < want_err.size(); ++i) EXPECT_EQ(static_cast<int>(err[16 + i]), want_err[i]);
}

TEST(Proto, LargestListReplyFitsTheMessageLimit) {
  const Message m{1, max_list_reply()};
  const Bytes bytes = encode(m);
  // The widest SegmentInfo: 8 id + 2+128 name + 1 kind + 2 mode + 8 size + 16 device + 4 uid + 4 gid
  // + 8 created + 4 references + 4 mapper_count + 2+16*4 pids + 8 view_offset + 8 view_size = 271 bytes.
  constexpr std::size_t kMaxInfo =
      8 + 2 + kMaxNameLength + 1 + 2 + 8 + 16 + 4 + 4 + 8 + 4 + 4 + 2 + 4 * kMaxMapperPids + 8 + 8;
  static_assert(kMaxInfo == 271);
  constexpr std::size_t kMaxListReply = kHeaderSize + 2 + kMaxListEntries * kMaxInfo + 1;
  static_assert(kMaxListReply <= kMaxMessageSize, "the broker's biggest reply must fit");
  EXPECT_EQ(bytes.size(), kMaxListReply);
  EXPECT_LE(bytes.size(), kMaxMessageSize);
  EXPECT_EQ(decode_ok(bytes, 0), m);
  // And the biggest ErrorReply.
  constexpr std::size_t kMaxError = kHeaderSize + 1 + 4 + 2 + kMaxTextLength;
  static_assert(kMaxError <= kMaxMessageSize);
}

// ---- Header validation ----

TEST(Proto, RefusesEveryHeaderPrefix) {
  const Bytes ok = encode(Message{1, OkReply{}});
  for (std::size_t n = 0; n < kHeaderSize; ++n) {
    const std::string e = decode_error(Bytes(ok.begin(), ok.begin() + static_cast<std::ptrdiff_t>(n)), 0);
    EXPECT_TRUE(starts_with(e, "header: truncated")) << e;
  }
  decode_ok(ok, 0);
}

TEST(Proto, RefusesBadMagic) {
  Bytes b = encode(Message{1, Close{5}});
  b[0] = std::byte{'X'};
  EXPECT_TRUE(starts_with(decode_error(b, 0), "header.magic:"));
  // Big-endian magic is not accepted either.
  Bytes be = raw_header(static_cast<int>(MessageType::Ok), 0, 0, 1, 0x47495043);
  EXPECT_TRUE(starts_with(decode_error(be, 0), "header.magic:"));
}

TEST(Proto, RefusesOtherVersions) {
  for (std::uint16_t v : {0, 1, 3, 0x100, 0xFFFF}) {
    const Bytes b = raw_header(static_cast<int>(MessageType::Ok), 0, 0, 1, kMagic, v);
    const std::string e = decode_error(b, 0);
    EXPECT_TRUE(starts_with(e, "header.version:")) << e;
    EXPECT_NE(e.find("speaks version 2"), std::string::npos) << e;
  }
}

TEST(Proto, RefusesUnknownTypes) {
  for (std::uint16_t t : {0, 25, 999, 0xFFFF}) {
    const std::string e = decode_error(raw_header(t, 0, 0), 0);
    EXPECT_TRUE(starts_with(e, "header.type: unknown message type " + std::to_string(t))) << e;
  }
}

TEST(Proto, RefusesReservedByte) {
  for (int r : {1, 0x80, 0xFF}) {
    const std::string e = decode_error(raw_header(static_cast<int>(MessageType::Ok), 0, 0, 1, kMagic, kVersion, r), 0);
    EXPECT_TRUE(starts_with(e, "header.reserved:")) << e;
  }
}

TEST(Proto, RefusesLengthMismatchBothWays) {
  const Bytes good = encode(Message{1, Unlink{"frames"}});
  Bytes longer = good;
  longer.push_back(std::byte{0});  // one byte more than body_length says
  EXPECT_TRUE(starts_with(decode_error(longer, 0), "header.body_length:"));
  Bytes shorter = good;
  shorter.pop_back();  // one byte less than body_length says
  EXPECT_TRUE(starts_with(decode_error(shorter, 0), "header.body_length:"));
  Bytes claims_more = good;
  put_u16(claims_more, kBodyLength, 0xFFFF);
  EXPECT_TRUE(starts_with(decode_error(claims_more, 0), "header.body_length:"));
}

TEST(Proto, RefusesOversizedDatagram) {
  Bytes big = raw_header(static_cast<int>(MessageType::Error), 0xFFFF, 0);
  big.resize(kHeaderSize + 0xFFFF);
  EXPECT_TRUE(starts_with(decode_error(big, 0), "message:"));
  Bytes just_over(kMaxMessageSize + 1);
  EXPECT_TRUE(starts_with(decode_error(just_over, 0), "message:"));
}

TEST(Proto, RefusesFdCountMismatch) {
  const Bytes close = encode(Message{1, Close{5}});
  EXPECT_TRUE(starts_with(decode_error(close, 1), "header.fd_count: 0 announced but 1 fds arrived"));
  EXPECT_TRUE(starts_with(decode_error(close, 300), "header.fd_count:"));

  const Bytes create = encode(Message{1, Create{"x", Kind::Host, 0600, 1, Uuid{}, 0}}, 1);
  EXPECT_TRUE(starts_with(decode_error(create, 0), "header.fd_count: 1 announced but 0 fds arrived"));
  EXPECT_TRUE(starts_with(decode_error(create, 2), "header.fd_count:"));

  // Create announcing 0 fds and getting 0.
  const Bytes create0 = raw_message(Create{"x", Kind::Host, 0600, 1, Uuid{}, 0}, 0);
  EXPECT_TRUE(starts_with(decode_error(create0, 0), "header.fd_count: Create carries exactly 1 fd"))
      << decode_error(create0, 0);
  const Bytes create2 = raw_message(Create{"x", Kind::Host, 0600, 1, Uuid{}, 0}, 2);
  EXPECT_TRUE(starts_with(decode_error(create2, 2), "header.fd_count: Create carries exactly 1 fd"));

  // Types that carry none, announcing one that arrived.
  const Bytes close1 = raw_message(Close{5}, 1);
  EXPECT_TRUE(starts_with(decode_error(close1, 1), "header.fd_count: Close carries at most 0 fds"));
  const Bytes reply2 = raw_message(OpenReply{small_info()}, 2);
  EXPECT_TRUE(starts_with(decode_error(reply2, 2), "header.fd_count: OpenReply carries at most 1 fds"));
  const Bytes hello2 = raw_message(HelloReply{1, 2, 3, "0.1.0"}, 2);
  EXPECT_TRUE(starts_with(decode_error(hello2, 2), "header.fd_count: HelloReply carries at most 1 fds"));
  const Bytes ok1 = raw_message(OkReply{}, 1);
  EXPECT_TRUE(starts_with(decode_error(ok1, 1), "header.fd_count: OkReply carries at most 0 fds"));

  EXPECT_THROW(encode(Message{1, Create{"x", Kind::Host, 0600, 1, Uuid{}, 0}}, 0), std::invalid_argument);
  EXPECT_THROW(encode(Message{1, Close{5}}, 1), std::invalid_argument);
  EXPECT_THROW(encode(Message{1, OpenReply{small_info()}}, 2), std::invalid_argument);
}

// ---- Truncation and trailing bytes ----

TEST(Proto, RefusesEveryPrefixOfEveryExample) {
  for (const Example& ex : examples()) {
    SCOPED_TRACE(ex.label);
    const Bytes full = encode(ex.msg, ex.fds);
    for (std::size_t n = 0; n < full.size(); ++n) {
      Bytes prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
      Message out;
      std::string error;
      ASSERT_FALSE(decode(prefix, ex.fds, out, error)) << "prefix " << n;
      ASSERT_FALSE(error.empty());
      if (n >= kHeaderSize) {
        // Make the header agree with the shorter body: now the body reader itself must notice.
        put_u16(prefix, kBodyLength, static_cast<std::uint16_t>(n - kHeaderSize));
        ASSERT_FALSE(decode(prefix, ex.fds, out, error)) << "prefix " << n;
        ASSERT_NE(error.find("truncated"), std::string::npos) << "prefix " << n << ": " << error;
      }
    }
  }
}

TEST(Proto, TruncationNamesTheField) {
  Bytes b = encode(Message{1, Create{"abc", Kind::Host, 0600, 1, Uuid{}, 0}}, 1);
  b.resize(kHeaderSize + 2 + 3 + 1 + 2 + 3);  // stops inside size
  put_u16(b, kBodyLength, static_cast<std::uint16_t>(b.size() - kHeaderSize));
  EXPECT_TRUE(starts_with(decode_error(b, 1), "Create.size: truncated")) << decode_error(b, 1);

  Bytes l = encode(Message{1, ListReply{{small_info(1), small_info(2)}, false}});
  l.resize(l.size() - 20);
  put_u16(l, kBodyLength, static_cast<std::uint16_t>(l.size() - kHeaderSize));
  EXPECT_TRUE(starts_with(decode_error(l, 0), "ListReply.entries[1].")) << decode_error(l, 0);

  // A string whose length runs past the end.
  Bytes s = raw_header(static_cast<int>(MessageType::Stat), 4, 0);
  for (int v : {10, 0, int{'a'}, int{'b'}}) s.push_back(static_cast<std::byte>(v));
  EXPECT_TRUE(starts_with(decode_error(s, 0), "Stat.name: truncated")) << decode_error(s, 0);
}

TEST(Proto, RefusesTrailingBytes) {
  for (const Example& ex : examples()) {
    SCOPED_TRACE(ex.label);
    Bytes b = encode(ex.msg, ex.fds);
    if (b.size() + 3 > kMaxMessageSize) continue;
    for (int k = 0; k < 3; ++k) b.push_back(std::byte{0});
    put_u16(b, kBodyLength, static_cast<std::uint16_t>(b.size() - kHeaderSize));
    const std::string e = decode_error(b, ex.fds);
    EXPECT_NE(e.find("3 trailing bytes"), std::string::npos) << e;
  }
}

// ---- Field validation: each bad message is refused by decode and by encode, naming the field ----

struct Bad {
  std::string label;
  Body body;
  std::string error_prefix;  // what the one-line error starts with
  std::size_t fds = 0;
};

std::vector<Bad> bad_messages() {
  std::vector<Bad> v;
  const Create create{"frames", Kind::Host, 0600, 4096, Uuid{}, 0};
  auto bad_create = [&](std::string label, auto mutate, std::string prefix) {
    Create c = create;
    mutate(c);
    v.push_back(Bad{std::move(label), c, std::move(prefix), 1});
  };
  bad_create(
      "name_slash", [](Create& c) { c.name = "abc/def"; }, "Create.name: invalid character '/' at 3");
  bad_create(
      "name_dotdot", [](Create& c) { c.name = ".."; }, "Create.name: starts with '.'");
  bad_create(
      "name_dot", [](Create& c) { c.name = ".x"; }, "Create.name: starts with '.'");
  bad_create(
      "name_dash", [](Create& c) { c.name = "-x"; }, "Create.name: starts with '-'");
  bad_create(
      "name_129", [](Create& c) { c.name = max_name() + "a"; }, "Create.name: 129 bytes");
  bad_create(
      "name_empty", [](Create& c) { c.name.clear(); }, "Create.name: empty");
  bad_create(
      "name_nul", [](Create& c) { c.name = std::string("a\0b", 3); }, "Create.name: invalid character 0x00 at 1");
  bad_create(
      "kind_0", [](Create& c) { c.kind = static_cast<Kind>(0); }, "Create.kind: invalid Kind 0");
  bad_create(
      "kind_5", [](Create& c) { c.kind = static_cast<Kind>(5); }, "Create.kind: invalid Kind 5");
  bad_create(
      "kind_255", [](Create& c) { c.kind = static_cast<Kind>(255); }, "Create.kind: invalid Kind 255");
  bad_create(
      "mode_01000", [](Create& c) { c.mode = 01000; }, "Create.mode: mode 01000");
  bad_create(
      "mode_ffff", [](Create& c) { c.mode = 0xFFFF; }, "Create.mode:");
  bad_create(
      "size_0", [](Create& c) { c.size = 0; }, "Create.size: size 0");
  bad_create(
      "size_over", [](Create& c) { c.size = kMaxSegmentSize + 1; }, "Create.size: size 1099511627777");
  bad_create(
      "size_huge", [](Create& c) { c.size = ~0ULL; }, "Create.size:");
  bad_create(
      "flags", [](Create& c) { c.flags = 3; }, "Create.flags:");
  bad_create(
      "flags_top", [](Create& c) { c.flags = 0x80000000; }, "Create.flags:");
  bad_create(
      "host_with_device", [](Create& c) { c.device[15] = 1; }, "Create.device: must be all zero");
  bad_create(
      "pinned_with_device",
      [](Create& c) {
        c.kind = Kind::HostPinned;
        c.device[0] = 1;
      },
      "Create.device: must be all zero");
  bad_create(
      "device_ipc_flags",
      [](Create& c) {
        c.kind = Kind::DeviceIpc;
        c.flags = kFlagSemaphore;
      },
      "Create.flags: 0x1; semaphores and channels are host memory");
  bad_create(
      "device_ipc_view",
      [](Create& c) {
        c.kind = Kind::DeviceIpc;
        c.view_size = 1;
      },
      "Create.view_size: 1; only Device segments");
  bad_create(
      "view_overflow",
      [](Create& c) {
        c.kind = Kind::Device;
        c.view_offset = ~0ULL;
        c.view_size = 2;
      },
      "Create.view_size: [18446744073709551615");
  bad_create(
      "view_bigger_than_segment",
      [](Create& c) {
        c.kind = Kind::Device;
        c.view_size = c.size + 1;
      },
      "Create.view_size: [0, 0 + 4097) does not lie inside");

  v.push_back(Bad{"join_role_0", Join{7, 0}, "Join.role: invalid Role 0"});
  v.push_back(Bad{"holders_name", Holders{".x"}, "Holders.name:"});
  v.push_back(Bad{"watch_name", Watch{""}, "Watch.name:"});
  v.push_back(Bad{"heartbeat_long", Heartbeat{"x", kMaxHeartbeatMs + 1}, "Heartbeat.deadline_ms: 3600001 ms"});
  v.push_back(Bad{"event_kind_0", Event{0, 1, "x", HolderInfo{}, 0}, "Event.kind: invalid EventKind 0"});
  v.push_back(Bad{"event_kind_7", Event{7, 1, "x", HolderInfo{}, 0}, "Event.kind: invalid EventKind 7"});
  v.push_back(Bad{"event_access", Event{1, 1, "x", HolderInfo{1, 1, 1, 3, 0, 0, 0, 0}, 0}, "Event.holder.access:"});
  v.push_back(Bad{"holders_reply_beat", HoldersReply{{HolderInfo{1, 1, 1, 1, 0, 0, 3, 0}}, false},
                  "HoldersReply.entries[0].beat: invalid Beat 3"});
  v.push_back(Bad{"holders_reply_creator", HoldersReply{{HolderInfo{1, 1, 1, 1, 2, 0, 0, 0}}, false},
                  "HoldersReply.entries[0].creator: 2"});
  v.push_back(Bad{"announce_size_0", Announce{"x", Access::ReadOnly, 0}, "Announce.size: size 0", 1});
  v.push_back(Bad{"rejoin_token_0", Rejoin{9, 1, 0, 2}, "Rejoin.token: 0 marks a free entry"});
  v.push_back(Bad{"leave_token_0", Leave{9, 1, 0}, "Leave.token: 0 marks a free entry"});
  v.push_back(Bad{"unlink_id_0", UnlinkId{0}, "UnlinkId.id: segment id 0"});
  v.push_back(Bad{"leave_member", Leave{9, 64, 1}, "Leave.member: 64 is not below 64"});
  v.push_back(Bad{"join_role_9", Join{7, 9}, "Join.role: invalid Role 9"});
  v.push_back(Bad{"join_reply_token_0", JoinReply{3, 0}, "JoinReply.token: 0 marks a free entry"});
  v.push_back(Bad{"join_reply_member", JoinReply{64, 1}, "JoinReply.member: 64 is not below 64"});
  v.push_back(Bad{"hello_long", Hello{1, std::string(65, 'a')}, "Hello.client_name: 65 bytes"});
  v.push_back(Bad{"hello_newline", Hello{1, "a\nb"}, "Hello.client_name: non-printable byte 0x0a at 1"});
  v.push_back(Bad{"hello_del", Hello{1, "\x7f"}, "Hello.client_name: non-printable byte 0x7f at 0"});
  v.push_back(Bad{"hello_reply_long", HelloReply{1, 2, 3, std::string(65, '1')}, "HelloReply.broker_version: 65"});
  v.push_back(Bad{"hello_reply_ctl", HelloReply{1, 2, 3, "0.1\t"}, "HelloReply.broker_version: non-printable"});

  v.push_back(Bad{"open_name", Open{"a/b", Access::ReadOnly, 0}, "Open.name: invalid character '/' at 1"});
  v.push_back(Bad{"open_access_0", Open{"a", static_cast<Access>(0), 0}, "Open.access: invalid Access 0"});
  v.push_back(Bad{"open_access_4", Open{"a", static_cast<Access>(4), 0}, "Open.access: invalid Access 4"});
  v.push_back(Bad{"announce_look", Announce{"a", Access::Look, 4096}, "Announce.access: invalid Access 3", 1});
  v.push_back(Bad{"unlink_name", Unlink{""}, "Unlink.name: empty"});
  v.push_back(Bad{"stat_name", Stat{"-"}, "Stat.name: starts with '-'"});
  v.push_back(Bad{"close_0", Close{0}, "Close.id: segment id 0"});

  auto bad_info = [&](std::string label, auto mutate, std::string field) {
    SegmentInfo i = small_info(9);
    mutate(i);
    v.push_back(Bad{label + "_open_reply", OpenReply{i}, "OpenReply.info." + field, 1});
    v.push_back(Bad{label + "_stat_reply", StatReply{i}, "StatReply.info." + field});
    v.push_back(Bad{label + "_list_reply", ListReply{{small_info(1), i}, false}, "ListReply.entries[1]." + field});
  };
  bad_info(
      "id_0", [](SegmentInfo& i) { i.id = 0; }, "id: segment id 0");
  bad_info(
      "name", [](SegmentInfo& i) { i.name = "a/b"; }, "name: invalid character '/' at 1");
  bad_info(
      "name_dot", [](SegmentInfo& i) { i.name = "."; }, "name: starts with '.'");
  bad_info(
      "kind_0", [](SegmentInfo& i) { i.kind = static_cast<Kind>(0); }, "kind: invalid Kind 0");
  bad_info(
      "kind_5", [](SegmentInfo& i) { i.kind = static_cast<Kind>(5); }, "kind: invalid Kind 5");
  bad_info(
      "view_on_host", [](SegmentInfo& i) { i.view_size = 1; }, "view_size: 1; only Device segments");
  bad_info(
      "view_offset_alone", [](SegmentInfo& i) { i.view_offset = 8; }, "view_offset: 8 with view_size 0");
  bad_info(
      "view_past_end",
      [](SegmentInfo& i) {
        i.kind = Kind::Device;
        i.view_offset = i.size - 1;
        i.view_size = 2;
      },
      "view_size: [4095, 4095 + 2) does not lie inside the 4096 bytes");
  bad_info(
      "mode", [](SegmentInfo& i) { i.mode = 01000; }, "mode: mode 01000");
  bad_info(
      "size_0", [](SegmentInfo& i) { i.size = 0; }, "size: size 0");
  bad_info(
      "size_over", [](SegmentInfo& i) { i.size = kMaxSegmentSize + 1; }, "size:");
  bad_info(
      "device", [](SegmentInfo& i) { i.device[3] = 9; }, "device: must be all zero");
  bad_info(
      "mapper_count", [](SegmentInfo& i) { i.mapper_count = i.references + 1; }, "mapper_count:");
  bad_info(
      "pids_17",
      [](SegmentInfo& i) {
        i.references = i.mapper_count = 100;
        i.mapper_pids.assign(kMaxMapperPids + 1, 1);
      },
      "mapper_pids: 17 elements, at most 16");
  bad_info(
      "pids_over_count", [](SegmentInfo& i) { i.mapper_count = 1; }, "mapper_pids: 2 pids but mapper_count is 1");

  ListReply too_many;
  for (std::size_t k = 0; k < kMaxListEntries + 1; ++k) too_many.entries.push_back(small_info(k + 1));
  v.push_back(Bad{"list_65", too_many, "ListReply.entries: 65 elements, at most 64"});
  v.push_back(Bad{"list_descending", ListReply{{small_info(2), small_info(1)}, false},
                  "ListReply.entries[1].id: 1 does not ascend"});
  v.push_back(Bad{"list_duplicate", ListReply{{small_info(2), small_info(2)}, false},
                  "ListReply.entries[1].id: 2 does not ascend"});
  v.push_back(Bad{"list_more_empty", ListReply{{}, true}, "ListReply.more:"});

  v.push_back(Bad{"error_code_0", ErrorReply{0, 0, "x"}, "ErrorReply.code: 0 is not a gpuipc::ErrorCode"});
  v.push_back(Bad{"error_code_16", ErrorReply{16, 0, "x"}, "ErrorReply.code: 16 is not"});
  v.push_back(Bad{"error_code_255", ErrorReply{255, 0, "x"}, "ErrorReply.code: 255 is not"});
  v.push_back(Bad{"error_errno", ErrorReply{1, -1, "x"}, "ErrorReply.sys_errno: -1 is negative"});
  v.push_back(Bad{"error_text", ErrorReply{1, 0, std::string(kMaxTextLength + 1, 'x')}, "ErrorReply.message: 2049"});
  return v;
}

TEST(Proto, RefusesEveryBadField) {
  for (const Bad& bad : bad_messages()) {
    SCOPED_TRACE(bad.label);
    const std::string e = decode_error(raw_message(bad.body, bad.fds), bad.fds);
    EXPECT_TRUE(starts_with(e, bad.error_prefix)) << "got: " << e << "\nwant: " << bad.error_prefix;
    try {
      (void)encode(Message{7, bad.body}, bad.fds);
      ADD_FAILURE() << "encode accepted it";
    } catch (const std::invalid_argument& ex) {
      // encode and decode name the problem identically.
      EXPECT_EQ(std::string(ex.what()), "encode: " + e);
    }
  }
}

TEST(Proto, RefusesBadBoolAndOversizedCounts) {
  // more = 2
  Bytes b = encode(Message{1, ListReply{{}, false}});
  b.back() = std::byte{2};
  EXPECT_TRUE(starts_with(decode_error(b, 0), "ListReply.more: 2 is not a bool")) << decode_error(b, 0);

  // A count of 0xFFFF entries is refused before anything is reserved or read.
  Bytes l = raw_header(static_cast<int>(MessageType::ListReply), 3, 0);
  for (int v : {0xFF, 0xFF, 0}) l.push_back(static_cast<std::byte>(v));
  EXPECT_TRUE(starts_with(decode_error(l, 0), "ListReply.entries: 65535 elements, at most 64"));

  SegmentInfo i = small_info();
  Bytes body = Raw().info(i).take();
  // The pid count sits 2 + 4*2 pids + 16 view bytes before the end; claim 0xFFFF pids.
  put_u16(body, body.size() - 16 - 2 - 4 * i.mapper_pids.size(), 0xFFFF);
  Bytes s = raw_header(static_cast<int>(MessageType::StatReply), body.size(), 0);
  s.insert(s.end(), body.begin(), body.end());
  EXPECT_TRUE(starts_with(decode_error(s, 0), "StatReply.info.mapper_pids: 65535 elements, at most 16"));
}

TEST(Proto, EncodeRefusesOversizedStrings) {
  // Lengths that would not even fit the u16 length prefix are refused, not truncated.
  EXPECT_THROW(encode(Message{1, ErrorReply{1, 0, std::string(70000, 'x')}}), std::invalid_argument);
  EXPECT_THROW(encode(Message{1, Stat{std::string(70000, 'x')}}), std::invalid_argument);
  SegmentInfo i = small_info();
  i.mapper_pids.assign(70000, 1);
  i.references = i.mapper_count = 70000;
  EXPECT_THROW(encode(Message{1, StatReply{i}}), std::invalid_argument);
}

TEST(Proto, DecodeLeavesOutputUntouchedOnFailure) {
  Message out{42, Close{9}};
  std::string error;
  Bytes b = encode(Message{1, Create{"x", Kind::Host, 0600, 1, Uuid{}, 0}}, 1);
  b[16 + 3] = std::byte{0};  // kind 0
  EXPECT_FALSE(decode(b, 1, out, error));
  EXPECT_EQ(out, (Message{42, Close{9}}));
}

// ---- Mutation: every single-byte change of a few valid messages; never crashes, and whatever is accepted
// re-encodes to exactly the bytes that were accepted (the encoding is canonical). ----

TEST(Proto, SingleByteMutationsNeverCrash) {
  std::vector<Example> subjects;
  for (const Example& ex : examples()) {
    for (const char* label : {"hello", "create", "open", "open_reply", "list_reply", "error", "ok", "close"}) {
      if (ex.label == label) subjects.push_back(ex);
    }
  }
  ASSERT_EQ(subjects.size(), 8u);
  std::size_t accepted = 0;
  std::size_t tried = 0;
  for (const Example& ex : subjects) {
    SCOPED_TRACE(ex.label);
    const Bytes original = encode(ex.msg, ex.fds);
    for (std::size_t at = 0; at < original.size(); ++at) {
      Bytes b = original;
      for (int v = 0; v < 256; ++v) {
        b[at] = static_cast<std::byte>(v);
        for (std::size_t fds : {ex.fds, ex.fds ^ 1}) {
          ++tried;
          Message out;
          std::string error;
          if (decode(b, fds, out, error)) {
            ++accepted;
            ASSERT_EQ(encode(out, fds), b) << "offset " << at << " value " << v;
          } else {
            ASSERT_FALSE(error.empty());
            ASSERT_EQ(error.find('\n'), std::string::npos);
          }
        }
      }
    }
  }
  EXPECT_GT(accepted, 0u);
  EXPECT_LT(accepted, tried);
}

// ---- Seed corpus for fuzz/fuzz_proto_decode: one file per example and near-miss, each the fds byte
// (fds_received) followed by the datagram. Writes only when GPUIPC_WRITE_CORPUS names a directory. ----

TEST(Proto, WriteFuzzCorpus) {
  const char* dir = std::getenv("GPUIPC_WRITE_CORPUS");
  if (dir == nullptr || *dir == '\0') GTEST_SKIP() << "set GPUIPC_WRITE_CORPUS=<dir> to write the fuzz seed corpus";
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, std::size_t fds, const Bytes& bytes) {
    std::ofstream f(std::filesystem::path(dir) / name, std::ios::binary | std::ios::trunc);
    const char fd_byte = static_cast<char>(fds);
    f.write(&fd_byte, 1);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(f.good()) << name;
  };
  std::size_t written = 0;
  for (const Example& ex : examples()) {
    if (ex.label == "list_reply_max") continue;  // 16 KiB; list_reply and open_reply_max cover its structure
    write("valid_" + ex.label, ex.fds, encode(ex.msg, ex.fds));
    ++written;
  }
  // Near misses: one rule broken each, so the fuzzer starts next to every refusal path.
  const Bytes close = encode(Message{1, Close{5}});
  Bytes b = close;
  b[4] = std::byte{2};
  write("bad_version_2", 0, b);
  b = close;
  b[0] = std::byte{'g'};
  write("bad_magic", 0, b);
  b = close;
  b[15] = std::byte{1};
  write("bad_reserved", 0, b);
  write("bad_type_999", 0, raw_header(999, 0, 0));
  b = close;
  b.pop_back();
  write("bad_truncated", 0, b);
  b = close;
  b.push_back(std::byte{0});
  put_u16(b, kBodyLength, static_cast<std::uint16_t>(b.size() - kHeaderSize));
  write("bad_trailing", 0, b);
  write("bad_create_no_fd", 0, raw_message(Create{"x", Kind::Host, 0600, 1, Uuid{}, 0}, 0));
  written += 7;
  for (const Bad& bad : bad_messages()) {
    for (const char* label : {"name_slash", "kind_5", "mode_01000", "size_over", "list_65", "error_code_255",
                              "pids_17_stat_reply", "list_more_empty"}) {
      if (bad.label == label) {
        write("bad_" + bad.label, bad.fds, raw_message(bad.body, bad.fds));
        ++written;
      }
    }
  }
  EXPECT_EQ(written, examples().size() - 1 + 7 + 8);
}

}  // namespace
}  // namespace gpuipc::proto
