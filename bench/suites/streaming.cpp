#include "streaming.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>

#include "bench.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "gpuipc/channel.hpp"
#include "os/identity.hpp"
#include "os/process.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/events.hpp"
#include "testkit/cuda/stream.hpp"
#include "workers.hpp"

namespace gpuipc::bench {

using json = nlohmann::json;

std::string unique(const char* what) {
  static std::atomic<std::uint32_t> n{0};
  return fmt::format("bench-{}-{}-{}", what, os::current_pid(), n.fetch_add(1) + now_ns() % 100000);
}

FrameKernels::FrameKernels(int timed_frames) : m_out(cuda::DeviceBuffer::allocate(8)), m_frames(timed_frames) {
  cuda::memset_d8(m_out.get(), 0, 8);
  if (m_frames > 0) {
    m_stamps = cuda::DeviceBuffer::allocate(16 * static_cast<std::size_t>(m_frames));
    cuda::memset_d8(m_stamps.get(), 0xff, 16 * static_cast<std::size_t>(m_frames));
  }
}

void FrameKernels::write(CUstream stream, CUdeviceptr data, int frame) const {
  const auto value = static_cast<std::uint32_t>(frame);
  if (m_frames > 0 && frame < m_frames) {
    m_k.write_fill_timed(stream, data, kFrameBytes / 16, value, stamp(frame));
  } else {
    m_k.write_fill(stream, data, kFrameBytes / 16, value);
  }
}

void FrameKernels::read(CUstream stream, CUdeviceptr data, int frame) const {
  if (m_frames > 0 && frame < m_frames) {
    m_k.read_sum_timed(stream, data, kFrameBytes / 16, m_out.get(), stamp(frame));
  } else {
    m_k.read_sum(stream, data, kFrameBytes / 16, m_out.get());
  }
}

json FrameKernels::stamps() const {
  if (m_frames == 0) return nullptr;
  std::vector<std::uint64_t> raw(2 * static_cast<std::size_t>(m_frames));
  cuda::copy_to_host(raw.data(), m_stamps.get(), raw.size() * sizeof(std::uint64_t));
  for (std::size_t i = 1; i < raw.size(); i += 2) raw[i] = ~raw[i];  // the kernels store ~end (see kernels.cu)
  return raw;
}

namespace {

/// Host time of the three calls a side makes per frame: medians and means (us), and the mean host time per frame.
class CallTimes {
 public:
  void start() noexcept { m_last = now_ns(); }
  void lap(int call) {
    const std::int64_t t = now_ns();
    m_us[call].push_back(static_cast<double>(t - m_last) / 1e3);
    m_last = t;
  }
  json summary(const std::array<const char*, 3>& names) const {
    json out;
    double per_frame = 0;
    for (int i = 0; i < 3; ++i) {
      const Summary s = summarize(m_us[i]);
      out[names[i]] = {{"median", s.median}, {"mean", s.mean}};
      per_frame += s.mean;
    }
    out["frame_us_mean"] = per_frame;
    return out;
  }

