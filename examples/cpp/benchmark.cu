// gpuipc example: copy bandwidth in GB/s, in the manner of NVIDIA's bandwidthTest and nvbandwidth: host to device
// (pageable and pinned host memory), device to host, device to device and, with two GPUs, peer to peer. Each copy goes,
// in the same run, to a buffer of this process (plain cudaMemcpy) and to a gpuipc device segment that a second
// process created and this one mapped (IPC). GB/s = bytes copied / time (1 GB = 1e9 bytes), the median of 4 rounds
// (alternating which of the two goes first) of the median of --reps copies timed with CUDA events. Needs a GPU.
#include <gpuipc/segment.hpp>
#include <gpuipc/semaphore.hpp>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.hpp"

using namespace std::chrono_literals;

constexpr const char* kUsage =
    "gpuipc-example-benchmark [--mib 256 (1-65536)] [--reps 20] [--name NAME]\n"
    "  The P2P row needs two GPUs with peer access; it says why when it is skipped.\n";

namespace {

/// The second process: creates device segments NAME.0 (GPU 0) and, with two GPUs, NAME.1, then waits until the
/// measuring process signals NAME.stop (or dies: the wait then returns PeerDied).
int serve(const std::string& name, std::size_t bytes, int gpus) {
  std::vector<gpuipc::Segment> segs;
  for (int d = 0; d < std::min(gpus, 2); ++d) {
    segs.push_back(gpuipc::Segment::create(name + "." + std::to_string(d), bytes,
                                           {.kind = gpuipc::SegmentKind::Device, .device = d}));
    example::remove_at_exit(segs.back().name(), gpuipc::Segment::unlink);
  }
  gpuipc::Semaphore stop = gpuipc::Semaphore::open(name + ".stop", {.wait = 30s});
  stop.wait_host(1, std::chrono::hours(1));
  return 0;  // the segments go on the way out (run_main)
}

/// Median GB/s of `reps` copies of `bytes` from `src` to `dst` on `s`.
double gbs(void* dst, const void* src, std::size_t bytes, int reps, cudaStream_t s) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));  // warm-up
  std::vector<double> rates;
  for (int r = 0; r < reps; ++r) {
    CUDA_CHECK(cudaEventRecord(a, s));
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    rates.push_back(double(bytes) / (ms * 1e-3) / 1e9);
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  return example::percentile(rates, 50);
}

int benchmark(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage, {"--mib", "--reps", "--name", "--serve"});
  const std::string name = args.get("--name", "bandwidth");
  const std::size_t bytes = static_cast<std::size_t>(args.num("--mib", 256, 1, 65536)) << 20;
  const int reps = static_cast<int>(args.num("--reps", 20, 1, 100000));
  std::string why;
  const int gpus = example::gpu_count(&why);
  if (gpus == 0) {
    std::fprintf(stderr, "benchmark: needs a GPU (%s)\n", why.c_str());
    return 3;
  }
  if (args.flag("--serve")) return serve(name, bytes, gpus);

  gpuipc::Semaphore stop = gpuipc::Semaphore::create(name + ".stop", {.kind = gpuipc::SegmentKind::Host});
  example::remove_at_exit(name + ".stop", gpuipc::Semaphore::unlink);
  const pid_t server =
      example::spawn("gpuipc-example-benchmark", {"--serve", "--name", name, "--mib", std::to_string(bytes >> 20)});
  CUDA_CHECK(cudaSetDevice(0));
  const gpuipc::Segment seg0 = gpuipc::Segment::open(name + ".0", {.wait = 30s, .device = 0});
  void *pageable = std::malloc(bytes), *pinned = nullptr, *d0 = nullptr, *d0b = nullptr;
  if (pageable == nullptr) example::fail(1, "cannot allocate %zu MiB of host memory", bytes >> 20);
  std::memset(pageable, 1, bytes);
  CUDA_CHECK(cudaMallocHost(&pinned, bytes));
  CUDA_CHECK(cudaMalloc(&d0, bytes));
  CUDA_CHECK(cudaMalloc(&d0b, bytes));
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreate(&s));
  void* ipc0 = seg0.data();

  std::printf("%zu MiB per copy, GB/s: median of 4 rounds of the median of %d; 'gpuipc segment' = memory of another\n"
              "process, mapped here\n",
              bytes >> 20, reps);
  std::printf("%-28s %16s %16s %8s\n", "copy", "cudaMemcpy local", "gpuipc segment", "ratio");
  // Each row: the local copy and the segment copy in 4 rounds that alternate which goes first (a machine's state
  // drifts: clocks, other tenants of the bus), each round the median of `reps` copies; the row shows the medians.
  auto row = [&](const char* what, void* local_dst, void* ipc_dst, const void* local_src, const void* ipc_src) {
    std::vector<double> l, i;
    for (int round = 0; round < 4; ++round) {
      if (round % 2 == 0) l.push_back(gbs(local_dst, local_src, bytes, reps, s));
      i.push_back(gbs(ipc_dst, ipc_src, bytes, reps, s));
      if (round % 2 == 1) l.push_back(gbs(local_dst, local_src, bytes, reps, s));
    }
    const double lm = example::percentile(l, 50), im = example::percentile(i, 50);
    std::printf("%-28s %16.1f %16.1f %8.3f\n", what, lm, im, im / lm);
  };
  row("H2D pageable (GPU 0)", d0, ipc0, pageable, pageable);
  row("H2D pinned (GPU 0)", d0, ipc0, pinned, pinned);
  row("D2H pageable (GPU 0)", pageable, pageable, d0, ipc0);
  row("D2H pinned (GPU 0)", pinned, pinned, d0, ipc0);
  row("D2D (GPU 0 -> GPU 0)", d0b, ipc0, d0, d0);
  if (gpus > 1 && !example::peer_access(0, 1)) {
    // A segment made on GPU 1 cannot be mapped into GPU 0's context without it (Segment::open: Unsupported).
    std::printf("%-28s %s\n", "P2P", "skipped: GPUs 0 and 1 have no peer access");
  } else if (gpus > 1) {
    // Peer to peer: GPU 0's buffer to GPU 1's memory, a cudaMalloc on GPU 1 beside a segment another process made on
    // GPU 1 and this process mapped into GPU 0's context (peer access).
    const gpuipc::Segment seg1 = gpuipc::Segment::open(name + ".1", {.wait = 30s, .device = 0});
    void* d1 = nullptr;
    CUDA_CHECK(cudaSetDevice(1));
    CUDA_CHECK(cudaMalloc(&d1, bytes));
    CUDA_CHECK(cudaSetDevice(0));
    const cudaError_t peer = cudaDeviceEnablePeerAccess(1, 0);
    if (peer != cudaSuccess && peer != cudaErrorPeerAccessAlreadyEnabled) CUDA_CHECK(peer);
    cudaGetLastError();
    row("P2P (GPU 0 -> GPU 1)", d1, seg1.data(), d0, d0);
  } else {
    std::printf("%-28s %s\n", "P2P", "skipped: one GPU");
  }
  stop.signal_host(1);
  return example::wait_exit(server);  // .stop goes on the way out (run_main)
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("benchmark", [&] { return benchmark(argc, argv); });
}
