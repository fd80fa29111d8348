// `gpuipc bench weights` (issue 13): model weights handed between PyTorch processes with gpuipc's Python API — a
// state dict born in a gpuipc.torch.MemPool opened by a fresh process, a versioned update seen by a reader, a dict
// streamed through buckets — each beside what is done without it, measured in the same run: torch.multiprocessing
// (bench/analysis/baselines/statedict.py), one gpuipc segment per tensor with a JSON index (the old weights_server example),
// and a device-to-device copy in one process. The measuring is Python (bench/suites/weights.py, one part per run, through
// the python runner); this file writes the dicts' specs (bench/suites/statedict.cpp), runs the parts, and judges the
// targets. The interpreter is python3 from PATH, or $GPUIPC_BENCH_PYTHON; it needs torch and gpuipc.
#include <fmt/format.h>

#include <cstdlib>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cuda/context.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/pool.hpp"
#include "os/child.hpp"
#include "programs.hpp"
#include "statedict.hpp"
#include "testkit/cuda/device_memory.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

/// Per part: spawned processes importing torch take seconds each (started together); every wait inside is bounded.
constexpr std::chrono::seconds kPartLimit{480};
/// The torch baseline: a spawned consumer, then each send of the dict (tens of ms for 2 GiB, more for 16 GiB).
constexpr std::chrono::seconds kTorchLimit{300};
/// The 16 GiB dict: the 2 GiB dict's model with as many layers as keep it within 16 GiB (3063 tensors).
constexpr std::size_t kLargeLayers = 340;

const char* verdict(bool ok) { return ok ? "holds" : "FAILS"; }

/// The specs of both dicts in temporary files (removed with this object).
struct Specs {
  std::filesystem::path small, large;
  std::size_t small_bytes = 0, large_bytes = 0, small_count = 0, large_count = 0;
  Specs() {
    const auto dir = std::filesystem::temp_directory_path();
    const auto stem = fmt::format("gpuipc-bench-weights-{}", ::getpid());
    const auto a = statedict::make();
    const auto b = statedict::make(statedict::Model{.layers = kLargeLayers});
    small = dir / (stem + "-2GiB.json");
    large = dir / (stem + "-16GiB.json");
    std::ofstream(small) << statedict::to_json(a).dump() << "\n";
    std::ofstream(large) << statedict::to_json(b).dump() << "\n";
    small_bytes = statedict::total_bytes(a);
    large_bytes = statedict::total_bytes(b);
    small_count = a.size();
    large_count = b.size();
  }
  Specs(const Specs&) = delete;
  Specs& operator=(const Specs&) = delete;
  ~Specs() {
    std::error_code ec;
    std::filesystem::remove(small, ec);
    std::filesystem::remove(large, ec);
  }
};

/// "" when a script's result `j` has figures; else why not (its error or the reason it skipped).
std::string why_not(const json& j) {
  if (j.contains("error")) return "it failed: " + j["error"].dump() + " (its log is in samples)";
  if (j.contains("skipped")) return "skipped: " + j["skipped"].get<std::string>();
  return {};
}

void set_null(Result& r, std::initializer_list<const char*> names) {
  for (const char* n : names) r.metrics[n] = nullptr;
}

/// Median and p99 of `v` as metrics `p50` and `p99`, and the values as a sample named `p50`.
Summary put(Result& r, const std::string& p50, const std::string& p99, const std::vector<double>& v,
            const std::string& unit) {
  const Summary s = summarize(v);
  r.metrics[p50] = s.median;
  r.metrics[p99] = s.p99;
  r.samples.push_back(sample(p50, unit, v));
  return s;
}

/// The values as a sample only.
Summary keep(Result& r, const std::string& name, const std::vector<double>& v, const std::string& unit,
             json extra = json::object()) {
  r.samples.push_back(sample(name, unit, v, std::move(extra)));
  return summarize(v);
}

double num(const json& j, const char* key) { return j.contains(key) && j[key].is_number() ? j[key].get<double>() : -1; }

json run_part(Result& r, const Options& o, const std::string& what, const std::string& args) {
  progress(o, "weights: " + what);
  json j = run_python_json("bench/suites/weights.py", args, kPartLimit);
  note_python_module(r, j);
  return j;
}

