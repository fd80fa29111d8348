// gpuipc example, with producer.cu: the receiving side of the three handoffs (raw CUDA IPC, gpuipc::share, a channel).
// Checks every word it receives with a kernel and prints how long each open took. Needs a GPU.
#include <gpuipc/channel.hpp>
#include <gpuipc/segment.hpp>
#include <gpuipc/semaphore.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "buffer_check.hpp"
#include "common.hpp"

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr const char* kUsage =
    "gpuipc-example-consumer [--dir DIR] [--name NAME] [--mib 64 (as the producer's)]\n"
    "Fails when the producer dies before it sent every frame.\n";

namespace {

/// Words of `p` (device memory) that differ from the pattern `seed`.
unsigned long long count_wrong(const void* p, std::size_t bytes, std::uint64_t seed, cudaStream_t s,
                               unsigned long long* counter) {
  unsigned long long wrong = 0;
  CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof wrong, s));
  example::check_kernel<<<256, 256, 0, s>>>(static_cast<const std::uint32_t*>(p), bytes / 4, seed, counter);
  CUDA_CHECK(cudaMemcpyAsync(&wrong, counter, sizeof wrong, cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  return wrong;
}

int consumer(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage, {"--dir", "--name", "--mib"});
  const fs::path dir = args.get("--dir", ".");
  const std::string name = args.get("--name", "handoff");
  // The size is not in the handle: the two sides must agree on it some other way (here: --mib).
  const std::size_t raw_bytes = static_cast<std::size_t>(args.num("--mib", 64, 1, 65536)) << 20;
  std::string why;
  if (example::gpu_count(&why) == 0) {
    std::fprintf(stderr, "consumer: needs a GPU (%s)\n", why.c_str());
    return 3;
  }
  CUDA_CHECK(cudaSetDevice(0));
  unsigned long long* counter = nullptr;
  CUDA_CHECK(cudaMalloc(&counter, sizeof *counter));
  unsigned long long wrong_total = 0;

  // 1. Raw CUDA IPC: poll for the handle file, open, use, close, say "done" with another file. --------------------
  for (int i = 0; i < 30000 && !fs::exists(dir / "raw.handle"); ++i) std::this_thread::sleep_for(1ms);
  cudaIpcMemHandle_t handle;
  if (!std::ifstream(dir / "raw.handle", std::ios::binary).read(reinterpret_cast<char*>(&handle), sizeof handle)) {
    std::fprintf(stderr, "raw IPC: no handle in %s after 30 s: is the producer running?\n", dir.c_str());
    return 1;
  }
  void* raw = nullptr;
  double t0 = example::now_s();
  CUDA_CHECK(cudaIpcOpenMemHandle(&raw, handle, cudaIpcMemLazyEnablePeerAccess));
  const double raw_open_us = (example::now_s() - t0) * 1e6;
  unsigned long long wrong = count_wrong(raw, raw_bytes, 1, nullptr, counter);
  CUDA_CHECK(cudaIpcCloseMemHandle(raw));
  std::ofstream(dir / "raw.done").put('1');
  std::printf("raw IPC: cudaIpcOpenMemHandle %.1f us, %zu MiB checked, %llu words wrong\n", raw_open_us,
              raw_bytes >> 20, wrong);
  wrong_total += wrong;

  // 2. gpuipc: open by name (waiting for it to appear), with its size; tell the producer through a semaphore. ------
  gpuipc::Semaphore done = gpuipc::Semaphore::create(name + ".done", {.kind = gpuipc::SegmentKind::Host});
  example::remove_at_exit(name + ".done", gpuipc::Semaphore::unlink);
  t0 = example::now_s();
  gpuipc::Segment seg = gpuipc::Segment::open(name, {.access = gpuipc::Access::ReadOnly, .wait = 30s});
  const double open_us = (example::now_s() - t0) * 1e6;
  t0 = example::now_s();
  gpuipc::Segment again = gpuipc::Segment::open(name, {.access = gpuipc::Access::ReadOnly});
  const double again_us = (example::now_s() - t0) * 1e6;
  wrong = count_wrong(seg.data(), seg.size(), 2, nullptr, counter);
  std::printf(
      "gpuipc: Segment::open %.1f us (again in this process: %.2f us, same mapping: %s), %zu MiB checked, "
      "%llu words wrong\n",
      open_us, again_us, again.data() == seg.data() ? "yes" : "no", seg.size() >> 20, wrong);
  wrong_total += wrong;
  seg.close();
  again.close();
  done.signal_host(1);

  // 3. The channel: each frame is checked by a kernel on this process's stream, which waits for the producer's. ----
  gpuipc::Channel in = gpuipc::Channel::open(name + ".frames", gpuipc::ChannelRole::Consumer, {.wait = 30s});
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof *counter, stream));
  std::uint64_t frames = 0, out_of_order = 0, sent = 0;  // sent: how many the producer said it sends
  double first = 0;
  gpuipc::Status st;
  for (;;) {
    gpuipc::MessageView msg;
    st = in.receive(stream, 1s, msg);
    if (st == gpuipc::Status::Timeout) continue;
    if (st != gpuipc::Status::Ok) break;  // Closed: the producer is done; PeerDied: it died (both after the drain)
    if (frames == 0) first = example::now_s();
    example::FrameHeader h;
    std::memcpy(&h, msg.header.data(), sizeof h);
    sent = h.of;
    out_of_order += h.number != frames++;
    example::check_kernel<<<64, 256, 0, stream>>>(static_cast<const std::uint32_t*>(msg.data), msg.size / 4, h.number,
                                                  counter);
    in.release(stream);  // the producer's stream may overwrite the slot once this stream gets here
  }
  CUDA_CHECK(cudaMemcpyAsync(&wrong, counter, sizeof wrong, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  const double seconds = example::now_s() - first;
  std::printf("channel: %llu frames of 1 MiB, %llu words wrong, %llu out of order, %.0f frames/s, %.2f GB/s\n",
              (unsigned long long)frames, wrong, (unsigned long long)out_of_order, frames / seconds,
              frames * double(1 << 20) / seconds / 1e9);
  wrong_total += wrong + out_of_order;
  // Only Closed is the end of the stream: the producer left after publishing. PeerDied is a crash.
  if (st != gpuipc::Status::Closed || frames == 0 || frames != sent) {
    std::fprintf(stderr, "consumer: channel: %s after %llu of %llu frames: %s\n", gpuipc::to_string(st).data(),
                 (unsigned long long)frames, (unsigned long long)sent,
                 st == gpuipc::Status::PeerDied ? "the producer died" : "the stream ended early");
    return 1;
  }
  return wrong_total == 0 ? 0 : 1;  // .done goes on the way out (run_main): the producer has long opened it
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("consumer", [&] { return consumer(argc, argv); });
}
