#include "core/shm_wait.hpp"


#include "os/futex.hpp"

namespace gpuipc::core {
namespace {

const std::atomic<std::uint32_t>* as_atomic(const std::uint32_t& word) noexcept {
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  return reinterpret_cast<const std::atomic<std::uint32_t>*>(&word);  // NOLINT: futex needs the word's address
}

}  // namespace

void futex_sleep(const std::uint32_t& futex_word, std::uint32_t seen, std::chrono::nanoseconds slice) noexcept {
  try {
    os::futex_wait(as_atomic(futex_word), seen, slice);
  } catch (...) {  // NOLINT(bugprone-empty-catch): a failed wait only costs a turn of the caller's loop
  }
}

}  // namespace gpuipc::core
