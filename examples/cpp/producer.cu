// gpuipc example, with consumer.cu: hand a cudaMalloc buffer to another process, three ways, one after the other.
//  1. raw CUDA IPC: cudaIpcGetMemHandle, the 64-byte handle written to a file, polling for a "done" file;
//  2. gpuipc: gpuipc::share names the same kind of buffer; the consumer opens it by name (no file, and the size comes
//     with it), and says it is done through a gpuipc semaphore, which cannot hang: if the consumer dies, the
//     producer's wait returns PeerDied;
//  3. a gpuipc channel: a stream of frames written by a kernel, with back-pressure and stream ordering.
// Needs a GPU. Run: gpuipc-example-producer --dir D & gpuipc-example-consumer --dir D
#include <gpuipc/channel.hpp>
#include <gpuipc/semaphore.hpp>
#include <gpuipc/share.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "buffer_check.hpp"
#include "common.hpp"

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr const char* kUsage =
    "gpuipc-example-producer [--dir DIR] [--name NAME] [--mib 64 (1-65536)] [--frames 1000]\n"
    "Start gpuipc-example-consumer with the same --dir and --name. Removes DIR/raw.handle and DIR/raw.done that a\n"
    "run before left, first.\n";

namespace {

/// Waits up to 30 s for `path` to exist (the raw IPC way of learning that the other side is done).
bool wait_for_file(const fs::path& path) {
  for (int i = 0; i < 30000 && !fs::exists(path); ++i) std::this_thread::sleep_for(1ms);
  return fs::exists(path);
}

/// Removes a file of the raw IPC handoff (example::remove_at_exit's type).
void remove_file(std::string_view path) {
  std::error_code ignored;
  fs::remove(fs::path(path), ignored);
}

int producer(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage, {"--dir", "--name", "--mib", "--frames"});
  const fs::path dir = args.get("--dir", ".");
  const std::string name = args.get("--name", "handoff");
  const std::size_t bytes = static_cast<std::size_t>(args.num("--mib", 64, 1, 65536)) << 20, words = bytes / 4;
  const auto frames = static_cast<std::uint64_t>(args.num("--frames", 1000, 1, 1LL << 40));
  std::string why;
  if (example::gpu_count(&why) == 0) {
    std::fprintf(stderr, "producer: needs a GPU (%s)\n", why.c_str());
    return 3;
  }
  CUDA_CHECK(cudaSetDevice(0));

  // 1. Raw CUDA IPC. -------------------------------------------------------------------------------------------
  // Files a run before left would hand the consumer a dead handle, or this run a "done" nobody said: gone first,
  // and on every way out of this one.
  for (const char* f : {"raw.handle.tmp", "raw.handle", "raw.done"}) {
    remove_file((dir / f).string());
    example::remove_at_exit((dir / f).string(), remove_file);
  }
  void* raw = nullptr;
  CUDA_CHECK(cudaMalloc(&raw, bytes));
  example::fill_kernel<<<256, 256>>>(static_cast<std::uint32_t*>(raw), words, 1);
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle;
  CUDA_CHECK(cudaIpcGetMemHandle(&handle, raw));
  std::ofstream(dir / "raw.handle.tmp", std::ios::binary).write(reinterpret_cast<const char*>(&handle), sizeof handle);
  fs::rename(dir / "raw.handle.tmp", dir / "raw.handle");  // the consumer never sees half a handle
  std::printf("raw IPC: %zu MiB buffer, handle written to %s\n", bytes >> 20, (dir / "raw.handle").c_str());
  std::fflush(stdout);
  // The buffer must outlive the consumer's use, and nothing tells us if the consumer died: poll, with a timeout.
  if (!wait_for_file(dir / "raw.done")) std::fprintf(stderr, "raw IPC: no %s after 30 s\n", "raw.done");
  CUDA_CHECK(cudaFree(raw));
  fs::remove(dir / "raw.handle");
  fs::remove(dir / "raw.done");

  // 2. gpuipc::share: the same cudaMalloc buffer, under a name. -----------------------------------------------------
  void* buf = nullptr;
  CUDA_CHECK(cudaMalloc(&buf, bytes));
  example::fill_kernel<<<256, 256>>>(static_cast<std::uint32_t*>(buf), words, 2);
  CUDA_CHECK(cudaDeviceSynchronize());
  gpuipc::Segment shared = gpuipc::share(name, buf, bytes);  // lives while `shared` and `buf` do
  std::printf("gpuipc: %zu MiB buffer shared as '%s'\n", bytes >> 20, name.c_str());
  std::fflush(stdout);
  // The consumer made this semaphore and is its only signaller: if it dies, the wait returns PeerDied at once.
  gpuipc::Semaphore done =
      gpuipc::Semaphore::open(name + ".done", {.role = gpuipc::SemaphoreRole::Waiter, .wait = 30s});
  const gpuipc::WaitResult w = done.wait_host(1, 30s);
  std::printf("gpuipc: consumer done: %s\n", gpuipc::to_string(w.status).data());
  std::fflush(stdout);
  shared.close();  // removes the name; openers' alive() turns false
  CUDA_CHECK(cudaFree(buf));

  // 3. A channel of frames. -----------------------------------------------------------------------------------
  const std::size_t frame_bytes = 1 << 20;
  gpuipc::Channel out = gpuipc::Channel::create(
      name + ".frames", {.slots = 8, .slot_bytes = frame_bytes, .header_bytes = sizeof(example::FrameHeader)},
      gpuipc::ChannelRole::Producer);
  example::remove_at_exit(name + ".frames", gpuipc::Channel::unlink);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  for (std::uint64_t f = 0; f < frames; ++f) {
    gpuipc::SlotView slot;
    gpuipc::Status st;
    while ((st = out.acquire(stream, 1s, slot)) == gpuipc::Status::Timeout) {
    }
    if (st != gpuipc::Status::Ok) {
      std::fprintf(stderr, "channel: acquire: %s (the consumer left)\n", gpuipc::to_string(st).data());
      return 1;
    }
    example::fill_kernel<<<64, 256, 0, stream>>>(static_cast<std::uint32_t*>(slot.data), frame_bytes / 4, f);
    const example::FrameHeader h{f, frames};
    out.publish(stream, std::as_bytes(std::span(&h, 1)), frame_bytes);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  // The name goes with this process: not before the consumer has the channel open (8 frames fit in its slots).
  for (int i = 0; i < 30000 && out.stats().consumers == 0 && out.stats().tail == 0; ++i)
    std::this_thread::sleep_for(1ms);
  std::printf("channel: %llu frames of 1 MiB published\n", static_cast<unsigned long long>(frames));
  return 0;  // the consumer has the channel open: its name goes now (run_main), the frames stay for it
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("producer", [&] { return producer(argc, argv); });
}
