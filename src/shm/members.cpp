#include "shm/members.hpp"

namespace gpuipc::shm {

using proto::atomic;

std::uint32_t claim_member(MemberTable& members, std::uint32_t token, proto::Role role) noexcept {
  if (token == 0) return proto::kNoMember;
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    std::uint32_t expected = 0;
    if (atomic(members[i].token).compare_exchange_strong(expected, token, std::memory_order_acq_rel)) {
      atomic(members[i].role).store(static_cast<std::uint32_t>(role), std::memory_order_release);
      return i;
    }
  }
  return proto::kNoMember;
}

bool holds_token(const MemberTable& members, std::uint32_t index, std::uint32_t token) noexcept {
  if (index >= proto::kMaxMembers || token == 0) return false;
  return atomic(const_cast<std::uint32_t&>(members[index].token)).load(std::memory_order_acquire) == token;
}

bool clear_member(MemberTable& members, std::uint32_t index, std::uint32_t token) noexcept {
  if (index >= proto::kMaxMembers || token == 0) return false;
  std::uint32_t expected = token;
  return atomic(members[index].token).compare_exchange_strong(expected, 0U, std::memory_order_acq_rel);
}

}  // namespace gpuipc::shm
