// `gpuipc bench transfer`: copy bandwidth into and out of segments beside the same copies on plain allocations,
// all in the importing process (B) of the same run:
//   h2d: host -> device, d2h: device -> host, d2d: device -> device (same GPU), with
//   segment: a host_pinned segment and device segments A created, opened by name in B;
//   plain:   cuMemHostAlloc'ed pinned host memory and cuMemAlloc device memory of B.
// Synchronous copies (cuMemcpyHtoD / DtoH / DtoD, then a synchronisation of the default stream) timed with the
// host clock; bandwidth = bytes copied / time (1e9 bytes/s). With two GPUs or more, peer copies too: GPU 1 reads
// from (and writes into) a device segment of GPU 0 that B opened for GPU 1, beside cuMemAlloc buffers of the two
// GPUs with peer access enabled.
// The CLI process never touches CUDA: A and B are forked workers joined by a socketpair. Every wait is bounded.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "os/fd.hpp"
#include "os/socket.hpp"
#include "pair.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"
#include "testkit/kernels/pattern.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

constexpr int kDevice = 0;

// Two workers and the socket between them: bench/harness/pair.hpp.
using namespace pair;  // NOLINT(google-build-using-namespace): Link, Gpu, kKiB, kMiB, kGiB, size_label, to_hex
const SuitePair kPair{"transfer"};

// ---------------------------------------------------------------------------------------------------------------
// The measurement.

constexpr int kReplyTimeoutMs = 120'000;

/// Pinned host memory from cuMemHostAlloc: the plain baseline of a host_pinned segment.
using PinnedHost = cuda::PinnedHostBuffer;

void fill_host(void* p, std::size_t bytes, std::uint64_t seed) {
  auto* w = static_cast<std::uint32_t*>(p);
  for (std::size_t i = 0; i < bytes / 4; ++i) w[i] = kernels::pattern_word(seed, i);
}

std::size_t host_mismatches(const void* p, std::size_t bytes, std::uint64_t seed) {
  const auto* w = static_cast<const std::uint32_t*>(p);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < bytes / 4; ++i) bad += w[i] != kernels::pattern_word(seed, i) ? 1 : 0;
  return bad;
}

void expect_zero(std::size_t bad, std::size_t words, const std::string& what) {
  if (bad != 0) {
    throw Error(ErrorCode::Protocol, fmt::format("bench transfer: {}: {} of {} words differ from the source", what, bad, words));
  }
}

json values_json(const std::vector<double>& v) {
  json a = json::array();
  for (double x : v) a.push_back(std::round(x * 1e3) / 1e3);
  return a;
}

struct Names {
  std::string src, dst, host;
};

/// Worker A: creates the segments (device src with a pattern, device dst, host_pinned) and keeps them alive
/// until B is done.
json exporter(const Link& link, const Names& names, std::size_t bytes, std::uint64_t seed_dev, std::uint64_t seed_host) {
  Gpu g;
  {
    const CreateOptions dev{.kind = SegmentKind::Device, .device = kDevice, .mode = 0600};
    Segment src = Segment::create(names.src, bytes, dev);
    Segment dst = Segment::create(names.dst, bytes, dev);
    Segment host = Segment::create(names.host, bytes, {.kind = SegmentKind::HostPinned, .device = kDevice, .mode = 0600});
    g.k.fill_pattern(g.stream.get(), src.device_pointer(), bytes / 4, seed_dev);
    fill_host(host.data(), bytes, seed_host);
    g.stream.synchronize();
    link.send({{"ready", true}});
    link.receive(kReplyTimeoutMs * 4);  // B is done and has closed its mappings
    for (const auto* n : {&names.src, &names.dst, &names.host}) Segment::unlink(*n);
  }
  return {{"ok", true}};
}

struct Copy {
  std::string dir;   ///< h2d, d2h, d2d, p2p_out, p2p_in
  std::string kind;  ///< segment, plain
  std::function<void()> run;
};

