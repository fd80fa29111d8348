// The `multigpu` suite (issue 15): two GPUs of one node, each figure beside its baseline in the same run.
//   - Peer bandwidth: process A makes a device segment on GPU 1; process B maps it from GPU 0 and reads and writes
//     it by a kernel and by the copy engine (cuMemcpyAsync), beside cuMemcpyPeerAsync between B's own buffers on
//     the two GPUs, and a kernel over B's own cuMemAlloc memory of GPU 1 (peer access enabled): what torch's peer
//     copy and a raw peer kernel get.
//   - Handoff round trip over a channel whose producer is on GPU 1 and consumer on GPU 0, beside both on GPU 0.
//   - 8 MiB frames streamed from a producer on GPU 1 to a consumer on GPU 0, beside both on GPU 0.
// With fewer than two GPUs the suite is skipped (Suite::min_gpus). Never touches NVLink multicast.
#include <fmt/format.h>

#include <map>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cuda/context.hpp"
#include "cuda/driver.hpp"
#include "cuda/stream_ops.hpp"
#include "gpu.hpp"
#include "gpuipc/segment.hpp"
#include "handoff.hpp"
#include "streaming.hpp"
#include "sync.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/events.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

constexpr int kOwnerGpu = 1;   // where the segment lives (process A)
constexpr int kReaderGpu = 0;  // where the kernels and copies run (process B)
/// Launches or copies between the two events of one sample (the host's launch latency is paid once per sample).
constexpr int kOpsPerSample = 5;

/// The paths measured, in the order of the samples and the JSON keys ("<key>_ms").
const std::vector<std::string> kPaths = {
    "segment_read_kernel",  "segment_write_kernel",  "segment_read_copy",  "segment_write_copy",
    "raw_peer_read_kernel", "raw_peer_write_kernel", "memcpy_peer_read",   "memcpy_peer_write",
    "local_read_kernel",    "local_write_kernel",
};

void check_cuda(CUresult r, const char* call) { cuda::check(r, call, "multigpu bench"); }

/// B's side: GPU 0 maps A's segment on GPU 1 and times every path, interleaved run by run (the order rotates, so
/// no path always follows the same one). Milliseconds per operation.
json measure_peer(const std::string& name, std::uint64_t seed, std::size_t bytes, int warmup, int runs) {
  Gpu g(kReaderGpu);
  const CUstream s = g.stream.get();
  Segment seg = Segment::open(name, {.access = Access::ReadWrite, .wait = {}, .device = kReaderGpu});
  if (seg.device() != kReaderGpu || seg.size() < bytes) {
    throw Error(ErrorCode::Protocol, fmt::format("multigpu: segment '{}' is mapped by GPU {} with {} bytes", name,
                                                 seg.device(), seg.size()));
  }
  const CUdeviceptr remote = seg.device_pointer();
  if (const auto bad = g.k.count_mismatches(s, remote, bytes / 4, seed); bad != 0) {
    throw Error(ErrorCode::Protocol,
                fmt::format("multigpu: {} words of GPU 1's segment read from GPU 0 differ from what A wrote", bad));
  }
  auto local = cuda::DeviceBuffer::allocate(bytes);
  auto sums = cuda::DeviceBuffer::allocate(sizeof(std::uint64_t));
  // The baselines' memory on GPU 1: B's own cuMemAlloc, peer access enabled both ways (what cuMemcpyPeer and a
  // framework's peer copy use).
  cuda::PrimaryContext owner_ctx(kOwnerGpu);
  cuda::DeviceBuffer theirs;
  {
    cuda::ScopedContext scope(owner_ctx.get());
    theirs = cuda::DeviceBuffer::allocate(bytes);
    cuda::enable_peer_access(g.ctx.get());
  }
  cuda::enable_peer_access(owner_ctx.get());
  const cuda::DriverApi& api = cuda::driver();
  if (api.cuMemcpyPeerAsync == nullptr) throw Error(ErrorCode::Unsupported, "the driver lacks cuMemcpyPeerAsync");
  const CUcontext here = g.ctx.get();
  const CUcontext there = owner_ctx.get();
  const CUdeviceptr out = sums.get();
  const std::size_t vec16 = bytes / 16;
  std::map<std::string, std::function<void()>> op{
      {"segment_read_kernel", [&] { g.k.read_sum(s, remote, vec16, out); }},
      {"segment_write_kernel", [&] { g.k.write_fill(s, remote, vec16, 0x5a5aa5a5U); }},
      {"segment_read_copy", [&] { check_cuda(cuda::copy_async(local.get(), remote, bytes, s), "cuMemcpyAsync"); }},
      {"segment_write_copy", [&] { check_cuda(cuda::copy_async(remote, local.get(), bytes, s), "cuMemcpyAsync"); }},
      {"raw_peer_read_kernel", [&] { g.k.read_sum(s, theirs.get(), vec16, out); }},
      {"raw_peer_write_kernel", [&] { g.k.write_fill(s, theirs.get(), vec16, 0x5a5aa5a5U); }},
      {"memcpy_peer_read",
       [&] { check_cuda(api.cuMemcpyPeerAsync(local.get(), here, theirs.get(), there, bytes, s), "cuMemcpyPeerAsync"); }},
      {"memcpy_peer_write",
       [&] { check_cuda(api.cuMemcpyPeerAsync(theirs.get(), there, local.get(), here, bytes, s), "cuMemcpyPeerAsync"); }},
      {"local_read_kernel", [&] { g.k.read_sum(s, local.get(), vec16, out); }},
      {"local_write_kernel", [&] { g.k.write_fill(s, local.get(), vec16, 0x5a5aa5a5U); }},
  };
  const auto start = cuda::Event::create();
  const auto end = cuda::Event::create();
  auto timed = [&](const std::function<void()>& f) {
    start.record(s);
    for (int i = 0; i < kOpsPerSample; ++i) f();
    end.record(s);
    end.synchronize();
    return static_cast<double>(cuda::Event::elapsed_ms(start, end)) / kOpsPerSample;
  };
  std::map<std::string, std::vector<double>> ms;
  for (int r = 0; r < warmup + runs; ++r) {
    for (std::size_t i = 0; i < kPaths.size(); ++i) {
      const std::string& path = kPaths[(i + static_cast<std::size_t>(r)) % kPaths.size()];
      const double t = timed(op.at(path));
      if (r >= warmup) ms[path].push_back(t);
    }
  }
  g.stream.synchronize();
  json report = {{"bytes", bytes}, {"ops_per_sample", kOpsPerSample}};
  for (const auto& path : kPaths) report[path + "_ms"] = ms[path];
  return report;
}

