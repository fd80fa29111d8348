// The `ordering` suite: where the time of two-process streaming goes, and which way of ordering a producer's and a
// consumer's streams costs least. The channels suite measures the channel (stream_throughput_ratio); this one takes
// the channel apart, with and without MPS:
//  - op_cost: what one operation after each kernel costs a stream in one process (an event record, a stream memop
//    write or wait on host or device memory, a batch of both, a host function), against kernels alone;
//  - local: the one-process reference ordered by events, by memops on host or on device words, or not at all;
//  - two_process: the same kernels in two processes, without the channel, ordered by memops (waits, writes,
//    both), IPC events, nothing, or paced by the host (the waiting side polls the peer's word or IPC event on the
//    CPU and enqueues no GPU wait);
//  - timeline: the GPU's own record of when each kernel ran (%globaltimer, one clock for every process) for the
//    channel, the one-process reference and the main raw orderings: kernel times, the idle time between a
//    stream's kernels, and how often both, one or neither kernel ran.
#include <fmt/format.h>

#include <cstring>
#include <functional>

#include "bench.hpp"
#include "cuda/driver.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "gpuipc/segment.hpp"
#include "mps.hpp"
#include "streaming.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/events.hpp"
#include "testkit/cuda/stream.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

void memop(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    throw Error(ErrorCode::Cuda, fmt::format("{}: {}", what, cuda::result_name(r)), "bench");
  }
}

