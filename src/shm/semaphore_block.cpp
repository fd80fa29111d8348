#include "shm/semaphore_block.hpp"

#include "shm/members.hpp"
#include "shm/sync.hpp"

namespace gpuipc::shm {

using proto::atomic;

void semaphore_init(void* block, std::uint64_t initial) noexcept {
  auto* b = static_cast<proto::SemaphoreBlock*>(block);
  atomic(b->value).store(initial, std::memory_order_relaxed);
  b->version = proto::kSemaphoreVersion;
  atomic(b->magic).store(proto::kSemaphoreMagic, std::memory_order_release);
}

proto::SemaphoreBlock* semaphore_block(void* block, std::size_t size) noexcept {
  if (block == nullptr || size < sizeof(proto::SemaphoreBlock)) return nullptr;
  auto* b = static_cast<proto::SemaphoreBlock*>(block);
  if (atomic(b->magic).load(std::memory_order_acquire) != proto::kSemaphoreMagic ||
      atomic(b->version).load() != proto::kSemaphoreVersion) {
    return nullptr;
  }
  return b;
}

proto::PoisonReason semaphore_poison(const proto::SemaphoreBlock& block, std::uint64_t v) noexcept {
  const std::uint32_t reason = atomic(const_cast<std::uint32_t&>(block.poison_reason)).load();
  if ((v & proto::kPoisonBit) == 0 && reason == 0) return proto::PoisonReason::None;
  return reason == static_cast<std::uint32_t>(proto::PoisonReason::Closed) ? proto::PoisonReason::Closed
                                                                           : proto::PoisonReason::PeerDied;
}

proto::PoisonReason semaphore_raise(proto::SemaphoreBlock& block, std::uint64_t value) noexcept {
  auto v = atomic(block.value);
  std::uint64_t cur = v.load(std::memory_order_acquire);
  for (;;) {
    if (const auto why = semaphore_poison(block, cur); why != proto::PoisonReason::None) return why;
    if (!garbage(cur) && cur >= value) break;
    if (v.compare_exchange_weak(cur, value, std::memory_order_acq_rel)) break;
  }
  bump_and_wake(block.wake_seq);
  return proto::PoisonReason::None;
}

std::uint32_t semaphore_join(proto::SemaphoreBlock& block, std::uint32_t token) noexcept {
  const std::uint32_t index = claim_member(block.members, token, proto::Role::Signaller);
  if (index == proto::kNoMember) return index;
  saturating_increment(block.signallers);
  atomic(block.signallers_seen).store(1, std::memory_order_release);
  return index;
}

bool semaphore_remove_member(proto::SemaphoreBlock& block, std::uint32_t index, std::uint32_t token,
                             proto::PoisonReason reason) noexcept {
  if (!clear_member(block.members, index, token)) return false;
  if (saturating_decrement(block.signallers) <= 1) {
    // The reason word first: a waiter that sees the poison bit reads why.
    atomic(block.poison_reason).store(static_cast<std::uint32_t>(reason), std::memory_order_release);
    // The value bits kept, a garbage top bit cleared: poison must pass every stream wait for a value.
    auto v = atomic(block.value);
    std::uint64_t cur = v.load(std::memory_order_acquire);
    for (int tries = 0; tries < kMostCasTries; ++tries) {
      if (v.compare_exchange_weak(cur, (cur & proto::kMaxValue) | proto::kPoisonBit, std::memory_order_acq_rel)) break;
    }
    bump_and_wake(block.wake_seq);
  }
  return true;
}

}  // namespace gpuipc::shm
