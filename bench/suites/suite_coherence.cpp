// The `coherence` suite: what a process that polls a flag in shared GPU memory can observe while another process
// writes data and then the flag, through a gpuipc device segment (created by A, opened by B) on one GPU.
//
// Per trial i, each of kBlocks writer blocks (kBlock threads, many warps) stores its chunk of data = i and then its
// flag = i; the matching reader block waits for the flag, reads the chunk and counts words still older than the
// flag ("stale data after flag"), then acknowledges. Three flag protocols: plain volatile stores and loads,
// __threadfence_system() between data and flag (and after the flag on the reader), and cuda::atomic_ref at system
// scope (store release / load acquire). Visibility latency: the writer stamps %globaltimer just before its flag
// store, the reader when it sees the flag (same GPU, same clock). Without MPS the two kernels time-slice, so
// trials are few there; under a private MPS daemon they run side by side. Then the same handoff ordered by gpuipc
// semaphores in stream order (A: kernel writes, signal; B: wait, kernel reads): stale reads and latency.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <atomic>
#include <thread>

#include "bench.hpp"
#include "cuda/context.hpp"
#include "cuda/stream_ops.hpp"
#include "gpu.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "mps.hpp"
#include "os/identity.hpp"
#include "os/process.hpp"
#include "sync.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;
using Protocol = kernels::Kernels::FlagProtocol;

constexpr unsigned kBlocks = 8;                   ///< writer/reader block pairs: independent flag handoffs a trial
constexpr unsigned kWordsPerBlock = 2048;         ///< u32 words each block writes (8 per thread)
constexpr std::size_t kRegion = 1 << 20;          ///< one protocol's flags, acks and data
constexpr std::size_t kAcksAt = 64 << 10;         ///< within a region
constexpr std::size_t kDataAt = 128 << 10;        ///< within a region
constexpr std::size_t kSegmentBytes = 4 * kRegion;
constexpr std::uint64_t kWaitTimeoutNs = 2'000'000'000;  ///< a kernel gives up after 2 s without progress

struct ProtocolInfo {
  Protocol protocol;
  const char* name;
};
constexpr ProtocolInfo kProtocols[] = {{Protocol::Plain, "plain"},
                                       {Protocol::Fence, "fence"},
                                       {Protocol::ReleaseAcquire, "release_acquire"}};

std::string unique(const char* what) {
  return fmt::format("bench-coh-{}-{}-{}", what, os::current_pid(), now_ns() % 1000000);
}

std::vector<std::uint64_t> download_u64(CUdeviceptr p, std::size_t n) {
  std::vector<std::uint64_t> v(n);
  if (n != 0) cuda::copy_to_host(v.data(), p, n * sizeof(std::uint64_t));
  return v;
}

/// Runs two workers with a shared Sync; a worker that throws marks the Sync failed so its peer stops waiting.
/// Returns {a, b}; either may be {"error": ...}.
std::pair<json, json> run_pair(const std::function<json(Sync*)>& a, const std::function<json(Sync*)>& b,
                               const Env& env, std::chrono::seconds timeout) {
  const SyncPage page;
  Sync* sync = page.get();
  auto wa = spawn_synced(sync, [&] { return a(sync); }, env);
  auto wb = spawn_synced(sync, [&] { return b(sync); }, env);
  json ra = join_worker(wa, timeout);
  if (ra.contains("error")) sync->failed = 1;
  json rb = join_worker(wb, timeout);
  return {ra, rb};
}

