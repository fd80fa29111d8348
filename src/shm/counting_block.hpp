// The protocol of a counting semaphore's block (proto::CountingBlock): acquire and release as one CAS on the
// available count, with each member's held permits counted in its own slot, in a way that a member killed at any
// instruction leaves a state the broker can repair exactly.
//
// An operation of member m: (1) write intent[m] = {seq, release?, n}; (2) CAS `state` from {count, tag} to
// {count -+ n, tag = (m, seq)}; (3) apply it to held[m] (a CAS that sets held[m]'s sequence number to seq). Before
// (2) overwrites a tag, its writer completes the tagged operation (3) if it is not applied yet (the helping of
// lock-free algorithms), so the only operation that can be half-made is the one `state` still names, and the
// repair of a dead member completes it, then releases everything the member holds. A clean leave runs the same
// function as the repair. See src/shm/sync.hpp for the layer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "proto/shm.hpp"

namespace gpuipc::shm {

/// The block at `block` (`size` bytes), or nullptr when it is not a counting semaphore of this version.
proto::CountingBlock* counting_block(void* block, std::size_t size) noexcept;

/// Checks a block being registered: magic, version, 0 < max_count <= kCountingMaxPermits, initial <= max_count,
/// and the state is the initial one (initial permits available, nothing held). Returns nullptr when it is fine,
/// else why not.
const char* counting_check_new(const proto::CountingBlock& block) noexcept;

/// Claims a member entry for `token` holding `grant` permits (the creator's max_count - initial; 0 for others).
/// Returns its index or proto::kNoMember (table full). Broker only.
std::uint32_t counting_join(proto::CountingBlock& block, std::uint32_t token, std::uint32_t grant) noexcept;

enum class CountingResult : std::uint8_t {
  Done,         ///< applied
  NotEnough,    ///< acquire: fewer permits available than asked for
  OverRelease,  ///< release: the member holds fewer than it releases
  Contended,    ///< `max_tries` CAS attempts failed (other members kept changing the count)
};

/// Member `member` acquires (`release` false) or releases `n` permits. Only one thread may make operations for a
/// member at a time (its process serializes them; the broker makes them only once the process is dead).
/// `max_count` is the geometry the caller trusts (the broker's own copy), never re-read from shared memory.
CountingResult counting_apply(proto::CountingBlock& block, std::uint32_t member, bool release, std::uint32_t n,
                              std::uint32_t max_count, std::uint64_t max_tries = UINT64_MAX) noexcept;

/// Permits member `member` holds (0 for an index out of range).
std::uint32_t counting_held(const proto::CountingBlock& block, std::uint32_t member) noexcept;
/// Permits available now.
std::uint32_t counting_available(const proto::CountingBlock& block) noexcept;

/// Puts member `member` in the queue of waiters for `n` permits (one place per member).
void counting_enqueue(proto::CountingBlock& block, std::uint32_t member, std::uint32_t n) noexcept;
/// Takes member `member` out of the queue (if it is in it) and, with `wake`, wakes the waiters so that the next
/// oldest tries (a waiter that got its permits passes wake only when some are left: with none left, the next
/// release wakes them anyway).
void counting_dequeue(proto::CountingBlock& block, std::uint32_t member, bool wake = true) noexcept;
/// Whether any member whose entry is held is in the queue. `waiting` says so without a scan, but may count one
/// waiter too few for a while after a member was killed leaving it (never one too many).
bool counting_queued(const proto::CountingBlock& block) noexcept;
/// Makes `n` permits that no member holds available (up to `max_count`) and wakes the waiters: the creator's
/// grant when the creator went without joining (broker only).
void counting_give_back(proto::CountingBlock& block, std::uint32_t n, std::uint32_t max_count) noexcept;
/// Whether member `member` is the oldest waiter of those whose entry is still held.
bool counting_is_head(const proto::CountingBlock& block, std::uint32_t member) noexcept;

/// Removes member `index` if it still holds `token`: completes its half-made operation, releases every permit it
/// holds, takes it out of the queue, clears its entry and wakes the waiters. A clean leave and the broker's repair
/// of a dead member call this same function. `max_count` as for counting_apply. Returns whether it removed it.
bool counting_remove_member(proto::CountingBlock& block, std::uint32_t index, std::uint32_t token,
                            std::uint32_t max_count) noexcept;

/// Members whose entry is held now.
std::uint32_t counting_members(const proto::CountingBlock& block) noexcept;

}  // namespace gpuipc::shm
