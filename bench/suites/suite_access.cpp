// `gpuipc bench access`: does reaching memory through another process's mapping cost anything? Kernel read and
// write latency and bandwidth over sizes from 4 KiB to 4 GiB, for three kinds of memory, all measured in the same
// process (B) in the same run:
//   local   — cuMemAlloc memory of B;
//   legacy  — cuMemAlloc memory of A, exported with cuIpcGetMemHandle and opened in B with cuIpcOpenMemHandle;
//   segment — a gpuipc device segment created (and filled) by A and opened by name in B.
// Plus the memory a share costs: the drop in B's free GPU memory when it opens the segment and the legacy handle,
// and the allocation granularity a segment's size is rounded up to.
//
// The CLI process never touches CUDA: it forks A and B, connected by a SOCK_SEQPACKET socketpair; each reports one
// JSON object back (bench/harness/workers.hpp). Every wait is bounded; on failure both workers' errors are reported and
// the segment A may have left named is unlinked by the parent (broker only, CUDA-free).
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
#include "cuda/device.hpp"
#include "cuda/legacy_ipc.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "os/fd.hpp"
#include "os/socket.hpp"
#include "pair.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/events.hpp"
#include "testkit/kernels/kernels.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

constexpr int kDevice = 0;

// Two workers and the socket between them: bench/harness/pair.hpp.
using namespace pair;  // NOLINT(google-build-using-namespace): Link, Gpu, kKiB, kMiB, kGiB, size_label, to_hex
const SuitePair kPair{"access"};

// ---------------------------------------------------------------------------------------------------------------
// The measurement.

/// The kinds of memory, in the order of the plots.
constexpr std::array<const char*, 3> kKinds{"local", "legacy", "segment"};

/// Successive launches of one sample rotate through this much of a buffer, so that small sizes are read from HBM,
/// not from the L2 cache (50-60 MB on H100/H200) a previous launch filled.
constexpr std::size_t kWindow = 256 * kMiB;

struct Plan {
  std::vector<std::size_t> sizes;
  int warmup = 3;
  int runs = 15;
};

/// Launches between the two events of one sample: enough to amortise the launch and event overhead at small sizes.
int launches_for(std::size_t size) {
  const std::size_t want = (64 * kMiB + size - 1) / size;
  return static_cast<int>(std::clamp<std::size_t>(want, 5, 200));
}

struct Target {
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  std::uint64_t cursor = 0;  // next region of the rotation
};

/// Milliseconds per launch of `launches` read_sum (or write_fill) kernels over `size` bytes of `t`, timed by
/// events around them. Each launch takes the next `size`-byte region of a window of the buffer.
double timed_ms(Gpu& g, Target& t, bool write, std::size_t size, int launches, const cuda::Event& start,
                const cuda::Event& end, CUdeviceptr sum) {
  if (size > t.bytes || size % 16 != 0) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("bench access: size {} does not fit a {}-byte buffer", size, t.bytes));
  }
  const std::size_t window = std::max(size, std::min(t.bytes, kWindow));
  const std::size_t regions = std::max<std::size_t>(1, window / size);
  const CUstream s = g.stream.get();
  start.record(s);
  for (int i = 0; i < launches; ++i) {
    const CUdeviceptr p = t.base + (t.cursor++ % regions) * size;
    if (write) {
      g.k.write_fill(s, p, size / 16, 0x5a5aa5a5U + static_cast<std::uint32_t>(i));
    } else {
      g.k.read_sum(s, p, size / 16, sum);
    }
  }
  end.record(s);
  end.synchronize();  // a fault in a kernel surfaces here
  return static_cast<double>(cuda::Event::elapsed_ms(start, end)) / launches;
}

/// B's free GPU memory (bytes).
double free_bytes() { return static_cast<double>(cuda::memory_info(kDevice).free); }

