#include "shm/counting_block.hpp"

#include "base/log.hpp"
#include "shm/members.hpp"
#include "shm/sync.hpp"

namespace gpuipc::shm {

using proto::atomic;

namespace {

constexpr std::uint64_t kLow32 = 0xFFFFFFFFULL;
constexpr std::uint32_t kSeqMask = 0xFFFFFF;
constexpr std::uint64_t kReleaseBit = 1ULL << 32;

std::uint32_t seq_of(std::uint64_t word) noexcept { return static_cast<std::uint32_t>(word >> 40) & kSeqMask; }
std::uint32_t low_of(std::uint64_t word) noexcept { return static_cast<std::uint32_t>(word & kLow32); }
std::uint64_t held_word(std::uint32_t held, std::uint32_t seq) noexcept {
  return (static_cast<std::uint64_t>(seq & kSeqMask) << 40) | held;
}
std::uint64_t intent_word(std::uint32_t seq, bool release, std::uint32_t n) noexcept {
  return (static_cast<std::uint64_t>(seq & kSeqMask) << 40) | (release ? kReleaseBit : 0) | n;
}
std::uint64_t state_word(std::uint32_t count, std::uint32_t member, std::uint32_t seq) noexcept {
  return (static_cast<std::uint64_t>(seq & kSeqMask) << 40) | (static_cast<std::uint64_t>((member + 1) & 0xFF) << 32) |
         count;
}
/// The member a state word names (kNoMember: none, or garbage).
std::uint32_t tag_of(std::uint64_t state) noexcept {
  const auto t = static_cast<std::uint32_t>((state >> 32) & 0xFF);
  return t == 0 || t > proto::kMaxMembers ? proto::kNoMember : t - 1;
}
std::uint32_t next_seq(std::uint32_t seq) noexcept {
  const std::uint32_t s = (seq + 1) & kSeqMask;
  return s == 0 ? 1 : s;
}

/// Applies to held[m] the operation whose tag `state` carries, unless it is applied already (by its member or by
/// another helper: the CAS makes it happen once).
void complete(proto::CountingBlock& b, std::uint64_t state) noexcept {
  const std::uint32_t m = tag_of(state);
  if (m == proto::kNoMember) return;
  const std::uint32_t s = seq_of(state);
  const std::uint64_t intent = atomic(b.slots[m].intent).load(std::memory_order_seq_cst);
  // A member writes a new intent only once its previous operation is applied: a different sequence number here
  // means the tagged one is done.
  if (seq_of(intent) != s) return;
  const std::uint32_t n = low_of(intent);
  const bool release = (intent & kReleaseBit) != 0;
  auto held = atomic(b.slots[m].held);
  std::uint64_t h = held.load(std::memory_order_seq_cst);
  // Only onto the word the operation follows: a helper that read the intent and was then descheduled may find
  // the member's held word past `s` already (applied, and the member on to its next operation), and must not apply
  // the operation a second time (it did, before: TSan's timing showed it as more permits inside than exist).
  // Bounded: completing is help, and a member that keeps rewriting its own word must not hold the helper (the
  // broker, repairing) in this loop. Without such a member the word reaches `s` within a few tries.
  for (int tries = 0; tries < 64 && next_seq(seq_of(h)) == s; ++tries) {
    const std::uint32_t cur = low_of(h);
    // Saturating: a member may have scribbled on its own words; the counts must not wrap.
    const std::uint32_t next = release ? (cur >= n ? cur - n : 0) : (cur + n < cur ? cur : cur + n);
    if (held.compare_exchange_weak(h, held_word(next, s), std::memory_order_seq_cst)) return;
  }
}

}  // namespace

proto::CountingBlock* counting_block(void* block, std::size_t size) noexcept {
  if (block == nullptr || size < sizeof(proto::CountingBlock)) return nullptr;
  auto* b = static_cast<proto::CountingBlock*>(block);
  if (atomic(b->magic).load(std::memory_order_acquire) != proto::kCountingMagic ||
      atomic(b->version).load() != proto::kCountingVersion) {
    return nullptr;
  }
  return b;
}

const char* counting_check_new(const proto::CountingBlock& block) noexcept {
  auto& b = const_cast<proto::CountingBlock&>(block);
  const std::uint32_t max = atomic(b.max_count).load();
  const std::uint32_t initial = atomic(b.initial).load();
  if (max == 0 || max > proto::kCountingMaxPermits) return "its maximum count must be between 1 and 2^31 - 1";
  if (initial > max) return "its initial count is above its maximum";
  if (atomic(b.state).load() != initial) return "its state is not the initial one (initial permits, no tag)";
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    if (atomic(b.slots[i].held).load() != 0 || atomic(b.members[i].token).load() != 0) {
      return "it has members or held permits already";
    }
  }
  return nullptr;
}