/// gpuipc.open_tensors in fresh processes; returns the median (ms) or -1. `suffix` names the dict's metrics.
double measure_open(Result& r, const Options& o, const std::filesystem::path& spec, const std::string& label,
                    const std::string& suffix, int consumers) {
  const json j = run_part(r, o, "gpuipc.open_tensors of the " + label + " dict in fresh processes",
                          fmt::format("--part open --spec '{}' --consumers {}", spec.string(), consumers));
  r.samples.push_back({{"name", "weights_open" + suffix}, {"result", j}});
  const auto p50 = "weights_open_ms" + suffix;
  const auto p99 = "weights_open_p99_ms" + suffix;
  if (const auto why = why_not(j); !why.empty()) {
    r.metrics[p50] = nullptr;
    r.metrics[p99] = nullptr;
    r.notes.push_back(
        fmt::format("{} (gpuipc.open_tensors of the {} dict): {}. Target <= 1 ms: not judged.", p50, label, why));
    return -1;
  }
  const Summary open = put(r, p50, p99, values_of(j, "open_ms"), "ms");
  const Summary call = keep(r, "weights_open_call_ms" + suffix, values_of(j, "call_ms"), "ms");
  const Summary touch = keep(r, "weights_open_touch_ms" + suffix, values_of(j, "touch_ms"), "ms");
  const Summary reopen = keep(r, "weights_reopen_ms" + suffix, values_of(j, "reopen_ms"), "ms");
  r.notes.push_back(fmt::format(
      "A fresh process (torch imported, CUDA initialised before the clock) goes from the name to all {} tensors of the "
      "{} dict ({} bytes) usable in {:.3f} ms p50 (p99 {:.3f}) over {} processes: gpuipc.open_tensors {:.3f} ms "
      "(index, pool join, {} storages resolved and held, torch tensors made), then data_ptr() of every tensor and a "
      "stream synchronize {:.3f} ms. The same open again in the now warm process: {:.3f} ms. The publisher built the "
      "dict under gpuipc.torch.MemPool and shared it {} (publish_tensors, versions=1). Every tensor's first and last "
      "element was checked. Target <= 1 ms {}.",
      j.value("tensors", 0), label, j.value("bytes", std::uint64_t{0}), open.median, open.p99, open.n, call.median,
      j.value("storages", 0), touch.median, reopen.median,
      j.value("by_reference", false) ? "by reference, with no copy" : "WITH A COPY (not by reference)",
      verdict(open.median <= 1.0)));
  return open.median;
}

/// The same dict through torch.multiprocessing; sets the ratio metric against `gpuipc_ms`.
void measure_torch(Result& r, const Options& o, const std::filesystem::path& spec, const std::string& label,
                   const std::string& suffix, int sends, double gpuipc_ms) {
  progress(o, "weights: the " + label + " dict through torch.multiprocessing");
  const json t = run_python_json("bench/analysis/baselines/statedict.py",
                                 fmt::format("--spec '{}' --sends {}", spec.string(), sends), kTorchLimit);
  r.samples.push_back({{"name", "torch_mp_weights_open" + suffix}, {"result", t}});
  const auto p50 = "torch_mp_weights_open_ms" + suffix;
  const auto p99 = "torch_mp_weights_open_p99_ms" + suffix;
  const auto ratio_name = "weights_ratio" + suffix;
  if (const auto why = why_not(t); !why.empty()) {
    r.metrics[p50] = nullptr;
    r.metrics[p99] = nullptr;
    r.metrics[ratio_name] = nullptr;
    r.notes.push_back(fmt::format("torch.multiprocessing with the {} dict: {}. Target {} >= 15: not judged.", label,
                                  why, ratio_name));
    return;
  }
  auto v = values_of(t, "values_ms");
  const double first = v.empty() ? -1 : v.front();
  if (!v.empty()) v.erase(v.begin());  // the first send apart, as the script reports it
  const Summary s = put(r, p50, p99, v, "ms");
  if (gpuipc_ms <= 0) {
    r.metrics[ratio_name] = nullptr;
    r.notes.push_back(
        fmt::format("torch.multiprocessing hands the {} dict over in {:.2f} ms p50; {} not computed "
                    "(no gpuipc figure).",
                    label, s.median, ratio_name));
    return;
  }
  const double ratio = s.median / gpuipc_ms;
  r.metrics[ratio_name] = ratio;
  r.notes.push_back(fmt::format(
      "torch.multiprocessing (torch {}) hands the same {} dict over (an mp.Queue; the consumer touches every tensor "
      "and synchronizes, timed at the producer from put to the acknowledgement) in {:.2f} ms p50 (p99 {:.2f}) over {} "
      "sends; the first took {:.1f} ms. Target {} >= 15 {}: torch / gpuipc = {:.1f}.",
      t.value("version", std::string("?")), label, s.median, s.p99, s.n, first, ratio_name, verdict(ratio >= 15.0),
      ratio));
}

