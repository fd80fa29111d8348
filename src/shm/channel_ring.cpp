#include "shm/channel_ring.hpp"

#include <cstring>

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
    s.releaser = proto::kNoMember;
    s.publisher = proto::kNoMember;
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

/// The message whose `filled` the slot's `publisher` wrote last, given the slot's state `s`: the one in the slot,
/// or, once a consumer released it on the host and the slot went on to its next round, the one before. false when
/// the slot has had no round before.
bool published_round(std::uint64_t s, std::uint64_t n, std::uint64_t& round) noexcept {
  const Phase phase = proto::state_phase(s);
  round = proto::state_seq(s);
  if (phase == Phase::Published || phase == Phase::Reading) return true;
  if (round < n) return false;
  round -= n;
  return true;
}

/// Raises `filled` to kPoisonBit | value unless it already reached value (masked): a late host write never
/// lowers what a stream wrote.
void poison_filled(std::uint64_t& filled, std::uint64_t value) noexcept {
  auto f = atomic(filled);
  std::uint64_t cur = f.load(std::memory_order_acquire);
  while ((cur & proto::kMaxValue) < value &&
         !f.compare_exchange_weak(cur, proto::kPoisonBit | value, std::memory_order_acq_rel)) {
  }
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

proto::PoisonReason reason_of(std::uint32_t word) noexcept {
  return word == static_cast<std::uint32_t>(proto::PoisonReason::Closed) ? proto::PoisonReason::Closed
                                                                         : proto::PoisonReason::PeerDied;
}

}  // namespace

bool ring_try_acquire(const Ring& ring, std::uint32_t member, std::uint64_t& seq, proto::PoisonReason& gone) noexcept {
  auto& h = ring.header();
  for (;;) {
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
    if (round >= pos) {  // claimed by another producer (or abandoned) but head not moved yet: help it along
      advance(h.head, pos);
      continue;
    }
    return false;  // the slot still holds message pos - n: every slot is in flight
  }
}

std::uint64_t ring_free_mark(const Ring& ring, std::uint64_t seq) noexcept {
  return atomic(ring.slot(seq).release_mark).load(std::memory_order_acquire) & proto::kMaxValue;
}

void ring_give_back(const Ring& ring, std::uint64_t seq, std::uint32_t member) noexcept {
  auto& h = ring.header();
  (void)abandon(h, ring.slot(seq), proto::pack_state(seq, Phase::Writing, member), ring.geometry.slots);
  bump_and_wake(h.released_seq, &h.released_sleepers);
}

void ring_publish(const Ring& ring, std::uint64_t seq, std::uint32_t member, std::span<const std::byte> header,
                  std::uint64_t bytes, bool stream_fills) noexcept {
  auto& h = ring.header();
  auto& s = ring.slot(seq);
  if (!header.empty()) std::memcpy(ring.user_header(seq), header.data(), header.size());
  s.header_size = static_cast<std::uint32_t>(header.size());
  s.size = bytes;
  atomic(s.flags).store(0);
  atomic(s.publisher).store(member);
  if (!stream_fills) atomic(s.filled).store(seq + 1, std::memory_order_release);
  atomic(s.state).store(proto::pack_state(seq, Phase::Published, member), std::memory_order_release);
  atomic(h.published).fetch_add(1, std::memory_order_relaxed);
  atomic(h.published_bytes).fetch_add(bytes, std::memory_order_relaxed);
  bump_and_wake(h.published_seq, &h.published_sleepers);
}

void ring_mark_incomplete(proto::Slot& slot, std::uint64_t seq) noexcept {
  atomic(slot.flags).fetch_or(proto::kSlotIncomplete);
  poison_filled(slot.filled, seq + 1);
}

void ring_clear_stale_poison(proto::Slot& slot, std::uint64_t seq) noexcept {
  auto f = atomic(slot.filled);
  std::uint64_t cur = f.load(std::memory_order_acquire);
  // A CAS, not a store: this round's stream write, or the repair's poison for this round, may land meanwhile.
  while ((cur & proto::kPoisonBit) != 0 && (cur & proto::kMaxValue) < seq + 1 &&
         !f.compare_exchange_weak(cur, cur & proto::kMaxValue, std::memory_order_acq_rel)) {
  }
}