std::uint32_t counting_join(proto::CountingBlock& b, std::uint32_t token, std::uint32_t grant) noexcept {
  const std::uint32_t index = claim_member(b.members, token, proto::Role::Holder);
  if (index == proto::kNoMember) return index;
  auto& slot = b.slots[index];
  // The entry was free: its last member was removed, holding nothing. Keep the sequence number going.
  const std::uint64_t h = atomic(slot.held).load();
  atomic(slot.ticket).store(0);
  atomic(slot.want).store(0);
  atomic(slot.held).store(held_word(grant, seq_of(h)), std::memory_order_seq_cst);
  return index;
}

CountingResult counting_apply(proto::CountingBlock& b, std::uint32_t member, bool release, std::uint32_t n,
                              std::uint32_t max_count, std::uint64_t max_tries) noexcept {
  if (member >= proto::kMaxMembers) return CountingResult::OverRelease;
  auto& slot = b.slots[member];
  auto held = atomic(slot.held);
  const std::uint64_t h = held.load(std::memory_order_seq_cst);
  if (release && low_of(h) < n) return CountingResult::OverRelease;
  const std::uint32_t s = next_seq(seq_of(h));
  atomic(slot.intent).store(intent_word(s, release, n), std::memory_order_seq_cst);
  auto state = atomic(b.state);
  std::uint64_t cur = state.load(std::memory_order_seq_cst);
  for (std::uint64_t tries = 0;; ++tries) {
    if (tries == max_tries) return CountingResult::Contended;
    // Whoever the word names gets its operation applied before the tag is overwritten.
    complete(b, cur);
    const std::uint32_t count = low_of(cur);
    std::uint32_t next = 0;
    if (release) {
      next = count + n > max_count || count + n < count ? max_count : count + n;
    } else {
      if (count < n) return CountingResult::NotEnough;
      next = count - n;
    }
    if (state.compare_exchange_weak(cur, state_word(next, member, s), std::memory_order_seq_cst)) break;
  }
  complete(b, state_word(0, member, s));
  return CountingResult::Done;
}

std::uint32_t counting_held(const proto::CountingBlock& b, std::uint32_t member) noexcept {
  if (member >= proto::kMaxMembers) return 0;
  return low_of(atomic(const_cast<std::uint64_t&>(b.slots[member].held)).load());
}

std::uint32_t counting_available(const proto::CountingBlock& b) noexcept {
  return low_of(atomic(const_cast<std::uint64_t&>(b.state)).load());
}

void counting_enqueue(proto::CountingBlock& b, std::uint32_t member, std::uint32_t n) noexcept {
  if (member >= proto::kMaxMembers) return;
  auto& slot = b.slots[member];
  const std::uint64_t t = atomic(b.next_ticket).fetch_add(1, std::memory_order_seq_cst) + 1;
  atomic(slot.want).store(n);
  if (atomic(slot.ticket).exchange(t == 0 ? 1 : t, std::memory_order_seq_cst) == 0) {
    saturating_increment(b.waiting);
  }
}

