// The broker's status page: one page of shared memory the broker writes and every client maps read-only
// (its fd comes with HelloReply). Clients read it without a round trip to the broker.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace gpuipc::proto {

inline constexpr std::uint32_t kStatusMagic = 0x54534947;  // "GIST"
inline constexpr std::uint32_t kStatusVersion = 1;

/// StatusPage::features bits: requests this broker accepts beyond those every version-2 broker accepts.
inline constexpr std::uint32_t kFeatureUnlinkId = 1U << 0;  ///< UnlinkId (messages.hpp)
inline constexpr std::uint32_t kFeatureLook = 1U << 1;      ///< Open with Access::Look (messages.hpp)

/// The name of one kFeature* bit ("unlink_id"), or nullptr for a bit this version does not know.
constexpr const char* feature_name(std::uint32_t bit) noexcept {
  return bit == kFeatureUnlinkId ? "unlink_id" : bit == kFeatureLook ? "look" : nullptr;
}

/// How the running broker was started (StatusPage::mode; `gpuipc daemon status` prints it).
enum class BrokerMode : std::uint32_t {
  Unknown = 0,          ///< a broker that predates the field
  OnDemand = 1,         ///< started by the library (`gpuipcd --on-demand`): exits when idle
  SocketActivated = 2,  ///< started by a service manager that passed its listening socket (systemd)
  Manual = 3,           ///< started by hand or by a supervisor: `gpuipcd`, `gpuipc daemon --foreground`
};

/// "on-demand", "socket-activated", "manual" or "unknown".
constexpr const char* broker_mode_name(BrokerMode mode) noexcept {
  switch (mode) {
    case BrokerMode::OnDemand:
      return "on-demand";
    case BrokerMode::SocketActivated:
      return "socket-activated";
    case BrokerMode::Manual:
      return "manual";
    case BrokerMode::Unknown:
      break;
  }
  return "unknown";
}

// Fields after broker_pid came later into bytes that were zero, so the version stayed 1: a client reading an older
// broker's page sees mode Unknown and zeros, an older client ignores them.
struct alignas(64) StatusPage {
  std::uint32_t magic;
  std::uint32_t version;
  /// Incremented (release) on every unlink: a client's cached name -> segment binding made at an older value
  /// must be checked again with the broker before it is reused.
  std::uint64_t names_generation;
  std::uint64_t broker_pid;
  /// The rest is written once, before the broker shares the page, and never changes.
  std::uint32_t mode;             ///< a BrokerMode
  /// kFeature* bits (0 from a broker that predates the field): a client sends such a request only when its bit is set.
  std::uint32_t features;
  std::uint64_t started_unix_ns;  ///< when the broker started (CLOCK_REALTIME)
  std::uint64_t idle_timeout_ms;  ///< exits after this long idle; 0: never
  /// Set to 1 (release) when the broker shuts down on purpose (SIGTERM, SIGINT, `gpuipc daemon --stop`), before
  /// it closes its connections: a client that sees its connection close reads it to tell a stop, after which it
  /// starts no broker by itself, from a death, after which it reconnects at once to give names and memberships back.
  std::uint32_t stopping;
  std::uint32_t reserved2;  ///< 0
};
static_assert(sizeof(StatusPage) == 64);
static_assert(offsetof(StatusPage, broker_pid) == 16 && offsetof(StatusPage, mode) == 24 &&
              offsetof(StatusPage, started_unix_ns) == 32 && offsetof(StatusPage, idle_timeout_ms) == 40 &&
              offsetof(StatusPage, stopping) == 48);
static_assert(std::atomic_ref<std::uint64_t>::is_always_lock_free);

}  // namespace gpuipc::proto