/// Worker A: allocates the legacy buffer and the segment, fills both with the pattern, hands them to B, and keeps
/// them alive until B is done.
json exporter(const Link& link, const std::string& segment_name, std::size_t largest, std::uint64_t seed,
              int timeout_ms) {
  Gpu g;
  // Three buffers of `bytes` live at once (A's two, B's local one): shrink the largest size if the GPU lacks room.
  const auto mem = cuda::memory_info(kDevice);
  std::size_t bytes = largest;
  while (bytes > 64 * kMiB && static_cast<double>(3 * bytes) > 0.8 * static_cast<double>(mem.free)) bytes /= 4;
  json out{{"bytes", bytes}, {"free_bytes", mem.free}, {"total_bytes", mem.total}};
  {
    Segment seg = Segment::create(segment_name, bytes, {.kind = SegmentKind::Device, .device = kDevice, .mode = 0600});
    out["segment_size"] = seg.size();
    auto legacy = cuda::DeviceBuffer::allocate(bytes);
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), bytes / 4, seed);
    g.k.fill_pattern(g.stream.get(), legacy.get(), bytes / 4, seed);
    g.stream.synchronize();
    // What a small segment costs: its size is rounded up to the allocation granularity.
    out["granularity_bytes"] = cuda::allocation_granularity(kDevice, false);
    const CUipcMemHandle h = cuda::ipc_get_mem_handle(legacy.get());
    link.send({{"segment", segment_name}, {"handle", to_hex(&h, sizeof h)}, {"bytes", bytes}});
    link.receive(timeout_ms);  // B is done and has closed its mappings
    Segment::unlink(segment_name);
  }
  return out;
}

