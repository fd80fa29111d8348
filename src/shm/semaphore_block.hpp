// The semaphore control block's transitions that more than one process makes: joining as a signaller, and a
// signaller's removal, whether it left cleanly (Closed) or died (PeerDied, by the broker). See sync.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "proto/shm.hpp"

namespace gpuipc::shm {

/// Fills in a new semaphore block with value `initial`: magic last (release).
void semaphore_init(void* block, std::uint64_t initial) noexcept;

/// The block at `block` if `size` bytes hold a semaphore block of this version, else nullptr.
proto::SemaphoreBlock* semaphore_block(void* block, std::size_t size) noexcept;

/// Why block `b` is poisoned (None: it is not), given a value `v` read from it. The reason word is written before
/// the poison bit and never cleared: it stays true even if a late stream write (from a process that died with
/// signals queued) overwrote the value. A poison bit without a reason reads PeerDied.
proto::PoisonReason semaphore_poison(const proto::SemaphoreBlock& block, std::uint64_t v) noexcept;

/// Raises the value to `value` from the host (never lowers it) and wakes host waiters, unless the block is
/// poisoned: then returns why, and changes nothing.
proto::PoisonReason semaphore_raise(proto::SemaphoreBlock& block, std::uint64_t value) noexcept;

/// Claims a member entry for `token` as a signaller and counts it (broker, answering Join). Returns the entry's
/// index, or proto::kNoMember when the table is full.
std::uint32_t semaphore_join(proto::SemaphoreBlock& block, std::uint32_t token) noexcept;

/// Removes signaller `index` if it still holds `token`. When that leaves no signaller, poisons the value with
/// `reason` (Closed for a clean leave, PeerDied for a dead process) and wakes host waiters: no stream or thread
/// waits forever for a value nobody can signal any more. Returns whether the member was removed.
bool semaphore_remove_member(proto::SemaphoreBlock& block, std::uint32_t index, std::uint32_t token,
                             proto::PoisonReason reason) noexcept;

}  // namespace gpuipc::shm