void counting_dequeue(proto::CountingBlock& b, std::uint32_t member, bool wake) noexcept {
  if (member >= proto::kMaxMembers) return;
  auto& slot = b.slots[member];
  // The count first, then the ticket: killed between the two, the member leaves a ticket that the broker's
  // repair counts off again (one waiter too few until the queue empties: a newcomer may pass a waiter once).
  // The other order left one waiter too many for good, and a zero-timeout acquire then never took the fast path.
  if (atomic(slot.ticket).load(std::memory_order_seq_cst) != 0) {
    saturating_decrement(b.waiting);
    atomic(slot.ticket).store(0, std::memory_order_seq_cst);
  }
  atomic(slot.want).store(0);
  if (wake) bump_and_wake(b.wake_seq, &b.sleepers);
}

bool counting_is_head(const proto::CountingBlock& block, std::uint32_t member) noexcept {
  if (member >= proto::kMaxMembers) return false;
  auto& b = const_cast<proto::CountingBlock&>(block);
  const std::uint64_t mine = atomic(b.slots[member].ticket).load(std::memory_order_seq_cst);
  if (mine == 0) return false;
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    if (i == member) continue;
    const std::uint64_t t = atomic(b.slots[i].ticket).load(std::memory_order_seq_cst);
    if (t != 0 && t < mine && atomic(b.members[i].token).load() != 0) return false;
  }
  return true;
}

bool counting_queued(const proto::CountingBlock& block) noexcept {
  auto& b = const_cast<proto::CountingBlock&>(block);
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    if (atomic(b.slots[i].ticket).load(std::memory_order_seq_cst) != 0 && atomic(b.members[i].token).load() != 0) {
      return true;
    }
  }
  return false;
}

void counting_give_back(proto::CountingBlock& b, std::uint32_t n, std::uint32_t max_count) noexcept {
  if (n == 0) return;
  auto state = atomic(b.state);
  std::uint64_t cur = state.load(std::memory_order_seq_cst);
  // Bounded like the repair: a block that members keep changing (or scribble on) must not hold the broker.
  for (int tries = 0; tries < (1 << 12); ++tries) {
    complete(b, cur);  // the tag goes: its operation is applied first
    const std::uint32_t count = low_of(cur);
    const std::uint32_t next = count + n > max_count || count + n < count ? max_count : count + n;
    if (state.compare_exchange_weak(cur, next, std::memory_order_seq_cst)) {
      bump_and_wake(b.wake_seq, &b.sleepers);
      return;
    }
  }
  GPUIPC_LOG_WARN("counting semaphore: {} permits not given back (other members kept changing the block)", n);
}

bool counting_remove_member(proto::CountingBlock& b, std::uint32_t index, std::uint32_t token,
                            std::uint32_t max_count) noexcept {
  if (!holds_token(b.members, index, token)) return false;
  // Its half-made operation, if `state` still names it (an operation that did not reach `state` never took
  // effect; one that was overwritten was completed by the overwriter).
  complete(b, atomic(b.state).load(std::memory_order_seq_cst));
  const std::uint32_t held = counting_held(b, index);
  // Bounded: the broker must not loop for long on a block that members keep changing (or scribble on). Permits
  // not given back then are lost to the semaphore; say so.
  if (held > 0) {
    const CountingResult r = counting_apply(b, index, true, held, max_count, std::uint64_t{1} << 12);
    if (r != CountingResult::Done) {
      GPUIPC_LOG_WARN("counting semaphore: the {} permits of removed member {} were not given back ({}: other "
                      "members kept changing the block)",
                      held, index, r == CountingResult::Contended ? "contended" : "its held word changed");
    }
  }
  counting_dequeue(b, index, false);  // the one wake below serves both
  const bool cleared = clear_member(b.members, index, token);
  bump_and_wake(b.wake_seq, &b.sleepers);
  return cleared;
}

std::uint32_t counting_members(const proto::CountingBlock& block) noexcept {
  auto& b = const_cast<proto::CountingBlock&>(block);
  std::uint32_t n = 0;
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) n += atomic(b.members[i].token).load() != 0 ? 1 : 0;
  return n;
}

}  // namespace gpuipc::shm
