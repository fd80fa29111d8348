// The broker wire format, version 2 (Holders, Watch, Event, Heartbeat, Leave and UnlinkId were added to it: a broker
// that predates them answers them as malformed): one message per SOCK_SEQPACKET datagram, fixed layout, little-endian,
// file descriptors alongside by SCM_RIGHTS. Pure data: no I/O here. See docs/protocol.md.
//
// Every message starts with a 16-byte header:
//   u32 magic 'GIPC' (0x43504947) | u16 version | u16 type | u32 request_id | u16 body_length | u8 fd_count | u8 0
// then body_length bytes of body. Strings are u16 length + bytes (no terminator). Decoding checks the magic,
// version, type, lengths (header, body, each string, each array), every enum, the name charset, every size
// limit, the reserved byte, that the body is consumed exactly, and that fd_count matches both the type and the
// number of fds that actually arrived.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace gpuipc::proto {

inline constexpr std::uint32_t kMagic = 0x43504947;  // "GIPC" little-endian
inline constexpr std::uint16_t kVersion = 2;  // 2: Join, JoinReply, Announce, Rejoin; members are broker tokens
inline constexpr std::size_t kHeaderSize = 16;
/// Largest message either side sends or accepts (header included).
inline constexpr std::size_t kMaxMessageSize = 60 * 1024;
/// Longest object name; names are [A-Za-z0-9._-], not starting with '.' or '-'.
inline constexpr std::size_t kMaxNameLength = 128;
/// Longest error message text.
inline constexpr std::size_t kMaxTextLength = 2048;
/// Most segment entries in one ListReply (the client pages with ListRequest::after_id).
inline constexpr std::size_t kMaxListEntries = 64;
/// Most mapper pids reported per segment (SegmentInfo::mapper_count has the full number).
inline constexpr std::size_t kMaxMapperPids = 16;
/// Most holders in one HoldersReply (HoldersReply::more says when there were more).
inline constexpr std::size_t kMaxHolders = 256;
/// Longest heartbeat deadline (one hour).
inline constexpr std::uint32_t kMaxHeartbeatMs = 3'600'000;
/// Largest segment (1 TiB).
inline constexpr std::uint64_t kMaxSegmentSize = 1ULL << 40;

enum class MessageType : std::uint16_t {
  Hello = 1,
  HelloReply = 2,
  Create = 3,
  Open = 4,
  OpenReply = 5,
  Close = 6,
  Unlink = 7,
  Stat = 8,
  StatReply = 9,
  List = 10,
  ListReply = 11,
  Ok = 12,
  Error = 13,
  Join = 14,
  JoinReply = 15,
  Announce = 16,
  Rejoin = 17,
  Holders = 18,
  HoldersReply = 19,
  Watch = 20,
  Event = 21,
  Heartbeat = 22,
  Leave = 23,
  UnlinkId = 24,
};

/// Segment kinds (include/gpuipc/segment.hpp mirrors these values). DeviceIpc: cudaMalloc memory adopted with a
/// legacy IPC handle; its fd is a host memfd holding a DeviceIpcRecord (proto/shm.hpp), and it dies with its
/// exporter.
enum class Kind : std::uint8_t { Device = 1, Host = 2, HostPinned = 3, DeviceIpc = 4 };

/// Whether memory of this kind lives on a GPU (its SegmentInfo/Create carry the device's UUID).
constexpr bool is_device_kind(Kind kind) noexcept { return kind == Kind::Device || kind == Kind::DeviceIpc; }

/// How the opener wants to access a segment. Look (Open only, to a broker whose status page has kFeatureLook): read
/// only, and not as a holder: watchers hear nothing of it and Holders does not list it. What stat() and the CLI's
/// listings take to read a control block.
enum class Access : std::uint8_t { ReadOnly = 1, ReadWrite = 2, Look = 3 };

/// 16-byte CUDA device UUID; all zero for host kinds.
using Uuid = std::array<std::uint8_t, 16>;

/// Client -> broker, first message on a connection. The broker refuses other versions with an Error reply.
struct Hello {
  std::uint32_t pid = 0;     ///< the client's pid as it sees it: shown, never trusted (identity is SO_PEERCRED)
  std::string client_name;   ///< program name, for `gpuipc ls`; at most 64 bytes, printable ASCII