/// Times each copy `warmup + runs` times, interleaved (the order alternates run by run); microseconds per copy.
std::map<std::string, std::vector<double>> time_copies(const std::vector<Copy>& copies, int warmup, int runs) {
  std::map<std::string, std::vector<double>> us;
  for (int r = 0; r < warmup + runs; ++r) {
    for (std::size_t j = 0; j < copies.size(); ++j) {
      const auto& c = copies[r % 2 == 0 ? j : copies.size() - 1 - j];
      const auto t0 = now_ns();
      c.run();
      cuda::synchronize(nullptr, "the default stream after a copy");  // DtoD returns before it is done
      const auto t1 = now_ns();
      if (r >= warmup) us[c.dir + "/" + c.kind].push_back(static_cast<double>(t1 - t0) / 1e3);
    }
  }
  return us;
}

/// Worker B: opens A's segments, allocates the plain baselines, checks every copy once, then times them.
json importer(const Link& link, const Names& names, std::size_t bytes, std::uint64_t seed_dev, std::uint64_t seed_host,
              int warmup, int runs) {
  Gpu g;
  const CUstream s = g.stream.get();
  link.receive(kReplyTimeoutMs);  // A's segments exist
  const std::size_t words = bytes / 4;
  json out{{"bytes", bytes}};
  std::map<std::string, std::vector<double>> us;
  {
    Segment src = Segment::open(names.src);
    Segment dst = Segment::open(names.dst);
    Segment host = Segment::open(names.host);
    for (const Segment* seg : {&src, &dst}) {
      if (!*seg || seg->kind() != SegmentKind::Device || seg->device_pointer() == 0 || seg->size() < bytes) {
        throw Error(ErrorCode::Protocol, fmt::format("bench transfer: '{}' did not open as a device segment", seg->name()));
      }
    }
    if (!host || host.kind() != SegmentKind::HostPinned || host.data() == nullptr || host.size() < bytes) {
      throw Error(ErrorCode::Protocol, "bench transfer: the host_pinned segment did not open as one");
    }
    const CUdeviceptr sseg = src.device_pointer(), dseg = dst.device_pointer();
    void* hseg = host.data();
    auto psrc = cuda::DeviceBuffer::allocate(bytes);
    auto pdst = cuda::DeviceBuffer::allocate(bytes);
    PinnedHost phost(bytes);
    g.k.fill_pattern(s, psrc.get(), words, seed_dev);
    fill_host(phost.get(), bytes, seed_host);
    g.stream.synchronize();

    // Every copy once, checked (A's host pattern through the segment, B's own through the plain path).
    expect_zero(host_mismatches(hseg, bytes, seed_host), words, "the host_pinned segment as B sees it");
    cuda::copy_to_device(dseg, hseg, bytes);
    expect_zero(g.k.count_mismatches(s, dseg, words, seed_host), words, "h2d into the device segment");
    cuda::copy_to_device(pdst.get(), phost.get(), bytes);
    expect_zero(g.k.count_mismatches(s, pdst.get(), words, seed_host), words, "h2d into cuMemAlloc memory");
    cuda::copy_to_host(hseg, sseg, bytes);
    expect_zero(host_mismatches(hseg, bytes, seed_dev), words, "d2h into the host_pinned segment");
    cuda::copy_to_host(phost.get(), psrc.get(), bytes);
    expect_zero(host_mismatches(phost.get(), bytes, seed_dev), words, "d2h into cuMemHostAlloc memory");
    cuda::copy_device_to_device(dseg, sseg, bytes);
    cuda::synchronize(nullptr, "the default stream after a copy");
    expect_zero(g.k.count_mismatches(s, dseg, words, seed_dev), words, "d2d between device segments");
    cuda::copy_device_to_device(pdst.get(), psrc.get(), bytes);
    cuda::synchronize(nullptr, "the default stream after a copy");
    expect_zero(g.k.count_mismatches(s, pdst.get(), words, seed_dev), words, "d2d between cuMemAlloc buffers");

    const std::vector<Copy> copies{
        {"h2d", "segment", [&] { cuda::copy_to_device(dseg, hseg, bytes); }},
        {"h2d", "plain", [&] { cuda::copy_to_device(pdst.get(), phost.get(), bytes); }},
        {"d2h", "segment", [&] { cuda::copy_to_host(hseg, sseg, bytes); }},
        {"d2h", "plain", [&] { cuda::copy_to_host(phost.get(), psrc.get(), bytes); }},
        {"d2d", "segment", [&] { cuda::copy_device_to_device(dseg, sseg, bytes); }},
        {"d2d", "plain", [&] { cuda::copy_device_to_device(pdst.get(), psrc.get(), bytes); }},
    };
    us = time_copies(copies, warmup, runs);

    // Peer copies: GPU 1 and a device segment of GPU 0 that B opens for GPU 1.
    const int devices = cuda::device_count();
    out["devices"] = devices;
    if (devices >= 2) {
      const auto peers = cuda::peer_access_matrix();
      const bool can = peers.size() >= 2 && peers[1].size() >= 1 && peers[1][0] && peers[0].size() >= 2 && peers[0][1];
      out["peer_access"] = can;
      if (can) {
        cuda::PrimaryContext ctx1(1);
        cuda::ScopedContext scope(ctx1.get());
        Segment src1 = Segment::open(names.src, {.device = 1});
        Segment dst1 = Segment::open(names.dst, {.device = 1});
        // Plain baseline: peer access between the two contexts, as a user of cuMemAlloc would enable it.
        cuda::enable_peer_access(g.ctx.get());
        auto stream1 = cuda::Stream::create();
        kernels::Kernels k1;
        auto buf1 = cuda::DeviceBuffer::allocate(bytes);
        const CUdeviceptr s1 = src1.device_pointer(), d1 = dst1.device_pointer();
        // Check: GPU 0 memory read from GPU 1 through the segment, and through plain peer access.
        cuda::copy_device_to_device(buf1.get(), s1, bytes);
        cuda::synchronize(nullptr, "the default stream after a copy");
        expect_zero(k1.count_mismatches(stream1.get(), buf1.get(), words, seed_dev), words, "p2p from the segment");
        cuda::copy_device_to_device(buf1.get(), psrc.get(), bytes);
        cuda::synchronize(nullptr, "the default stream after a copy");
        expect_zero(k1.count_mismatches(stream1.get(), buf1.get(), words, seed_dev), words, "p2p from cuMemAlloc memory");
        const std::vector<Copy> peer{
            {"p2p_out", "segment", [&] { cuda::copy_device_to_device(buf1.get(), s1, bytes); }},
            {"p2p_out", "plain", [&] { cuda::copy_device_to_device(buf1.get(), psrc.get(), bytes); }},
            {"p2p_in", "segment", [&] { cuda::copy_device_to_device(d1, buf1.get(), bytes); }},
            {"p2p_in", "plain", [&] { cuda::copy_device_to_device(pdst.get(), buf1.get(), bytes); }},
        };
        auto pus = time_copies(peer, warmup, runs);
        us.insert(pus.begin(), pus.end());
        stream1.synchronize();
      }
    }
    g.stream.synchronize();
  }  // B's mappings are gone before A unlinks
  link.send({{"done", true}});
  json t = json::object();
  for (const auto& [key, v] : us) t[key] = values_json(v);
  out["us"] = std::move(t);
  return out;
}

