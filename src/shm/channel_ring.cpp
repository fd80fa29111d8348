#include "shm/channel_ring.hpp"

#include <cstring>
#include <utility>

#include "shm/members.hpp"
#include "shm/sync.hpp"

namespace gpuipc::shm {

using proto::atomic;
using proto::Phase;

std::optional<RingGeometry> ring_geometry(const void* control, std::size_t size) noexcept {
  if (control == nullptr || size < sizeof(proto::ChannelHeader)) return std::nullopt;
  auto& h = *static_cast<proto::ChannelHeader*>(const_cast<void*>(control));
  // Each word once, atomically: the checks and the geometry returned are the same values.
  RingGeometry g;
  const std::uint32_t magic = atomic(h.magic).load(std::memory_order_acquire);
  const std::uint32_t version = atomic(h.version).load();
  g.slots = atomic(h.slots).load();
  g.header_bytes = atomic(h.header_bytes).load();
  g.record_bytes = atomic(h.record_bytes).load();
  if (magic != proto::kChannelMagic || version != proto::kChannelVersion || g.slots == 0 ||
      g.slots > proto::kMaxSlots || g.header_bytes > proto::kMaxHeaderBytes ||
      g.record_bytes != proto::record_bytes(g.header_bytes) ||
      proto::channel_control_bytes(g.slots, g.header_bytes) > size) {
    return std::nullopt;
  }
  return g;
}

void ring_init(void* control, std::uint32_t slots, std::uint32_t header_bytes, std::uint64_t slot_bytes,
               std::uint32_t data_kind) noexcept {
  auto* h = static_cast<proto::ChannelHeader*>(control);
  h->slots = slots;
  h->header_bytes = header_bytes;
  h->slot_bytes = slot_bytes;
  h->data_kind = data_kind;
  h->record_bytes = proto::record_bytes(header_bytes);
  const RingGeometry g{slots, header_bytes, h->record_bytes};
  for (std::uint32_t i = 0; i < slots; ++i) {
    auto& s = ring_slot(control, g, i);
    s.state = proto::pack_state(i, Phase::Free, proto::kNoMember);
  }
  h->version = proto::kChannelVersion;
  atomic(h->magic).store(proto::kChannelMagic, std::memory_order_release);
}

namespace {

/// Moves a ring index from `from` to `from + 1` unless someone already did. (Not compare_exchange on `from`
/// itself: a failed exchange overwrites its expected value, and callers still need `from`.)
void advance(std::uint64_t& index, std::uint64_t from) noexcept {
  std::uint64_t expected = from;
  atomic(index).compare_exchange_strong(expected, from + 1, std::memory_order_acq_rel);
}

/// Writing(seq) -> Free(seq + n) if the slot still reads `s`: the round is skipped. The slot's next producer
/// waits for the last consumer's release (release_mark), which this round does not change.
bool abandon(proto::ChannelHeader& h, proto::Slot& slot, std::uint64_t s, std::uint64_t n) noexcept {
  if (!atomic(slot.state).compare_exchange_strong(s, proto::pack_state(proto::state_seq(s) + n, Phase::Free,
                                                                       proto::kNoMember))) {
    return false;
  }
  atomic(h.abandoned).fetch_add(1);
  return true;
}

/// Reading(seq) -> Published(seq) if the slot still reads `s`: the message is back behind the tail, for exactly
/// one other consumer (try_receive's orphan scan). `redelivered` counts those of a consumer that left or died.
bool hand_back(proto::ChannelHeader& h, proto::Slot& slot, std::uint64_t s, bool redelivered) noexcept {
  if (!atomic(slot.state).compare_exchange_strong(s, proto::pack_state(proto::state_seq(s), Phase::Published,
                                                                       proto::kNoMember))) {
    return false;
  }
  atomic(h.orphans).fetch_add(1);
  if (redelivered) atomic(h.redelivered).fetch_add(1);
  return true;
}

proto::OwedWrite& owed_entry(const Ring& ring, proto::OwedTable& t, std::uint64_t i) noexcept {
  auto* entries = reinterpret_cast<proto::OwedWrite*>(&t + 1);  // NOLINT: layout of shm.hpp
  return entries[i % proto::owed_capacity(ring.geometry.slots)];
}

/// The table's [begin, end), at most owed_capacity entries long: other members can write any value into any
/// member's table, and no loop over it may run longer than the table.
std::pair<std::uint64_t, std::uint64_t> owed_range(const Ring& ring, proto::OwedTable& t) noexcept {
  const std::uint64_t cap = proto::owed_capacity(ring.geometry.slots);
  const std::uint64_t end = atomic(t.end).load(std::memory_order_acquire);
  const std::uint64_t begin = atomic(t.begin).load(std::memory_order_acquire);
  return {end - begin > cap ? end - cap : begin, end};
}

std::uint64_t owed_seq(const proto::OwedWrite& w) noexcept { return w.code & ~proto::kOwedFreed; }
bool owed_freed(const proto::OwedWrite& w) noexcept { return (w.code & proto::kOwedFreed) != 0; }
std::uint64_t& owed_word(const Ring& ring, const proto::OwedWrite& w) noexcept {
  auto& slot = ring.slot(owed_seq(w));
  return owed_freed(w) ? slot.freed : slot.filled;
}

/// Whether the owed write has landed.
bool landed(const Ring& ring, const proto::OwedWrite& w) noexcept {
  return (atomic(owed_word(ring, w)).load(std::memory_order_acquire) & proto::kMaxValue) >= owed_seq(w) + 1;
}

/// Whether `own` is a record to use for a ring of this geometry (OwnOwed).
bool usable(const Ring& ring, const OwnOwed* own) noexcept {
  return own != nullptr && own->entries.size() == proto::owed_capacity(ring.geometry.slots);
}

/// Records a write `member`'s stream will owe, before the host-visible step that others act on: in `own` when
/// given, and in the member's table (its bounds rewritten from `own`). The caller made room (ring_owed_room); a
/// full table (a caller that did not) records nothing. Returns whether it recorded.
bool owe(const Ring& ring, std::uint32_t member, proto::OwedWrite w, OwnOwed* own) noexcept {
  auto& t = ring_owed_table(ring, member);
  const std::uint64_t cap = proto::owed_capacity(ring.geometry.slots);
  const bool mine = usable(ring, own);
  const std::uint64_t begin = mine ? own->begin : atomic(t.begin).load(std::memory_order_relaxed);
  const std::uint64_t end = mine ? own->end : atomic(t.end).load(std::memory_order_relaxed);
  if (end - begin >= cap) return false;
  auto& e = owed_entry(ring, t, end);
  atomic(e.code).store(w.code, std::memory_order_relaxed);
  atomic(e.after).store(w.after, std::memory_order_relaxed);
  if (mine) {
    own->entries[end % cap] = w;
    own->end = end + 1;
    atomic(t.begin).store(begin, std::memory_order_relaxed);
  }
  atomic(t.end).store(end + 1, std::memory_order_release);
  return true;
}

/// Takes back the write just recorded (owe) whose host-visible step did not happen: its stream will not be asked
/// for it (publish and release return false before they enqueue it), so it would never land. Only in `own`: the
/// table's `end` goes back with it, and the broker reading the table meanwhile takes no write whose step was not
/// made (made()).
void unowe(const Ring& ring, std::uint32_t member, OwnOwed* own) noexcept {
  if (!usable(ring, own) || own->end == own->begin) return;
  --own->end;
  atomic(ring_owed_table(ring, member).end).store(own->end, std::memory_order_release);
}

/// Whether member `member` made the host-visible step of owed write `w` (its publish or release; it records the
/// write just before). Until then the message is still its claim or its hold, which the repair abandons or hands
/// back, and nothing is owed.
bool made(const Ring& ring, std::uint32_t member, const proto::OwedWrite& w) noexcept {
  const std::uint64_t seq = owed_seq(w);
  const std::uint64_t s = atomic(ring.slot(seq).state).load(std::memory_order_acquire);
  return s != proto::pack_state(seq, owed_freed(w) ? Phase::Reading : Phase::Writing, member);
}

/// Writes an owed word as its stream would have. A `filled` written for a producer that did not write it flags its
/// message incomplete (its data may be partly written): also once the message has left the slot, since a consumer
/// that released it in stream order checks the flag after its stream has read the data. The mark names the message,
/// so a later round of the slot is not flagged by it.
void write_owed(const Ring& ring, const proto::OwedWrite& w) noexcept {
  const std::uint64_t seq = owed_seq(w);
  auto& slot = ring.slot(seq);
  if (owed_freed(w)) {
    raise_to(slot.freed, seq + 1);
    return;
  }
  ring_mark_incomplete(slot, seq);
}

/// Whether the stream that owed `w` would be past its wait before the write: a producer's stream waits for the
/// slot's previous release to land, a consumer's for the message's `filled`.
bool ready(const Ring& ring, const proto::OwedWrite& w) noexcept {
  auto& slot = ring.slot(owed_seq(w));
  if (owed_freed(w)) return (atomic(slot.filled).load(std::memory_order_acquire) & proto::kMaxValue) >= owed_seq(w) + 1;
  return (atomic(slot.freed).load(std::memory_order_acquire) & proto::kMaxValue) >= w.after;
}

/// Moves the slot from `s` (round `pos`) to `to` for `member` and `index` past `pos`. False when another member
/// changed the slot first.
bool take(std::atomic_ref<std::uint64_t> st, std::uint64_t s, std::uint64_t& index, std::uint64_t pos, Phase to,
          std::uint32_t member, std::uint64_t& seq, proto::PoisonReason& gone) noexcept {
  if (!st.compare_exchange_strong(s, proto::pack_state(pos, to, member), std::memory_order_acq_rel)) return false;
  advance(index, pos);
  seq = pos;
  gone = proto::PoisonReason::None;
  return true;
}

/// How often one claim may move the head or tail past a slot taken ahead of it. A ring in order needs a few per
/// slot at most; a peer that wrote a far-ahead round into every slot, or an index far behind, would otherwise keep
/// the claimer helping for up to 2^48 steps. Past it the claim finds nothing, and the caller's wait times out.
constexpr std::uint32_t kMaxHelps = 1U << 16;

proto::PoisonReason reason_of(std::uint32_t word) noexcept {
  return word == static_cast<std::uint32_t>(proto::PoisonReason::Closed) ? proto::PoisonReason::Closed
                                                                         : proto::PoisonReason::PeerDied;
}

}  // namespace

bool ring_try_acquire(const Ring& ring, std::uint32_t member, std::uint64_t& seq, proto::PoisonReason& gone) noexcept {
  auto& h = ring.header();
  for (std::uint32_t helped = 0;;) {
    if (atomic(h.consumers).load() == 0) {
      if (const auto word = atomic(h.consumers_gone).load(); word != 0) {
        gone = reason_of(word);
        return true;
      }
    }
    const std::uint64_t pos = atomic(h.head).load(std::memory_order_acquire);
    auto st = atomic(ring.slot(pos).state);
    const std::uint64_t s = st.load(std::memory_order_acquire);
    const std::uint64_t round = proto::state_seq(s);
    if (round == pos && proto::state_phase(s) == Phase::Free) {
      if (take(st, s, h.head, pos, Phase::Writing, member, seq, gone)) return true;
      continue;
    }
    if (round >= pos && ++helped <= kMaxHelps) {  // claimed (or abandoned) but head not moved yet: help it along
      advance(h.head, pos);
      continue;
    }
    return false;  // the slot still holds message pos - n: every slot is in flight (or the ring is corrupt)
  }
}

std::uint64_t ring_free_mark(const Ring& ring, std::uint64_t seq) noexcept {
  return atomic(ring.slot(seq).release_mark).load(std::memory_order_acquire) & proto::kMaxValue;
}

void ring_give_back(const Ring& ring, std::uint64_t seq, std::uint32_t member) noexcept {
  auto& h = ring.header();
  (void)abandon(h, ring.slot(seq), proto::pack_state(seq, Phase::Writing, member), ring.geometry.slots);
  bump_and_wake(h.released_seq, &h.released_sleepers);
  // Consumers too: one asleep at this slot (the tail) while a later message was published by another producer can
  // move past it now, and would otherwise sleep until the next publish or its timeout.
  bump_and_wake(h.published_seq, &h.published_sleepers);
}

bool ring_publish(const Ring& ring, std::uint64_t seq, std::uint32_t member, std::span<const std::byte> header,
                  std::uint64_t bytes, bool stream_fills, OwnOwed* own) noexcept {
  auto& h = ring.header();
  auto& s = ring.slot(seq);
  auto state = atomic(s.state);
  // Only while the claim is this member's: a repair that took this member for gone abandoned the round, and the
  // slot's next round may be another producer's by now. A store of Published(seq) would move its state back.
  std::uint64_t claimed = proto::pack_state(seq, Phase::Writing, member);
  if (state.load(std::memory_order_acquire) != claimed) return false;
  if (!header.empty()) std::memcpy(ring.user_header(seq), header.data(), header.size());
  s.header_size = static_cast<std::uint32_t>(header.size());
  s.size = bytes;
  // `incomplete` is left alone: a mark names its message, and an earlier round's stays for that round's consumer.
  bool owed = false;
  if (stream_fills) {
    owed = owe(ring, member, {seq, ring_free_mark(ring, seq)}, own);
  } else {
    atomic(s.filled).store(seq + 1, std::memory_order_release);
  }
  if (!state.compare_exchange_strong(claimed, proto::pack_state(seq, Phase::Published, member),
                                     std::memory_order_acq_rel)) {
    if (owed) unowe(ring, member, own);
    return false;  // abandoned meanwhile
  }
  atomic(h.published).fetch_add(1, std::memory_order_relaxed);
  atomic(h.published_bytes).fetch_add(bytes, std::memory_order_relaxed);
  bump_and_wake(h.published_seq, &h.published_sleepers);
  return true;
}

void ring_mark_incomplete(proto::Slot& slot, std::uint64_t seq) noexcept {
  // Never over a later round's mark: a dead producer's `filled` can be written after the slot's next round was
  // published (its consumer released in stream order) and flagged by its own producer (a failed enqueue). Bounded:
  // the broker runs this, and a member that keeps writing the word must not hold it here.
  const std::uint32_t mark = proto::incomplete_mark(seq);
  auto word = atomic(slot.incomplete);
  std::uint32_t cur = word.load(std::memory_order_acquire);
  for (int tries = 0; tries < kMostCasTries && !proto::incomplete_mark_is_later(cur, mark); ++tries) {
    if (word.compare_exchange_weak(cur, mark)) break;
  }
  raise_to(slot.filled, seq + 1);
}

bool ring_try_receive(const Ring& ring, std::uint32_t member, std::uint64_t& seq, proto::PoisonReason& gone) noexcept {
  auto& h = ring.header();
  const std::uint64_t n = ring.geometry.slots;
  std::uint32_t scanned = atomic(h.orphans_scanned).load(std::memory_order_acquire);
  if (const std::uint32_t handed = atomic(h.orphans).load(std::memory_order_acquire); handed != scanned) {
    // Messages a dead (or leaving) consumer held: behind the tail, back in the Published phase. Taking one does not
    // count down: a look that finds none says so for the hand-backs counted when it began. A count kept of those
    // behind the tail was zeroed by a look that missed one handed back meanwhile (into a slot it had passed), which
    // then stayed behind the tail for good, and the ring filled up behind it.
    const std::uint64_t tail = atomic(h.tail).load(std::memory_order_acquire);
    for (std::uint64_t i = 0; i < n; ++i) {
      auto st = atomic(ring.slot(i).state);
      std::uint64_t s = st.load(std::memory_order_acquire);
      if (proto::state_phase(s) != Phase::Published || proto::state_seq(s) >= tail) continue;
      const std::uint64_t round = proto::state_seq(s);
      if (st.compare_exchange_strong(s, proto::pack_state(round, Phase::Reading, member), std::memory_order_acq_rel)) {
        seq = round;
        gone = proto::PoisonReason::None;
        return true;
      }
    }
    // Every message handed back before `handed` was counted is taken: one handed back since counts past it, so the
    // next call looks again. (Another consumer's look that ended first may have moved the mark: it stays.)
    atomic(h.orphans_scanned).compare_exchange_strong(scanned, handed);
  }
  for (std::uint32_t helped = 0;;) {
    const std::uint64_t pos = atomic(h.tail).load(std::memory_order_acquire);
    auto st = atomic(ring.slot(pos).state);
    const std::uint64_t s = st.load(std::memory_order_acquire);
    const std::uint64_t round = proto::state_seq(s);
    const Phase phase = proto::state_phase(s);
    if (round == pos && phase == Phase::Published) {
      if (take(st, s, h.tail, pos, Phase::Reading, member, seq, gone)) return true;
      continue;
    }
    if ((round > pos || (round == pos && phase == Phase::Reading)) && ++helped <= kMaxHelps) {
      // Taken by another consumer, or abandoned by a dead producer: move the tail past it.
      advance(h.tail, pos);
      continue;
    }
    if (atomic(h.producers).load() == 0) {
      if (const auto word = atomic(h.producers_gone).load(); word != 0) {
        gone = reason_of(word);
        return true;
      }
    }
    return false;
  }
}

void ring_hand_back(const Ring& ring, std::uint64_t seq, std::uint32_t member) noexcept {
  auto& h = ring.header();
  (void)hand_back(h, ring.slot(seq), proto::pack_state(seq, Phase::Reading, member), false);
  bump_and_wake(h.published_seq);
}

bool ring_release(const Ring& ring, std::uint64_t seq, std::uint32_t member, bool stream_frees, OwnOwed* own) noexcept {
  auto& h = ring.header();
  auto& s = ring.slot(seq);
  auto state = atomic(s.state);
  // Only while the message is this member's: a repair that took this member for gone handed it back, and another
  // consumer may be reading it. A store of Free would hand its slot to the next producer under that reader, and
  // this member's `freed` would release that producer's stream early.
  std::uint64_t held = proto::pack_state(seq, Phase::Reading, member);
  if (state.load(std::memory_order_acquire) != held) return false;
  bool owed = false;
  if (stream_frees) {
    owed = owe(ring, member, {seq | proto::kOwedFreed, 0}, own);
  } else {
    raise_to(s.freed, seq + 1);
  }
  atomic(s.release_mark).store(seq + 1, std::memory_order_release);  // before the slot is Free for the next round
  if (!state.compare_exchange_strong(held, proto::pack_state(seq + ring.geometry.slots, Phase::Free, proto::kNoMember),
                                     std::memory_order_acq_rel)) {
    if (owed) unowe(ring, member, own);
    return false;  // handed back meanwhile
  }
  bump_and_wake(h.released_seq, &h.released_sleepers);
  return true;
}

bool ring_member_writes_done(const Ring& ring, std::uint32_t member, const OwnOwed* own) noexcept {
  if (usable(ring, own)) {
    for (std::uint64_t i = own->begin; i < own->end; ++i) {
      if (!landed(ring, own->entries[i % own->entries.size()])) return false;
    }
    return true;
  }
  auto& t = ring_owed_table(ring, member);
  const auto [begin, end] = owed_range(ring, t);
  for (std::uint64_t i = begin; i < end; ++i) {
    if (!landed(ring, owed_entry(ring, t, i))) return false;
  }
  return true;
}

proto::OwedTable& ring_owed_table(const Ring& ring, std::uint32_t member) noexcept {
  auto* base = static_cast<std::byte*>(ring.control) +
               proto::owed_tables_offset(ring.geometry.slots, ring.geometry.header_bytes);
  return *reinterpret_cast<proto::OwedTable*>(base + static_cast<std::size_t>(member % proto::kMaxMembers) *
                                                         proto::owed_table_bytes(ring.geometry.slots));  // NOLINT
}

std::uint64_t ring_owed_room(const Ring& ring, std::uint32_t member, OwnOwed* own) noexcept {
  auto& t = ring_owed_table(ring, member);
  const std::uint64_t cap = proto::owed_capacity(ring.geometry.slots);
  if (usable(ring, own)) {
    if (own->end - own->begin >= cap / 2) {  // as below, from its own record
      while (own->begin < own->end && landed(ring, own->entries[own->begin % cap])) ++own->begin;
      atomic(t.begin).store(own->begin, std::memory_order_relaxed);
    }
    return cap - (own->end - own->begin);
  }
  auto [begin, end] = owed_range(ring, t);
  // Forgets landed writes only once half the table is used: the handoff's path then reads no word a stream
  // wrote (a cache miss each), only its own two counters. (A member holds at most a quarter of the table.)
  if (end - begin >= cap / 2) {
    while (begin < end && landed(ring, owed_entry(ring, t, begin))) ++begin;
    atomic(t.begin).store(begin, std::memory_order_relaxed);
  }
  return cap - (end - begin);
}

std::size_t ring_take_owed(const Ring& ring, std::uint32_t member, std::span<proto::OwedWrite> out) noexcept {
  auto& t = ring_owed_table(ring, member);
  const auto [begin, end] = owed_range(ring, t);
  std::size_t n = 0;
  for (std::uint64_t i = begin; i < end && n < out.size(); ++i) {
    const proto::OwedWrite w{atomic(owed_entry(ring, t, i).code).load(), atomic(owed_entry(ring, t, i).after).load()};
    if (made(ring, member, w) && !landed(ring, w)) out[n++] = w;
  }
  return n;
}

bool ring_member_claims(const Ring& ring, std::uint32_t member) noexcept {
  for (std::uint64_t i = 0; i < ring.geometry.slots; ++i) {
    const std::uint64_t s = atomic(ring.slot(i).state).load(std::memory_order_acquire);
    if (proto::state_phase(s) == Phase::Writing && proto::state_member(s) == member) return true;
  }
  return false;
}

void ring_restore_owed(const Ring& ring, std::uint32_t member, const OwnOwed& own) noexcept {
  if (!usable(ring, &own)) return;
  auto& t = ring_owed_table(ring, member);
  for (std::uint64_t i = own.begin; i < own.end; ++i) {
    auto& e = owed_entry(ring, t, i);
    atomic(e.code).store(own.entries[i % own.entries.size()].code, std::memory_order_relaxed);
    atomic(e.after).store(own.entries[i % own.entries.size()].after, std::memory_order_relaxed);
  }
  atomic(t.begin).store(own.begin, std::memory_order_relaxed);
  atomic(t.end).store(own.end, std::memory_order_release);
}

void ring_forget_owed(const Ring& ring, std::uint32_t member) noexcept {
  auto& t = ring_owed_table(ring, member);
  atomic(t.begin).store(atomic(t.end).load());
}

std::size_t ring_drop_landed(const Ring& ring, std::span<proto::OwedWrite> owed) noexcept {
  std::size_t left = 0;
  for (const auto& w : owed) {
    if (!landed(ring, w)) owed[left++] = w;
  }
  return left;
}

std::size_t ring_settle_owed(const Ring& ring, std::span<proto::OwedWrite> owed) noexcept {
  std::size_t left = 0;
  for (const auto& w : owed) {
    if (landed(ring, w)) continue;
    if (ready(ring, w)) {
      write_owed(ring, w);
      continue;
    }
    owed[left++] = w;
  }
  return left;
}

void ring_write_owed_now(const Ring& ring, std::span<const proto::OwedWrite> owed) noexcept {
  for (const auto& w : owed) {
    if (!landed(ring, w)) write_owed(ring, w);
  }
}

std::uint32_t channel_join(const Ring& ring, std::uint32_t token, proto::Role role) noexcept {
  if (role != proto::Role::Producer && role != proto::Role::Consumer) return proto::kNoMember;
  auto& h = ring.header();
  const std::uint32_t index = claim_member(h.members, token, role);
  if (index == proto::kNoMember) return index;
  // A fresh table: what an earlier member of this entry owed was written when it left or died.
  auto& t = ring_owed_table(ring, index);
  atomic(t.begin).store(0);
  atomic(t.end).store(0);
  const bool producer = role == proto::Role::Producer;
  saturating_increment(producer ? h.producers : h.consumers);
  atomic(producer ? h.producers_gone : h.consumers_gone).store(0);
  atomic(producer ? h.producers_seen : h.consumers_seen).store(1, std::memory_order_release);
  return index;
}

namespace {

/// Repairs one slot of member `idx`; returns which sides must be woken (bit 0: consumers, bit 1: producers).
unsigned repair_slot(proto::ChannelHeader& h, proto::Slot& slot, std::uint64_t n, std::uint32_t idx) noexcept {
  unsigned wake = 0;
  auto st = atomic(slot.state);
  // Bounded: the broker runs this on a word every member may write; one that keeps rewriting it keeps its slot.
  for (int tries = 0; tries < kMostCasTries; ++tries) {
    const std::uint64_t s = st.load(std::memory_order_acquire);
    if (proto::state_member(s) != idx) break;
    const auto phase = proto::state_phase(s);
    if (phase == Phase::Writing) {
      // Claimed, never published: nobody will consume it.
      if (abandon(h, slot, s, n)) {
        wake |= 3U;
        break;
      }
    } else if (phase == Phase::Published) {
      std::uint64_t expected = s;
      if (st.compare_exchange_strong(expected, proto::pack_state(proto::state_seq(s), Phase::Published,
                                                                 proto::kNoMember))) {
        break;
      }
    } else if (phase == Phase::Reading) {
      // A consumer gone holding it: hand it back, for another consumer (exactly one survivor gets it).
      if (hand_back(h, slot, s, true)) {
        wake |= 1U;
        break;
      }
    } else {
      break;
    }
  }
  return wake;
}

}  // namespace

bool channel_remove_member(void* control, const RingGeometry& g, std::uint32_t index, std::uint32_t token,
                           proto::Role role, proto::PoisonReason reason) noexcept {
  auto& h = *static_cast<proto::ChannelHeader*>(control);
  // Slots first, membership last: until the entry is cleared, nobody else can be member `index`.
  if (!holds_token(h.members, index, token)) return false;
  const Ring ring{control, g};
  if (reason == proto::PoisonReason::Closed) {
    // A clean leave waited (bounded) for its stream's writes; what is still owed is written now, ahead of the
    // stream (the documented gap of a leave whose stream is stuck).
    auto& t = ring_owed_table(ring, index);
    const auto [begin, end] = owed_range(ring, t);
    for (std::uint64_t i = begin; i < end; ++i) {
      const proto::OwedWrite w = owed_entry(ring, t, i);
      if (made(ring, index, w) && !landed(ring, w)) write_owed(ring, w);
    }
  }
  unsigned wake = 0;
  for (std::uint64_t i = 0; i < g.slots; ++i) wake |= repair_slot(h, ring_slot(control, g, i), g.slots, index);
  if (!clear_member(h.members, index, token)) return false;
  if (role == proto::Role::Producer && saturating_decrement(h.producers) <= 1) {
    atomic(h.producers_gone).store(static_cast<std::uint32_t>(reason));
    wake |= 1U;
  }
  if (role == proto::Role::Consumer && saturating_decrement(h.consumers) <= 1) {
    atomic(h.consumers_gone).store(static_cast<std::uint32_t>(reason));
    wake |= 2U;
  }
  // A clean leave wakes both sides unconditionally (callers may sleep on either word).
  if ((wake & 1U) != 0 || reason == proto::PoisonReason::Closed) bump_and_wake(h.published_seq);
  if ((wake & 2U) != 0 || reason == proto::PoisonReason::Closed) bump_and_wake(h.released_seq);
  return true;
}

}  // namespace gpuipc::shm
