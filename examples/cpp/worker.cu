// gpuipc example: a worker of the master's work queue (master.cu). It takes a task from NAME.tasks, computes the
// tile into a slot of NAME.results (a kernel on GPU memory, or the CPU on host memory) and publishes it; only then
// does it release the task. If it dies before that release, the broker puts the task back in the queue for another
// worker. Exits 0 when the master has left and the queue is drained.
#include <gpuipc/channel.hpp>
#include <gpuipc/segment.hpp>

#include <csignal>
#include <cstring>
#include <thread>

#include "common.hpp"
#include "tiles.hpp"

using namespace std::chrono_literals;
using example::Result;
using example::Task;

constexpr const char* kUsage =
    "gpuipc-example-worker [--name NAME] [--kind host|device] [--device GPU] [--task-ms MS] [--die-in-task N]\n"
    "Works on the tasks of gpuipc-example-master --name NAME. --task-ms adds a pause to each task;\n"
    "--die-in-task N makes it SIGKILL itself after taking its N-th task, before sending the result.\n";

__global__ void tile_kernel(const float* a, const float* b, float* c, Task t) {
  const std::uint32_t r = blockIdx.y * blockDim.y + threadIdx.y, col = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= t.tile || col >= t.tile) return;
  const std::uint32_t n = t.tile * t.tiles, i = t.row * t.tile + r, j = t.col * t.tile + col;
  float sum = 0;
  for (std::uint32_t k = 0; k < t.k; ++k) sum += a[std::size_t{i} * t.k + k] * b[std::size_t{k} * n + j];
  c[std::size_t{r} * t.tile + col] = sum;
}

namespace {

int worker(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage, {"--name", "--kind", "--device", "--task-ms", "--die-in-task"});
  const std::string name = args.get("--name", "tiles");
  const bool device = args.choice("--kind", "host", {"host", "device"}) == "device";
  const long long die_in_task = args.num("--die-in-task", 0, 0, LLONG_MAX);
  const long long task_ms = args.num("--task-ms", 0, 0, 3600000);
  const int gpu = static_cast<int>(args.num("--device", 0, 0, 1023));
  if (device) CUDA_CHECK(cudaSetDevice(gpu));

  gpuipc::Channel results =
      gpuipc::Channel::open(name + ".results", gpuipc::ChannelRole::Producer, {.wait = 10s, .device = gpu});
  const gpuipc::Segment matrices = gpuipc::Segment::open(
      name + ".matrices", {.access = gpuipc::Access::ReadOnly, .wait = 10s, .device = device ? gpu : -1});
  cudaStream_t stream = nullptr;
  if (device) CUDA_CHECK(cudaStreamCreate(&stream));
  // Last, once it can work: a master that spawned its workers hands tasks out once all have joined the queue.
  gpuipc::Channel tasks = gpuipc::Channel::open(name + ".tasks", gpuipc::ChannelRole::Consumer, {.wait = 10s});

  long long taken = 0;
  for (;;) {
    gpuipc::MessageView msg;
    gpuipc::Status st = tasks.receive(nullptr, 1s, msg);
    if (st == gpuipc::Status::Timeout) continue;
    if (st != gpuipc::Status::Ok) break;  // Closed: the master left and nothing is queued
    Task t;
    std::memcpy(&t, msg.header.data(), sizeof t);
    if (++taken == die_in_task) {
      std::printf("worker %d: SIGKILL in the middle of task %u\n", ::getpid(), t.id);
      std::fflush(stdout);
      std::raise(SIGKILL);
    }
    if (task_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(task_ms));

    const std::size_t n = std::size_t{t.tile} * t.tiles;
    const auto* a = static_cast<const float*>(matrices.data());
    const float* b = a + n * t.k;
    gpuipc::SlotView slot;
    while ((st = results.acquire(stream, 1s, slot)) == gpuipc::Status::Timeout) {
    }
    if (st != gpuipc::Status::Ok) break;  // the master is gone
    auto* c = static_cast<float*>(slot.data);
    if (device) {
      const dim3 block(16, 16), grid((t.tile + 15) / 16, (t.tile + 15) / 16);
      tile_kernel<<<grid, block, 0, stream>>>(a, b, c, t);
      CUDA_CHECK(cudaGetLastError());
    } else {
      for (std::uint32_t r = 0; r < t.tile; ++r)
        for (std::uint32_t col = 0; col < t.tile; ++col)
          c[std::size_t{r} * t.tile + col] = example::tile_element(a, b, t, r, col);
    }
    const Result r{t.id, ::getpid()};
    results.publish(stream, std::as_bytes(std::span(&r, 1)), std::size_t{t.tile} * t.tile * sizeof(float));
    // The task is done once its tile is in the slot, not when publish returns (the kernel may still be queued):
    // a worker that dies before its stream wrote the tile leaves the master an incomplete result, so it must not
    // have released the task yet. A death before the release below hands the task to another worker.
    if (device) CUDA_CHECK(cudaStreamSynchronize(stream));
    tasks.release(nullptr);
  }
  if (device) CUDA_CHECK(cudaStreamSynchronize(stream));
  std::printf("worker %d: %lld tasks\n", ::getpid(), taken);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("worker", [&] { return worker(argc, argv); });
}