// --- flag handoffs through a spinning kernel pair -----------------------------------------------------------------
/// A creates the segment and runs the writer kernels; B opens it and runs the reader kernels, for each protocol.
json spin_study(const Env& env, unsigned trials, std::chrono::seconds kernel_timeout) {
  const std::string name = unique("spin");
  const auto [ra, rb] = run_pair(
      [&](Sync* sync) -> json {
        Gpu g;
        kernels::Kernels& k = g.k;
        auto seg = Segment::create(name, kSegmentBytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
        cuda::memset_d8(seg.device_pointer(), 0, kSegmentBytes);
        auto t_write = cuda::DeviceBuffer::allocate(trials * sizeof(std::uint64_t));
        auto result = cuda::DeviceBuffer::allocate(2 * sizeof(std::uint64_t));
        sync->a_ready = 1;
        sync->await([&] { return sync->b_ready.load() == 1; }, "the reader to open the segment");
        json out = json::object();
        for (std::size_t m = 0; m < std::size(kProtocols); ++m) {
          const CUdeviceptr base = seg.device_pointer() + m * kRegion;
          cuda::memset_d8(t_write.get(), 0, trials * sizeof(std::uint64_t));
          cuda::memset_d8(result.get(), 0, 2 * sizeof(std::uint64_t));
          sync->await([&] { return sync->progress_b.load() >= m + 1; }, "the reader kernel's launch");
          k.coherence_writer(g.stream.get(), kBlocks, base + kDataAt, base, base + kAcksAt, kWordsPerBlock, trials,
                             kProtocols[m].protocol, kWaitTimeoutNs, t_write.get(), result.get());
          sync_bounded(g.stream, kernel_timeout, "the writer kernel");
          const auto r = download_u64(result.get(), 2);
          out[kProtocols[m].name] = json{{"t_write", download_u64(t_write.get(), trials)},
                                         {"trials_done", r[0]},
                                         {"timed_out_blocks", r[1]}};
          sync->progress_a = m + 1;
        }
        sync->await([&] { return sync->b_ready.load() == 2; }, "the reader to finish");
        Segment::unlink(name);
        return out;
      },
      [&](Sync* sync) -> json {
        Gpu g;
        kernels::Kernels& k = g.k;
        sync->await([&] { return sync->a_ready.load() == 1; }, "the segment");
        auto seg = Segment::open(name, {.access = Access::ReadWrite});
        auto t_seen = cuda::DeviceBuffer::allocate(trials * sizeof(std::uint64_t));
        auto result = cuda::DeviceBuffer::allocate(5 * sizeof(std::uint64_t));
        sync->b_ready = 1;
        json out = json::object();
        for (std::size_t m = 0; m < std::size(kProtocols); ++m) {
          const CUdeviceptr base = seg.device_pointer() + m * kRegion;
          cuda::memset_d8(t_seen.get(), 0, trials * sizeof(std::uint64_t));
          cuda::memset_d8(result.get(), 0, 5 * sizeof(std::uint64_t));
          k.coherence_reader(g.stream.get(), kBlocks, base + kDataAt, base, base + kAcksAt, kWordsPerBlock, trials,
                             kProtocols[m].protocol, kWaitTimeoutNs, t_seen.get(), result.get());
          sync->progress_b = m + 1;
          sync_bounded(g.stream, kernel_timeout, "the reader kernel");
          const auto r = download_u64(result.get(), 5);
          out[kProtocols[m].name] = json{{"t_seen", download_u64(t_seen.get(), trials)},
                                         {"observations", r[0]},
                                         {"timed_out_blocks", r[1]},
                                         {"stale_events", r[2]},
                                         {"stale_words", r[3]},
                                         {"flag_overshoot", r[4]}};
          sync->await([&] { return sync->progress_a.load() >= m + 1; }, "the writer kernel");
        }
        seg.close();
        sync->b_ready = 2;
        return out;
      },
      env, kernel_timeout * 4 + std::chrono::seconds(60));
  if (ra.contains("error") || rb.contains("error")) {
    // Segment::unlink is the creator's; if it failed before, the name goes with the broker's idle exit.
    return json{{"error", fmt::format("writer: {}; reader: {}", ra.value("error", json("ok")).dump(),
                                      rb.value("error", json("ok")).dump())}};
  }
  json out = json::object();
  for (const auto& p : kProtocols) {
    const auto& w = ra[p.name];
    const auto& r = rb[p.name];
    const auto tw = w["t_write"].get<std::vector<std::uint64_t>>();
    const auto ts = r["t_seen"].get<std::vector<std::uint64_t>>();
    std::vector<double> us;
    // The first trials include the two kernels' start: skipped.
    for (std::size_t i = std::min<std::size_t>(2, tw.size() / 10); i < tw.size() && i < ts.size(); ++i) {
      if (tw[i] == 0 || ts[i] == 0) continue;
      us.push_back((static_cast<double>(ts[i]) - static_cast<double>(tw[i])) / 1e3);
    }
    out[p.name] = json{{"visibility_us", to_json(summarize(us))},
                       {"trials", trials},
                       {"blocks", kBlocks},
                       {"words_per_block", kWordsPerBlock},
                       {"observations", r["observations"]},
                       {"stale_events", r["stale_events"]},
                       {"stale_words", r["stale_words"]},
                       {"flag_overshoot", r["flag_overshoot"]},
                       {"timed_out_blocks_reader", r["timed_out_blocks"]},
                       {"timed_out_blocks_writer", w["timed_out_blocks"]},
                       {"writer_trials_done", w["trials_done"]}};
  }
  return out;
}

// --- the same handoff ordered by gpuipc semaphores ----------------------------------------------------------------
/// A: [wait ack >= i-1] fill data = i, stamp, signal data = i. B: wait data >= i, check (stamps at start), signal
/// ack = i. Everything enqueued up front: no host in the loop.
json semaphore_study(const Env& env, unsigned trials, std::chrono::seconds timeout) {
  const std::string seg_name = unique("semdata");
  const std::string data_sem = seg_name + "-filled";
  const std::string ack_sem = seg_name + "-read";
  constexpr std::size_t kWords = static_cast<std::size_t>(kBlocks) * kWordsPerBlock;
  const auto [ra, rb] = run_pair(
      [&](Sync* sync) -> json {
        Gpu g;
        kernels::Kernels& k = g.k;
        auto seg = Segment::create(seg_name, kWords * 4, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
        cuda::memset_d8(seg.device_pointer(), 0, kWords * 4);
        auto filled = Semaphore::create(data_sem, {.initial = 0, .kind = SegmentKind::HostPinned, .device = 0, .mode = 0600});
        auto t_write = cuda::DeviceBuffer::allocate(trials * sizeof(std::uint64_t));
        cuda::memset_d8(t_write.get(), 0, trials * sizeof(std::uint64_t));
        sync->a_ready = 1;
        sync->await([&] { return sync->b_ready.load() == 1; }, "the reader's semaphore");
        auto read = Semaphore::open(ack_sem, {.role = SemaphoreRole::Waiter});
        const auto t0 = now_ns();
        for (unsigned i = 1; i <= trials; ++i) {
          if (i > 1) check_status(read.wait(g.stream.get(), i - 1), "wait(read)");
          k.write_fill(g.stream.get(), seg.device_pointer(), kWords / 4, i);
          k.stamp_time(g.stream.get(), t_write.get() + (i - 1) * sizeof(std::uint64_t));
          check_status(filled.signal(g.stream.get(), i), "signal(filled)");
        }
        check_status(read.wait(g.stream.get(), trials), "wait(read)");
        sync_bounded(g.stream, timeout, "the writer's stream");
        const double total_us = static_cast<double>(now_ns() - t0) / 1e3;
        sync->progress_a = 1;
        sync->await([&] { return sync->b_ready.load() == 2; }, "the reader to finish");
        Segment::unlink(seg_name);
        Semaphore::unlink(data_sem);
        return json{{"t_write", download_u64(t_write.get(), trials)}, {"round_trip_us", total_us / trials}};
      },
      [&](Sync* sync) -> json {
        Gpu g;
        kernels::Kernels& k = g.k;
        sync->await([&] { return sync->a_ready.load() == 1; }, "the segment");
        auto seg = Segment::open(seg_name, {.access = Access::ReadOnly});
        auto filled = Semaphore::open(data_sem, {.role = SemaphoreRole::Waiter});
        auto read = Semaphore::create(ack_sem, {.initial = 0, .kind = SegmentKind::HostPinned, .device = 0, .mode = 0600});
        auto t_seen = cuda::DeviceBuffer::allocate(trials * sizeof(std::uint64_t));
        auto mismatches = cuda::DeviceBuffer::allocate(trials * sizeof(std::uint64_t));
        cuda::memset_d8(t_seen.get(), 0, trials * sizeof(std::uint64_t));
        cuda::memset_d8(mismatches.get(), 0, trials * sizeof(std::uint64_t));
        sync->b_ready = 1;
        for (unsigned i = 1; i <= trials; ++i) {
          check_status(filled.wait(g.stream.get(), i), "wait(filled)");
          k.check_value(g.stream.get(), seg.device_pointer(), kWords, i,
                        mismatches.get() + (i - 1) * sizeof(std::uint64_t),
                        t_seen.get() + (i - 1) * sizeof(std::uint64_t));
          check_status(read.signal(g.stream.get(), i), "signal(read)");
        }
        sync_bounded(g.stream, timeout, "the reader's stream");
        const auto mm = download_u64(mismatches.get(), trials);
        std::uint64_t stale_trials = 0, stale_words = 0;
        for (const auto m : mm) {
          stale_trials += m != 0 ? 1 : 0;
          stale_words += m;
        }
        // The writer waits for our last signal before it finishes; keep the semaphore until it has.
        sync->await([&] { return sync->progress_a.load() == 1; }, "the writer to finish");
        Semaphore::unlink(ack_sem);
        sync->b_ready = 2;
        return json{{"t_seen", download_u64(t_seen.get(), trials)}, {"stale_trials", stale_trials},
                    {"stale_words", stale_words}, {"filled_status", std::string(to_string(filled.status()))}};
      },
      env, timeout * 2 + std::chrono::seconds(60));
  if (ra.contains("error") || rb.contains("error")) {
    return json{{"error", fmt::format("writer: {}; reader: {}", ra.value("error", json("ok")).dump(),
                                      rb.value("error", json("ok")).dump())}};
  }
  const auto tw = ra["t_write"].get<std::vector<std::uint64_t>>();
  const auto ts = rb["t_seen"].get<std::vector<std::uint64_t>>();
  std::vector<double> us;
  for (std::size_t i = std::min<std::size_t>(10, tw.size() / 10); i < tw.size() && i < ts.size(); ++i) {
    if (tw[i] == 0 || ts[i] == 0) continue;
    us.push_back((static_cast<double>(ts[i]) - static_cast<double>(tw[i])) / 1e3);
  }
  return json{{"handoff_us", to_json(summarize(us))}, {"round_trip_us", ra["round_trip_us"]}, {"trials", trials},
              {"words", kWords}, {"stale_trials", rb["stale_trials"]}, {"stale_words", rb["stale_words"]}};
}

// --- the suite ----------------------------------------------------------------------------------------------------
/// Fills metrics, samples and notes of one environment ("" or "_mps").
void report(Result& r, const std::string& suffix, const json& spin, const json& sem, const char* label) {
  r.samples.push_back({{"what", "spin_flag_handoff" + suffix}, {"result", spin}});
  r.samples.push_back({{"what", "semaphore_handoff" + suffix}, {"result", sem}});
  if (spin.contains("error")) {
    r.notes.push_back(fmt::format("{}: the spinning kernel pair failed: {}", label, spin["error"].dump()));
    for (const auto& p : kProtocols) {
      r.metrics[fmt::format("coherence_visibility_us_{}{}", p.name, suffix)] = nullptr;
      r.metrics[fmt::format("stale_after_flag_{}{}", p.name, suffix)] = nullptr;
    }
  } else {
    std::vector<std::string> seen, clean;
    for (const auto& p : kProtocols) {
      const auto& s = spin[p.name];
      const auto obs = s["observations"].get<std::uint64_t>();
      const auto stale = s["stale_events"].get<std::uint64_t>();
      const auto timeouts = s["timed_out_blocks_reader"].get<std::uint64_t>() + s["timed_out_blocks_writer"].get<std::uint64_t>();
      const bool have_latency = s["visibility_us"]["n"].get<std::size_t>() > 0;
      r.metrics[fmt::format("coherence_visibility_us_{}{}", p.name, suffix)] =
          have_latency ? s["visibility_us"]["median"] : json(nullptr);
      r.metrics[fmt::format("coherence_visibility_p99_us_{}{}", p.name, suffix)] =
          have_latency ? s["visibility_us"]["p99"] : json(nullptr);
      r.metrics[fmt::format("stale_after_flag_{}{}", p.name, suffix)] = stale;
      r.metrics[fmt::format("coherence_observations_{}{}", p.name, suffix)] = obs;
      if (timeouts != 0) {
        r.notes.push_back(fmt::format("{}: {} protocol: {} kernel block(s) gave up after 2 s without progress; {} of "
                                      "{} observations made",
                                      label, p.name, timeouts, obs,
                                      static_cast<std::uint64_t>(kBlocks) * s["trials"].get<std::uint64_t>()));
      }
      (stale != 0 ? seen : clean)
          .push_back(stale != 0 ? fmt::format("{} ({} of {} observations, {} stale words)", p.name, stale, obs,
                                              s["stale_words"].get<std::uint64_t>())
                                : fmt::format("{} (not observed in {} observations)", p.name, obs));
    }
    std::string line = fmt::format("{}: stale data after the flag", label);
    if (!seen.empty()) line += fmt::format(" SEEN with {}", fmt::join(seen, ", "));
    if (!clean.empty()) line += fmt::format("{} none with {}", seen.empty() ? "" : ";", fmt::join(clean, ", "));
    r.notes.push_back(line + fmt::format(" ({} blocks of {} threads, {} words each, per trial)", kBlocks,
                                         kernels::Kernels::kBlock, kWordsPerBlock));
  }
  if (sem.contains("error")) {
    r.notes.push_back(fmt::format("{}: the semaphore handoff failed: {}", label, sem["error"].dump()));
    r.metrics["semaphore_handoff_us" + suffix] = nullptr;
    r.metrics["stale_semaphore" + suffix] = nullptr;
  } else {
    const bool have = sem["handoff_us"]["n"].get<std::size_t>() > 0;
    r.metrics["semaphore_handoff_us" + suffix] = have ? sem["handoff_us"]["median"] : json(nullptr);
    r.metrics["semaphore_handoff_p99_us" + suffix] = have ? sem["handoff_us"]["p99"] : json(nullptr);
    r.metrics["semaphore_round_trip_us" + suffix] = sem["round_trip_us"];
    r.metrics["stale_semaphore" + suffix] = sem["stale_trials"];
    const auto stale = sem["stale_trials"].get<std::uint64_t>();
    r.notes.push_back(fmt::format(
        "{}: handoff ordered by gpuipc semaphores (kernel writes, signal; wait, kernel reads): stale reads {} in {} "
        "trials{}; kernel end to reader kernel start {:.1f} us median",
        label, stale, sem["trials"].get<unsigned>(), stale == 0 ? " (not observed)" : " (UNEXPECTED: a bug)",
        have ? sem["handoff_us"]["median"].get<double>() : -1.0));
  }
}

double metric(const Result& r, const std::string& k) {
  return r.metrics.contains(k) && r.metrics[k].is_number() ? r.metrics[k].get<double>() : -1.0;
}

Result run(const Options& o, const DeviceMeta& meta) {
  Result r;
  r.mps = meta.mps;
  // Without MPS every round of the spinning pair costs a time slice or two (~ms): few trials there.
  const unsigned spin_trials = o.quick ? 50 : 200;
  const unsigned spin_trials_mps = o.quick ? 2000 : 20000;
  const unsigned sem_trials = o.quick ? 2000 : 20000;
  const auto kernel_timeout = std::chrono::seconds(o.quick ? 60 : 180);

  progress(o, "coherence: spinning flag handoff, no MPS");
  const json spin = spin_study({}, spin_trials, kernel_timeout);
  progress(o, "coherence: semaphore handoff, no MPS");
  const json sem = semaphore_study({}, sem_trials, kernel_timeout);
  report(r, "", spin, sem, meta.mps ? "with the machine's MPS" : "without MPS");

  progress(o, "coherence: the same under a private MPS daemon");
  bool mps_ran = false;
  if (meta.mps) {
    r.notes.push_back("MPS is already active for this machine's processes: the runs above are under MPS; no _mps "
                      "runs with a private daemon");
  } else {
    mps_ran = run_under_mps(r.notes, "_mps metrics", [&](const Env& mps_env) {
      const json spin_mps = spin_study(mps_env, spin_trials_mps, kernel_timeout);
      const json sem_mps = semaphore_study(mps_env, sem_trials, kernel_timeout);
      report(r, "_mps", spin_mps, sem_mps, "under MPS");
    });
  }

  // What a user must do, from the counts above.
  const std::string sfx = mps_ran ? "_mps" : "";
  const double plain = metric(r, "stale_after_flag_plain" + sfx);
  const double fence = metric(r, "stale_after_flag_fence" + sfx);
  const double ra = metric(r, "stale_after_flag_release_acquire" + sfx);
  const double obs_plain = metric(r, "coherence_observations_plain" + sfx);
  const double obs_fence = metric(r, "coherence_observations_fence" + sfx);
  const double obs_ra = metric(r, "coherence_observations_release_acquire" + sfx);
  const char* where = mps_ran ? "under MPS (the two kernels run side by side)" : "";
  if (plain > 0) {
    r.notes.push_back(fmt::format(
        "advice: plain volatile stores let a reader in another process see the flag before the data ({:.0f} of "
        "{:.0f} observations {}): order data before flag with cuda::atomic_ref<..., cuda::thread_scope_system> "
        "store(memory_order_release) / load(memory_order_acquire), or __threadfence_system() between data and flag "
        "(and after reading the flag); with them stale data was {} / {}",
        plain, obs_plain, where,
        ra == 0 ? fmt::format("not observed in {:.0f} observations (release/acquire)", obs_ra)
                : fmt::format("seen {:.0f} times (release/acquire)", ra),
        fence == 0 ? fmt::format("not observed in {:.0f} (fence)", obs_fence)
                   : fmt::format("seen {:.0f} times (fence)", fence)));
  } else if (plain == 0) {
    r.notes.push_back(fmt::format(
        "advice: plain volatile stores showed no stale data in {:.0f} observations {}, which is not a guarantee (the "
        "CUDA memory model allows the reorder): still use release/acquire at system scope or "
        "__threadfence_system() between data and flag; release/acquire: {:.0f} stale, fence: {:.0f} stale",
        obs_plain, where, ra, fence));
  }
  const double lat = metric(r, "coherence_visibility_us_release_acquire");
  const double lat_mps = metric(r, "coherence_visibility_us_release_acquire_mps");
  if (lat > 0 && lat_mps > 0) {
    r.notes.push_back(fmt::format(
        "advice: a flag written by another process becomes visible to a spinning kernel in {:.1f} us median under "
        "MPS but {:.1f} us without MPS ({:.0f}x: the two processes' kernels time-slice); never spin in a kernel on "
        "another process's progress without MPS",
        lat_mps, lat, lat / lat_mps));
  } else if (lat > 0) {
    r.notes.push_back(fmt::format("a flag written by another process became visible to a spinning kernel in {:.1f} us "
                                  "median ({})",
                                  lat, meta.mps ? "under the machine's MPS" : "without MPS: time slicing"));
  }
  const double sem_stale = metric(r, "stale_semaphore");
  const double sem_us = metric(r, "semaphore_handoff_us");
  if (sem_stale == 0) {
    r.notes.push_back(fmt::format(
        "advice: or let gpuipc semaphores order it (signal after the writing kernel, wait before the reading one): "
        "no stale read observed in {} trials{}, {:.1f} us from the end of the writing kernel to the start of the "
        "reading one (median), and no kernel spins",
        sem_trials, mps_ran ? fmt::format(" (nor in {} under MPS: {})", sem_trials, metric(r, "stale_semaphore_mps")) : "",
        sem_us));
  }
  return r;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{.name = "coherence",
                         .description = "what a kernel polling a flag in shared GPU memory sees while another process "
                                        "writes data then the flag (plain, fence, release/acquire; with and without "
                                        "MPS), and the same handoff through gpuipc semaphores",
                         .needs_gpu = true,
                         .run = run});

}  // namespace gpuipc::bench