/// Worker B: opens A's memory, allocates its own, checks all three hold the pattern, then measures.
json importer(const Link& link, const Plan& plan, std::uint64_t seed) {
  Gpu g;
  const json in = link.receive(120'000);  // A's context, allocations and fills come first
  const auto bytes = in.at("bytes").get<std::size_t>();
  json out = json::object();
  json samples = json::array();
  {
    const double free0 = free_bytes();
    Segment seg = Segment::open(in.at("segment").get<std::string>());
    const double free1 = free_bytes();
    if (!seg || seg.kind() != SegmentKind::Device || seg.device_pointer() == 0 || seg.size() < bytes) {
      throw Error(ErrorCode::Protocol, "bench access: the segment did not open as a mapped device segment of the size A made");
    }
    CUipcMemHandle h{};
    kPair.from_hex(in.at("handle").get<std::string>(), &h, sizeof h);
    auto legacy = cuda::IpcMapping::open(h);
    const double free2 = free_bytes();
    auto local = cuda::DeviceBuffer::allocate(bytes);
    const double free3 = free_bytes();
    out["open_free_drop_bytes_segment"] = free0 - free1;
    out["open_free_drop_bytes_legacy"] = free1 - free2;
    out["alloc_free_drop_bytes_local"] = free2 - free3;
    g.k.fill_pattern(g.stream.get(), local.get(), bytes / 4, seed);
    g.stream.synchronize();

    std::map<std::string, Target> targets{{"local", {local.get(), bytes, 0}},
                                          {"legacy", {legacy.get(), bytes, 0}},
                                          {"segment", {seg.device_pointer(), bytes, 0}}};
    // The pattern A wrote is what B reads through both mappings (and its own copy is right too).
    for (const auto& [kind, t] : targets) {
      if (const auto bad = g.k.count_mismatches(g.stream.get(), t.base, bytes / 4, seed); bad != 0) {
        throw Error(ErrorCode::Protocol, fmt::format("bench access: {} of {} words of the {} buffer read in B differ from "
                                                     "the pattern written",
                                                     bad, bytes / 4, kind));
      }
    }
    auto sum = cuda::DeviceBuffer::allocate(sizeof(std::uint64_t));
    cuda::memset_d8(sum.get(), 0, sizeof(std::uint64_t));
    const auto start = cuda::Event::create();
    const auto end = cuda::Event::create();
    for (const std::size_t size : plan.sizes) {
      if (size > bytes) continue;  // A shrank the buffers to fit the GPU
      const int launches = launches_for(size);
      for (const bool write : {false, true}) {
        std::map<std::string, std::vector<double>> ms;
        for (int w = 0; w < plan.warmup; ++w) {
          for (const char* kind : kKinds) timed_ms(g, targets[kind], write, size, launches, start, end, sum.get());
        }
        for (int r = 0; r < plan.runs; ++r) {
          for (std::size_t j = 0; j < kKinds.size(); ++j) {  // rotate the order: no kind always runs first
            const char* kind = kKinds[(j + static_cast<std::size_t>(r)) % kKinds.size()];
            ms[kind].push_back(timed_ms(g, targets[kind], write, size, launches, start, end, sum.get()));
          }
        }
        for (const char* kind : kKinds) {
          std::vector<double> us, gbs;
          for (double m : ms[kind]) {
            us.push_back(m * 1e3);
            gbs.push_back(m > 0 ? static_cast<double>(size) / (m * 1e-3) / 1e9 : 0.0);
          }
          json s{{"name", "access"},
                 {"kind", kind},
                 {"op", write ? "write" : "read"},
                 {"size_bytes", size},
                 {"label", size_label(size)},
                 {"launches_per_sample", launches},
                 {"latency_us", to_json(summarize(us))},
                 {"bw_gbs", to_json(summarize(gbs))}};
          samples.push_back(std::move(s));
        }
      }
    }
    g.stream.synchronize();
  }  // B's mappings and buffers are released before A may free its memory
  link.send({{"done", true}});
  out["samples"] = std::move(samples);
  return out;
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

Result run_access(const Options& options, const DeviceMeta& meta) {
  Plan plan;
  if (options.quick) {
    plan.sizes = {4 * kKiB, 64 * kKiB, 1 * kMiB, 16 * kMiB, 256 * kMiB, 1 * kGiB};
    plan.warmup = 2;
    plan.runs = 10;
  } else {
    for (std::size_t s = 4 * kKiB; s <= 4 * kGiB; s *= 4) plan.sizes.push_back(s);
    plan.warmup = 3;
    plan.runs = 30;
  }
  const std::size_t largest = plan.sizes.back();
  const std::uint64_t seed = static_cast<std::uint64_t>(now_ns()) | 1U;
  const std::string name = fmt::format("gpuipc-bench-access-{}-{}", ::getpid(), now_ns() % 1'000'000);
  const auto timeout = std::chrono::seconds(options.quick ? 120 : 300);
  const int wait_ms = static_cast<int>(timeout.count()) * 1000;

  Result result;
  result.mps = meta.mps;
  progress(options, fmt::format("access: exporter (A) and importer (B) processes, {} sizes x 3 kinds x read/write",
                                plan.sizes.size()));
  std::pair<json, json> reports;
  try {
    reports = kPair.run([&](const Link& l) { return exporter(l, name, largest, seed, wait_ms); },
                       [&](const Link& l) { return importer(l, plan, seed); }, timeout, true);
  } catch (...) {
    try {
      Segment::unlink(name);
    } catch (...) {
    }
    throw;
  }
  const json& a = reports.first;
  const json& b = reports.second;
  const auto bytes = a.at("bytes").get<std::size_t>();

  // median[op][kind][label] -> summaries
  std::map<std::string, std::map<std::string, std::map<std::string, json>>> lat, bw;
  std::vector<std::string> labels;
  for (const auto& s : b.at("samples")) {
    const auto op = s.at("op").get<std::string>(), kind = s.at("kind").get<std::string>();
    const auto label = s.at("label").get<std::string>();
    lat[op][kind][label] = s.at("latency_us");
    bw[op][kind][label] = s.at("bw_gbs");
    if (std::find(labels.begin(), labels.end(), label) == labels.end()) labels.push_back(label);
    result.samples.push_back(s);
  }
  auto med = [](const json& j) { return j.is_object() ? j.value("median", 0.0) : 0.0; };
  const std::string small = "4KiB", big = "1GiB";
  for (const char* op : {"read", "write"}) {
    for (const char* kind : kKinds) {
      result.metrics[fmt::format("{}_latency_us_{}_{}", op, kind, small)] = med(lat[op][kind][small]);
      if (bw[op][kind].count(big) != 0) result.metrics[fmt::format("{}_bw_gbs_{}_{}", op, kind, big)] = med(bw[op][kind][big]);
    }
    for (const char* kind : {"segment", "legacy"}) {
      if (bw[op][kind].count(big) != 0) {
        result.metrics[fmt::format("{}_bw_ratio_{}_{}", op, kind, big)] =
            ratio(med(bw[op][kind][big]), med(bw[op]["local"][big]));
      }
      result.metrics[fmt::format("{}_latency_ratio_{}_{}", op, kind, small)] =
          ratio(med(lat[op][kind][small]), med(lat[op]["local"][small]));
    }
  }
  const double drop_seg = b.value("open_free_drop_bytes_segment", 0.0);
  const double drop_legacy = b.value("open_free_drop_bytes_legacy", 0.0);
  const double drop_local = b.value("alloc_free_drop_bytes_local", 0.0);
  result.metrics["open_mem_overhead_mib_segment"] = drop_seg / static_cast<double>(kMiB);
  result.metrics["open_mem_overhead_mib_legacy"] = drop_legacy / static_cast<double>(kMiB);
  result.metrics["segment_granularity_bytes"] = a.value("granularity_bytes", 0);
  result.samples.push_back({{"name", "memory"},
                            {"buffer_bytes", bytes},
                            {"segment_size_bytes", a.value("segment_size", 0)},
                            {"granularity_bytes", a.value("granularity_bytes", 0)},
                            {"gpu_free_bytes_in_A", a.value("free_bytes", 0)},
                            {"gpu_total_bytes", a.value("total_bytes", 0)},
                            {"open_free_drop_bytes_segment", drop_seg},
                            {"open_free_drop_bytes_legacy", drop_legacy},
                            {"alloc_free_drop_bytes_local", drop_local},
                            {"what", "drop of cuMemGetInfo free memory in B around opening A's segment, opening A's "
                                     "legacy handle, and allocating B's own buffer of the same size"}});

  // ---- notes (every figure from this run) ----
  auto& notes = result.notes;
  if (bytes < largest) {
    notes.push_back(fmt::format("The GPU had room for 3 x {} only (free {:.1f} GiB): sizes above {} were skipped.",
                                size_label(bytes), a.value("free_bytes", 0.0) / static_cast<double>(kGiB), size_label(bytes)));
  }
  for (const char* op : {"read", "write"}) {
    if (bw[op]["local"].count(big) != 0) {
      notes.push_back(fmt::format(
          "{} bandwidth at {}: local {:.0f} GB/s, legacy IPC {:.0f} GB/s ({:.3f}x local), gpuipc segment {:.0f} GB/s "
          "({:.3f}x local).",
          op, big, med(bw[op]["local"][big]), med(bw[op]["legacy"][big]), ratio(med(bw[op]["legacy"][big]), med(bw[op]["local"][big])),
          med(bw[op]["segment"][big]), ratio(med(bw[op]["segment"][big]), med(bw[op]["local"][big]))));
    }
    notes.push_back(fmt::format(
        "{} of {} (per launch, {} launches back to back per timed sample): local {:.2f} us, legacy IPC {:.2f} us, "
        "segment {:.2f} us.",
        op, small, launches_for(4 * kKiB), med(lat[op]["local"][small]), med(lat[op]["legacy"][small]),
        med(lat[op]["segment"][small])));
  }
  // Worst ratio over every size, each way.
  double worst = 1.0;
  std::string worst_what;
  for (const char* op : {"read", "write"}) {
    for (const char* kind : {"segment", "legacy"}) {
      double lo = 1e9, hi = 0;
      for (const auto& label : labels) {
        const double r = ratio(med(bw[op][kind][label]), med(bw[op]["local"][label]));
        if (r <= 0) continue;
        lo = std::min(lo, r);
        hi = std::max(hi, r);
        if (std::abs(r - 1.0) > std::abs(worst - 1.0)) {
          worst = r;
          worst_what = fmt::format("{} {} at {}", kind, op, label);
        }
      }
      if (hi > 0) {
        notes.push_back(fmt::format("Over all {} sizes, {} {} bandwidth is {:.3f}x to {:.3f}x local.", labels.size(),
                                    kind == std::string("segment") ? "gpuipc segment" : "legacy IPC", op, lo, hi));
      }
    }
  }
  notes.push_back(fmt::format(
      "Memory: opening A's {} segment lowered B's free GPU memory by {:.1f} MiB, opening the legacy handle by {:.1f} "
      "MiB, while B's own cuMemAlloc of the same size took {:.1f} MiB: a share maps the exporter's memory, it does not "
      "copy it. A segment's size is rounded up to {} KiB (the allocation granularity), so a tiny segment costs that much.",
      size_label(bytes), drop_seg / static_cast<double>(kMiB), drop_legacy / static_cast<double>(kMiB),
      drop_local / static_cast<double>(kMiB), a.value("granularity_bytes", 0) / 1024));
  if (std::abs(worst - 1.0) <= 0.05) {
    notes.push_back(fmt::format("Verdict: sharing adds no bandwidth overhead beyond 5% at any size (the largest deviation "
                                "is {:.3f}x local, {}).",
                                worst, worst_what.empty() ? "none" : worst_what));
  } else {
    notes.push_back(fmt::format("Verdict: the largest deviation from local bandwidth is {:.3f}x ({}): more than 5%; "
                                "compare it with the spread of repeated local samples in `samples` before calling it "
                                "overhead.",
                                worst, worst_what));
  }
  notes.push_back(fmt::format("Method: {} timed samples after {} warm-up samples per (kind, size, op), kinds "
                              "interleaved; launches rotate through a {} MiB window of each buffer so that sizes "
                              "under the L2 cache are read from HBM; bandwidth is bytes/time in 1e9 bytes/s.",
                              plan.runs, plan.warmup, kWindow / kMiB));
  return result;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{
    .name = "access",
    .description = "kernel read/write latency and bandwidth, 4 KiB-4 GiB: local vs legacy IPC vs gpuipc segment",
    .needs_gpu = true,
    .run = run_access,
});

}  // namespace gpuipc::bench
