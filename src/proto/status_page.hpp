// The broker's status page: one page of shared memory the broker writes and every client maps read-only
// (its fd comes with HelloReply). Clients read it without a round trip to the broker.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpuipc::proto {

inline constexpr std::uint32_t kStatusMagic = 0x54534947;  // "GIST"
inline constexpr std::uint32_t kStatusVersion = 1;

struct alignas(64) StatusPage {
  std::uint32_t magic;
  std::uint32_t version;
  /// Incremented (release) on every unlink: a client's cached name -> segment binding made at an older value
  /// must be checked again with the broker before it is reused.
  std::uint64_t names_generation;
  std::uint64_t broker_pid;
};
static_assert(sizeof(StatusPage) == 64);
static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free);

}  // namespace gpuipc::proto
