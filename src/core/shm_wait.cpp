#include "core/shm_wait.hpp"


#include "os/futex.hpp"
#include "os/module.hpp"
#include "os/process.hpp"

namespace gpuipc::core {
namespace {

const std::atomic<std::uint32_t>* as_atomic(const std::uint32_t& word) noexcept {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  return reinterpret_cast<const std::atomic<std::uint32_t>*>(&word);  // NOLINT: futex needs the word's address
}

}  // namespace

std::uint32_t claim_member(proto::Member (&members)[proto::kMaxMembers], proto::Role role) noexcept {
  const auto pid = static_cast<std::uint32_t>(os::current_pid());
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    std::uint32_t expected = 0;
    if (proto::atomic(members[i].pid).compare_exchange_strong(expected, pid, std::memory_order_acq_rel)) {
      proto::atomic(members[i].role).store(static_cast<std::uint32_t>(role), std::memory_order_release);
      return i;
    }
  }
  return proto::kNoMember;
}

void release_member(proto::Member (&members)[proto::kMaxMembers], std::uint32_t index) noexcept {
  if (index >= proto::kMaxMembers) return;
  std::uint32_t expected = static_cast<std::uint32_t>(os::current_pid());
  proto::atomic(members[index].pid).compare_exchange_strong(expected, 0U, std::memory_order_acq_rel);
}

void bump_and_wake(std::uint32_t& word, std::uint32_t* sleepers) noexcept {
  proto::atomic(word).fetch_add(1, std::memory_order_seq_cst);
  if (sleepers != nullptr && proto::atomic(*sleepers).load(std::memory_order_seq_cst) == 0) return;
  try {
    os::futex_wake(as_atomic(word));
  } catch (...) {  // NOLINT(bugprone-empty-catch): sleepers also wake by timeout
  }
}

void futex_sleep(const std::uint32_t& futex_word, std::uint32_t seen, std::chrono::nanoseconds slice) noexcept {
  try {
    os::futex_wait(as_atomic(futex_word), seen, slice);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a failed wait only costs a turn of the caller's loop
  }
}

}  // namespace gpuipc::core
