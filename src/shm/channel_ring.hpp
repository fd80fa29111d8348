// The channel ring's shared-memory protocol: every transition of a channel control block (proto::ChannelHeader and
// its Slot records), made by the clients' host threads and by the broker's repair, CUDA-free. src/core adds the
// stream operations (cuStreamWriteValue64 / cuStreamWaitValue64 through src/cuda) and pacing on top; the broker
// (src/broker/repair.cpp) calls channel_join and channel_remove_member. A member leaving cleanly and the broker
// repairing a dead one run the same channel_remove_member, with reason Closed or PeerDied (docs/channels.md, "Peer
// death"). See sync.hpp for the layer's rules.
//
// Slot words only grow. No writer (a producer's or consumer's host thread, its stream, or the broker's repair)
// moves a slot word backwards; each word has one kind of writer per round, and rounds of one slot are ordered:
// - `state`: its sequence (state_seq) never decreases. Free(s) -> Writing(s) (ring_try_acquire, a CAS);
//   Writing(s) -> Published(s) (ring_publish, by the claimant); Published(s) -> Reading(s) (ring_try_receive, a
//   CAS); Reading(s) -> Free(s + slots) (ring_release, by the holder). The two ways back keep the sequence:
//   Writing(s) -> Free(s + slots) abandons a round (ring_give_back, repair) and Reading(s) -> Published(s) hands a
//   message back (ring_hand_back, repair).
// - `head` and `tail` move only from x to x + 1, by CAS (advance in channel_ring.cpp).
// - `filled` is written only for round s, after round s's claim, and only with seq + 1: by the producer's host
//   thread (host channels) or its stream (device channels), or, when that stream write cannot come, by the host
//   (a failed enqueue) or the broker (a dead producer, after the wait its stream made first), which also flag the
//   message incomplete. Host writes use raise_to. The next round's producer claims the slot only after round s's
//   consumer released it, whose stream waited for `filled` first. (No poison bit: a stream wait is a cyclic >=,
//   and a marked value of an earlier round would pass a later round's wait before its producer wrote the slot.)
// - `freed` is written only for consumers: seq + 1 at the release of message seq, by the host thread (raise_to,
//   host channels, or when the stream write cannot be enqueued) or the consumer's stream, or by the repair of a
//   consumer that released on the host and died or left before its stream wrote it. A round that no consumer
//   releases (given back, abandoned by a dead producer, or a failed stream-wait enqueue in acquire) writes no
//   `freed` at all: the next producer waits for `release_mark`, the slot's last consumer release, not for
//   seq - slots + 1. So every consumer stream write of round s comes after the write of the round released before
//   it (the producer of the later round waited for it on its stream), and host writes use raise_to, which never
//   lowers the word.
// - `release_mark` (host only) is set by ring_release to seq + 1, in round order.
// Owed stream writes. A device channel's member records each stream write it will owe in its own table
// (proto::OwedTable, after the slot records) before the host-visible publish or release that others act on. When
// it dies, the broker takes the writes its stream had not made (ring_take_owed) and makes each as that stream
// would have, after the wait before it there (ring_settle_owed): a producer's `filled` (its message flagged
// incomplete) once the slot's previous release, which its stream waited for, has landed; a consumer's `freed` once
// the message's `filled` has. So the chain of stream waits that orders the writes of one word (a producer's stream
// waits for the previous `freed` before it writes the slot and `filled`, a consumer's waits for `filled` before it
// reads and writes `freed`) holds through deaths: no survivor's stream writes a slot a peer's stream still works on, no
// word goes back, and a stream any number of rounds behind is written for. A member claims only with room in its table
// (ring_owed_room): a stream that falls owed_capacity messages behind its host holds the host back.
// What this rests on, and does not enforce: a member that dies has no stream work left running once its process
// has exited (its contexts are torn down by then; the broker makes no owed write of a process before it has
// exited: until then its stream may still run, on an H200 for long enough that its own late write took a word
// back after the broker's). The broker keeps the writes it took in memory and in its journal, so a broker started
// after it was killed makes them too (src/broker/restore.cpp). A clean leave whose stream still owes writes hands
// them to the broker (proto::Leave, Channel's leave in src/core/channel.cpp): the broker removes the entry and drops
// each write once the stream has made it, or makes it as its turn comes once the process has exited. Only without
// a broker to take them does the leave wait (bounded, 10 s) for its stream (ring_member_writes_done) and write what
// is still owed at once, ahead of that stream. Likewise a dead producer's claimed, unpublished slot is given up
// (abandoned) only once its process has exited: its stream may still be filling it.
// The model test tests/unit/test_shm_channel_ring.cpp checks the rules above on every interleaving of a few steps,
// and tests/integration/test_channel_model.cpp on random interleavings of the real Channel with deaths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "proto/shm.hpp"

