#include "broker/repair.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "base/log.hpp"
#include "os/process.hpp"
#include "shm/counting_block.hpp"
#include "shm/members.hpp"
#include "shm/pool_block.hpp"
#include "shm/semaphore_block.hpp"

namespace gpuipc::broker {

std::string check_control(ControlBlock& block, bool fresh) {
  if ((block.flags & proto::kFlagCounting) != 0) {
    auto* b = shm::counting_block(block.data, block.size);
    if (b == nullptr) {
      return fmt::format("not a counting semaphore block of version {} ({} bytes): fill it in before Create",
                         proto::kCountingVersion, block.size);
    }
    if (fresh) {
      if (const char* why = shm::counting_check_new(*b); why != nullptr) {
        return fmt::format("counting semaphore block: {}", why);
      }
    }
    const std::uint32_t max = proto::atomic(b->max_count).load();
    const std::uint32_t initial = proto::atomic(b->initial).load();
    if (max == 0 || max > proto::kCountingMaxPermits) return "counting semaphore block: maximum count out of range";
    block.counting_max = max;
    block.grant = fresh && initial <= max ? max - initial : 0;
    return {};
  }
  if ((block.flags & proto::kFlagSemaphore) != 0) {
    if (shm::semaphore_block(block.data, block.size) == nullptr) {
      return fmt::format("not a semaphore block of version {} ({} bytes): fill it in before Create",
                         proto::kSemaphoreVersion, block.size);
    }
    return {};
  }
  if ((block.flags & proto::kFlagChannel) != 0) {
    auto g = shm::ring_geometry(block.data, block.size);
    if (!g) {
      return fmt::format("not a channel control block of version {} that fits its {} bytes: fill it in before Create",
                         proto::kChannelVersion, block.size);
    }
    block.ring = *g;
    return {};
  }
  if ((block.flags & proto::kFlagPool) != 0) {
    shm::PoolGeometry g;
    if (!shm::read_geometry(block.data, block.size, g)) {
      return fmt::format("not a pool control block that fits its {} bytes: fill it in before Create", block.size);
    }
    return {};
  }
  return {};
}

std::size_t min_control_bytes(std::uint32_t flags) noexcept {
  if ((flags & proto::kFlagSemaphore) != 0) return sizeof(proto::SemaphoreBlock);
  if ((flags & proto::kFlagPool) != 0) return shm::pool_control_bytes(1);
  if ((flags & proto::kFlagCounting) != 0) return sizeof(proto::CountingBlock);
  return sizeof(proto::ChannelHeader);
}

std::uint32_t join_member(ControlBlock& block, proto::Role role, std::uint32_t token, bool creator, ErrorCode& code,
                          std::string& why) {
  code = ErrorCode::InvalidArgument;
  std::uint32_t index = proto::kNoMember;
  if ((block.flags & proto::kFlagSemaphore) != 0) {
    if (role != proto::Role::Signaller) {
      why = "a semaphore's members are signallers";
      return index;
    }
    index = shm::semaphore_join(*static_cast<proto::SemaphoreBlock*>(block.data), token);
  } else if ((block.flags & proto::kFlagChannel) != 0) {
    if (role != proto::Role::Producer && role != proto::Role::Consumer) {
      why = "a channel's members are producers or consumers";
      return index;
    }
    index = shm::channel_join(shm::Ring{block.data, block.ring}, token, role);
  } else if ((block.flags & proto::kFlagPool) != 0) {
    if (role != proto::Role::Holder) {
      why = "a pool's members are holders";
      return index;
    }
    index = shm::claim_member(static_cast<shm::PoolHeader*>(block.data)->members, token, role);
  } else if ((block.flags & proto::kFlagCounting) != 0) {
    if (role != proto::Role::Holder) {
      why = "a counting semaphore's members are holders";
      return index;
    }
    // The permits above the initial count are the creator's, given at its first join (only once).
    const std::uint32_t grant = creator ? block.grant : 0;
    index = shm::counting_join(*static_cast<proto::CountingBlock*>(block.data), token, grant);
    if (index != proto::kNoMember && creator) block.grant = 0;
  } else {
    why = "this segment is not a semaphore, a channel or a pool: it has no members";
    return index;
  }
  if (index == proto::kNoMember) {
    code = ErrorCode::QuotaExceeded;
    why = fmt::format("it already has {} members, the most it can", proto::kMaxMembers);
  }
  return index;
}

void creator_gone(ControlBlock& block) noexcept {
  if ((block.flags & proto::kFlagCounting) == 0 || block.grant == 0) return;
  shm::counting_give_back(*static_cast<proto::CountingBlock*>(block.data), block.grant, block.counting_max);
  block.grant = 0;
}

std::string check_rejoin(const ControlBlock& block, const Joined& m) noexcept {
  shm::MemberTable* members = nullptr;
  bool role_ok = false;
  if ((block.flags & proto::kFlagSemaphore) != 0) {
    members = &static_cast<proto::SemaphoreBlock*>(block.data)->members;
    role_ok = m.role == proto::Role::Signaller;
  } else if ((block.flags & proto::kFlagChannel) != 0) {
    members = &static_cast<proto::ChannelHeader*>(block.data)->members;
    role_ok = m.role == proto::Role::Producer || m.role == proto::Role::Consumer;
  } else if ((block.flags & proto::kFlagPool) != 0) {
    members = &static_cast<shm::PoolHeader*>(block.data)->members;
    role_ok = m.role == proto::Role::Holder;
  } else if ((block.flags & proto::kFlagCounting) != 0) {
    members = &static_cast<proto::CountingBlock*>(block.data)->members;
    role_ok = m.role == proto::Role::Holder;
  }
  if (members == nullptr || !role_ok) return "not a role this object has";
  if (!shm::holds_token(*members, m.member, m.token)) return "that entry no longer holds that token";
  if (proto::atomic((*members)[m.member].role).load() != static_cast<std::uint32_t>(m.role)) {
    return "the entry's role differs";
  }
  return {};
}

std::size_t owed_kept(const ControlBlock& block) noexcept {
  std::size_t n = block.owed.size();
  for (const auto& l : block.leavers) n += l.writes.size();
  return n;
}

void reserve_owed(ControlBlock& block) { block.owed.reserve(owed_kept(block)); }

bool settle_owed(ControlBlock& block) noexcept {
  const shm::Ring ring{block.data, block.ring};
  std::erase_if(block.leavers, [&](ControlBlock::Leaver& l) {
    l.writes.resize(shm::ring_drop_landed(ring, l.writes));
    if (l.writes.empty()) return true;
    if (!exited(l.process)) return false;
    // Exited: its stream makes no more. No allocation: reserve_owed made room.
    block.owed.insert(block.owed.end(), l.writes.begin(), l.writes.end());
    return true;
  });
  if (block.owed.empty()) {
    block.dying.clear();
    return !block.leavers.empty();
  }
  std::erase_if(block.dying, [](const ProcessWatch& d) { return exited(d); });
  if (!block.dying.empty()) return true;
  block.owed.resize(shm::ring_settle_owed(ring, block.owed));
  return !block.owed.empty() || !block.leavers.empty();
}

std::size_t max_owed_writes(std::uint32_t slots) noexcept {
  return static_cast<std::size_t>(proto::kMaxMembers) * proto::owed_capacity(slots);
}

namespace {

/// Member `member`'s owed writes, from its table.
std::vector<proto::OwedWrite> take_owed(const ControlBlock& block, std::uint32_t member) {
  std::vector<proto::OwedWrite> owed(proto::owed_capacity(block.ring.slots));
  owed.resize(shm::ring_take_owed(shm::Ring{block.data, block.ring}, member, owed));
  owed.shrink_to_fit();
  return owed;
}

/// Cuts `owed` (a removed member's) to what `block` has room to keep (max_owed_writes, block.most_owed). The rest
/// are written now, ahead of the stream that owed them, as when a member leaves without the broker: none is lost, so
/// no survivor's stream waits for ever.
void keep_within_room(const ControlBlock& block, std::uint32_t member, std::vector<proto::OwedWrite>& owed) noexcept {
  const std::size_t most = std::min(max_owed_writes(block.ring.slots), block.most_owed);
  const std::size_t kept = owed_kept(block);
  const std::size_t room = most - std::min(kept, most);
  if (owed.size() <= room) return;
  GPUIPC_LOG_WARN(
      "channel member {} owed {} stream writes, and the broker keeps {} already, the most it keeps for this channel "
      "(what its members' tables hold, and the owner's share): {} are written now, ahead of its stream",
      member, owed.size(), kept, owed.size() - room);
  shm::ring_write_owed_now(shm::Ring{block.data, block.ring}, std::span<const proto::OwedWrite>(owed).subspan(room));
  owed.resize(room);
}

}  // namespace

std::string_view repair_waits_for_exit(const ControlBlock& block, const Joined& m) noexcept {
  if ((block.flags & proto::kFlagChannel) != 0 && m.role == proto::Role::Producer) {
    const shm::Ring ring{block.data, block.ring};
    if (shm::holds_token(ring.header().members, m.member, m.token) && shm::ring_member_claims(ring, m.member)) {
      return "a claimed slot";
    }
  } else if ((block.flags & proto::kFlagPool) != 0) {
    if (shm::holds_token(static_cast<shm::PoolHeader*>(block.data)->members, m.member, m.token) &&
        shm::pool_member_uses_memory(block.data, block.size, m.member)) {
      return "pool blocks";
    }
  }
  return {};
}

bool leave_member(ControlBlock& block, const Joined& m, const ProcessWatch& process,
                  std::vector<proto::OwedWrite>* kept) {
  if ((block.flags & proto::kFlagSemaphore) != 0) {
    // No stream work to wait for: the library leaves a semaphore through the broker only for an entry it never
    // used (a Join it gave up on); the last signaller leaving poisons it (Closed), as a close does.
    const bool removed = shm::semaphore_remove_member(*static_cast<proto::SemaphoreBlock*>(block.data), m.member,
                                                      m.token, proto::PoisonReason::Closed);
    if (removed) GPUIPC_LOG_INFO("semaphore member {} left through the broker", m.member);
    return removed;
  }
  if ((block.flags & proto::kFlagCounting) != 0) {
    // The same: a Join given up on. Whatever it holds (a creator's grant) is given back.
    const bool removed = shm::counting_remove_member(*static_cast<proto::CountingBlock*>(block.data), m.member, m.token,
                                                     block.counting_max);
    if (removed) GPUIPC_LOG_INFO("counting semaphore member {} left through the broker", m.member);
    return removed;
  }
  if ((block.flags & proto::kFlagChannel) == 0) return false;
  const shm::Ring ring{block.data, block.ring};
  if (!shm::holds_token(ring.header().members, m.member, m.token)) return false;
  std::vector<proto::OwedWrite> owed = take_owed(block, m.member);
  shm::ring_forget_owed(ring, m.member);  // taken over: the removal below writes none of them ahead of the stream
  if (!shm::channel_remove_member(block.data, block.ring, m.member, m.token, m.role, proto::PoisonReason::Closed)) {
    return false;
  }
  keep_within_room(block, m.member, owed);
  if (kept != nullptr) *kept = owed;
  if (!owed.empty()) {
    // Without a process to wait for (gone already, or not watched), made as their turns come.
    block.leavers.push_back(ControlBlock::Leaver{process, std::move(owed)});
    reserve_owed(block);
    if (settle_owed(block)) {
      GPUIPC_LOG_INFO(
          "channel member {} left owing {} stream writes: its stream makes them, or the broker once the "
          "process has exited",
          m.member, block.leavers.empty() ? 0 : block.leavers.back().writes.size());
    }
  }
  GPUIPC_LOG_INFO("member {} (role {}) left through the broker", m.member, static_cast<int>(m.role));
  return true;
}

bool remove_member(ControlBlock& block, const Joined& m, const ProcessWatch& process,
                   std::vector<proto::OwedWrite>* kept) {
  bool removed = false;
  if ((block.flags & proto::kFlagSemaphore) != 0) {
    removed = shm::semaphore_remove_member(*static_cast<proto::SemaphoreBlock*>(block.data), m.member, m.token,
                                           proto::PoisonReason::PeerDied);
  } else if ((block.flags & proto::kFlagChannel) != 0) {
    // What its stream still owed, before the repair moves the slots on (the states tell which steps it made).
    std::vector<proto::OwedWrite> owed = take_owed(block, m.member);
    removed = shm::channel_remove_member(block.data, block.ring, m.member, m.token, m.role,
                                         proto::PoisonReason::PeerDied);
    if (removed) keep_within_room(block, m.member, owed);
    if (removed && kept != nullptr) *kept = owed;
    if (removed && !owed.empty()) {
      block.owed.insert(block.owed.end(), owed.begin(), owed.end());
      reserve_owed(block);
      if (process && std::find(block.dying.begin(), block.dying.end(), process) == block.dying.end()) {
        block.dying.push_back(process);
      }
      if (settle_owed(block)) {
        GPUIPC_LOG_INFO("channel member {} is gone owing {} stream writes: they are made as their turns come", m.member,
                        block.owed.size());
      }
    }
  } else if ((block.flags & proto::kFlagCounting) != 0) {
    // Completes its half-made operation and gives back every permit it held.
    removed = shm::counting_remove_member(*static_cast<proto::CountingBlock*>(block.data), m.member, m.token,
                                          block.counting_max);
  } else if ((block.flags & proto::kFlagPool) != 0) {
    auto& members = static_cast<shm::PoolHeader*>(block.data)->members;
    if (shm::holds_token(members, m.member, m.token)) {
      // Its holds first (blocks it held last are freed, its stream frees complete, a lock it died in is broken),
      // then the entry: until then nobody else can be member `m.member`.
      if (shm::pool_remove_member(block.data, block.size, m.member, false, shm::kRepairLockWait) < 0) {
        // The lock stayed taken: the removal is recorded in the block and the lock's next holder finishes it,
        // freeing the entry too (a member that died holding the lock is repaired next, or a live one lets go).
        GPUIPC_LOG_INFO("pool member {} is gone; its lock was taken, the next lock holder releases its holds",
                        m.member);
        removed = true;
      } else {
        removed = shm::clear_member(members, m.member, m.token);
      }
    }
  }
  if (removed) GPUIPC_LOG_INFO("member {} (role {}) is gone: repaired", m.member, static_cast<int>(m.role));
  return removed;
}

}  // namespace gpuipc::broker
