#include "shm/semaphore_block.hpp"

#include "shm/members.hpp"
#include "shm/sync.hpp"

namespace gpuipc::shm {

using proto::atomic;

proto::SemaphoreBlock* semaphore_block(void* block, std::size_t size) noexcept {
  if (block == nullptr || size < sizeof(proto::SemaphoreBlock)) return nullptr;
  auto* b = static_cast<proto::SemaphoreBlock*>(block);
  if (atomic(b->magic).load(std::memory_order_acquire) != proto::kSemaphoreMagic ||
      atomic(b->version).load() != proto::kSemaphoreVersion) {
    return nullptr;
  }
  return b;
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
    atomic(block.value).fetch_or(proto::kPoisonBit, std::memory_order_acq_rel);
    bump_and_wake(block.wake_seq);
  }
  return true;
}

}  // namespace gpuipc::shm