  bool operator==(const Hello&) const = default;
};

/// Carries 0 or 1 fd: the broker's read-only status page (status_page.hpp).
struct HelloReply {
  std::uint32_t broker_pid = 0;
  std::uint32_t uid = 0;     ///< the client's uid as the broker sees it
  std::uint32_t gid = 0;
  std::string broker_version;  ///< the broker's release, GPUIPC_VERSION_STRING (e.g. "0.1.0"); shown, not checked

  bool operator==(const HelloReply&) const = default;
};

/// Registers a new segment. Carries exactly one fd: the memory (memfd for host kinds, cuMem POSIX fd for
/// device). The creator holds one reference, as if it had opened the segment read-write.
struct Create {
  std::string name;
  Kind kind = Kind::Host;
  std::uint16_t mode = 0600;  ///< permission bits, only 0777 allowed
  std::uint64_t size = 0;     ///< bytes; 1..kMaxSegmentSize
  Uuid device{};              ///< device kinds: the GPU the memory lives on
  std::uint32_t flags = 0;    ///< 0, kFlagSemaphore or kFlagChannel (proto/shm.hpp)
  /// Device kind only, for adopted VMM memory: the segment is bytes [view_offset, view_offset + view_size) of the
  /// exported allocation of `size` bytes. view_size 0 (with view_offset 0): the whole allocation.
  std::uint64_t view_offset = 0;
  std::uint64_t view_size = 0;

  bool operator==(const Create&) const = default;
};

/// Opens a segment by name. `wait_ms` > 0: the broker answers once the name exists or after that long.
struct Open {
  std::string name;
  Access access = Access::ReadWrite;
  std::uint32_t wait_ms = 0;

  bool operator==(const Open&) const = default;
};

/// What the broker knows of a segment.
struct SegmentInfo {
  std::uint64_t id = 0;       ///< unique for the broker's lifetime, never reused
  std::string name;           ///< empty once unlinked
  Kind kind = Kind::Host;
  std::uint16_t mode = 0;
  std::uint64_t size = 0;
  Uuid device{};
  std::uint32_t owner_uid = 0;
  std::uint32_t owner_gid = 0;
  std::uint64_t created_unix_ns = 0;
  std::uint32_t references = 0;   ///< open references over all connections
  std::uint32_t mapper_count = 0; ///< distinct connections holding references
  std::vector<std::uint32_t> mapper_pids;  ///< at most kMaxMapperPids
  std::uint64_t view_offset = 0;  ///< as in Create
  std::uint64_t view_size = 0;

  bool operator==(const SegmentInfo&) const = default;
};

/// Reply to Open (and to Create: no fd then). Carries one fd for Open: read-only opens of host kinds get a
/// read-only file description.
struct OpenReply {
  SegmentInfo info;

  bool operator==(const OpenReply&) const = default;
};

/// Drops one reference this connection holds on segment `id`.
struct Close {
  std::uint64_t id = 0;

  bool operator==(const Close&) const = default;
};

/// Removes the name; the memory goes when the last reference does.
struct Unlink {
  std::string name;

  bool operator==(const Unlink&) const = default;
};

struct Stat {
  std::string name;

  bool operator==(const Stat&) const = default;
};

struct StatReply {
  SegmentInfo info;

  bool operator==(const StatReply&) const = default;
};

/// Lists segments with id > after_id, at most kMaxListEntries per reply.
struct List {
  std::uint64_t after_id = 0;

  bool operator==(const List&) const = default;
};

struct ListReply {
  std::vector<SegmentInfo> entries;
  bool more = false;  ///< another List with after_id = entries.back().id returns the rest

  bool operator==(const ListReply&) const = default;
};

struct OkReply {
  bool operator==(const OkReply&) const = default;
};

/// A refused request. `code` is a gpuipc::ErrorCode value; `message` says what to do.
struct ErrorReply {
  std::uint8_t code = 0;
  std::int32_t sys_errno = 0;
  std::string message;

  bool operator==(const ErrorReply&) const = default;
};

