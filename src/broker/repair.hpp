// What the broker does to a semaphore, channel or pool control block when a process that was a member of it is gone
// (its connection closed: exit or SIGKILL). The broker is CUDA-free, but a CPU write to these pinned pages
// releases GPU streams waiting on them, so no survivor's stream waits forever on the dead.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace gpuipc::broker {

/// Unregisters every member with `pid`; if that leaves no signaller, poisons the value (PeerDied) and wakes
/// host waiters. Returns the number of members removed. Ignores blocks that do not validate.
int repair_semaphore(void* block, std::size_t size, pid_t pid) noexcept;

/// Unregisters every member with `pid` and repairs the slots it held: a message it was writing is abandoned
/// (its slot freed), a message it published whose GPU work never finished is marked incomplete and its `filled`
/// word poisoned, a message it was reading goes back to the queue for another consumer, and `freed` words its
/// stream never wrote are written. When the last producer (or consumer) goes, the channel records PeerDied and
/// every sleeper is woken. Returns the number of members removed. Ignores blocks that do not validate.
int repair_channel(void* control, std::size_t size, pid_t pid) noexcept;

/// Unregisters every member of a pool with `pid` after releasing its holds (shm::pool_remove_member): blocks it was
/// the last holder of are freed, its pending stream-ordered frees complete, a chunk it was creating is given up
/// and a pool lock it died holding is broken. Returns the number of members removed. Ignores blocks that do not
/// validate.
int repair_pool(void* control, std::size_t size, pid_t pid) noexcept;

/// The smallest control block a Create with these flags (one of proto::kFlag*) may declare.
std::size_t min_control_bytes(std::uint32_t flags) noexcept;

}  // namespace gpuipc::broker
