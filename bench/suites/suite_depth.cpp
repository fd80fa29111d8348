// The `depth` suite: how close two processes streaming 8 MiB frames through a channel come to one process, by the
// ring's depth, the producer's lead (Channel::set_pacing_ahead), the batch each side takes per wake-up and the
// pacing time; without MPS (the processes' contexts time-slice on the GPU) and under MPS. The channels suite's
// stream_throughput_ratio is one point of this grid (8 slots, default lead, batch 1); this suite looks for the
// shape that amortises what each switch between the two processes costs. GPU timelines (%globaltimer stamps)
// show the switches: stretches over 20 us with neither kernel running.
#include <fmt/format.h>

#include <chrono>
#include <optional>
#include <vector>

#include "bench.hpp"
#include "mps.hpp"
#include "streaming.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

struct Shape {
  std::uint32_t slots;
  std::uint32_t ahead;  // 0: the default
  std::uint32_t batch;
  int pacing_us;        // -1: the default
};

std::string label(const Shape& s) {
  return fmt::format("slots{}_ahead{}_batch{}{}", s.slots, s.ahead == 0 ? std::string("def") : std::to_string(s.ahead),
                     s.batch, s.pacing_us < 0 ? std::string() : fmt::format("_pacing{}us", s.pacing_us));
}

StreamShape stream_shape(const Shape& s, bool timed) {
  StreamShape out{.timed = timed, .batch = s.batch};
  if (s.ahead != 0) out.ahead = s.ahead;
  if (s.pacing_us >= 0) out.pacing = std::chrono::microseconds(s.pacing_us);
  return out;
}

void study(const Options& o, const Env& env, const char* suffix, const std::vector<Shape>& shapes,
           const std::vector<Shape>& timed, Result& r) {
  const int frames = o.quick ? 2000 : 5000;
  const int reps = o.quick ? 1 : 3;
  // The one-process reference (kStreamSlots buffers, ordered by events), alternated with the shapes: its pace drifts.
  std::vector<double> reference;
  json rows = json::object();
  double best = 0;
  std::string best_label;
  for (int rep = 0; rep < reps; ++rep) {
    reference.push_back(local_stream(env, frames, kStreamSlots)["fps"].get<double>());
    for (const Shape& s : shapes) {
      progress(o, fmt::format("depth{}: {} (run {} of {})", suffix, label(s), rep + 1, reps));
      const json run = channel_stream(env, frames, s.slots, stream_shape(s, false));
      json& row = rows[label(s)];
      row["runs"].push_back(run["fps"]);
      row["producer_host"] = run["producer_host"];
      row["consumer_host"] = run["consumer_host"];
    }
  }
  const double ref = summarize(reference).median;
  for (auto& [name, row] : rows.items()) {
    const double fps = summarize(row["runs"].get<std::vector<double>>()).median;
    row["fps"] = fps;
    row["ratio"] = fps / ref;
    if (fps / ref > best) {
      best = fps / ref;
      best_label = name;
    }
  }
  json timelines = json::object();
  for (const Shape& s : timed) {
    progress(o, fmt::format("depth{}: GPU timeline of {}", suffix, label(s)));
    timelines[label(s)] = channel_stream(env, frames, s.slots, stream_shape(s, true));
  }
  r.samples.push_back({{"what", fmt::format("depth{}", suffix)}, {"frames", frames}, {"frame_bytes", kFrameBytes},
                       {"fps_one_process", ref}, {"fps_one_process_runs", reference}, {"result", rows},
                       {"timeline", timelines}});
  const std::string base = label({kStreamSlots, 0, 1, -1});
  if (rows.contains(base)) r.metrics[fmt::format("depth_default_ratio{}", suffix)] = rows[base]["ratio"];
  r.metrics[fmt::format("depth_best_ratio{}", suffix)] = best;
  r.notes.push_back(fmt::format("{}: the default shape ({}) reaches {:.2f} of one process; the best, {}, {:.2f}",
                                *suffix != 0 ? "under MPS" : "without MPS", base,
                                rows.contains(base) ? rows[base]["ratio"].get<double>() : 0.0, best_label, best));
}

Result run(const Options& o, const DeviceMeta& meta) {
  Result r;
  r.mps = meta.mps;
  // Without MPS each switch between the two contexts costs far more than a frame's kernels: more frames per switch.
  // "def": the channel's default lead (the whole ring without MPS, half a ring of 8 or more under MPS).
  const std::vector<Shape> plain = {
      {8, 0, 1, -1},   {8, 4, 1, -1},      {16, 0, 1, -1},       {16, 8, 1, -1},       {32, 0, 1, -1},
      {32, 0, 16, -1}, {64, 0, 1, -1},     {64, 0, 32, -1},      {128, 0, 1, -1},      {128, 0, 64, -1},
      {64, 0, 32, 0},  {64, 0, 32, 2000}};
  study(o, {}, "", plain, {{8, 0, 1, -1}, {64, 0, 32, -1}, {128, 0, 64, -1}}, r);
  progress(o, "depth: the same under MPS");
  const std::vector<Shape> mps = {{8, 0, 1, -1}, {8, 8, 1, -1}, {16, 0, 1, -1}, {32, 0, 8, -1}};
  run_under_mps(r.notes, "_mps samples", [&](const Env& mps_env) {
    study(o, mps_env, "_mps", mps, {{8, 0, 1, -1}}, r);
  });
  return r;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{.name = "depth",
                         .description = "two-process streaming by ring depth, producer lead, batch per wake-up and "
                                        "pacing, against one process; with and without MPS; GPU timelines of the "
                                        "switches between the processes",
                         .needs_gpu = true,
                         .run = run});

}  // namespace gpuipc::bench