void measure_segments(Result& r, const Options& o, const Specs& specs, int consumers, double gpuipc_ms) {
  const json j = run_part(r, o, "one segment per tensor and a JSON index (the old way), 2 GiB",
                          fmt::format("--part segments --spec '{}' --consumers {}", specs.small.string(), consumers));
  r.samples.push_back({{"name", "segment_per_tensor_open"}, {"result", j}});
  if (const auto why = why_not(j); !why.empty()) {
    set_null(r, {"segment_per_tensor_open_ms", "segment_per_tensor_open_p99_ms"});
    r.notes.push_back("segment_per_tensor_open_ms (one gpuipc segment per tensor and a JSON index): " + why + ".");
    return;
  }
  const Summary s =
      put(r, "segment_per_tensor_open_ms", "segment_per_tensor_open_p99_ms", values_of(j, "open_ms"), "ms");
  r.notes.push_back(fmt::format(
      "The old way (examples/python/weights_server.py before issue 13: {} device segments, one per tensor, and a JSON "
      "index in a host segment; the consumer opens the index, then each segment read-only and torch.from_dlpack "
      "each, then touches every tensor) takes {:.2f} ms p50 (p99 {:.2f}) in a fresh process{}.",
      j.value("tensors", 0), s.median, s.p99,
      gpuipc_ms > 0 ? fmt::format(": {:.1f}x the time of gpuipc.open_tensors", s.median / gpuipc_ms) : ""));
}

void measure_updates(Result& r, const Options& o, const Specs& specs) {
  const int updates = o.quick ? 50 : 200;
  const int copies = o.quick ? 5 : 20;
  const json j = run_part(
      r, o, "pub.update() until a reader's wait_version returns, versions=1 and 2",
      fmt::format("--part update --spec '{}' --updates {} --copies {}", specs.small.string(), updates, copies));
  r.samples.push_back({{"name", "weights_update"}, {"result", j}});
  if (const auto why = why_not(j); !why.empty()) {
    set_null(r,
             {"weights_update_visible_us", "weights_update_visible_p99_us", "weights_update_visible_v2_us",
              "weights_update_visible_v2_p99_us", "weights_update_visible_host_us", "weights_update_visible_v2_host_us",
              "weights_update_visible_spin_us", "weights_update_visible_spin_p99_us",
              "weights_update_visible_host_spin_us", "weights_update_visible_v2_spin_us",
              "weights_update_visible_v2_spin_p99_us", "weights_update_visible_v2_host_spin_us",
              "weights_update_wake_floor_us", "weights_update_wake_floor_v2_us", "weights_update_copy_ms",
              "weights_update_copy_p99_ms", "weights_update_copy_v2_ms", "weights_update_copy_v2_p99_ms"});
    r.notes.push_back("weights_update_visible_us: " + why + ". Target <= 20 us: not judged.");
    return;
  }
  for (const char* v : {"v1", "v2"}) {
    const json& d = j.at(v);
    const std::string sfx = std::string(v) == "v1" ? "" : "_v2";
    const Summary vis = put(r, "weights_update_visible" + sfx + "_us", "weights_update_visible" + sfx + "_p99_us",
                            values_of(d.at("stream"), "visible_us"), "us");
    const Summary host =
        keep(r, "weights_update_visible" + sfx + "_host_us", values_of(d.at("host"), "visible_us"), "us");
    r.metrics["weights_update_visible" + sfx + "_host_us"] = host.median;
    const Summary spin =
        keep(r, "weights_update_visible" + sfx + "_spin_us", values_of(d.at("stream_spin"), "visible_us"), "us");
    r.metrics["weights_update_visible" + sfx + "_spin_us"] = spin.median;
    r.metrics["weights_update_visible" + sfx + "_spin_p99_us"] = spin.p99;
    const Summary host_spin =
        keep(r, "weights_update_visible" + sfx + "_host_spin_us", values_of(d.at("host_spin"), "visible_us"), "us");
    r.metrics["weights_update_visible" + sfx + "_host_spin_us"] = host_spin.median;
    const Summary call = keep(r, "weights_update_call" + sfx + "_us", values_of(d.at("stream"), "call_us"), "us");
    // Older part scripts did not measure the floor.
    const Summary floor = d.contains("floor") ? keep(r, "weights_update_wake_floor" + sfx + "_us",
                                                     values_of(d.at("floor"), "visible_us"), "us")
                                              : Summary{};
    r.metrics["weights_update_wake_floor" + sfx + "_us"] = d.contains("floor") ? json(floor.median) : json(nullptr);
    const Summary copy = put(r, "weights_update_copy" + sfx + "_ms", "weights_update_copy" + sfx + "_p99_ms",
                             values_of(d, "copy_ms"), "ms");
    r.notes.push_back(fmt::format(
        "versions={}: from the publisher's pub.update(stream=torch's current stream) call to the return of a reader "
        "process's Reader.wait_version, blocked on the host ({} updates, one clock: CLOCK_MONOTONIC in both "
        "processes): {:.1f} us p50 (p99 {:.1f}); the update() call itself {:.1f} us; the signal is {}. With "
        "update(stream=None), a host signal: {:.1f} us p50. Target <= 20 us {} for a sleeping reader. A reader "
        "that polls (wait_version(spin=...), a CPU core while it waits) sees the stream-ordered update in {:.1f} us "
        "p50 (p99 {:.1f}) and the host signal in {:.1f} us: target {}. Apart: update_from of the whole {} bytes "
        "(the copy in, then the update, until its stream finished) {:.2f} ms p50 (p99 {:.2f}). The floor, {:.1f} us "
        "p50 (p99 {:.1f}): a plain host semaphore raised by the publisher, waited for the same way (20 us of "
        "polling, then a futex) by the same reader: what waking a sleeping process costs on this machine.",
        v[1], vis.n, vis.median, vis.p99, call.median, d.value("signal", std::string("?")), host.median,
        verdict(vis.median <= 20.0), spin.median, spin.p99, host_spin.median, verdict(spin.median <= 20.0),
        j.value("bytes", std::uint64_t{0}), copy.median, copy.p99, floor.median, floor.p99));
  }
}