 private:
  std::int64_t m_last = 0;
  std::vector<double> m_us[3];
};

}  // namespace

json channel_stream(const Env& env, int frames, std::uint32_t slots, const StreamShape& shape) {
  const SyncPage page;
  Sync* sync = page.get();
  const std::string name = unique("stream");
  const UnlinkOnExit unlink_name([&] { Channel::unlink(name); });
  const bool timed = shape.timed;
  const int batch = static_cast<int>(std::clamp<std::uint32_t>(shape.batch, 1, slots));
  const auto results = run_workers(
      {[&]() -> json {
         Gpu g(shape.gpus.producer);
         FrameKernels k(timed ? frames : 0);
         auto ch = Channel::create(name, {.slots = slots, .slot_bytes = kFrameBytes, .header_bytes = 0,
                                          .kind = SegmentKind::Device, .device = shape.gpus.producer, .mode = 0600},
                                   ChannelRole::Producer);
         if (shape.pacing) ch.set_pacing(*shape.pacing);
         if (shape.ahead) ch.set_pacing_ahead(*shape.ahead);
         sync->a_ready = 1;
         await([&] { return sync->b_ready.load() == 1; }, "the consumer");
         sync->t0 = now_ns();
         CallTimes t;
         std::vector<CUdeviceptr> slot(static_cast<std::size_t>(batch));
         for (int f = 0; f < frames; f += batch) {
           const int n = std::min(batch, frames - f);
           t.start();
           for (int i = 0; i < n; ++i) {
             SlotView s;
             check_status(ch.acquire(g.stream.get(), std::chrono::seconds(30), s), "acquire");
             slot[static_cast<std::size_t>(i)] = s.device_pointer;
           }
           t.lap(0);
           for (int i = 0; i < n; ++i) k.write(g.stream.get(), slot[static_cast<std::size_t>(i)], f + i);
           t.lap(1);
           for (int i = 0; i < n; ++i) check_status(ch.publish(g.stream.get(), {}, kFrameBytes), "publish");
           t.lap(2);
         }
         g.stream.synchronize();
         return json{{"stamps", k.stamps()}, {"host", t.summary({"acquire_us", "launch_us", "publish_us"})}};
       },
       [&]() -> json {
         Gpu g(shape.gpus.consumer);
         FrameKernels k(timed ? frames : 0);
         await([&] { return sync->a_ready.load() == 1; }, "the channel");
         auto ch = Channel::open(name, ChannelRole::Consumer, {.wait = {}, .device = shape.gpus.consumer});
         if (shape.pacing) ch.set_pacing(*shape.pacing);
         sync->b_ready = 1;
         CallTimes t;
         std::vector<CUdeviceptr> message(static_cast<std::size_t>(batch));
         for (int f = 0; f < frames; f += batch) {
           const int n = std::min(batch, frames - f);
           t.start();
           for (int i = 0; i < n; ++i) {
             MessageView m;
             check_status(ch.receive(g.stream.get(), std::chrono::seconds(30), m), "receive");
             message[static_cast<std::size_t>(i)] = m.device_pointer;
           }
           t.lap(0);
           for (int i = 0; i < n; ++i) k.read(g.stream.get(), message[static_cast<std::size_t>(i)], f + i);
           t.lap(1);
           for (int i = 0; i < n; ++i) check_status(ch.release(g.stream.get()), "release");
           t.lap(2);
         }
         g.stream.synchronize();
         const double seconds = static_cast<double>(now_ns() - sync->t0.load()) / 1e9;
         return json{{"seconds", seconds}, {"stamps", k.stamps()},
                     {"host", t.summary({"receive_us", "launch_us", "release_us"})}};
       }},
      env);
  json out = {{"fps", frames / results[1]["seconds"].get<double>()}, {"producer_host", results[0]["host"]},
              {"consumer_host", results[1]["host"]}};
  if (timed) out["timeline"] = timeline_stats(results[0]["stamps"], results[1]["stamps"]);
  return out;
}

const char* to_string(LocalOrder order) noexcept {
  switch (order) {
    case LocalOrder::Events: return "events";
    case LocalOrder::None: return "none";
    case LocalOrder::HostWords: return "host_words";
    case LocalOrder::DeviceWords: return "device_words";
  }
  return "?";
}

json local_stream(const Env& env, int frames, std::uint32_t slots, LocalOrder order, bool timed) {
  const auto results = run_workers(
      {[&]() -> json {
        Gpu g;
        FrameKernels producer(timed ? frames : 0), consumer_kernels(timed ? frames : 0);
        auto consumer = cuda::Stream::create();
        std::vector<cuda::DeviceBuffer> buf;
        std::vector<cuda::Event> filled, freed;
        for (std::uint32_t i = 0; i < slots; ++i) {
          buf.push_back(cuda::DeviceBuffer::allocate(kFrameBytes));
          filled.push_back(cuda::Event::create(CU_EVENT_DISABLE_TIMING));
          freed.push_back(cuda::Event::create(CU_EVENT_DISABLE_TIMING));
        }
        // Memop words: filled[b] at b * 128, freed[b] at b * 128 + 64, on a pinned host page or in device memory.
        void* page = std::aligned_alloc(4096, 4096);
        std::memset(page, 0, 4096);
        auto reg = cuda::HostRegistration::register_memory(page, 4096);
        auto dev = cuda::DeviceBuffer::allocate(4096);
        cuda::memset_d8(dev.get(), 0, 4096);
        const CUdeviceptr words = order == LocalOrder::HostWords ? reg.device_pointer() : dev.get();
        auto memop = [](CUresult r, const char* what) {
          if (r != CUDA_SUCCESS) throw Error(ErrorCode::Cuda, fmt::format("{}: CUresult {}", what, static_cast<int>(r)), "bench");
        };
        const bool memops = order == LocalOrder::HostWords || order == LocalOrder::DeviceWords;
        const auto t0 = now_ns();
        for (int f = 0; f < frames; ++f) {
          const auto b = static_cast<std::size_t>(f) % slots;
          const std::uint64_t round = static_cast<std::uint64_t>(f) / slots;
          if (f >= static_cast<int>(slots)) {
            if (order == LocalOrder::Events) cuda::stream_wait_event(g.stream.get(), freed[b].get());
            if (memops) memop(cuda::stream_wait_value64(g.stream.get(), words + b * 128 + 64, round), "wait freed");
          }
          producer.write(g.stream.get(), buf[b].get(), f);
          if (order == LocalOrder::Events) {
            filled[b].record(g.stream.get());
            cuda::stream_wait_event(consumer.get(), filled[b].get());
          }
          if (memops) {
            memop(cuda::stream_write_value64(g.stream.get(), words + b * 128, round + 1), "write filled");
            memop(cuda::stream_wait_value64(consumer.get(), words + b * 128, round + 1), "wait filled");
          }
          consumer_kernels.read(consumer.get(), buf[b].get(), f);
          if (order == LocalOrder::Events) freed[b].record(consumer.get());
          if (memops) memop(cuda::stream_write_value64(consumer.get(), words + b * 128 + 64, round + 1), "write freed");
        }
        g.stream.synchronize();
        consumer.synchronize();
        const double seconds = static_cast<double>(now_ns() - t0) / 1e9;
        json out = {{"seconds", seconds}, {"producer", producer.stamps()}, {"consumer", consumer_kernels.stamps()}};
        reg = cuda::HostRegistration();
        std::free(page);
        return out;
      }},
      env);
  json out = {{"fps", frames / results[0]["seconds"].get<double>()}};
  if (timed) out["timeline"] = timeline_stats(results[0]["producer"], results[0]["consumer"]);
  return out;
}

json timeline_stats(const json& producer, const json& consumer) {
  const auto p = producer.get<std::vector<std::uint64_t>>();
  const auto c = consumer.get<std::vector<std::uint64_t>>();
  const std::size_t frames = std::min(p.size(), c.size()) / 2;
  const std::size_t first = frames / 10;
  if (frames < 20) return json{{"error", "too few frames"}};
  auto us = [](std::uint64_t later, std::uint64_t earlier) {
    return (static_cast<double>(later) - static_cast<double>(earlier)) / 1e3;
  };
  std::vector<double> p_kernel, c_kernel, p_idle, c_idle, handoff;
  struct Edge {
    std::uint64_t t;
    int delta;
  };
  std::vector<Edge> edges;
  for (std::size_t f = first; f < frames; ++f) {
    const std::uint64_t ps = p[2 * f], pe = p[2 * f + 1], cs = c[2 * f], ce = c[2 * f + 1];
    if (ps == ~0ULL || cs == ~0ULL || pe < ps || ce < cs) continue;  // a frame a kernel did not stamp
    p_kernel.push_back(us(pe, ps));
    c_kernel.push_back(us(ce, cs));
    handoff.push_back(us(cs, pe));
    if (f + 1 < frames) {
      p_idle.push_back(us(p[2 * f + 2], pe));
      c_idle.push_back(us(c[2 * f + 2], ce));
    }
    edges.push_back({ps, +1});
    edges.push_back({pe, -1});
    edges.push_back({cs, +1});
    edges.push_back({ce, -1});
  }
  if (edges.empty()) return json{{"error", "no stamped frames"}};
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) { return a.t < b.t || (a.t == b.t && a.delta < b.delta); });
  double by_running[3] = {0, 0, 0};
  // Stretches with neither kernel running longer than 20 us: where the GPU switches between the processes'
  // contexts (or waits for a host), as opposed to the few microseconds between back-to-back kernels.
  constexpr double kLongGapNs = 20e3;
  std::vector<double> long_gaps;
  int running = 0;
  for (std::size_t i = 0; i + 1 < edges.size(); ++i) {
    running += edges[i].delta;
    const auto gap = static_cast<double>(edges[i + 1].t - edges[i].t);
    by_running[std::clamp(running, 0, 2)] += gap;
    if (running <= 0 && gap > kLongGapNs) long_gaps.push_back(gap / 1e3);
  }
  auto p90 = [](std::vector<double> v) {
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    return v[v.size() * 9 / 10];
  };
  const double span = static_cast<double>(edges.back().t - edges.front().t);
  auto median = [](std::vector<double> v) { return v.empty() ? 0.0 : summarize(std::move(v)).median; };
  return json{{"frames", p_kernel.size()},
              {"period_us", span / 1e3 / static_cast<double>(p_kernel.size())},
              {"producer_kernel_us", median(p_kernel)},
              {"consumer_kernel_us", median(c_kernel)},
              {"producer_idle_us", median(p_idle)},
              {"consumer_idle_us", median(c_idle)},
              {"write_end_to_read_start_us", median(handoff)},
              {"share_none_running", by_running[0] / span},
              {"share_one_running", by_running[1] / span},
              {"share_both_running", by_running[2] / span},
              {"producer_idle_p90_us", p90(p_idle)},
              {"consumer_idle_p90_us", p90(c_idle)},
              {"long_gaps_per_100_frames", 100.0 * static_cast<double>(long_gaps.size()) / static_cast<double>(p_kernel.size())},
              {"long_gap_median_us", median(long_gaps)}};
}

}  // namespace gpuipc::bench
