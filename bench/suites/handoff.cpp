#include "handoff.hpp"

#include <chrono>
#include <vector>

#include "bench.hpp"
#include "gpu.hpp"
#include "gpuipc/channel.hpp"
#include "sync.hpp"
#include "workers.hpp"

namespace gpuipc::bench {

using json = nlohmann::json;

// --- channel handoff ------------------------------------------------------------------------------------------
// One slot: the producer's next acquire returns when the consumer has released the previous message, so
// acquire(k+1) - publish(k) is one handoff round trip: publish -> the consumer holds the buffer (a device pointer
// its stream may use) -> the producer sees the release.
//
// `drained`: both streams are synchronised between round trips (outside the timed window), so each one is a
// handoff on idle GPUs: the latency a pipeline sees. Back to back (not drained), every round trip also queues a
// cross-process round trip of the two streams (write filled, wait, write freed, wait), and once the queues are
// full the host runs at the GPUs' pace: that is the sustained rate of a one-slot channel.
json handoff_rtt(std::size_t bytes, int iterations, SegmentKind kind, bool drained, FrameGpus gpus) {
  const SyncPage page;
  Sync* sync = page.get();
  const std::string name = unique("handoff");
  const UnlinkOnExit unlink_name([&] { Channel::unlink(name); });
  const auto results = run_workers(
      {[&]() -> json {
         Gpu g(gpus.producer);
         auto ch = Channel::create(name, {.slots = 1, .slot_bytes = bytes, .header_bytes = 64,
                                          .kind = kind, .device = gpus.producer, .mode = 0600},
                                   ChannelRole::Producer);
         sync->a_ready = 1;
         await([&] { return sync->b_ready.load() == 1; }, "the consumer");
         std::vector<double> us, publish_us, acquire_us;
         std::int64_t published = 0;
         for (int k = 0; k <= iterations + 50; ++k) {
           SlotView s;
           const auto a0 = now_ns();
           check_status(ch.acquire(g.stream.get(), std::chrono::seconds(30), s), "acquire");
           const auto a1 = now_ns();
           if (k > 50) {
             us.push_back(static_cast<double>(a1 - published) / 1e3);
             acquire_us.push_back(static_cast<double>(a1 - a0) / 1e3);
           }
           if (k == iterations + 50) break;
           if (drained) {
             g.stream.synchronize();
             await([&] { return sync->progress_b.load(std::memory_order_acquire) == static_cast<std::uint64_t>(k); },
                   "the consumer's stream to drain");
           }
           published = now_ns();
           check_status(ch.publish(g.stream.get(), {}, bytes), "publish");
           if (k > 50) publish_us.push_back(static_cast<double>(now_ns() - published) / 1e3);
         }
         g.stream.synchronize();
         return json{{"rtt_us", to_json(summarize(us))}, {"publish_call_us", to_json(summarize(publish_us))},
                     {"acquire_call_us", to_json(summarize(acquire_us))}};
       },
       [&]() -> json {
         Gpu g(gpus.consumer);
         await([&] { return sync->a_ready.load() == 1; }, "the channel");
         auto ch = Channel::open(name, ChannelRole::Consumer, {.wait = {}, .device = gpus.consumer});
         sync->b_ready = 1;
         std::vector<double> receive_us, release_us;
         for (int k = 0; k < iterations + 50; ++k) {
           MessageView m;
           const auto r0 = now_ns();
           check_status(ch.receive(g.stream.get(), std::chrono::seconds(30), m), "receive");
           const auto r1 = now_ns();
           check_status(ch.release(g.stream.get()), "release");
           const auto r2 = now_ns();
           if (k >= 50) {
             receive_us.push_back(static_cast<double>(r1 - r0) / 1e3);
             release_us.push_back(static_cast<double>(r2 - r1) / 1e3);
           }
           if (drained) {
             g.stream.synchronize();
             sync->progress_b.store(static_cast<std::uint64_t>(k + 1), std::memory_order_release);
           }
         }
         g.stream.synchronize();
         return json{{"receive_call_us", to_json(summarize(receive_us))},
                     {"release_call_us", to_json(summarize(release_us))}};
       }});
  json out = results[0];
  out["receive_call_us"] = results[1]["receive_call_us"];
  out["release_call_us"] = results[1]["release_call_us"];
  return out;
}

}  // namespace gpuipc::bench