Result run_transfer(const Options& options, const DeviceMeta& meta) {
  const std::size_t bytes = options.quick ? 64 * kMiB : 256 * kMiB;
  const int warmup = 2, runs = 10;
  const std::uint64_t seed_dev = static_cast<std::uint64_t>(now_ns()) | 1U;
  const std::uint64_t seed_host = seed_dev * 0x9E3779B97F4A7C15ULL + 7;
  const std::string prefix = fmt::format("gpuipc-bench-transfer-{}-{}", ::getpid(), now_ns() % 1'000'000);
  const Names names{prefix + "-src", prefix + "-dst", prefix + "-host"};
  const auto timeout = std::chrono::seconds(options.quick ? 120 : 300);

  Result result;
  result.mps = meta.mps;
  progress(options, fmt::format("transfer: h2d, d2h, d2d copies of {} MiB, segments vs plain allocations", bytes / kMiB));
  std::pair<json, json> reports;
  try {
    reports = kPair.run([&](const Link& l) { return exporter(l, names, bytes, seed_dev, seed_host); },
                       [&](const Link& l) { return importer(l, names, bytes, seed_dev, seed_host, warmup, runs); },
                       timeout, true);
  } catch (...) {
    for (const auto* n : {&names.src, &names.dst, &names.host}) {
      try {
        Segment::unlink(*n);
      } catch (...) {
      }
    }
    throw;
  }
  const json& b = reports.second;
  std::map<std::string, double> gbs;
  for (const auto& [key, values] : b.at("us").items()) {
    const auto slash = key.find('/');
    const std::string dir = key.substr(0, slash), kind = key.substr(slash + 1);
    std::vector<double> us, g;
    for (const auto& x : values) {
      const double t = x.get<double>();
      us.push_back(t);
      g.push_back(t > 0 ? static_cast<double>(bytes) / (t * 1e-6) / 1e9 : 0.0);
    }
    const auto sg = summarize(g);
    gbs[key] = sg.median;
    result.metrics[fmt::format("{}_gbs_{}", dir, kind)] = sg.median;
    json smp{{"name", "transfer"}, {"dir", dir}, {"kind", kind}, {"bytes", bytes}, {"unit", "GB/s"}};
    smp.update(to_json(sg));
    smp["us"] = to_json(summarize(us));
    smp["values_us"] = values;
    result.samples.push_back(std::move(smp));
  }
  auto& notes = result.notes;
  const std::map<std::string, std::string> what{
      {"h2d", "host -> device (host_pinned segment -> device segment; cuMemHostAlloc -> cuMemAlloc)"},
      {"d2h", "device -> host (device segment -> host_pinned segment; cuMemAlloc -> cuMemHostAlloc)"},
      {"d2d", "device -> device on one GPU (segment -> segment; cuMemAlloc -> cuMemAlloc)"},
      {"p2p_out", "GPU 0 -> GPU 1 (device segment of GPU 0 opened for GPU 1 -> cuMemAlloc on GPU 1; peer cuMemAlloc)"},
      {"p2p_in", "GPU 1 -> GPU 0 (cuMemAlloc on GPU 1 -> device segment of GPU 0 opened for GPU 1; peer cuMemAlloc)"}};
  double worst = 1.0;
  std::string worst_dir;
  for (const char* dir : {"h2d", "d2h", "d2d", "p2p_out", "p2p_in"}) {
    const std::string ks = std::string(dir) + "/segment", kp = std::string(dir) + "/plain";
    if (gbs.count(ks) == 0 || gbs.count(kp) == 0) continue;
    const double r = gbs[kp] > 0 ? gbs[ks] / gbs[kp] : 0.0;
    result.metrics[fmt::format("{}_ratio", dir)] = r;
    if (std::abs(r - 1.0) > std::abs(worst - 1.0)) {
      worst = r;
      worst_dir = dir;
    }
    notes.push_back(fmt::format("{}, {} MiB: segment {:.1f} GB/s, plain {:.1f} GB/s ({:.3f}x).", what.at(dir),
                                bytes / kMiB, gbs[ks], gbs[kp], r));
  }
  const int devices = b.value("devices", 1);
  if (devices < 2) {
    notes.push_back("one GPU: no peer copies");
  } else if (!b.value("peer_access", false)) {
    notes.push_back(fmt::format("{} GPUs without peer access between GPU 0 and GPU 1: no peer copies", devices));
  }
  notes.push_back(std::abs(worst - 1.0) <= 0.05
                      ? fmt::format("Verdict: copies into and out of segments run at the speed of plain allocations "
                                    "(every ratio within 5%; the furthest {:.3f}x{}).",
                                    worst, worst_dir.empty() ? "" : " (" + worst_dir + ")")
                      : fmt::format("Verdict: {} through segments runs at {:.3f}x plain: more than 5% off.", worst_dir, worst));
  notes.push_back(fmt::format("Method: median of {} synchronous copies after {} warm-up copies, segment and plain "
                              "interleaved, each timed with the host clock up to a synchronisation of the default "
                              "stream (includes ~10 us of call overhead, the same on both sides).",
                              runs, warmup));
  return result;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{
    .name = "transfer",
    .description = "H2D, D2H, D2D (and peer) copy bandwidth into/out of segments vs plain allocations",
    .needs_gpu = true,
    .run = run_transfer,
});

}  // namespace gpuipc::bench
