#include "broker/repair.hpp"

#include "base/log.hpp"
#include "os/futex.hpp"
#include "proto/shm.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc::broker {
namespace {

using proto::atomic;

void bump_and_wake(std::uint32_t& word) noexcept {
  atomic(word).fetch_add(1, std::memory_order_release);
  try {
    os::futex_wake(reinterpret_cast<const std::atomic<std::uint32_t>*>(&word));  // NOLINT: same-size atomic view
  } catch (...) {  // NOLINT(bugprone-empty-catch): waiters also poll with a bounded sleep
  }
}

/// Stores max(word, value): GPU-visible words only ever grow.
void raise_to(std::uint64_t& word, std::uint64_t value) noexcept {
  auto a = atomic(word);
  std::uint64_t cur = a.load(std::memory_order_acquire);
  while ((cur & ~proto::kPoisonBit) < value && !a.compare_exchange_weak(cur, value, std::memory_order_acq_rel)) {
  }
}

}  // namespace

int repair_semaphore(void* block, std::size_t size, pid_t pid) noexcept {
  if (size < sizeof(proto::SemaphoreBlock)) return 0;
  auto& b = *static_cast<proto::SemaphoreBlock*>(block);
  if (b.magic != proto::kSemaphoreMagic || b.version != proto::kSemaphoreVersion) return 0;
  int removed = 0;
  for (auto& m : b.members) {
    std::uint32_t expected = static_cast<std::uint32_t>(pid);
    if (atomic(m.pid).load(std::memory_order_acquire) != expected) continue;
    if (!atomic(m.pid).compare_exchange_strong(expected, 0U, std::memory_order_acq_rel)) continue;
    ++removed;
    if (m.role == static_cast<std::uint32_t>(proto::Role::Signaller)) atomic(b.signallers).fetch_sub(1);
  }
  if (removed > 0 && atomic(b.signallers).load() == 0 && atomic(b.signallers_seen).load() != 0) {
    atomic(b.poison_reason).store(static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
    atomic(b.value).fetch_or(proto::kPoisonBit, std::memory_order_acq_rel);
    bump_and_wake(b.wake_seq);
    GPUIPC_LOG_INFO("semaphore poisoned: its last signaller (pid {}) is gone", pid);
  }
  return removed;
}

int repair_channel(void* control, std::size_t size, pid_t pid) noexcept {
  if (size < sizeof(proto::ChannelHeader)) return 0;
  auto& h = *static_cast<proto::ChannelHeader*>(control);
  if (h.magic != proto::kChannelMagic || h.version != proto::kChannelVersion || h.slots == 0 ||
      h.slots > proto::kMaxSlots || h.header_bytes > proto::kMaxHeaderBytes ||
      h.record_bytes != proto::record_bytes(h.header_bytes) ||
      proto::channel_control_bytes(h.slots, h.header_bytes) > size) {
    return 0;
  }
  const std::uint64_t n = h.slots;
  auto* records = static_cast<std::byte*>(control) + sizeof(proto::ChannelHeader);
  int removed = 0;
  for (std::uint32_t idx = 0; idx < proto::kMaxMembers; ++idx) {
    auto& m = h.members[idx];
    std::uint32_t expected = static_cast<std::uint32_t>(pid);
    if (atomic(m.pid).load(std::memory_order_acquire) != expected) continue;
    const auto role = static_cast<proto::Role>(atomic(m.role).load());
    bool published = false;
    bool released = false;
    for (std::uint64_t i = 0; i < n; ++i) {
      auto& slot = *reinterpret_cast<proto::Slot*>(records + i * h.record_bytes);  // NOLINT: layout of shm.hpp
      auto st = atomic(slot.state);
      for (;;) {
        std::uint64_t s = st.load(std::memory_order_acquire);
        const std::uint64_t seq = proto::state_seq(s);
        if (proto::state_member(s) != idx) break;
        const auto phase = proto::state_phase(s);
        if (phase == proto::Phase::Writing) {
          // Claimed, never published: nobody will consume it. Free the slot for the next round.
          raise_to(slot.freed, seq + 1);
          if (st.compare_exchange_strong(s, proto::pack_state(seq + n, proto::Phase::Free, proto::kNoMember))) {
            atomic(h.abandoned).fetch_add(1);
            published = released = true;
            break;
          }
        } else if (phase == proto::Phase::Published) {
          if (st.compare_exchange_strong(s, proto::pack_state(seq, proto::Phase::Published, proto::kNoMember))) break;
        } else if (phase == proto::Phase::Reading) {
          // A consumer died holding it: hand it back, for another consumer (exactly one survivor gets it).
          if (st.compare_exchange_strong(s, proto::pack_state(seq, proto::Phase::Published, proto::kNoMember))) {
            atomic(h.orphans).fetch_add(1);
            atomic(h.redelivered).fetch_add(1);
            published = true;
            break;
          }
        } else {
          break;
        }
      }
      // A message it published (waiting in the queue, or already held by a consumer) whose stream never got to
      // the publish: the data is incomplete and a consumer stream waiting for `filled` would wait forever.
      // Poison `filled` (the cyclic GEQ releases the wait) and flag the message.
      if (atomic(slot.publisher).load() == idx) {
        const std::uint64_t s = st.load(std::memory_order_acquire);
        const auto phase = proto::state_phase(s);
        const std::uint64_t seq = proto::state_seq(s);
        if ((phase == proto::Phase::Published || phase == proto::Phase::Reading) &&
            (atomic(slot.filled).load() & ~proto::kPoisonBit) < seq + 1) {
          atomic(slot.flags).fetch_or(proto::kSlotIncomplete);
          atomic(slot.filled).store(proto::kPoisonBit | (seq + 1), std::memory_order_release);
        }
        atomic(slot.publisher).store(proto::kNoMember);
      }
      // The last release of this slot was the dead member's: its stream may never have written `freed`.
      if (atomic(slot.releaser).load() == idx) {
        const std::uint64_t seq = proto::state_seq(st.load());
        if (seq >= n) raise_to(slot.freed, seq - n + 1);
        atomic(slot.releaser).store(proto::kNoMember);
      }
    }
    if (!atomic(m.pid).compare_exchange_strong(expected, 0U, std::memory_order_acq_rel)) continue;
    ++removed;
    if (role == proto::Role::Producer && atomic(h.producers).fetch_sub(1) == 1) {
      atomic(h.producers_gone).store(static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
      published = true;
    }
    if (role == proto::Role::Consumer && atomic(h.consumers).fetch_sub(1) == 1) {
      atomic(h.consumers_gone).store(static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
      released = true;
    }
    GPUIPC_LOG_INFO("channel member {} (pid {}, role {}) is gone: repaired", idx, pid, static_cast<int>(role));
    if (published) bump_and_wake(h.published_seq);
    if (released) bump_and_wake(h.released_seq);
  }
  return removed;
}

int repair_pool(void* control, std::size_t size, pid_t pid) noexcept {
  if (!shm::PoolBlock(control, size).valid()) return 0;
  auto& h = *static_cast<shm::PoolHeader*>(control);
  int removed = 0;
  for (std::uint32_t idx = 0; idx < proto::kMaxMembers; ++idx) {
    std::uint32_t expected = static_cast<std::uint32_t>(pid);
    if (atomic(h.members[idx].pid).load(std::memory_order_acquire) != expected) continue;
    const int holds = shm::pool_remove_member(control, size, idx);
    if (holds < 0) {
      // The next holder of the pool lock finishes it (and frees the entry): a member that died holding the lock
      // is repaired next, or a live one lets go.
      GPUIPC_LOG_INFO("pool member {} (pid {}) is gone; its lock was taken, the next lock holder releases its holds",
                      idx, pid);
      ++removed;
      continue;
    }
    if (!atomic(h.members[idx].pid).compare_exchange_strong(expected, 0U, std::memory_order_acq_rel)) continue;
    ++removed;
    GPUIPC_LOG_INFO("pool member {} (pid {}) is gone: {} holds released", idx, pid, holds);
  }
  return removed;
}

std::size_t min_control_bytes(std::uint32_t flags) noexcept {
  if ((flags & proto::kFlagSemaphore) != 0) return sizeof(proto::SemaphoreBlock);
  if ((flags & proto::kFlagPool) != 0) return shm::pool_control_bytes(1);
  return sizeof(proto::ChannelHeader);
}

}  // namespace gpuipc::broker
