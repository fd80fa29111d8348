// gpuipc example: one process, many threads. Opening a segment this process already has open is a cache hit (no
// broker round trip, the same mapping); handles are cheap to copy and threads share them; a channel works between
// two threads of one process as between processes. --kind host (default) needs no GPU; --kind device uses GPU 0.
#include <gpuipc/channel.hpp>
#include <gpuipc/segment.hpp>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "common.hpp"

using namespace std::chrono_literals;

constexpr const char* kUsage =
    "gpuipc-example-intra [--name NAME] [--kind host|device] [--threads 4 (1-1024)] [--opens 1000]\n"
    "                     [--messages 10000]\n";

namespace {

int intra(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage, {"--name", "--kind", "--threads", "--opens", "--messages"});
  const std::string name = args.get("--name", "intra");
  const bool device = args.choice("--kind", "host", {"host", "device"}) == "device";
  const auto threads = static_cast<std::size_t>(args.num("--threads", 4, 1, 1024));  // a MiB each
  const long long opens = args.num("--opens", 1000, 1, 100000000);
  const auto messages = static_cast<std::uint64_t>(args.num("--messages", 10000, 0, 1LL << 40));
  std::string why;
  if (device && example::gpu_count(&why) == 0) {
    std::fprintf(stderr, "intra: --kind device needs a GPU (%s); run with --kind host\n", why.c_str());
    return 3;
  }
  const auto kind = device ? gpuipc::SegmentKind::Device : gpuipc::SegmentKind::Host;
  const std::size_t slice = 1 << 20;

  // 1. Opening again is a cache hit: the same mapping, no broker round trip.
  const gpuipc::Segment seg = gpuipc::Segment::create(name, threads * slice, {.kind = kind});
  example::remove_at_exit(name, gpuipc::Segment::unlink);
  std::vector<double> us;
  bool same = true;
  for (long long i = 0; i < opens; ++i) {
    const double t0 = example::now_s();
    const gpuipc::Segment again = gpuipc::Segment::open(name);
    us.push_back((example::now_s() - t0) * 1e6);
    same = same && again.data() == seg.data();
  }
  std::printf("intra: %lld opens of '%s' (%s) in this process: p50 %.2f us, p99 %.2f us, same mapping: %s\n", opens,
              name.c_str(), device ? "device" : "host", example::median(us), example::percentile(us, 99),
              same ? "yes" : "no");

  // 2. Threads share: each opens the segment by name itself and fills its own slice with its number (as a byte: the
  // 257th thread writes 1s, as the first does).
  std::vector<std::thread> workers;
  for (std::size_t t = 0; t < threads; ++t)
    workers.emplace_back([&, t] {
      const gpuipc::Segment mine = gpuipc::Segment::open(name);
      char* p = static_cast<char*>(mine.data()) + t * slice;
      if (device)
        CUDA_CHECK(cudaMemset(p, int(t + 1), slice));
      else
        std::memset(p, int(t + 1), slice);
    });
  for (std::thread& w : workers) w.join();
  std::vector<unsigned char> all(threads * slice);
  if (device)
    CUDA_CHECK(cudaMemcpy(all.data(), seg.data(), all.size(), cudaMemcpyDeviceToHost));
  else
    std::memcpy(all.data(), seg.data(), all.size());
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < all.size(); ++i) wrong += all[i] != ((i / slice + 1) & 0xff);
  std::printf("intra: %zu threads wrote their slices through their own handles; %zu bytes wrong\n", threads, wrong);

  // 3. A channel between two threads: a producer sends numbers, a consumer checks they arrive in order.
  gpuipc::Channel in = gpuipc::Channel::create(
      name + ".ch", {.slots = 8, .slot_bytes = 256, .header_bytes = 0, .kind = kind}, gpuipc::ChannelRole::Consumer);
  example::remove_at_exit(name + ".ch", gpuipc::Channel::unlink);
  std::thread producer([&] {
    gpuipc::Channel out = gpuipc::Channel::open(name + ".ch", gpuipc::ChannelRole::Producer);
    for (std::uint64_t i = 0; i < messages; ++i) {
      std::uint64_t seq;
      if (out.send(nullptr, &i, sizeof i, {}, 10s, seq) != gpuipc::Status::Ok) return;
    }
  });  // `out` closes at the end: the consumer then gets Closed
  std::uint64_t received = 0, out_of_order = 0, value = 0;
  const double t0 = example::now_s();
  for (;;) {
    gpuipc::MessageView msg;
    const gpuipc::Status st = in.receive(nullptr, 10s, msg);
    if (st != gpuipc::Status::Ok) break;
    if (device)
      CUDA_CHECK(cudaMemcpy(&value, msg.data, sizeof value, cudaMemcpyDeviceToHost));  // default stream: in order
    else
      std::memcpy(&value, msg.data, sizeof value);
    in.release(nullptr);
    out_of_order += value != received++;
  }
  const double seconds = example::now_s() - t0;
  producer.join();
  std::printf("intra: %llu messages between two threads, %llu out of order, %.0f messages/s\n",
              (unsigned long long)received, (unsigned long long)out_of_order, received / seconds);

  return same && wrong == 0 && received == messages && out_of_order == 0 ? 0 : 1;  // names go in run_main
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("intra", [&] { return intra(argc, argv); });
}