void measure_stream(Result& r, const Options& o, const Specs& specs) {
  const int reps = o.quick ? 2 : 5;
  // --quick streams the 2 GiB dict only.
  const std::string large_arg = o.quick ? std::string() : fmt::format(" --spec-large '{}'", specs.large.string());
  const json j = run_part(r, o, "bucketed streaming to another process vs a local device-to-device copy",
                          fmt::format("--part stream --spec '{}'{} --reps {}", specs.small.string(), large_arg, reps));
  r.samples.push_back({{"name", "weights_stream"}, {"result", j}});
  const auto all = {"weights_stream_gbs",       "weights_stream_p99_gbs",       "local_d2d_gbs",
                    "local_d2d_p99_gbs",        "local_d2d_flat_gbs",           "weights_stream_ratio",
                    "local_d2d_foreach_gbs",    "local_d2d_wide_gbs",           "weights_stream_bytes",
                    "weights_stream_byref_gbs", "weights_stream_byref_p99_gbs", "weights_stream_byref_ratio"};
  if (const auto why = why_not(j); !why.empty()) {
    for (const char* n : all) r.metrics[n] = nullptr;
    r.notes.push_back("weights_stream_gbs, weights_stream_byref_gbs: " + why +
                      ". Targets weights_stream_ratio, weights_stream_byref_ratio >= 0.8: not judged.");
    return;
  }
  const auto bytes = j.value("bytes", std::uint64_t{0});
  r.metrics["weights_stream_bytes"] = bytes;
  const auto gbs = [&](double ms) { return ms > 0 ? static_cast<double>(bytes) / ms / 1e6 : 0.0; };
  const json& local = j.at("local");
  // The baseline is the faster of the local ways: torch._foreach_copy_ over the tensors as they are, and the way the
  // stream reader copies (large tensors one by one, the rest as int64 views).
  const Summary fused = keep(r, "local_d2d_ms", values_of(local, "ms"), "ms", {{"bytes", bytes}});
  const Summary wide = keep(r, "local_d2d_wide_ms", values_of(local, "wide_ms"), "ms", {{"bytes", bytes}});
  const bool wide_faster = wide.median > 0 && wide.median < fused.median;
  const Summary& l = wide_faster ? wide : fused;
  r.metrics["local_d2d_gbs"] = gbs(l.median);
  r.metrics["local_d2d_p99_gbs"] = gbs(l.p99);
  r.metrics["local_d2d_foreach_gbs"] = gbs(fused.median);
  r.metrics["local_d2d_wide_gbs"] = wide.median > 0 ? json(gbs(wide.median)) : json(nullptr);
  const Summary flat = keep(r, "local_d2d_flat_ms", values_of(local, "flat_ms"), "ms",
                            {{"bytes", local.value("flat_bytes", std::uint64_t{0})}});
  const double flat_gbs =
      flat.median > 0 ? static_cast<double>(local.value("flat_bytes", std::uint64_t{0})) / flat.median / 1e6 : 0.0;
  r.metrics["local_d2d_flat_gbs"] = flat_gbs;
  const bool large = j.value("dict", std::string()) == "large";
  const std::string dict =
      fmt::format("the {} dict ({} tensors, {} bytes)", large ? "16 GiB" : "2 GiB", j.value("tensors", 0), bytes);
  if (!large && !o.quick && j.contains("skipped_sizes") && !j["skipped_sizes"].empty()) {
    r.notes.push_back("The 16 GiB dict is not streamed: " + j["skipped_sizes"][0].get<std::string>() +
                      "; the 2 GiB dict is.");
  }
  r.notes.push_back(fmt::format(
      "In one process, copying {} device to device into a second dict runs at {:.1f} GB/s p50 with {} and {:.1f} GB/s "
      "with {}; the faster ({}, local_d2d_gbs) is the baseline of the ratios below. One flat copy of {} bytes runs at "
      "{:.1f} GB/s.",
      dict, gbs(fused.median), local.value("method", std::string("?")), wide.median > 0 ? gbs(wide.median) : 0.0,
      local.value("wide_method", std::string("no second way (this torch has no _foreach_copy_)")),
      wide_faster ? "the second" : "the first", local.value("flat_bytes", std::uint64_t{0}), flat_gbs));
  // A streaming run's times (`st`) as a sample NAME_ms and metrics NAME_gbs, NAME_p99_gbs and NAME_ratio (to the
  // local copy); returns the note's figures and its verdict on the target.
  const auto figures = [&](const json& st, const std::string& name) {
    const Summary s = keep(r, name + "_ms", values_of(st, "ms"), "ms", {{"bytes", bytes}});
    r.metrics[name + "_gbs"] = gbs(s.median);
    r.metrics[name + "_p99_gbs"] = gbs(s.p99);
    const double ratio = l.median > 0 && s.median > 0 ? l.median / s.median : 0.0;
    r.metrics[name + "_ratio"] = ratio;
    return fmt::format(
        "{:.1f} GB/s p50 ({:.1f} ms from publish() to the reader's receive() returning and its stream synchronized; "
        "p99 {:.1f} ms) over {} publishes after one more; the first took {:.1f} ms. Target {}_ratio >= 0.8 of the "
        "local copy {}: {:.2f}.",
        gbs(s.median), s.median, s.p99, s.n, num(st, "first_ms"), name, verdict(ratio >= 0.8), ratio);
  };
  // No figures for NAME: null metrics, and why in a note.
  const auto no_figures = [&](const std::string& name, const std::string& what, const std::string& why) {
    for (const char* m : {"_gbs", "_p99_gbs", "_ratio"}) r.metrics[name + m] = nullptr;
    r.notes.push_back(name + "_gbs (" + what + "): " + why + ". Target " + name + "_ratio >= 0.8: not judged.");
  };
  const auto failed = [&](const char* key) {
    return "it failed: " + j[key].get<std::string>() + " (its log is in samples)";
  };
  if (j.contains("stream")) {
    r.notes.push_back(
        fmt::format("Bucketed streaming, staged (weights_stream_gbs, weights_stream_ratio: gpuipc.stream_publisher "
                    "with by_reference=False, {} buckets of {} bytes; every byte is copied twice, into a bucket by "
                    "the publisher and out of it by the reader, two processes that take turns on the GPU without "
                    "MPS) of {} (torch's own allocator) to a reader process that receives into its own tensors: ",
                    j.value("buckets", 0), j.value("bucket_bytes", std::uint64_t{0}), dict) +
        figures(j.at("stream"), "weights_stream"));
  } else {
    no_figures("weights_stream", "bucketed streaming, staged",
               j.contains("stream_missing") ? j["stream_missing"].get<std::string>()
               : j.contains("stream_error") ? failed("stream_error")
                                            : std::string("no figure"));
  }
  if (j.contains("stream_byref")) {
    const json& st = j.at("stream_byref");
    r.notes.push_back(
        fmt::format("Bucketed streaming by reference (weights_stream_byref_gbs, weights_stream_byref_ratio): {} "
                    "built under gpuipc.torch.MemPool and published with by_reference=True, so nothing is staged "
                    "(ring buckets of {} bytes carry descriptors only) and the reader copies every tensor straight "
                    "from the publisher's memory into its own: one copy, in one process. ",
                    dict, st.value("bucket_bytes", std::uint64_t{0})) +
        figures(st, "weights_stream_byref"));
  } else {
    no_figures("weights_stream_byref", "bucketed streaming by reference from a MemPool dict",
               j.contains("stream_byref_missing")   ? j["stream_byref_missing"].get<std::string>()
               : j.contains("stream_byref_skipped") ? "skipped: " + j["stream_byref_skipped"].get<std::string>()
               : j.contains("stream_byref_error")   ? failed("stream_byref_error")
                                                    : std::string("no figure (this gpuipc has no bucketed streaming)"));
  }
}

