// What the broker does with the control blocks of semaphores and channels: it checks them when they are
// registered, claims member entries for the connections that Join, and removes exactly those entries when their
// connection goes (exit or SIGKILL). The transitions themselves live in src/shm, shared with the clients' clean
// leave; this file only dispatches by object kind. The broker is CUDA-free, but a CPU write to these pinned
// pages releases GPU streams waiting on them, so no survivor's stream waits forever on the dead.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "broker/exit_watch.hpp"
#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "proto/shm.hpp"
#include "shm/channel_ring.hpp"

namespace gpuipc::broker {

/// The broker's view of one control block: its own mapping, the Create flags, and the geometry it read once when
/// the block was registered (never read again from shared memory).
struct ControlBlock {
  void* data = nullptr;
  std::size_t size = 0;
  std::uint32_t flags = 0;   ///< proto::kFlagSemaphore, kFlagChannel, kFlagPool or kFlagCounting
  shm::RingGeometry ring{};  ///< channels
  std::uint32_t counting_max = 0;  ///< counting semaphores: max_count
  std::uint32_t grant = 0;         ///< counting semaphores: permits the creator holds once it joins (then 0)
  /// Channels: stream writes dead members still owe, each made once the wait before it in its stream would pass
  /// (shm::ring_settle_owed; the registry looks again while any is left).
  std::vector<proto::OwedWrite> owed{};
  /// Channels: processes whose owed writes are in `owed` and which have not exited yet (each once). None is made
  /// before they all have: a killed process's GPU work runs on until its exit tears its contexts down, and a stream
  /// write of its landing after ours (and after the ring moved on) would take the word back.
  std::vector<ProcessWatch> dying{};
  /// Channels: members that left (Leave) while their stream still owed writes. Their process lives on, and so does
  /// its stream, which makes the writes itself: each is dropped once it has landed. What is left when the process
  /// exits goes to `owed`, made as its turn comes.
  struct Leaver {
    ProcessWatch process;
    std::vector<proto::OwedWrite> writes;
  };
  std::vector<Leaver> leavers{};
  /// Channels: the most owed writes (`owed` and the leavers' together) it may keep: max_owed_writes, lowered by the
  /// registry to what is left of the owner uid's share (Quotas::owed_writes).
  std::size_t most_owed = SIZE_MAX;
};

/// The smallest control block a Create with these flags (one of proto::kFlag*) may declare.
std::size_t min_control_bytes(std::uint32_t flags) noexcept;

/// One member entry a connection joined.
struct Joined {
  std::uint32_t member = proto::kNoMember;
  std::uint32_t token = 0;
  proto::Role role = proto::Role::None;
  pid_t pid = 0;            ///< the joining process (SO_PEERCRED; 0: unknown), for the journal
  std::uint64_t start = 0;  ///< its start (os::process_start_ticks; 0: unknown)
};

/// Checks a control block being registered (the creator fills it in before Create, so it is complete before
/// its name is visible) and takes its geometry. `fresh`: a Create (the block must be in its initial state); false
/// for a name a restarted broker takes back (Announce), whose members have been using it. Returns an empty
/// string, or what is wrong.
std::string check_control(ControlBlock& block, bool fresh = true);

/// Claims a member entry of `block` for `token` with `role`. Returns its index, or proto::kNoMember with `code`
/// and `why` saying what is wrong (InvalidArgument: a role the object has not; QuotaExceeded: a full table).
/// `creator`: the joining connection created the object (a counting semaphore's creator gets block.grant).
std::uint32_t join_member(ControlBlock& block, proto::Role role, std::uint32_t token, bool creator, ErrorCode& code,
                          std::string& why);

/// The creator's connection has gone (closed, or its process died): a counting semaphore's grant that it never
/// joined to take becomes available (otherwise max_count - initial permits would be held by nobody for good).
void creator_gone(ControlBlock& block) noexcept;

/// Whether `member` (after a broker restart) still holds its entry of `block` with a role the object has: the
/// entry holds its token and its role. Empty string when it does, else why not.
std::string check_rejoin(const ControlBlock& block, const Joined& member) noexcept;

/// Removes a member whose connection is gone (PeerDied), if its entry still holds its token. Returns whether it
/// did (false: it had left cleanly). A channel member's owed stream writes go to block.owed, made as their turns
/// come once `process` (its process; empty: exited, or not to be waited for) has exited; `kept` (when given) gets
/// those the broker keeps, for the journal.
bool remove_member(ControlBlock& block, const Joined& member, const ProcessWatch& process = {},
                   std::vector<proto::OwedWrite>* kept = nullptr);

/// Removes channel, semaphore or counting semaphore member `member`, which leaves while its process lives (Leave,
/// reason Closed; a counting semaphore's member gives back what it holds). A
/// channel member's writes its stream still owes are taken over into block.leavers, waiting for `process` to exit
/// or the stream to make them, instead of being written ahead of the stream; a semaphore's last signaller leaving
/// poisons it (Closed). Returns whether it removed the entry (false: the token is not in it). `kept` (when given)
/// gets the writes the broker keeps, for the journal.
bool leave_member(ControlBlock& block, const Joined& member, const ProcessWatch& process,
                  std::vector<proto::OwedWrite>* kept = nullptr);

/// How many owed stream writes the broker keeps for a channel of `slots`, its dead members' and its leavers'
/// together: as many as the members' tables in its control block hold (kMaxMembers of them). Members that wrote
/// writes into their tables that never come due, joining and dying in a loop, grew block.owed without end.
std::size_t max_owed_writes(std::uint32_t slots) noexcept;

/// The owed writes `block` keeps, its dead members' and its leavers'.
std::size_t owed_kept(const ControlBlock& block) noexcept;

/// Whether the repair of dead member `member` must wait for its process to exit, and why (empty: it need not): a
/// channel producer holding a slot it claimed and did not publish, whose stream may still be writing it (repaired
/// at once, the slot would go to the next round's producer, and the dead process's stream could fill it after that
/// producer had); a pool member holding blocks or with a stream-ordered free pending (their memory would go to the
/// next allocation while its kernels may still write it).
std::string_view repair_waits_for_exit(const ControlBlock& block, const Joined& member) noexcept;

/// Makes room in block.owed for every write block.leavers may still move into it, so that settle_owed, which runs
/// from the broker's timers (noexcept), never allocates. Call after adding to either; throws std::bad_alloc.
void reserve_owed(ControlBlock& block);

/// Makes the owed stream writes of `block` whose turn has come, dropping leavers' writes their stream made and
/// moving to `owed` those of leavers whose process has exited. Returns whether any are left.
bool settle_owed(ControlBlock& block) noexcept;

}  // namespace gpuipc::broker