namespace gpuipc::shm {

/// A channel's geometry, read from its control block once and validated against the mapping's size. Every later
/// access goes through this copy, never through the shared words again: a member may rewrite them at any time.
struct RingGeometry {
  std::uint32_t slots = 0;
  std::uint32_t header_bytes = 0;
  std::uint32_t record_bytes = 0;
};

/// Reads and checks the geometry of the channel control block at `control` (`size` bytes mapped): magic, version,
/// slot count, header bytes, record size, and that every record lies inside the mapping. nullopt when invalid.
std::optional<RingGeometry> ring_geometry(const void* control, std::size_t size) noexcept;

/// Fills in a new control block of `slots` records with `header_bytes` of user header each, for slots of
/// `slot_bytes` in a data segment of kind `data_kind`: every slot Free for its first round; magic last (release).
void ring_init(void* control, std::uint32_t slots, std::uint32_t header_bytes, std::uint64_t slot_bytes,
               std::uint32_t data_kind) noexcept;

/// Slot record `seq % slots` of a ring whose geometry was checked.
inline proto::Slot& ring_slot(void* control, const RingGeometry& g, std::uint64_t seq) noexcept {
  auto* records = static_cast<std::byte*>(control) + sizeof(proto::ChannelHeader);
  return *reinterpret_cast<proto::Slot*>(records + (seq % g.slots) * g.record_bytes);  // NOLINT: layout of shm.hpp
}

/// A mapped control block whose geometry was checked: what the transitions below work on.
struct Ring {
  void* control = nullptr;
  RingGeometry geometry;

