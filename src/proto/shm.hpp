// Layouts of the shared-memory control blocks of semaphores and channels. Like the wire format, these are a
// protocol between processes (clients, and the broker that repairs them when a member dies), so they live here:
// fixed layout, versioned, no pointers (offsets and sequence numbers only), one atomic scope per word
// (std::atomic_ref on the host; the GPU touches only the `value`, `filled` and `freed` words, through stream
// memory operations).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "proto/messages.hpp"

namespace gpuipc::proto {

/// Create.flags: what a segment is (at most one flag). The broker repairs semaphores, channels and pools when a
/// member dies.
inline constexpr std::uint32_t kFlagSemaphore = 1U << 0;
inline constexpr std::uint32_t kFlagChannel = 1U << 1;
inline constexpr std::uint32_t kFlagPool = 1U << 2;  ///< the control block of a pool (src/shm/pool_block.hpp)
inline constexpr std::uint32_t kFlagCounting = 1U << 3;  ///< a counting semaphore (src/shm/counting_block.hpp)
inline constexpr std::uint32_t kKnownCreateFlags = kFlagSemaphore | kFlagChannel | kFlagPool | kFlagCounting;

/// Values are below 2^62. Bit 62 marks a poisoned value: CUDA's 64-bit stream waits compare cyclically
/// ((int64_t)(*addr - v) >= 0), so poison must stay within 2^63 of every value waited for — a set top bit would
/// look *smaller* to a waiting stream and keep it blocked.
inline constexpr std::uint64_t kPoisonBit = 1ULL << 62;
inline constexpr std::uint64_t kMaxValue = kPoisonBit - 1;

/// Why a block was poisoned.
enum class PoisonReason : std::uint32_t { None = 0, PeerDied = 1, Closed = 2 };

/// Most members (processes) registered at once in one semaphore, channel or pool.
inline constexpr std::uint32_t kMaxMembers = 64;

/// Member roles.
enum class Role : std::uint32_t { None = 0, Signaller = 1, Producer = 2, Consumer = 3, Holder = 4, kLast = Holder };

/// One entry of a member table. Only the broker claims entries (a Join request): it writes a token of its own
/// choosing, so no process can claim to be another, and it removes exactly the entries a connection joined
/// when that connection goes. A member leaving cleanly clears its own token.
struct alignas(8) Member {
  std::uint32_t token;  ///< 0: free entry; else the broker's token for the connection that joined
  std::uint32_t role;   ///< Role
};

// ---------------------------------------------------------------------------------------------------------------
// Semaphore: one page.
inline constexpr std::uint32_t kSemaphoreMagic = 0x4D534947;  // "GISM"
inline constexpr std::uint32_t kSemaphoreVersion = 2;  // 2: broker-assigned member tokens

struct alignas(64) SemaphoreBlock {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t poison_reason;  ///< PoisonReason, written before the value gets kPoisonBit
  std::uint32_t signallers;     ///< live signallers (registered members)
  std::uint32_t signallers_seen;  ///< 1 once any signaller registered
  std::uint32_t pad0;
  std::uint64_t pad1[5];
  alignas(64) std::uint64_t value;     ///< the timeline; GPU streams wait on / write this word
  alignas(64) std::uint32_t wake_seq;  ///< futex word: bumped after every host-visible change
  alignas(64) Member members[kMaxMembers];
};
static_assert(sizeof(SemaphoreBlock) <= 4096);
static_assert(offsetof(SemaphoreBlock, value) % 64 == 0);

// ---------------------------------------------------------------------------------------------------------------
// Counting semaphore: permits that processes acquire and release, with the permits each member holds counted in
// the block, so that the broker gives back what a dead member held (src/shm/counting_block.hpp has the protocol).
inline constexpr std::uint32_t kCountingMagic = 0x43434947;  // "GICC"
inline constexpr std::uint32_t kCountingVersion = 1;
/// Most permits a counting semaphore has (counts are 32-bit words; one bit is kept clear).
inline constexpr std::uint32_t kCountingMaxPermits = 0x7FFFFFFF;

/// One member's words. `intent` and `held` carry a 24-bit operation sequence number each (bits 40-63): `intent`
/// is the operation the member is making (n in bits 0-31, bit 32 set for a release), `held` its permits (bits
/// 0-31) and the sequence number of the last operation applied to them.
struct alignas(64) CountingSlot {
  std::uint64_t intent;
  std::uint64_t held;
  std::uint64_t ticket;  ///< 0: not waiting; else its place in the queue of waiters (smaller: older)
  std::uint32_t want;    ///< permits it waits for (monitoring)
  std::uint32_t pad;
};

struct alignas(64) CountingBlock {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t max_count;  ///< permits in all: available + held by members (the broker reads it once)
  std::uint32_t initial;    ///< available at creation; the creator holds max_count - initial once it joins
  std::uint64_t pad0[6];
  /// available permits (bits 0-31), the member that last changed it + 1 (bits 32-39; 0: none) and the sequence
  /// number of that member's operation (bits 40-63): whoever changes it next first completes that operation.
  alignas(64) std::uint64_t state;
  alignas(64) std::uint32_t wake_seq;  ///< futex: bumped after every release and every waiter leaving the queue
  std::uint32_t sleepers;              ///< waiters asleep on wake_seq: a release makes a syscall only if > 0
  std::uint32_t waiting;               ///< members with a ticket (acquirers queue behind them)
  std::uint32_t pad1;
  std::uint64_t next_ticket;
  alignas(64) Member members[kMaxMembers];
  CountingSlot slots[kMaxMembers];
};
static_assert(sizeof(CountingSlot) == 64);
static_assert(offsetof(CountingBlock, state) % 64 == 0 && offsetof(CountingBlock, slots) % 64 == 0);

// ---------------------------------------------------------------------------------------------------------------
// Channel: a control segment (this header, then `slots` Slot records each followed by header_bytes of inline
// user header, each record 64-byte aligned) and a data segment of slots * slot_bytes.
inline constexpr std::uint32_t kChannelMagic = 0x48434947;  // "GICH"
// 2: broker-assigned member tokens; 3: Slot::release_mark; 4: ChannelHeader::published and published_bytes;
// 5: each member's table of owed stream writes (OwedTable), in place of Slot::publisher and releaser;
// 6: Slot::incomplete names the message it flags (was a bit in Slot::flags)
inline constexpr std::uint32_t kChannelVersion = 6;
inline constexpr std::uint32_t kMaxSlots = 4096;
inline constexpr std::uint32_t kMaxHeaderBytes = 4096;

/// Slot phases (in Slot::state).
enum class Phase : std::uint32_t {
  Free = 0,       ///< ready for the producer of `seq`
  Writing = 1,    ///< claimed by producer `member` for message `seq`
  Published = 2,  ///< message `seq` is ready for a consumer
  Reading = 3,    ///< consumer `member` holds message `seq`
};

/// Slot::state packs seq (48 bits) | phase (8 bits) | member (8 bits), so a claim is one CAS.
inline constexpr std::uint64_t pack_state(std::uint64_t seq, Phase phase, std::uint32_t member) noexcept {
  return (seq << 16) | (static_cast<std::uint64_t>(phase) << 8) | (member & 0xFFU);
}
inline constexpr std::uint64_t state_seq(std::uint64_t s) noexcept { return s >> 16; }
inline constexpr Phase state_phase(std::uint64_t s) noexcept { return static_cast<Phase>((s >> 8) & 0xFFU); }
inline constexpr std::uint32_t state_member(std::uint64_t s) noexcept { return static_cast<std::uint32_t>(s & 0xFFU); }
inline constexpr std::uint32_t kNoMember = 0xFF;

struct alignas(64) Slot {
  std::uint64_t state;      ///< pack_state(...)
  std::uint64_t size;       ///< payload bytes of the message
  std::uint32_t header_size;
  std::uint32_t reserved0;
  /// incomplete_mark(seq) once message `seq`'s producer died before its GPU work finished (0: none). It names the
  /// message because the broker's flag can land after the slot moved on to a later round. A publish leaves it: the
  /// consumer of an earlier round may read it after releasing that round in stream order.
  std::uint32_t incomplete;
  std::uint32_t reserved1;
  /// Host-only: the `freed` value the slot's next producer must see before it writes, i.e. seq + 1 of the last
  /// message a consumer released from this slot (0: none yet). Only a consumer's release sets it. A round that
  /// is abandoned (a producer that leaves, dies or gives its claim back) leaves it, and `freed`, alone: so
  /// `freed` is written only by consumers' streams, each after the previous round's write, and never goes back.
  std::uint64_t release_mark;
  alignas(64) std::uint64_t filled;  ///< GPU-visible: seq + 1 once the producer's stream reached publish
  alignas(64) std::uint64_t freed;   ///< GPU-visible: seq + 1 once the consumer's stream reached release
};
static_assert(sizeof(Slot) == 192);
/// Slot::incomplete's value for message `seq`: never 0, and different for rounds of one slot less than 2^32 - 1
/// messages apart.
inline constexpr std::uint32_t incomplete_mark(std::uint64_t seq) noexcept {
  return static_cast<std::uint32_t>(seq % 0xFFFF'FFFFULL) + 1;
}
/// Whether mark `a` names a later message than mark `b` (neither 0): less than 2^31 rounds ahead of it, modulo the
/// marks' cycle. 0 (no mark) is later than nothing.
inline constexpr bool incomplete_mark_is_later(std::uint32_t a, std::uint32_t b) noexcept {
  if (a == 0 || b == 0) return false;
  const std::uint64_t ahead = (std::uint64_t{a} + 0xFFFF'FFFFULL - b) % 0xFFFF'FFFFULL;
  return ahead != 0 && ahead < (1ULL << 31);
}

struct alignas(64) ChannelHeader {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t slots;
  std::uint32_t header_bytes;
  std::uint64_t slot_bytes;
  std::uint32_t data_kind;    ///< Kind of the data segment
  std::uint32_t record_bytes; ///< sizeof(Slot) + header_bytes, rounded to 64
  std::uint64_t pad0[5];
  alignas(64) std::uint64_t head;  ///< next sequence producers claim
  alignas(64) std::uint64_t tail;  ///< next sequence consumers claim
  alignas(64) std::uint32_t published_seq;  ///< futex: bumped on every publish (consumers sleep on it)
  std::uint32_t published_sleepers;         ///< consumers asleep on published_seq: a publish wakes only if > 0
  /// Messages and payload bytes published in total (monitoring: `gpuipc top`). In the line publish writes anyway.
  std::uint64_t published;
  std::uint64_t published_bytes;
  alignas(64) std::uint32_t released_seq;   ///< futex: bumped on every release (producers sleep on it)
  std::uint32_t released_sleepers;          ///< producers asleep on released_seq
  alignas(64) std::uint32_t producers;      ///< live producers
  std::uint32_t consumers;                  ///< live consumers
  std::uint32_t producers_seen;             ///< 1 once any producer registered
  std::uint32_t consumers_seen;
  std::uint32_t producers_gone;             ///< PoisonReason once producers went from >0 to 0
  std::uint32_t consumers_gone;
  /// Messages handed back so far (a consumer that closed holding them, the repair of a dead one; mod 2^32): they are
  /// Published again behind the tail, where the tail path does not look. Consumers look behind the tail while it
  /// differs from `orphans_scanned`, the count as of the start of the last look that found none there.
  std::uint32_t orphans;
  std::uint32_t orphans_scanned;
  std::uint64_t redelivered;                ///< messages redelivered after a consumer died holding them
  std::uint64_t abandoned;                  ///< messages whose producer died before publishing them
  alignas(64) Member members[kMaxMembers];
};
static_assert(sizeof(ChannelHeader) % 64 == 0);
static_assert(offsetof(ChannelHeader, published_bytes) + 8 <= offsetof(ChannelHeader, released_seq));

/// One stream write a member owes: `filled` (a producer's publish) or `freed` (a consumer's release) of message
/// `seq`, both seq + 1, which its stream writes after its work on the slot. The member's host records it before the
/// host-visible publish or release, so a repair finds every write a dead member's stream still owed, also for
/// rounds whose slot has since moved on.
struct OwedWrite {
  std::uint64_t code;  ///< seq | kOwedFreed (else `filled`)
  /// `filled`: the `freed` value its producer's stream waited for before it wrote the slot (the slot's last release,
  /// 0: none). `freed`: unused (its consumer's stream waited for `filled` >= seq + 1).
  std::uint64_t after;
};
inline constexpr std::uint64_t kOwedFreed = 1ULL << 63;
static_assert(sizeof(OwedWrite) == 16);

/// A member's owed stream writes, a ring written only by that member's host: entries [begin, end) may not have
/// landed yet. The member moves `begin` past entries it sees landed, and claims a slot or message only with room
/// for the write it will owe (a stream that falls this far behind its host holds the host back).
struct alignas(64) OwedTable {
  std::uint64_t begin;
  std::uint64_t end;
  std::uint64_t pad[6];
  // then owed_capacity(slots) OwedWrite entries
};
static_assert(sizeof(OwedTable) == 64);

inline constexpr std::uint32_t record_bytes(std::uint32_t header_bytes) noexcept {
  return static_cast<std::uint32_t>((sizeof(Slot) + header_bytes + 63) / 64 * 64);
}
/// Entries of each member's OwedTable in a channel of `slots`: how far (in messages) a member's stream may fall
/// behind its host.
inline constexpr std::uint32_t owed_capacity(std::uint32_t slots) noexcept {
  return slots < 16 ? 64U : (slots > 1024 ? 4096U : slots * 4U);
}
inline constexpr std::size_t owed_table_bytes(std::uint32_t slots) noexcept {
  return sizeof(OwedTable) + static_cast<std::size_t>(owed_capacity(slots)) * sizeof(OwedWrite);
}
/// Offset of the member tables: after the slot records.
inline constexpr std::size_t owed_tables_offset(std::uint32_t slots, std::uint32_t header_bytes) noexcept {
  return sizeof(ChannelHeader) + static_cast<std::size_t>(slots) * record_bytes(header_bytes);
}
inline constexpr std::size_t channel_control_bytes(std::uint32_t slots, std::uint32_t header_bytes) noexcept {
  return owed_tables_offset(slots, header_bytes) + kMaxMembers * owed_table_bytes(slots);
}

// ---------------------------------------------------------------------------------------------------------------
// DeviceIpc segment (Kind::DeviceIpc): cudaMalloc / cuMemAlloc memory adopted with a legacy IPC handle. Its fd is a
// host memfd of exactly kDeviceIpcRecordBytes holding this record, written once by the exporter before Create.
// The broker validates it at Create and writes exporter_gone when the exporter drops its last reference to the
// segment, or when its process has exited (or not come back within the rejoin grace) after its connection closed;
// openers read exporter_gone (std::atomic_ref) and report PeerDied once it is set.
inline constexpr std::uint32_t kDeviceIpcMagic = 0x44494947;  // "GIID"
inline constexpr std::uint32_t kDeviceIpcVersion = 1;
inline constexpr std::size_t kDeviceIpcRecordBytes = 4096;
/// CU_IPC_HANDLE_SIZE (src/cuda static_asserts it).
inline constexpr std::size_t kIpcHandleBytes = 64;

struct alignas(64) DeviceIpcRecord {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint32_t exporter_gone;  ///< PoisonReason: None while the exporter holds the segment
  std::uint32_t exporter_pid;   ///< the exporter's pid as it sees it (for messages only)
  std::uint64_t offset;         ///< where the shared bytes start inside the allocation
  std::uint64_t size;           ///< bytes shared: Create.size
  std::uint64_t alloc_size;     ///< bytes of the allocation the handle opens (cuMemGetAddressRange)
  std::uint8_t device[16];      ///< UUID of the GPU the allocation lives on: Create.device
  std::uint8_t handle[kIpcHandleBytes];  ///< CUipcMemHandle of the allocation's base
};
static_assert(sizeof(DeviceIpcRecord) == 128);
static_assert(offsetof(DeviceIpcRecord, exporter_gone) == 8 && offsetof(DeviceIpcRecord, offset) == 16 &&
              offsetof(DeviceIpcRecord, device) == 40 && offsetof(DeviceIpcRecord, handle) == 56);
static_assert(sizeof(DeviceIpcRecord) <= kDeviceIpcRecordBytes);

/// Checks a record against what Create declares (`size` bytes on the GPU with UUID `device`): magic, version, a
/// non-empty range inside the allocation, the size and device. Returns an empty string when valid, else why not.
/// exporter_gone is not checked (callers that care read it). Defined in proto/device_ipc.cpp.
std::string check_device_ipc_record(const DeviceIpcRecord& record, std::uint64_t size, const Uuid& device);

template <typename T>
std::atomic_ref<T> atomic(T& word) noexcept {
  return std::atomic_ref<T>(word);
}

}  // namespace gpuipc::proto