bool ring_try_receive(const Ring& ring, std::uint32_t member, std::uint64_t& seq, proto::PoisonReason& gone) noexcept {
  auto& h = ring.header();
  const std::uint64_t n = ring.geometry.slots;
  if (const std::uint32_t orphans = atomic(h.orphans).load(std::memory_order_acquire); orphans > 0) {
    // Messages a dead (or leaving) consumer held: behind the tail, back in the Published phase.
    const std::uint64_t tail = atomic(h.tail).load(std::memory_order_acquire);
    for (std::uint64_t i = 0; i < n; ++i) {
      auto st = atomic(ring.slot(i).state);
      std::uint64_t s = st.load(std::memory_order_acquire);
      if (proto::state_phase(s) != Phase::Published || proto::state_seq(s) >= tail) continue;
      const std::uint64_t round = proto::state_seq(s);
      if (st.compare_exchange_strong(s, proto::pack_state(round, Phase::Reading, member), std::memory_order_acq_rel)) {
        atomic(h.orphans).fetch_sub(1);
        seq = round;
        gone = proto::PoisonReason::None;
        return true;
      }
    }
    std::uint32_t seen = orphans;
    atomic(h.orphans).compare_exchange_strong(seen, 0U);  // all taken already
  }
  for (;;) {
    const std::uint64_t pos = atomic(h.tail).load(std::memory_order_acquire);
    auto st = atomic(ring.slot(pos).state);
    const std::uint64_t s = st.load(std::memory_order_acquire);
    const std::uint64_t round = proto::state_seq(s);
    const Phase phase = proto::state_phase(s);
    if (round == pos && phase == Phase::Published) {
      if (take(st, s, h.tail, pos, Phase::Reading, member, seq, gone)) return true;
      continue;
    }
    if (round > pos || (round == pos && phase == Phase::Reading)) {
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

void ring_release(const Ring& ring, std::uint64_t seq, std::uint32_t member, bool stream_frees) noexcept {
  auto& h = ring.header();
  auto& s = ring.slot(seq);
  if (!stream_frees) raise_to(s.freed, seq + 1);
  atomic(s.releaser).store(member);
  atomic(s.release_mark).store(seq + 1, std::memory_order_release);  // before the slot is Free for the next round
  atomic(s.state).store(proto::pack_state(seq + ring.geometry.slots, Phase::Free, proto::kNoMember),
                        std::memory_order_release);
  bump_and_wake(h.released_seq, &h.released_sleepers);
}

bool ring_member_writes_done(const Ring& ring, std::uint32_t member) noexcept {
  const std::uint64_t n = ring.geometry.slots;
  for (std::uint64_t i = 0; i < n; ++i) {
    auto& sl = ring.slot(i);
    std::uint64_t published = 0;
    if (atomic(sl.publisher).load() == member &&
        published_round(atomic(sl.state).load(std::memory_order_acquire), n, published) &&
        (atomic(sl.filled).load() & proto::kMaxValue) < published + 1) {
      return false;
    }
    if (atomic(sl.releaser).load() == member &&
        (atomic(sl.freed).load() & proto::kMaxValue) < atomic(sl.release_mark).load()) {
      return false;
    }
  }
  return true;
}

std::uint32_t channel_join(proto::ChannelHeader& h, std::uint32_t token, proto::Role role) noexcept {
  if (role != proto::Role::Producer && role != proto::Role::Consumer) return proto::kNoMember;
  const std::uint32_t index = claim_member(h.members, token, role);
  if (index == proto::kNoMember) return index;
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
  for (;;) {
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
  // A message it published (waiting in the queue, held by a consumer, or already released by one on the host)
  // whose stream never got to the publish: the data is incomplete and a consumer stream waiting for `filled`
  // would wait forever. Poison `filled` (the cyclic GEQ releases the wait) and flag the message if it is still
  // in the slot.
  if (atomic(slot.publisher).load() == idx) {
    const std::uint64_t s = st.load(std::memory_order_acquire);
    std::uint64_t published = 0;
    if (published_round(s, n, published) && (atomic(slot.filled).load() & proto::kMaxValue) < published + 1) {
      if (published == proto::state_seq(s)) {
        ring_mark_incomplete(slot, published);
      } else {
        poison_filled(slot.filled, published + 1);
      }
    }
    atomic(slot.publisher).store(proto::kNoMember);
  }
  // The last release of this slot was this member's: its stream may never have written `freed`. Write the
  // value its release announced (raise_to: never lower than what is there).
  if (atomic(slot.releaser).load() == idx) {
    raise_to(slot.freed, atomic(slot.release_mark).load(std::memory_order_acquire) & proto::kMaxValue);
    atomic(slot.releaser).store(proto::kNoMember);
  }
  return wake;
}

}  // namespace

bool channel_remove_member(void* control, const RingGeometry& g, std::uint32_t index, std::uint32_t token,
                           proto::Role role, proto::PoisonReason reason) noexcept {
  auto& h = *static_cast<proto::ChannelHeader*>(control);
  // Slots first, membership last: until the entry is cleared, nobody else can be member `index`.
  if (!holds_token(h.members, index, token)) return false;
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