/// Makes this connection a member of the semaphore, channel or pool whose control block is segment `id`: the
/// broker claims a free entry of its member table for it, with a token of the broker's choosing, and counts it.
/// The connection must hold a read-write reference to `id`. When the connection drops its last reference (or
/// dies), the broker removes exactly the entries it joined, and only while they still hold their token.
struct Join {
  std::uint64_t id = 0;
  std::uint8_t role = 0;  ///< proto::Role (shm.hpp): Signaller for semaphores, Producer or Consumer for channels

  bool operator==(const Join&) const = default;
};

/// The member entry a Join claimed and the token written into it (never 0).
struct JoinReply {
  std::uint32_t member = 0;
  std::uint32_t token = 0;

  bool operator==(const JoinReply&) const = default;
};

/// After a broker restart: "I still hold segment `name`; here is its memory". Carries exactly one fd. The broker
/// takes the segment's owner, mode and kind from its own journal of names (never from the client), checks that the
/// fd is that segment's memory (host kinds: the same file; device: a driver export of the journal's size, and
/// only from its owner or root), gives the name back, and answers with an OpenReply (no fd) and a reference.
struct Announce {
  std::string name;
  Access access = Access::ReadOnly;  ///< how this process maps it
  std::uint64_t size = 0;            ///< bytes the broker registered (SegmentInfo::size)

  bool operator==(const Announce&) const = default;
};

/// After a broker restart: "I am still member `member` (token `token`, `role`) of the object whose control block
/// is segment `id`" (the id the Announce answer gave). The broker checks the entry in shared memory still holds
/// that token and records it as this connection's, to repair if the connection goes.
struct Rejoin {
  std::uint64_t id = 0;
  std::uint32_t member = 0;
  std::uint32_t token = 0;
  std::uint8_t role = 0;

  bool operator==(const Rejoin&) const = default;
};

/// A channel member leaving while its stream still owes writes (a `filled` it published, a `freed` it released):
/// "remove member `member` (token `token`) of the object whose control block is segment `id`, and make what its
/// stream still owes when the stream would have, once this process has exited if the stream has not made them by
/// then". A pool member whose stream has not reached some of its frees (it released its holds itself): "remove it
/// once those frees have landed, or once this process has exited". A semaphore signaller: "remove it now" (sent for a
/// Join given up on whose answer came late). The member must be one this connection joined. Answered with OkReply
/// once the broker has taken it over.
struct Leave {
  std::uint64_t id = 0;
  std::uint32_t member = 0;
  std::uint32_t token = 0;

  bool operator==(const Leave&) const = default;
};

/// Removes the name of segment `id`, if it still has one: Unlink that cannot reach a segment since made under the
/// same name by someone else. Sent for a Create given up on whose answer came late (the library's own undo), only to
/// a broker whose status page has kFeatureUnlinkId (an older one answers it as malformed). The same rights as Unlink.
struct UnlinkId {
  std::uint64_t id = 0;

  bool operator==(const UnlinkId&) const = default;
};

/// Who has segment `name` open: one entry per connection (process) holding references. Needs read permission (like
/// Stat).
struct Holders {
  std::string name;

  bool operator==(const Holders&) const = default;
};

/// A holder's heartbeat, as the broker sees it.
enum class Beat : std::uint8_t { None = 0, Alive = 1, Hung = 2 };

/// One process holding a segment open.
struct HolderInfo {
  std::uint32_t pid = 0;  ///< SO_PEERCRED pid (in the broker's PID namespace)
  std::uint32_t uid = 0;
  std::uint32_t references = 0;  ///< its open references
  std::uint8_t access = 1;       ///< Access: ReadWrite when any of its references is read-write
  std::uint8_t creator = 0;      ///< 1: its connection created the segment
  std::uint8_t roles = 0;        ///< bit (1 << proto::Role) for every member role it joined (shm.hpp)
  std::uint8_t beat = 0;         ///< Beat
  std::uint32_t beat_ms = 0;     ///< the deadline it promised beats within (0: none)

  bool operator==(const HolderInfo&) const = default;
};

struct HoldersReply {
  std::vector<HolderInfo> entries;  ///< at most kMaxHolders, by pid
  bool more = false;

  bool operator==(const HoldersReply&) const = default;
};

/// Makes this connection a watcher of segment `name` (read permission; at most 64 names per connection): from the
/// OkReply on, the broker sends it an Event (request_id 0) whenever a process joins (first reference), leaves (last
/// reference closed), dies (connection gone while holding references), misses its heartbeat deadline, or beats
/// again after missing one. A connection that watches should do nothing else (events arrive between replies).
struct Watch {
  std::string name;