/// A: the segment on GPU 1, filled with `seed`, kept until B is done.
json peer_bandwidth(std::size_t bytes, int warmup, int runs) {
  const SyncPage page;
  Sync* sync = page.get();
  const std::string name = unique("mgpu-bw");
  const std::uint64_t seed = static_cast<std::uint64_t>(now_ns()) | 1U;
  std::vector<Worker> workers;
  workers.push_back(spawn_synced(sync, [&]() -> json {
    Gpu g(kOwnerGpu);
    Segment seg = Segment::create(name, bytes, {.kind = SegmentKind::Device, .device = kOwnerGpu, .mode = 0600});
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), bytes / 4, seed);
    g.stream.synchronize();
    sync->a_ready = 1;
    sync->await([&] { return sync->b_ready.load() == 1; }, "the reader on GPU 0", std::chrono::seconds(600),
                std::chrono::microseconds(1000));
    return json::object();
  }));
  workers.push_back(spawn_synced(sync, [&]() -> json {
    sync->await([&] { return sync->a_ready.load() == 1; }, "the segment on GPU 1", std::chrono::seconds(120),
                std::chrono::microseconds(1000));
    json r = measure_peer(name, seed, bytes, warmup, runs);
    sync->b_ready = 1;
    return r;
  }));
  const json b = join_worker(workers[1], std::chrono::seconds(900));
  const json a = join_worker(workers[0], std::chrono::seconds(60));
  try {
    Segment::unlink(name);
  } catch (const Error&) {  // NOLINT(bugprone-empty-catch): A may not have made it; its error is the one to report
  }
  for (const json* w : {&a, &b}) {
    if (w->contains("error")) throw Error(ErrorCode::System, fmt::format("multigpu: {}", (*w)["error"].dump()));
  }
  return b;
}