/// Bytes of the pool pause_resume_ms is measured on, and the least it falls back to.
constexpr std::size_t kPauseWanted = 16ULL << 30;
constexpr std::size_t kPauseChunk = 1ULL << 30;

/// Pool::pause with keep_contents and keep_buffer and Pool::resume of a full device pool (1 GiB chunks), timed apart,
/// in a forked worker (the suite's process stays free of CUDA): 16 GiB, or as many GiB as leave 2 GiB of the GPU
/// free. The first cycle pins the host buffer, the later ones reuse it. Returns JSON: bytes, free_bytes, pause_ms and
/// resume_ms (lists, the first cycle's first), the GPU memory a pause gave back, whether the contents came back
/// (each block holds the cycle's own bytes, written before its pause); or "error".
json pause_worker(int cycles) {
  json j;
  try {
    cuda::PrimaryContext ctx(0);
    ctx.make_current();
    const std::size_t free = cuda::memory_info(0).free;
    std::size_t bytes = kPauseWanted;
    while (bytes > kPauseChunk && bytes + (2ULL << 30) > free) bytes -= kPauseChunk;
    j["bytes"] = bytes;
    j["free_bytes"] = free;
    if (bytes + (2ULL << 30) > free) {
      j["error"] = fmt::format("the GPU has {} MiB free, less than 3 GiB", free >> 20);
      return j;
    }
    const std::string name = fmt::format("bench-pause-{}", ::getpid());
    auto pool = Pool::create(
        name,
        {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = kPauseChunk, .max_bytes = bytes, .max_blocks = 64});
    std::vector<Block> blocks;
    for (std::size_t b = 0; b < bytes / kPauseChunk; ++b) {
      blocks.push_back(pool.allocate(kPauseChunk));
      cuda::memset_d8(reinterpret_cast<CUdeviceptr>(blocks.back().data()), static_cast<std::uint8_t>(b + 1),
                      kPauseChunk);
    }
    std::vector<double> pause_ms, resume_ms;
    std::size_t freed = 0;
    bool intact = true;
    // One pause and resume, timed apart, with the GPU memory the pause gave back.
    const auto cycle = [&](const PauseOptions& how, std::vector<double>& p_ms, std::vector<double>& r_ms) {
      const std::size_t before = cuda::memory_info(0).free;
      const auto t0 = now_ns();
      pool.pause(how);
      const auto t1 = now_ns();
      const std::size_t paused = cuda::memory_info(0).free;
      const auto t2 = now_ns();
      pool.resume();
      const auto t3 = now_ns();
      p_ms.push_back(static_cast<double>(t1 - t0) / 1e6);
      r_ms.push_back(static_cast<double>(t3 - t2) / 1e6);
      return paused > before ? paused - before : std::size_t{0};
    };
    for (int i = 0; i < cycles; ++i) {
      for (std::size_t b = 0; b < blocks.size(); ++b) {  // this cycle's bytes: a reused buffer must not bring back
        cuda::memset_d8(reinterpret_cast<CUdeviceptr>(blocks[b].data()), static_cast<std::uint8_t>(b + 1 + i),
                        kPauseChunk);  // the last cycle's
      }
      freed = cycle({.keep_contents = true, .keep_buffer = true}, pause_ms, resume_ms);
      for (std::size_t b = 0; b < blocks.size(); ++b) {  // a byte at each end of every block came back
        std::uint8_t ends[2] = {0, 0};
        const auto p = reinterpret_cast<CUdeviceptr>(blocks[b].data());
        cuda::copy_to_host(&ends[0], p, 1);
        cuda::copy_to_host(&ends[1], p + kPauseChunk - 1, 1);
        const auto want = static_cast<std::uint8_t>(b + 1 + i);
        intact = intact && ends[0] == want && ends[1] == want;
      }
    }
    // Then without keep_contents (a KV cache's pause: nothing saved, nothing copied back), as many cycles, after
    // one untimed: a pause without keep_buffer gives the pinned buffer kept above back (1.4-2.0 s for 16 GiB on an
    // H200 at 9b481f1), which is not the cost of such a pause.
    pool.pause({});
    pool.resume();
    std::vector<double> discard_pause_ms, discard_resume_ms;
    std::size_t discard_freed = 0;
    for (int i = 0; i < cycles; ++i) discard_freed = cycle({}, discard_pause_ms, discard_resume_ms);
    blocks.clear();
    pool = Pool();
    Pool::unlink(name);
    j["pause_ms"] = pause_ms;
    j["resume_ms"] = resume_ms;
    j["freed_bytes"] = freed;
    j["intact"] = intact;
    j["discard_pause_ms"] = discard_pause_ms;
    j["discard_resume_ms"] = discard_resume_ms;
    j["discard_freed_bytes"] = discard_freed;
  } catch (const std::exception& e) {
    j["error"] = e.what();
  }
  return j;
}