  bool operator==(const Watch&) const = default;
};

/// Lost: the broker dropped events of that name for this watcher, which read too slowly (holder empty): ask Holders.
enum class EventKind : std::uint8_t { Joined = 1, Left = 2, Died = 3, Hung = 4, Alive = 5, Lost = 6 };

/// Pushed to watchers (request_id 0).
struct Event {
  std::uint8_t kind = 1;      ///< EventKind
  std::uint64_t id = 0;       ///< the segment's id
  std::string name;           ///< its name (empty once unlinked)
  HolderInfo holder;          ///< the process it is about, after the change
  std::uint64_t unix_ns = 0;  ///< when the broker saw it

  bool operator==(const Event&) const = default;
};

/// "Expect my next Heartbeat for segment `name` within `deadline_ms`" (0: no more heartbeats). The connection must
/// hold a reference to it. When the deadline passes first, the broker marks the process hung and tells watchers.
struct Heartbeat {
  std::string name;
  std::uint32_t deadline_ms = 0;  ///< at most kMaxHeartbeatMs

  bool operator==(const Heartbeat&) const = default;
};

using Body = std::variant<Hello, HelloReply, Create, Open, OpenReply, Close, Unlink, Stat, StatReply, List, ListReply,
                          OkReply, ErrorReply, Join, JoinReply, Announce, Rejoin, Holders, HoldersReply, Watch, Event,
                          Heartbeat, Leave, UnlinkId>;

struct Message {
  std::uint32_t request_id = 0;
  Body body;

  bool operator==(const Message&) const = default;
};

/// The type tag of a body.
MessageType type_of(const Body& body) noexcept;

/// Most fds a message of this type may carry: Create 1, OpenReply 1 (0 when it answers Create), HelloReply 1
/// (the broker's status page, src/proto/status_page.hpp; 0 if the broker could not share it), others 0.
/// Create must carry exactly 1.
std::size_t max_fds(MessageType type) noexcept;

/// Whether `name` is a valid object name (see kMaxNameLength). Returns an empty string when valid, else why not.
std::string check_name(std::string_view name);

/// Whether `create` passes the checks a Create's encode and decode run (name, kind, mode, size, device, flags,
/// view): empty when it does, else "Create.<field>: why". The broker checks what its journal says of a segment with
/// it, since a segment no Create could have made cannot be described to a client either.
std::string check_create(const Create& create);

/// The pool that a name of a pool's chunk (`POOL.chunk.<digits>`) belongs to, else empty. The broker lets only a
/// pool's members create such names while the pool exists, and refuses a pool whose chunk names another uid holds.
std::string_view pool_of_chunk(std::string_view name) noexcept;

/// Encodes `msg` announcing `fd_count` fds. Throws std::invalid_argument if the message breaks a limit
/// (callers build messages from checked values; the broker never encodes client-supplied garbage).
std::vector<std::byte> encode(const Message& msg, std::size_t fd_count = 0);

/// Decodes one received datagram that came with `fds_received` fds. On success returns true and fills `out`;
/// on failure returns false and puts a one-line reason in `error`. Never crashes, never reads past `bytes`.
bool decode(std::span<const std::byte> bytes, std::size_t fds_received, Message& out, std::string& error);

/// The protocol version in the header of a datagram from a gpuipc peer (a whole header with the 'GIPC' magic),
/// whatever that version is; nullopt when `bytes` is not one. The header is the same in every version, so a side
/// can tell "another release" from "garbage" before decode() refuses the message.
std::optional<std::uint16_t> peek_version(std::span<const std::byte> bytes) noexcept;

/// What the header of a datagram from a gpuipc peer says (a whole header with the 'GIPC' magic), before decode():
/// which request it is or answers, and how many fds its sender sent with it. nullopt when `bytes` is not one.
struct PeekedHeader {
  std::uint16_t version = 0;
  std::uint32_t request_id = 0;
  std::uint8_t fd_count = 0;
};
std::optional<PeekedHeader> peek_header(std::span<const std::byte> bytes) noexcept;

}  // namespace gpuipc::proto
