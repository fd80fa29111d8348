// How much broker memory one uid can make the broker keep for (segment, connection) pairs: its connections each open
// every segment read-write and start a heartbeat on each (SegmentRecord::refs, writers, beats, the heartbeat deadline
// index, and the connection's holding index), and what Quotas::opens (GPUIPC_QUOTA_OPENS) leaves of it. Drives a
// Registry as the server does, in one process; prints the resident set's growth per pair opened. Built by hand
// against a build tree:
//   g++ -std=c++20 -O2 -DFMT_HEADER_ONLY=1 -Iinclude -Ibuild/generated/include -Isrc \
//     bench/analysis/experiments/broker_holdings_memory.cpp build/src/libgpuipc_broker.a build/src/libgpuipc_shm.a \
//     build/src/libgpuipc_proto.a build/src/libgpuipc_os.a build/src/libgpuipc_base.a -lpthread -o /tmp/holdings
//   /tmp/holdings [SEGMENTS] [CONNECTIONS] [OPENS]   (OPENS: Quotas::opens; default its default, 65536)
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <variant>
#include <vector>

#include "broker/registry.hpp"
#include "os/memfd.hpp"

using namespace gpuipc;

namespace {
long rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  }
  return -1;
}
}  // namespace

int main(int argc, char** argv) {
  const int segments = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int connections = argc > 2 ? std::atoi(argv[2]) : 64;
  rlimit lim{};
  getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  setrlimit(RLIMIT_NOFILE, &lim);
  broker::Quotas quotas;
  if (argc > 3) quotas.opens = std::strtoull(argv[3], nullptr, 10);
  broker::Registry registry(quotas);
  const os::Credentials me{::getpid(), ::getuid(), ::getgid(), {}};
  std::uint32_t rid = 1;
  long refused = 0;
  long opened = 0;
  std::string last_refusal;
  const auto ask = [&](broker::ConnId conn, proto::Body body, std::vector<os::UniqueFd> fds = {}) {
    std::vector<broker::Outgoing> out;
    registry.handle(broker::Caller{conn, me}, proto::Message{rid++, std::move(body)}, fds, 0, out);
    for (auto& o : out) {
      if (std::holds_alternative<proto::OpenReply>(o.msg.body)) ++opened;
      if (const auto* e = std::get_if<proto::ErrorReply>(&o.msg.body)) {
        ++refused;
        last_refusal = e->message;
      }
    }
  };
  for (broker::ConnId c = 1; c <= static_cast<broker::ConnId>(connections) + 1; ++c) registry.add_connection(c, me);
  for (int s = 0; s < segments; ++s) {
    const std::string name = "s" + std::to_string(s);
    std::vector<os::UniqueFd> fds;
    fds.push_back(os::memfd_create(name.c_str(), 4096));
    ask(1, proto::Create{name, proto::Kind::Host, 0600, 4096, {}, 0}, std::move(fds));
  }
  const long before = rss_kib();
  opened = 0;
  refused = 0;
  for (broker::ConnId c = 2; c <= static_cast<broker::ConnId>(connections) + 1; ++c) {
    for (int s = 0; s < segments; ++s) {
      const std::string name = "s" + std::to_string(s);
      const long was = opened;
      ask(c, proto::Open{name, proto::Access::ReadWrite, 0});
      if (opened > was) ask(c, proto::Heartbeat{name, 60'000});
    }
  }
  const long after = rss_kib();
  std::printf("%d segments x %d connections, Quotas::opens %zu: %ld pairs opened, RSS %ld -> %ld KiB (%.0f bytes per "
              "pair opened); %ld requests refused%s%s\n",
              segments, connections, quotas.opens, opened, before, after,
              opened > 0 ? (after - before) * 1024.0 / static_cast<double>(opened) : 0.0, refused,
              refused ? ", the last: " : "", last_refusal.c_str());
}
