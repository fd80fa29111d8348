// Member tables (proto::Member): who belongs to a semaphore, channel or pool. Entries are claimed only by the
// broker, which writes a token of its own choosing (never 0) in answer to a Join: so no process can pose as
// another, and the broker removes exactly the entries a connection joined. See src/shm/sync.hpp for the layer.
#pragma once

#include <cstdint>

#include "proto/shm.hpp"

namespace gpuipc::shm {

using MemberTable = proto::Member[proto::kMaxMembers];

/// Claims a free entry for `token` (not 0) with `role`. Returns its index, or proto::kNoMember when the table is
/// full. Broker only.
std::uint32_t claim_member(MemberTable& members, std::uint32_t token, proto::Role role) noexcept;

/// Whether entry `index` holds `token` now.
bool holds_token(const MemberTable& members, std::uint32_t index, std::uint32_t token) noexcept;

/// Clears entry `index` if it still holds `token` (one CAS: a clean leave and a repair cannot both succeed).
/// Returns whether this call cleared it.
bool clear_member(MemberTable& members, std::uint32_t index, std::uint32_t token) noexcept;

}  // namespace gpuipc::shm
