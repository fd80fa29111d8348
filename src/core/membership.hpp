// Joining a semaphore, channel or pool as a member: the broker claims the member entry (a Join request) and
// writes a token of its choosing, so no process can pose as another and a process's departure touches only what
// its own connection joined (src/shm/members.hpp).
#pragma once

#include <cstdint>

#include "core/client.hpp"
#include "gpuipc/segment.hpp"
#include "proto/shm.hpp"

namespace gpuipc::core {

/// A member entry this process holds: its index in the table and the broker's token in it.
struct Membership {
  std::uint32_t index = proto::kNoMember;
  std::uint32_t token = 0;
  explicit operator bool() const noexcept { return index != proto::kNoMember; }
};

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