  proto::ChannelHeader& header() const noexcept { return *static_cast<proto::ChannelHeader*>(control); }
  proto::Slot& slot(std::uint64_t seq) const noexcept { return ring_slot(control, geometry, seq); }
  /// The inline user header of slot `seq` (geometry.header_bytes bytes after its Slot record).
  std::byte* user_header(std::uint64_t seq) const noexcept {
    return reinterpret_cast<std::byte*>(&slot(seq)) + sizeof(proto::Slot);  // NOLINT: layout of shm.hpp
  }
};

/// One attempt by producer `member` to claim the next free slot. Returns false when every slot is in flight;
/// true when done: `gone` None and `seq` the claimed sequence (its slot now Writing), or `gone` why no consumer is
/// left (the last one's reason).
bool ring_try_acquire(const Ring& ring, std::uint32_t member, std::uint64_t& seq, proto::PoisonReason& gone) noexcept;

/// The `freed` value the producer of `seq` must see before it writes the slot: seq + 1 of the slot's last consumer
/// release (0: none yet). An abandoned round does not move it.
std::uint64_t ring_free_mark(const Ring& ring, std::uint64_t seq) noexcept;

/// Gives back slot `seq`, claimed by producer `member` and not published: the round is skipped (`abandoned`), no
/// `freed` is written, and producers and consumers waiting are woken (a later message may be waiting past it).
void ring_give_back(const Ring& ring, std::uint64_t seq, std::uint32_t member) noexcept;

/// A device channel member's own record of the stream writes it owes, in its process's memory (Channel::Impl). The
/// table in the control block is there for the broker, which takes the writes over when the member dies or leaves;
/// every member can write it, and a member that judged its room by it could be held back for good by another's
/// garbage (entries that never land). Given one, ring_publish and ring_release record into both (the table's
/// `begin` and `end` rewritten from this record each time), and ring_owed_room and ring_member_writes_done read
/// only this one. Sized owed_capacity(slots) by its maker; one of another size is ignored (the table is used).
/// Channel always passes one for a device channel. Without one (nullptr, the default) these functions work on the
/// table alone, as they did before the record: that path is what the unit and model tests of this layer and half of
/// fuzz_shm's members exercise; the table's contents (what the broker reads) are the same either way.
struct OwnOwed {
  std::vector<proto::OwedWrite> entries;  ///< [begin, end) modulo entries.size(), oldest first
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// Publishes message `seq` from its claimant `member`: copies `header` into the slot's user header (the caller
/// checked it fits), records `bytes`, writes `filled` unless `stream_fills` (a device channel: the producer's
/// stream writes it), makes the message visible and wakes sleeping consumers. Returns false, having written
/// nothing, when the claim is no longer `member`'s: the broker repaired the member as gone (its connection closed,
/// and it neither rejoined nor exited in time) and abandoned the round, whose slot may be another producer's now.
bool ring_publish(const Ring& ring, std::uint64_t seq, std::uint32_t member, std::span<const std::byte> header,
                  std::uint64_t bytes, bool stream_fills, OwnOwed* own = nullptr) noexcept;

/// Flags message `seq` incomplete and writes its `filled` from the host: a consumer stream waiting for the
/// producer's stream write that will never come (a failed enqueue) is released, and the consumer is told.
void ring_mark_incomplete(proto::Slot& slot, std::uint64_t seq) noexcept;

/// One attempt by consumer `member` to take the next message: a handed-back one first, then the one at the tail.
/// Returns false when there is none; true when done: `gone` None and `seq` the message taken (its slot now
/// Reading), or `gone` why no producer is left and nothing is queued.
bool ring_try_receive(const Ring& ring, std::uint32_t member, std::uint64_t& seq, proto::PoisonReason& gone) noexcept;

/// Hands message `seq`, taken by consumer `member`, back to the queue for another consumer (receive could not
/// enqueue its stream wait) and wakes sleeping consumers.
void ring_hand_back(const Ring& ring, std::uint64_t seq, std::uint32_t member) noexcept;

/// Releases message `seq`, taken by consumer `member`: records the `freed` value the slot's next producer waits
/// for, writes `freed` unless `stream_frees` (a device channel: the consumer's stream writes it), frees the slot
/// for the next round and wakes sleeping producers. Returns false, having written nothing, when the message is no
/// longer `member`'s: the broker repaired the member as gone and handed the message to another consumer.
bool ring_release(const Ring& ring, std::uint64_t seq, std::uint32_t member, bool stream_frees,
                  OwnOwed* own = nullptr) noexcept;

/// Whether the stream writes of `member` have landed: every `filled` of a message it published and every `freed`
/// of one it released (its owed table). Until then a clean leave would let survivors' streams wait for writes
/// still queued.
bool ring_member_writes_done(const Ring& ring, std::uint32_t member, const OwnOwed* own = nullptr) noexcept;

/// Member `member`'s table of owed stream writes (after the slot records).
proto::OwedTable& ring_owed_table(const Ring& ring, std::uint32_t member) noexcept;

/// Returns how many more writes `member`'s table can record, first forgetting those that have landed, oldest
/// first, once half of it is used. A device channel's member claims a slot (or a message) only while this is more than
/// the slots (or messages) it holds: each will owe one write at its publish (or release).
std::uint64_t ring_owed_room(const Ring& ring, std::uint32_t member, OwnOwed* own = nullptr) noexcept;

/// Writes member `member`'s own record back over its table in the control block, entries and bounds (before a leave
/// hands the table to the broker, or writes what is left of it: another member may have scribbled over it).
void ring_restore_owed(const Ring& ring, std::uint32_t member, const OwnOwed& own) noexcept;

/// The writes that dead member `member`'s stream still owed (broker, before channel_remove_member changes the
/// slots): every entry of its table whose publish or release it made and whose word has not reached it, oldest
/// first, at most out.size() (proto::owed_capacity of the ring is enough). Returns how many.
std::size_t ring_take_owed(const Ring& ring, std::uint32_t member, std::span<proto::OwedWrite> out) noexcept;

/// Whether member `member` holds a claimed slot it has not published (its host acquired it; its stream may still be
/// writing the slot).
bool ring_member_claims(const Ring& ring, std::uint32_t member) noexcept;

/// Empties member `member`'s table of owed writes (the broker took them over at its Leave: the clean leave that
/// follows must not write them ahead of the stream).
void ring_forget_owed(const Ring& ring, std::uint32_t member) noexcept;

/// Drops from `owed` the writes that have landed (a live member's stream made them); the others are moved to the
/// front. Returns how many are left.
std::size_t ring_drop_landed(const Ring& ring, std::span<proto::OwedWrite> owed) noexcept;

/// Writes each owed write whose stream would be past its wait before it: a dead producer's `filled` (and the
/// message flagged incomplete while it is still in its slot) once the slot's previous release has
/// landed, a dead consumer's `freed` once the message's `filled` has. Never sooner: a survivor's stream then
/// never writes the slot while the dead member's peer stream still works on it, and no word goes back. Those
/// still waiting are moved to the front of `owed`; returns how many.
std::size_t ring_settle_owed(const Ring& ring, std::span<proto::OwedWrite> owed) noexcept;

/// Writes each owed write that has not landed now, whether or not its turn has come (as a clean leave does with
/// what its stream still owes): for the writes the broker has no room to keep.
void ring_write_owed_now(const Ring& ring, std::span<const proto::OwedWrite> owed) noexcept;

/// Claims a member entry for `token` as a producer or consumer, counts it and empties its owed table (broker,
/// answering Join). Returns the entry's index, or proto::kNoMember when the table is full or the role is neither.
std::uint32_t channel_join(const Ring& ring, std::uint32_t token, proto::Role role) noexcept;

/// Removes member `index` of `role` if it still holds `token`, and repairs the slots it held: a message it was
/// writing is abandoned (its slot freed) and a message it was reading goes back to the queue for another consumer
/// (exactly one survivor gets it). A clean leave (`reason` Closed) also writes what its stream still owes, at
/// once; for a dead member (PeerDied) the broker took those first (ring_take_owed) and writes them in order
/// (ring_settle_owed). The last producer (or consumer) to go records `reason` for the other side; every sleeper is
/// woken. Returns whether it removed it.
bool channel_remove_member(void* control, const RingGeometry& geometry, std::uint32_t index, std::uint32_t token,
                           proto::Role role, proto::PoisonReason reason) noexcept;

}  // namespace gpuipc::shm
