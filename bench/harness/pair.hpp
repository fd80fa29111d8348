// Two benchmark workers joined by a socket: A (the exporter) and B (the importer) exchange JSON messages with fds
// attached, every receive bounded. Shared by the access, vmm and transfer suites.
#pragma once

#include <chrono>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cuda/resources.hpp"
#include "kernels/kernels.hpp"
#include "os/fd.hpp"

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

/// GPU `ordinal`'s primary context, current on this thread, a stream and the kernels. Declare it first in a worker
/// so it is destroyed after everything allocated in its context.
struct Gpu {
  explicit Gpu(int ordinal = 0) : ctx(ordinal) {}
  cuda::PrimaryContext ctx;
  // Members initialise in declaration order, before the constructor's body: the context must be current before
  // the stream and the kernels are made in it.
  int made_current = (ctx.make_current(), 0);
  cuda::Stream stream = cuda::Stream::create();
  kernels::Kernels k;
};

}  // namespace gpuipc::bench::pair
