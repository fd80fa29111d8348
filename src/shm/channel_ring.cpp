#include "shm/channel_ring.hpp"

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
    std::uint64_t s = st.load(std::memory_order_acquire);
    const std::uint64_t seq = proto::state_seq(s);
    if (proto::state_member(s) != idx) break;
    const auto phase = proto::state_phase(s);
    if (phase == Phase::Writing) {
      // Claimed, never published: nobody will consume it. Free the slot for the next round, whose producer
      // waits for the last consumer's release (release_mark), which this round does not change.
      if (st.compare_exchange_strong(s, proto::pack_state(seq + n, Phase::Free, proto::kNoMember))) {
        atomic(h.abandoned).fetch_add(1);
        wake |= 3U;
        break;
      }
    } else if (phase == Phase::Published) {
      if (st.compare_exchange_strong(s, proto::pack_state(seq, Phase::Published, proto::kNoMember))) break;
    } else if (phase == Phase::Reading) {
      // A consumer gone holding it: hand it back, for another consumer (exactly one survivor gets it).
      if (st.compare_exchange_strong(s, proto::pack_state(seq, Phase::Published, proto::kNoMember))) {
        atomic(h.orphans).fetch_add(1);
        atomic(h.redelivered).fetch_add(1);
        wake |= 1U;
        break;
      }
    } else {
      break;
    }
  }
  // A message it published (waiting in the queue, or already held by a consumer) whose stream never got to the
  // publish: the data is incomplete and a consumer stream waiting for `filled` would wait forever. Poison
  // `filled` (the cyclic GEQ releases the wait) and flag the message.
  if (atomic(slot.publisher).load() == idx) {
    const std::uint64_t s = st.load(std::memory_order_acquire);
    const auto phase = proto::state_phase(s);
    const std::uint64_t seq = proto::state_seq(s);
    if ((phase == Phase::Published || phase == Phase::Reading) &&
        (atomic(slot.filled).load() & ~proto::kPoisonBit) < seq + 1) {
      atomic(slot.flags).fetch_or(proto::kSlotIncomplete);
      atomic(slot.filled).store(proto::kPoisonBit | (seq + 1), std::memory_order_release);
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
