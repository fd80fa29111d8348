// The channel ring's transitions that more than one process makes: joining as a producer or consumer, and a
// member's removal, whether it left cleanly (Closed) or died (PeerDied, by the broker): one function for both.
// See sync.hpp for the layer's rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "proto/shm.hpp"

namespace gpuipc::shm {

/// A channel's geometry, read from its control block once and validated against the mapping's size. Every later
/// access goes through this copy, never through the shared words again: a member may rewrite them at any time.
struct RingGeometry {
  std::uint32_t slots = 0;
  std::uint32_t header_bytes = 0;
  std::uint32_t record_bytes = 0;
};

/// Reads and checks the geometry of the channel control block at `control` (`size` bytes mapped): magic, version,
/// slot count, header bytes, record size, and that every record lies inside the mapping. nullopt when invalid.
std::optional<RingGeometry> ring_geometry(const void* control, std::size_t size) noexcept;

/// Slot record `seq % slots` of a ring whose geometry was checked.
inline proto::Slot& ring_slot(void* control, const RingGeometry& g, std::uint64_t seq) noexcept {
  auto* records = static_cast<std::byte*>(control) + sizeof(proto::ChannelHeader);
  return *reinterpret_cast<proto::Slot*>(records + (seq % g.slots) * g.record_bytes);  // NOLINT: layout of shm.hpp
}

/// Claims a member entry for `token` as a producer or consumer and counts it (broker, answering Join). Returns
/// the entry's index, or proto::kNoMember when the table is full or the role is neither.
std::uint32_t channel_join(proto::ChannelHeader& header, std::uint32_t token, proto::Role role) noexcept;

/// Removes member `index` of `role` if it still holds `token`, and repairs the slots it held: a message it was
/// writing is abandoned (its slot freed), a message it published whose `filled` word its stream never wrote is
/// marked incomplete and `filled` poisoned, a message it was reading goes back to the queue for another consumer
/// (exactly one survivor gets it), and a `freed` word its stream never wrote is written. The last producer (or
/// consumer) to go records `reason` for the other side; every sleeper is woken. Returns whether it removed it.
bool channel_remove_member(void* control, const RingGeometry& geometry, std::uint32_t index, std::uint32_t token,
                           proto::Role role, proto::PoisonReason reason) noexcept;

}  // namespace gpuipc::shm
