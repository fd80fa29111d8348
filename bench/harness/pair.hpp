// Two benchmark workers joined by a socket: A (the exporter) and B (the importer) exchange JSON messages with fds
// attached, every receive bounded. Shared by the access, vmm and transfer suites (and the served workers).
#pragma once

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cuda/context.hpp"
#include "gpu.hpp"
#include "os/fd.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::bench::pair {

/// One end of the A <-> B socket: JSON messages with fds attached; every receive is bounded.
class Link {
 public:
  Link(int fd, std::string peer, std::string suite) : m_fd(fd), m_peer(std::move(peer)), m_suite(std::move(suite)) {}
  void send(const nlohmann::json& body, std::span<const int> fds = {}) const;
  /// The next message; throws Timeout after `timeout_ms`, PeerDied when the peer has gone, and the peer's error
  /// when it sent {"error": ...}.
  nlohmann::json receive(int timeout_ms, std::vector<os::UniqueFd>* fds_out = nullptr) const;

 private:
  int m_fd;
  std::string m_peer;
  std::string m_suite;
};

using Body = std::function<nlohmann::json(const Link&)>;

/// Runs `a` (the exporter, A) and `b` (the importer, B) in two forked workers joined by a socketpair. The one that
/// drives the exchange is awaited first (at most `timeout`), then the other (at most 60 s more: it only waits for
/// its peer). Returns {a's report, b's report}; throws Error naming both workers' errors when either failed.
std::pair<nlohmann::json, nlohmann::json> run_pair(const std::string& suite, const Body& a, const Body& b,
                                                   std::chrono::seconds timeout, bool b_drives);

std::string to_hex(const void* data, std::size_t n);
void from_hex(const std::string& suite, const std::string& s, void* data, std::size_t n);

/// "4KiB", "2MiB", "1GiB" (metric names and labels).
std::string size_label(std::size_t bytes);

inline constexpr std::size_t kKiB = 1ULL << 10;
inline constexpr std::size_t kMiB = 1ULL << 20;
inline constexpr std::size_t kGiB = 1ULL << 30;

/// The pair helpers of one suite, its name bound (every error names the suite): what the A/B suites (access, vmm,
/// transfer) open with.
struct SuitePair {
  std::string suite;
  std::pair<nlohmann::json, nlohmann::json> run(const Body& a, const Body& b, std::chrono::seconds timeout,
                                                bool b_drives) const {
    return run_pair(suite, a, b, timeout, b_drives);
  }
  void from_hex(const std::string& s, void* data, std::size_t n) const { pair::from_hex(suite, s, data, n); }
};

}  // namespace gpuipc::bench::pair
