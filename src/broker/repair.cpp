#include "broker/repair.hpp"

#include <fmt/format.h>

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

void reserve_owed(ControlBlock& block) {
  std::size_t n = block.owed.size();
  for (const auto& l : block.leavers) n += l.writes.size();
  block.owed.reserve(n);
}

bool settle_owed(ControlBlock& block) noexcept {
  const shm::Ring ring{block.data, block.ring};
  std::erase_if(block.leavers, [&](ControlBlock::Leaver& l) {
    l.writes.resize(shm::ring_drop_landed(ring, l.writes));
    if (l.writes.empty()) return true;
    if (l.process.pidfd && !os::pidfd_wait_exit(l.process.pidfd.get(), 0)) return false;
    // Exited: its stream makes no more. No allocation: reserve_owed made room.
    block.owed.insert(block.owed.end(), l.writes.begin(), l.writes.end());
    return true;
  });
  if (block.owed.empty()) {
    block.dying.clear();
    return !block.leavers.empty();
  }
  std::erase_if(block.dying, [](const ControlBlock::Dying& d) { return os::pidfd_wait_exit(d.pidfd.get(), 0); });
  if (!block.dying.empty()) return true;
  block.owed.resize(shm::ring_settle_owed(ring, block.owed));
  return !block.owed.empty() || !block.leavers.empty();
}

os::UniqueFd pidfd_of(pid_t pid, std::uint64_t start) noexcept {
  if (pid <= 0) return {};
  try {
    auto fd = os::pidfd_open(pid);
    if (start != 0 && os::process_start_ticks(pid) != start) return {};
    return fd;
  } catch (const std::exception&) {  // gone (NotFound) or no pidfd
    return {};
  }
}

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

bool leave_member(ControlBlock& block, const Joined& m, pid_t pid, std::uint64_t start) {
  if ((block.flags & proto::kFlagSemaphore) != 0) {
    // No stream work to wait for: the library leaves a semaphore through the broker only for an entry it never
    // used (a Join it gave up on); the last signaller leaving poisons it (Closed), as a close does.
    const bool removed = shm::semaphore_remove_member(*static_cast<proto::SemaphoreBlock*>(block.data), m.member,
                                                      m.token, proto::PoisonReason::Closed);
    if (removed) GPUIPC_LOG_INFO("semaphore member {} left through the broker", m.member);
    return removed;
  }
  if ((block.flags & proto::kFlagChannel) == 0) return false;
  const shm::Ring ring{block.data, block.ring};
  if (!shm::holds_token(ring.header().members, m.member, m.token)) return false;
  std::vector<proto::OwedWrite> owed(proto::owed_capacity(block.ring.slots));
  owed.resize(shm::ring_take_owed(ring, m.member, owed));
  shm::ring_forget_owed(ring, m.member);  // taken over: the removal below writes none of them ahead of the stream
  if (!shm::channel_remove_member(block.data, block.ring, m.member, m.token, m.role, proto::PoisonReason::Closed)) {
    return false;
  }
  if (!owed.empty()) {
    ControlBlock::Leaver l{ControlBlock::Dying{}, std::move(owed)};
    try {
      l.process = ControlBlock::Dying{os::pidfd_open(pid), pid, start};
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): gone already (or no pidfd): made as their turns come
    }
    block.leavers.push_back(std::move(l));
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

bool remove_member(ControlBlock& block, const Joined& m, pid_t pid) {
  bool removed = false;
  if ((block.flags & proto::kFlagSemaphore) != 0) {
    removed = shm::semaphore_remove_member(*static_cast<proto::SemaphoreBlock*>(block.data), m.member, m.token,
                                           proto::PoisonReason::PeerDied);
  } else if ((block.flags & proto::kFlagChannel) != 0) {
    const shm::Ring ring{block.data, block.ring};
    // What its stream still owed, before the repair moves the slots on (the states tell which steps it made).
    std::vector<proto::OwedWrite> owed(proto::owed_capacity(block.ring.slots));
    owed.resize(shm::ring_take_owed(ring, m.member, owed));
    removed = shm::channel_remove_member(block.data, block.ring, m.member, m.token, m.role,
                                         proto::PoisonReason::PeerDied);
    if (removed && !owed.empty()) {
      block.owed.insert(block.owed.end(), owed.begin(), owed.end());
      reserve_owed(block);
      if (pid > 0) {
        try {
          block.dying.push_back(ControlBlock::Dying{os::pidfd_open(pid), pid, m.pid == pid ? m.start : 0});
        } catch (const Error&) {  // NOLINT(bugprone-empty-catch): gone already (or no pidfd): nothing to wait for
        }
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
      if (shm::pool_remove_member(block.data, block.size, m.member) < 0) {
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