/// pause_resume_ms (with pause_ms and resume_ms apart): a 16 GiB device pool paused with its contents kept and
/// resumed; a smaller one (whole GiB) when the GPU has not that much free, said in a note.
void measure_pause(Result& r, const Options& o) {
  progress(o, "weights: Pool.pause(keep_contents) and resume of a 16 GiB device pool");
  const int cycles = o.quick ? 3 : 10;
  auto child = os::fork_reporting([&] { return pause_worker(cycles).dump(); });
  const auto report = os::join_reporting(child, std::chrono::seconds(kPartLimit));
  json j;
  try {
    j = json::parse(report.text);
  } catch (const std::exception&) {
    j = {{"error", report.text.empty() ? std::string("the worker died without a report") : report.text}};
  }
  r.samples.push_back({{"name", "pause_resume"}, {"result", j}});
  if (j.contains("error")) {
    set_null(r, {"pause_resume_ms", "pause_resume_p99_ms", "pause_ms", "pause_p99_ms", "resume_ms", "resume_p99_ms",
                 "pause_first_ms", "resume_first_ms", "pause_resume_bytes", "pause_freed_bytes",
                 "pause_resume_discard_ms", "pause_resume_discard_p99_ms", "pause_discard_ms", "pause_discard_p99_ms",
                 "resume_discard_ms", "resume_discard_p99_ms", "pause_discard_freed_bytes"});
    r.notes.push_back("pause_resume_ms: not measured: " + j["error"].dump());
    return;
  }
  const auto bytes = j.value("bytes", std::uint64_t{0});
  auto p = values_of(j, "pause_ms");
  auto q = values_of(j, "resume_ms");
  // The first cycle pins the host buffer; the others reuse it (keep_buffer), as a pool paused every step does.
  if (!p.empty() && !q.empty()) {
    r.metrics["pause_first_ms"] = p.front();
    r.metrics["resume_first_ms"] = q.front();
    if (p.size() > 1 && q.size() > 1) {
      p.erase(p.begin());
      q.erase(q.begin());
    }
  }
  std::vector<double> both;
  for (std::size_t i = 0; i < p.size() && i < q.size(); ++i) both.push_back(p[i] + q[i]);
  const Summary sp = put(r, "pause_ms", "pause_p99_ms", p, "ms");
  const Summary sq = put(r, "resume_ms", "resume_p99_ms", q, "ms");
  const Summary sb = put(r, "pause_resume_ms", "pause_resume_p99_ms", both, "ms");
  r.metrics["pause_resume_bytes"] = bytes;
  r.metrics["pause_freed_bytes"] = j.value("freed_bytes", std::uint64_t{0});
  r.notes.push_back(fmt::format(
      "Pool.pause(keep_contents=True, keep_buffer=True) then resume() of a full {} GiB device pool (1 GiB chunks): "
      "pause {:.1f} ms p50 (p99 {:.1f}: saves the blocks to pinned host memory, releases the chunks), resume {:.1f} ms "
      "p50 (p99 {:.1f}: new memory at the same addresses, contents copied back), {:.1f} ms the cycle, over {} cycles "
      "that reuse the pinned buffer; the first cycle, which pins it, took {:.1f} ms to pause and {:.1f} ms to resume "
      "(pause_first_ms, resume_first_ms); a pause gave the GPU back {} MiB; contents after resume {}.{}",
      bytes >> 30, sp.median, sp.p99, sq.median, sq.p99, sb.median, sb.n, r.metrics.value("pause_first_ms", 0.0),
      r.metrics.value("resume_first_ms", 0.0), j.value("freed_bytes", std::uint64_t{0}) >> 20,
      j.value("intact", false) ? "intact" : "WRONG",
      bytes == kPauseWanted ? ""
                            : fmt::format(" The GPU had {} MiB free, too little for 16 GiB: measured on {} GiB.",
                                          j.value("free_bytes", std::uint64_t{0}) >> 20, bytes >> 30)));
  const auto dp = values_of(j, "discard_pause_ms");
  const auto dq = values_of(j, "discard_resume_ms");
  std::vector<double> dboth;
  for (std::size_t i = 0; i < dp.size() && i < dq.size(); ++i) dboth.push_back(dp[i] + dq[i]);
  const Summary xp = put(r, "pause_discard_ms", "pause_discard_p99_ms", dp, "ms");
  const Summary xq = put(r, "resume_discard_ms", "resume_discard_p99_ms", dq, "ms");
  const Summary xb = put(r, "pause_resume_discard_ms", "pause_resume_discard_p99_ms", dboth, "ms");
  r.metrics["pause_discard_freed_bytes"] = j.value("discard_freed_bytes", std::uint64_t{0});
  r.notes.push_back(fmt::format(
      "The same pool paused without keep_contents (nothing saved, nothing copied back: a KV cache's pause): pause "
      "{:.1f} ms p50 (p99 {:.1f}), resume {:.1f} ms p50 (p99 {:.1f}), {:.1f} ms the cycle, over {} cycles; a pause "
      "gave the GPU back {} MiB.",
      xp.median, xp.p99, xq.median, xq.p99, xb.median, xb.n,
      j.value("discard_freed_bytes", std::uint64_t{0}) >> 20));
}