Result run_multigpu(const Options& options, const DeviceMeta& meta) {
  Result result;
  result.mps = meta.mps;
  const std::size_t bytes = options.quick ? (256ULL << 20) : (1ULL << 30);
  const int warmup = options.quick ? 2 : 5;
  const int runs = options.quick ? 10 : 40;

  progress(options, "multigpu: bandwidth through a segment of GPU 1 mapped from GPU 0, beside cuMemcpyPeer");
  const json bw = peer_bandwidth(bytes, warmup, runs);
  std::map<std::string, Summary> gbs;
  for (const auto& path : kPaths) {
    const auto ms = values_of(bw, (path + "_ms").c_str());
    const auto v = gbs_of(ms, static_cast<double>(bytes));
    gbs[path] = summarize(v);
    result.samples.push_back(sample(path + "_gbs", "GB/s", v,
                                    {{"bytes", bytes}, {"ms", to_json(summarize(ms))},
                                     {"ops_per_sample", kOpsPerSample},
                                     {"what", "1e9 bytes per second; events around back-to-back operations on GPU 0"}}));
  }
  auto med = [&](const char* path) { return gbs.at(path).median; };
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  auto& m = result.metrics;
  m["peer_read_gbs_kernel"] = med("segment_read_kernel");
  m["peer_write_gbs_kernel"] = med("segment_write_kernel");
  m["peer_read_gbs_copy"] = med("segment_read_copy");
  m["peer_write_gbs_copy"] = med("segment_write_copy");
  // The headline figures: the faster of the two ways through a segment, against the faster of the two ways on raw
  // peer memory of the same run (a kernel against cuMemcpyPeer alone would hide a segment's cost where kernels win).
  // The per-way ratios below compare like with like.
  const double read = std::max(med("segment_read_kernel"), med("segment_read_copy"));
  const double write = std::max(med("segment_write_kernel"), med("segment_write_copy"));
  m["peer_read_gbs"] = read;
  m["peer_write_gbs"] = write;
  m["memcpy_peer_read_gbs"] = med("memcpy_peer_read");
  m["memcpy_peer_write_gbs"] = med("memcpy_peer_write");
  m["peer_read_ratio"] = ratio(read, std::max(med("raw_peer_read_kernel"), med("memcpy_peer_read")));
  m["peer_write_ratio"] = ratio(write, std::max(med("raw_peer_write_kernel"), med("memcpy_peer_write")));
  m["peer_read_copy_ratio"] = ratio(med("segment_read_copy"), med("memcpy_peer_read"));
  m["peer_write_copy_ratio"] = ratio(med("segment_write_copy"), med("memcpy_peer_write"));
  m["raw_peer_read_gbs_kernel"] = med("raw_peer_read_kernel");
  m["raw_peer_write_gbs_kernel"] = med("raw_peer_write_kernel");
  m["peer_read_kernel_ratio"] = ratio(med("segment_read_kernel"), med("raw_peer_read_kernel"));
  m["peer_write_kernel_ratio"] = ratio(med("segment_write_kernel"), med("raw_peer_write_kernel"));
  m["local_read_gbs"] = med("local_read_kernel");
  m["local_write_gbs"] = med("local_write_kernel");

  const int handoffs = options.quick ? 500 : 5000;
  progress(options, "multigpu: 1 MiB handoff round trips, producer on GPU 1 and consumer on GPU 0");
  const json x = handoff_rtt(1 << 20, handoffs, SegmentKind::Device, true, {.producer = kOwnerGpu, .consumer = kReaderGpu});
  progress(options, "multigpu: 1 MiB handoff round trips, both on GPU 0");
  const json same = handoff_rtt(1 << 20, handoffs, SegmentKind::Device, true, {.producer = 0, .consumer = 0});
  m["xgpu_handoff_rtt_p50_us"] = x["rtt_us"]["median"];
  m["xgpu_handoff_rtt_p99_us"] = x["rtt_us"]["p99"];
  m["same_gpu_handoff_rtt_p50_us"] = same["rtt_us"]["median"];
  m["same_gpu_handoff_rtt_p99_us"] = same["rtt_us"]["p99"];
  result.samples.push_back({{"what", "xgpu_handoff_rtt_us_1MiB"}, {"summary", x["rtt_us"]}, {"producer_gpu", kOwnerGpu},
                            {"consumer_gpu", kReaderGpu}, {"iterations", handoffs}});
  result.samples.push_back({{"what", "same_gpu_handoff_rtt_us_1MiB"}, {"summary", same["rtt_us"]},
                            {"producer_gpu", 0}, {"consumer_gpu", 0}, {"iterations", handoffs}});

  const int frames = options.quick ? 2000 : 10000;
  const int repeats = options.quick ? 1 : 3;
  std::vector<double> xgpu_gbs, same_gbs;
  for (int r = 0; r < repeats; ++r) {  // alternated, so that neither always runs on a warmer machine
    progress(options, fmt::format("multigpu: 8 MiB frames GPU 1 -> GPU 0, run {} of {}", r + 1, repeats));
    const double xf = channel_stream({}, frames, kStreamSlots, {.gpus = {.producer = kOwnerGpu, .consumer = kReaderGpu}})["fps"]
                          .get<double>();
    const double sf =
        channel_stream({}, frames, kStreamSlots, {.gpus = {.producer = 0, .consumer = 0}})["fps"].get<double>();
    xgpu_gbs.push_back(xf * static_cast<double>(kFrameBytes) / 1e9);
    same_gbs.push_back(sf * static_cast<double>(kFrameBytes) / 1e9);
  }
  const Summary xs = summarize(xgpu_gbs);
  const Summary ss = summarize(same_gbs);
  m["xgpu_stream_gbs"] = xs.median;
  m["same_gpu_stream_gbs"] = ss.median;
  m["xgpu_stream_ratio"] = ratio(xs.median, ss.median);
  result.samples.push_back(sample("xgpu_stream_gbs", "GB/s", xgpu_gbs,
                                  {{"frames", frames}, {"frame_bytes", kFrameBytes}, {"slots", kStreamSlots},
                                   {"producer_gpu", kOwnerGpu}, {"consumer_gpu", kReaderGpu}}));
  result.samples.push_back(sample("same_gpu_stream_gbs", "GB/s", same_gbs,
                                  {{"frames", frames}, {"frame_bytes", kFrameBytes}, {"slots", kStreamSlots},
                                   {"producer_gpu", 0}, {"consumer_gpu", 0}}));

  auto verdict = [](bool ok) { return ok ? "holds" : "FAILS"; };
  auto& notes = result.notes;
  notes.push_back(fmt::format(
      "Peer read of a segment of GPU 1 from GPU 0 ({} MiB): kernel {:.0f} GB/s, copy engine {:.0f} GB/s; "
      "cuMemcpyPeer of the same bytes {:.0f} GB/s; a kernel over cuMemAlloc memory of GPU 1 {:.0f} GB/s; GPU 0's "
      "own memory {:.0f} GB/s. Target peer_read_ratio >= 0.95 {}: {:.3f}.",
      bytes >> 20, med("segment_read_kernel"), med("segment_read_copy"), med("memcpy_peer_read"),
      med("raw_peer_read_kernel"), med("local_read_kernel"), verdict(m["peer_read_ratio"].get<double>() >= 0.95),
      m["peer_read_ratio"].get<double>()));
  notes.push_back(fmt::format(
      "Peer write: kernel {:.0f} GB/s, copy engine {:.0f} GB/s; cuMemcpyPeer {:.0f} GB/s; raw peer kernel {:.0f} "
      "GB/s. Target peer_write_ratio >= 0.95 {}: {:.3f}.",
      med("segment_write_kernel"), med("segment_write_copy"), med("memcpy_peer_write"), med("raw_peer_write_kernel"),
      verdict(m["peer_write_ratio"].get<double>() >= 0.95), m["peer_write_ratio"].get<double>()));
  notes.push_back(fmt::format(
      "A 1 MiB handoff round trip across GPUs (producer GPU 1, consumer GPU 0) takes {:.1f} us (p99 {:.1f}), "
      "{:.1f} us (p99 {:.1f}) with both on GPU 0. 8 MiB frames from GPU 1 to GPU 0: {:.1f} GB/s, {:.1f} GB/s on "
      "one GPU ({:.2f}x).",
      m["xgpu_handoff_rtt_p50_us"].get<double>(), m["xgpu_handoff_rtt_p99_us"].get<double>(),
      m["same_gpu_handoff_rtt_p50_us"].get<double>(), m["same_gpu_handoff_rtt_p99_us"].get<double>(), xs.median,
      ss.median, m["xgpu_stream_ratio"].get<double>()));
  return result;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{
    .name = "multigpu",
    .description = "two GPUs: peer bandwidth through a segment vs cuMemcpyPeer; handoff and streaming across GPUs",
    .needs_gpu = true,
    .run = run_multigpu,
    .min_gpus = 2,
});

}  // namespace gpuipc::bench