// --- what one operation after each kernel costs its stream ----------------------------------------------------
/// One process, one stream: `iterations` times [a kernel writing `bytes`, then op], against the kernels alone.
/// Medians of 3 alternating passes, microseconds per iteration; `_extra` is the op's share.
json op_costs(const Env& env, int iterations) {
  const auto results = run_workers({[&]() -> json {
    Gpu g;
    kernels::Kernels& k = g.k;
    auto other = cuda::Stream::create();
    std::vector<cuda::DeviceBuffer> buf;
    for (int i = 0; i < 8; ++i) buf.push_back(cuda::DeviceBuffer::allocate(kFrameBytes));
    void* page = std::aligned_alloc(4096, 4096);
    std::memset(page, 0, 4096);
    auto reg = cuda::HostRegistration::register_memory(page, 4096);
    auto dev = cuda::DeviceBuffer::allocate(4096);
    cuda::memset_d8(dev.get(), 0, 4096);
    const CUdeviceptr host = reg.device_pointer();
    auto ev = cuda::Event::create(CU_EVENT_DISABLE_TIMING);
    auto ipc = cuda::Event::create(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING);
    auto done = cuda::Event::create(CU_EVENT_DISABLE_TIMING);
    done.record(other.get());
    other.synchronize();
    const auto& d = cuda::driver();
    auto batch_write_wait = [&](CUstream s, CUdeviceptr w, std::uint64_t v) {
      CUstreamBatchMemOpParams ops[2] = {};
      ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[0].writeValue.address = w;
      ops[0].writeValue.value64 = v;
      ops[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
      ops[1].waitValue.address = w + 8;
      ops[1].waitValue.value64 = 0;
      ops[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
      return d.cuStreamBatchMemOp(s, 2, ops, 0);
    };
    using Op = std::function<void(CUstream, std::uint64_t)>;
    const std::vector<std::pair<const char*, Op>> ops = {
        {"none", [](CUstream, std::uint64_t) {}},
        {"event_record", [&](CUstream s, std::uint64_t) { ev.record(s); }},
        {"ipc_event_record", [&](CUstream s, std::uint64_t) { ipc.record(s); }},
        {"wait_done_event", [&](CUstream s, std::uint64_t) { cuda::stream_wait_event(s, done.get()); }},
        {"write64_host", [&](CUstream s, std::uint64_t v) { memop(cuda::stream_write_value64(s, host, v), "write"); }},
        {"write64_device", [&](CUstream s, std::uint64_t v) { memop(cuda::stream_write_value64(s, dev.get(), v), "write"); }},
        {"write32_host", [&](CUstream s, std::uint64_t v) {
           memop(d.cuStreamWriteValue32(s, host, static_cast<cuuint32_t>(v), 0), "write32");
         }},
        {"wait64_met_host", [&](CUstream s, std::uint64_t) { memop(cuda::stream_wait_value64(s, host + 8, 0), "wait"); }},
        {"wait64_met_device", [&](CUstream s, std::uint64_t) { memop(cuda::stream_wait_value64(s, dev.get() + 8, 0), "wait"); }},
        {"wait32_met_host", [&](CUstream s, std::uint64_t) {
           memop(d.cuStreamWaitValue32(s, host + 8, 0, CU_STREAM_WAIT_VALUE_GEQ), "wait32");
         }},
        {"write_then_wait_host", [&](CUstream s, std::uint64_t v) {
           memop(cuda::stream_write_value64(s, host, v), "write");
           memop(cuda::stream_wait_value64(s, host + 8, 0), "wait");
         }},
        {"batch_write_wait_host", [&](CUstream s, std::uint64_t v) { memop(batch_write_wait(s, host, v), "batch"); }},
        {"host_func", [&](CUstream s, std::uint64_t) {
           memop(cuda::launch_host_func(s, [](void*) {}, nullptr), "host func");
         }},
    };
    json out;
    for (const std::size_t bytes : {kFrameBytes, std::size_t{64} << 10}) {
      std::map<std::string, std::vector<double>> runs;
      std::uint64_t v = 0;
      for (int pass = 0; pass < 3; ++pass) {
        for (const auto& [name, op] : ops) {
          auto run = [&](int n) {
            for (int i = 0; i < n; ++i) {
              k.write_fill(g.stream.get(), buf[static_cast<std::size_t>(i) % buf.size()].get(), bytes / 16,
                           static_cast<std::uint32_t>(i));
              op(g.stream.get(), ++v);
            }
            g.stream.synchronize();
          };
          run(100);
          const auto t0 = now_ns();
          run(iterations);
          runs[name].push_back(static_cast<double>(now_ns() - t0) / 1e3 / iterations);
        }
      }
      json size;
      const double none = summarize(runs["none"]).median;
      for (const auto& [name, us] : runs) {
        const double m = summarize(us).median;
        size[name] = m;
        if (name != "none") size[name + "_extra"] = m - none;
      }
      out[fmt::format("kernel_{}KiB", bytes >> 10)] = size;
    }
    reg = cuda::HostRegistration();
    std::free(page);
    return out;
  }}, env);
  return results[0];
}

// --- the two-process streaming without the channel -------------------------------------------------------------
/// How the producer's and consumer's streams find each other's progress.
struct Ordering {
  enum class Sync : std::uint8_t { Words, Events, None };
  enum class Write : std::uint8_t {
    Default,  ///< cuStreamWriteValue64 (a system-scope barrier, then the write)
    Skip,     ///< no write (with waits for 0: what the waits alone cost)
  };
  const char* name;
  Sync sync = Sync::Words;
  bool device_words = true;  ///< words in a device segment, else on a pinned host page
  Write write = Write::Default;
  bool wait_zero = false;    ///< waits are for 0 (always met): the memops' cost without the dependency
  bool no_waits = false;
  bool host_paced = false;   ///< the waiting side polls the word (host words) or IPC event on the CPU: no GPU wait
  int lag = 0;               ///< host-paced words: the producer of frame f waits for the release of f - lag (0: of
                             ///< f - slots, what reusing the slot needs), to keep the consumer close behind
};

const std::vector<Ordering>& orderings() {
  using S = Ordering::Sync;
  static const std::vector<Ordering> all = {
      {.name = "host_words", .device_words = false},
      {.name = "device_words"},
      {.name = "device_words_no_dependency", .wait_zero = true},
      {.name = "device_writes_only", .no_waits = true},
      {.name = "device_waits_only", .write = Ordering::Write::Skip, .wait_zero = true},
      {.name = "host_paced_words", .device_words = false, .host_paced = true},
      {.name = "host_paced_words_lag2", .device_words = false, .host_paced = true, .lag = 2},
      {.name = "host_paced_words_lag4", .device_words = false, .host_paced = true, .lag = 4},
      {.name = "ipc_events", .sync = S::Events},
      {.name = "none", .sync = S::None},
  };
  return all;
}

/// Per-slot IPC events and the host relay of their records (lives in a SharedPage).
struct EventRelay {
  CUipcEventHandle filled[16], freed[16];
  std::atomic<std::uint64_t> filled_recorded, freed_recorded;  // frames whose record was enqueued
};

/// The streaming measurement without the channel: the same two kernels and slots (filled[b] at b*128, freed[b]
/// at b*128+64 for the word variants). {"fps"} from the common start until both finished; timed, {"timeline"}.
json raw_stream(const Env& env, int frames, std::uint32_t slots, const Ordering& ordering, bool timed = false) {
  if (slots > 16) throw Error(ErrorCode::InvalidArgument, "raw streaming: at most 16 slots", "bench");
  const SyncPage page;
  Sync* sync = page.get();
  SharedPage relay_page;
  auto* relay = new (relay_page.as<EventRelay>()) EventRelay{};
  const std::string name = unique("raw");
  const bool words = ordering.sync == Ordering::Sync::Words;
  const bool events = ordering.sync == Ordering::Sync::Events;
  struct Side {
    Segment data, dev, host;
    std::vector<cuda::Event> own;           // IPC events this side records
    std::vector<cuda::ImportedEvent> peer;  // the other side's
    std::size_t offset(std::uint32_t b, bool freed) const { return b * 128 + (freed ? 64 : 0); }
    CUdeviceptr word(std::uint32_t b, bool device, bool freed) const {
      return (device ? dev.device_pointer() : host.device_pointer()) + offset(b, freed);
    }
    const std::atomic<std::uint64_t>& host_word(std::uint32_t b, bool freed) const {
      return *reinterpret_cast<const std::atomic<std::uint64_t>*>(static_cast<const char*>(host.data()) + offset(b, freed));
    }
  };
  auto open_all = [&](bool producer) {
    Side m;
    const CreateOptions host_opts{.kind = SegmentKind::HostPinned, .device = 0, .mode = 0600};
    const CreateOptions dev_opts{.kind = SegmentKind::Device, .device = 0, .mode = 0600};
    if (producer) {
      m.data = Segment::create(name + ".data", slots * kFrameBytes, dev_opts);
      m.dev = Segment::create(name + ".dev", 2 << 20, dev_opts);
      m.host = Segment::create(name + ".host", 4096, host_opts);
      cuda::memset_d8(m.dev.device_pointer(), 0, 2 << 20);
      std::memset(m.host.data(), 0, 4096);
    } else {
      m.data = Segment::open(name + ".data", {});
      m.dev = Segment::open(name + ".dev", {});
      m.host = Segment::open(name + ".host", {});
    }
    if (events) {
      for (std::uint32_t b = 0; b < slots; ++b) {
        m.own.push_back(cuda::Event::create(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING));
        (producer ? relay->filled : relay->freed)[b] = cuda::ipc_get_event_handle(m.own.back());
      }
    }
    return m;
  };
  auto import_peer = [&](Side& m, bool producer) {
    if (!events) return;
    for (std::uint32_t b = 0; b < slots; ++b) {
      m.peer.push_back(cuda::ImportedEvent::open((producer ? relay->freed : relay->filled)[b]));
    }
  };
  // Frame f uses slot f % slots; its producer first waits for the consumer's release of frame f - slots.
  auto wait_for_peer = [&](const Side& m, CUstream s, bool producer, int f) {
    const auto b = static_cast<std::uint32_t>(f) % slots;
    const std::uint64_t round = static_cast<std::uint64_t>(f) / slots;
    const bool needed = !producer || round > 0;
    const std::uint64_t value = producer ? round : round + 1;  // what the peer's word must reach
    if (words && !ordering.no_waits) {
      if (ordering.host_paced) {
        if (producer && ordering.lag > 0) {
          if (f >= ordering.lag) {
            const auto g = static_cast<std::uint32_t>(f - ordering.lag);
            const auto& w = m.host_word(g % slots, true);
            await([&] { return w.load(std::memory_order_acquire) >= g / slots + 1; }, "the peer's word");
          }
        } else if (needed) {
          const auto& w = m.host_word(b, producer);
          await([&] { return w.load(std::memory_order_acquire) >= value; }, "the peer's word");
        }
      } else if (ordering.wait_zero) {
        memop(cuda::stream_wait_value64(s, m.word(b, ordering.device_words, producer), 0), "wait");
      } else if (needed) {
        memop(cuda::stream_wait_value64(s, m.word(b, ordering.device_words, producer), value), "wait");
      }
    } else if (events && needed) {
      // A wait covers the event's latest record when it is enqueued: the host relays that the record happened.
      const std::uint64_t need = producer ? static_cast<std::uint64_t>(f) - slots + 1 : static_cast<std::uint64_t>(f) + 1;
      await([&] { return (producer ? relay->freed_recorded : relay->filled_recorded).load() >= need; }, "a record");
      if (ordering.host_paced) {
        const auto& d = cuda::driver();
        CUresult r = CUDA_ERROR_NOT_READY;
        await([&] { return (r = d.cuEventQuery(m.peer[b].get())) != CUDA_ERROR_NOT_READY; }, "the peer's event");
        memop(r, "cuEventQuery");
      } else {
        cuda::stream_wait_event(s, m.peer[b].get());
      }
    }
  };
  auto tell_peer = [&](const Side& m, CUstream s, bool producer, int f) {
    const auto b = static_cast<std::uint32_t>(f) % slots;
    const std::uint64_t value = static_cast<std::uint64_t>(f) / slots + 1;
    if (words) {
      const CUdeviceptr w = m.word(b, ordering.device_words, !producer);
      if (ordering.write == Ordering::Write::Default) memop(cuda::stream_write_value64(s, w, value), "write");
    } else if (events) {
      m.own[b].record(s);
      (producer ? relay->filled_recorded : relay->freed_recorded).store(static_cast<std::uint64_t>(f) + 1);
    }
  };
  const auto results = run_workers(
      {[&]() -> json {
         Gpu g;
         FrameKernels k(timed ? frames : 0);
         Side m = open_all(true);
         sync->a_ready = 1;
         await([&] { return sync->b_ready.load() == 1; }, "the consumer");
         import_peer(m, true);
         sync->progress_a = 1;
         await([&] { return sync->progress_b.load() == 1; }, "the consumer's events");
         sync->t0 = now_ns();
         for (int f = 0; f < frames; ++f) {
           const auto b = static_cast<std::uint32_t>(f) % slots;
           wait_for_peer(m, g.stream.get(), true, f);
           k.write(g.stream.get(), m.data.device_pointer() + b * kFrameBytes, f);
           tell_peer(m, g.stream.get(), true, f);
         }
         g.stream.synchronize();
         const double seconds = static_cast<double>(now_ns() - sync->t0.load()) / 1e9;
         await([&] { return sync->progress_b.load() == 2; }, "the consumer to finish");
         return json{{"seconds", seconds}, {"stamps", k.stamps()}};
       },
       [&]() -> json {
         Gpu g;
         FrameKernels k(timed ? frames : 0);
         await([&] { return sync->a_ready.load() == 1; }, "the segments");
         Side m = open_all(false);
         sync->b_ready = 1;
         await([&] { return sync->progress_a.load() == 1; }, "the producer's events");
         import_peer(m, false);
         sync->progress_b = 1;
         for (int f = 0; f < frames; ++f) {
           const auto b = static_cast<std::uint32_t>(f) % slots;
           wait_for_peer(m, g.stream.get(), false, f);
           k.read(g.stream.get(), m.data.device_pointer() + b * kFrameBytes, f);
           tell_peer(m, g.stream.get(), false, f);
         }
         g.stream.synchronize();
         const double seconds = static_cast<double>(now_ns() - sync->t0.load()) / 1e9;
         json out = {{"seconds", seconds}, {"stamps", k.stamps()}};
         sync->progress_b = 2;
         return out;
       }},
      env, std::chrono::seconds(45));
  for (const char* suffix : {".data", ".dev", ".host"}) Segment::unlink(name + suffix);
  json out = {{"fps", frames / std::max(results[0]["seconds"].get<double>(), results[1]["seconds"].get<double>())}};
  if (timed) out["timeline"] = timeline_stats(results[0]["stamps"], results[1]["stamps"]);
  return out;
}

/// Runs `f`; a study variant that fails becomes {"error": what} rather than costing the suite its other figures.
json guarded(const std::function<json()>& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return json{{"error", e.what()}};
  }
}

const Ordering& ordering_named(const char* name) {
  for (const Ordering& o : orderings()) {
    if (std::strcmp(o.name, name) == 0) return o;
  }
  throw Error(ErrorCode::InvalidArgument, fmt::format("no ordering {}", name), "bench");
}

/// Everything, in one environment (plain, or under MPS): samples named with `suffix`, headline metrics too.
void study(const Options& o, const Env& env, const char* suffix, Result& r) {
  const int frames = o.quick ? 2000 : 5000;
  const int repetitions = o.quick ? 1 : 3;
  const std::uint32_t slots = kStreamSlots;

  progress(o, fmt::format("ordering{}: one operation after each kernel", suffix));
  r.samples.push_back({{"what", fmt::format("op_cost{}", suffix)}, {"result", guarded([&] { return op_costs(env, o.quick ? 500 : 2000); })}});

  // The reference first (medians of alternating runs: the GPU's pace drifts), then every variant against it.
  progress(o, fmt::format("ordering{}: one process", suffix));
  std::map<std::string, std::vector<double>> local_runs;
  for (int rep = 0; rep < repetitions; ++rep) {
    for (const LocalOrder lo : {LocalOrder::Events, LocalOrder::None, LocalOrder::HostWords, LocalOrder::DeviceWords}) {
      local_runs[to_string(lo)].push_back(local_stream(env, frames, slots, lo)["fps"].get<double>());
    }
  }
  const double reference = summarize(local_runs["events"]).median;
  json local;
  for (const auto& [name, runs] : local_runs) {
    const double fps = summarize(runs).median;
    local[name] = {{"fps", fps}, {"ratio", fps / reference}, {"runs", runs}};
  }
  r.samples.push_back({{"what", fmt::format("local{}", suffix)}, {"slots", slots}, {"frames", frames}, {"result", local}});

  progress(o, fmt::format("ordering{}: two processes, ordered without the channel", suffix));
  json two;
  {
    std::vector<double> runs;
    json last;
    for (int rep = 0; rep < repetitions; ++rep) {
      last = channel_stream(env, frames, slots);
      runs.push_back(last["fps"].get<double>());
    }
    const double fps = summarize(runs).median;
    two["channel"] = {{"fps", fps}, {"ratio", fps / reference}, {"runs", runs},
                      {"producer_host", last["producer_host"]}, {"consumer_host", last["consumer_host"]}};
  }
  // The channel's pacing (the "channel" row has the defaults): none at all, and producers let further ahead.
  auto channel_variant = [&](const std::string& name, const Env& variant_env, std::optional<std::chrono::nanoseconds> pacing) {
    two[name] = guarded([&] {
      std::vector<double> runs;
      json last;
      for (int rep = 0; rep < repetitions; ++rep) {
        last = channel_stream(variant_env, frames, slots, {.pacing = pacing});
        runs.push_back(last["fps"].get<double>());
      }
      const double fps = summarize(runs).median;
      return json{{"fps", fps}, {"ratio", fps / reference}, {"runs", runs},
                  {"producer_host", last["producer_host"]}, {"consumer_host", last["consumer_host"]}};
    });
  };
  channel_variant("channel_pacing_0us", env, std::chrono::nanoseconds(0));
  for (const int ahead : {5, 6, 7, 8}) {
    Env e = env;
    e.emplace_back("GPUIPC_CHANNEL_PACING_AHEAD", std::to_string(ahead));
    channel_variant(fmt::format("channel_ahead_{}", ahead), e, std::nullopt);
  }
  for (const Ordering& w : orderings()) {
    two[w.name] = guarded([&] {
      std::vector<double> runs;
      for (int rep = 0; rep < repetitions; ++rep) runs.push_back(raw_stream(env, frames, slots, w)["fps"].get<double>());
      const double fps = summarize(runs).median;
      return json{{"fps", fps}, {"ratio", fps / reference}, {"runs", runs}};
    });
  }
  r.samples.push_back({{"what", fmt::format("two_process{}", suffix)}, {"slots", slots}, {"frames", frames},
                       {"fps_one_process", reference}, {"result", two}});
  for (const char* name : {"channel", "channel_pacing_0us", "channel_ahead_6", "host_words", "host_paced_words", "none"}) {
    if (two[name].contains("ratio")) r.metrics[fmt::format("{}_ratio{}", name, suffix)] = two[name]["ratio"];
  }

  progress(o, fmt::format("ordering{}: GPU timelines", suffix));
  json timelines;
  timelines["one_process_events"] = guarded([&] { return local_stream(env, frames, slots, LocalOrder::Events, true); });
  timelines["channel"] = guarded([&] { return channel_stream(env, frames, slots, {.timed = true}); });
  timelines["channel_pacing_0us"] = guarded([&] { return channel_stream(env, frames, slots, {.timed = true, .pacing = std::chrono::nanoseconds(0)}); });
  for (const char* name : {"host_words", "host_paced_words", "host_paced_words_lag2", "none"}) {
    timelines[name] = guarded([&] { return raw_stream(env, frames, slots, ordering_named(name), true); });
  }
  r.samples.push_back({{"what", fmt::format("timeline{}", suffix)}, {"slots", slots}, {"frames", frames}, {"result", timelines}});
}

Result run(const Options& o, const DeviceMeta& meta) {
  Result r;
  r.mps = meta.mps;
  study(o, {}, "", r);
  progress(o, "ordering: the same under MPS");
  run_under_mps(r.notes, "_mps samples", [&](const Env& mps_env) { study(o, mps_env, "_mps", r); });
  return r;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{.name = "ordering",
                         .description = "where two-process streaming time goes: the cost of each stream operation, "
                                        "orderings without the channel (memops, IPC events, host pacing), GPU "
                                        "timelines; with and without MPS",
                         .needs_gpu = true,
                         .run = run});

}  // namespace gpuipc::bench