Result run_weights(const Options& o, const DeviceMeta& meta) {
  Result r;
  r.mps = meta.mps;
  const Specs specs;
  const int consumers = o.quick ? 5 : 10;
  r.samples.push_back(
      {{"name", "setup"},
       {"python", python_interpreter()},
       {"dict_2GiB", {{"tensors", specs.small_count}, {"bytes", specs.small_bytes}}},
       {"dict_16GiB", {{"tensors", specs.large_count}, {"bytes", specs.large_bytes}, {"layers", kLargeLayers}}}});

  // $GPUIPC_BENCH_WEIGHTS_PARTS (open, update, stream, pause; comma-separated) runs only those, for experiments:
  // "open" is the open of both dicts with its baselines (torch.multiprocessing, one segment per tensor).
  const char* env = std::getenv("GPUIPC_BENCH_WEIGHTS_PARTS");  // NOLINT(concurrency-mt-unsafe): no threads yet
  const std::string parts = env != nullptr && *env != 0 ? fmt::format(",{},", env) : ",open,update,stream,pause,";
  auto wanted = [&](const char* part) { return parts.find(fmt::format(",{},", part)) != std::string::npos; };
  if (parts != ",open,update,stream,pause,") r.notes.push_back(fmt::format("only the parts {}", env));
  if (wanted("open")) {
    const double open_ms = measure_open(r, o, specs.small, "2 GiB", "", consumers);
    measure_segments(r, o, specs, consumers, open_ms);
    measure_torch(r, o, specs.small, "2 GiB", "", o.quick ? 5 : 20, open_ms);
  }
  if (wanted("update")) measure_updates(r, o, specs);
  if (wanted("stream")) measure_stream(r, o, specs);
  if (o.quick) {
    r.notes.push_back(
        "--quick: the 16 GiB dict is not opened (weights_open_ms_16GiB and its baseline are left out) "
        "and the 2 GiB dict is streamed.");
  } else if (wanted("open")) {
    const double big_ms = measure_open(r, o, specs.large, "16 GiB", "_16GiB", 5);
    measure_torch(r, o, specs.large, "16 GiB", "_16GiB", 10, big_ms);
  }
  if (wanted("pause")) measure_pause(r, o);
  return r;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{
    .name = "weights",
    .description = "a torch state dict (2 GiB, 291 tensors; 16 GiB) opened, updated and streamed with gpuipc's "
                   "Python API vs torch.multiprocessing, one segment per tensor, a local copy (needs torch + gpuipc)",
    .needs_gpu = true,
    .run = run_weights,
});

}  // namespace gpuipc::bench
