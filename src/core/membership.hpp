// Joining a semaphore, channel or pool as a member: the broker claims the member entry (a Join request) and
// writes a token of its choosing, so no process can pose as another and a process's departure touches only what
// its own connection joined (src/shm/members.hpp).
#pragma once

#include <cstdint>

#include "core/client.hpp"
#include "gpuipc/segment.hpp"
#include "proto/shm.hpp"

namespace gpuipc::core {

/// A member entry this process holds: its index in the table, the broker's token in it, and forks_so_far() when
/// it was joined.
struct Membership {
  std::uint32_t index = proto::kNoMember;
  std::uint32_t token = 0;
  std::uint32_t forks = 0;
  explicit operator bool() const noexcept { return index != proto::kNoMember; }
};

/// How many forks made this process from the one that first joined anything (counted in the child, from the first
/// join_member on): a handle copied into a forked child holds its parent's entry, which the child must neither use
/// nor clear. One relaxed load.
std::uint32_t forks_so_far() noexcept;

/// Whether `member` was joined by this process (not by a process this one was forked from).
inline bool joined_here(const Membership& member) noexcept { return member.forks == forks_so_far(); }

/// Joins the object whose control block is `control` (opened read-write by this process) with `role`. One
/// broker round trip. Throws Error: PermissionDenied (not opened read-write), QuotaExceeded (the member table is
/// full), InvalidArgument (a role the object has not), and the broker connection's errors.
Membership join_member(const Segment& control, proto::Role role);

/// Has the broker remove channel membership `member` of `control` (Leave) and take over the stream writes it
/// still owes: its stream makes them, or the broker once this process has exited. Returns false, having changed
/// nothing, when the broker did not (none reachable, a restarted one that has not taken the membership back, a
/// process it cannot see): the caller then leaves on its own.
bool leave_through_broker(const Segment& control, const Membership& member) noexcept;

/// Forgets a membership this process left (its entry already cleared): a restarted broker is not told of it.
void forget_member(const Membership& member) noexcept;

/// After a broker restart (the rebind hook): tells the new broker of every membership whose control block it gave
/// back (Rejoin), so that it repairs them if this process dies.
void rejoin_members(std::uint64_t generation, const BrokerClient::Exchange& exchange) noexcept;

}  // namespace gpuipc::core
