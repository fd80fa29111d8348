// gpuipc example: a work queue. The master splits C = A x B into tiles, queues one task per tile on channel
// NAME.tasks and collects the tiles on NAME.results from any number of workers (gpuipc-example-worker). A and B sit
// in segment NAME.matrices, which workers map read-only. With --kind device the matrices and the result slots are GPU
// memory and workers compute with a kernel; with --kind host everything is host memory and no GPU is needed.
//
// A worker that dies holding a task (SIGKILL included) gives it back: the broker repairs the channel and exactly one
// other worker receives the task again (docs/channels.md, "Peer death"). The master checks every tile against its
// own CPU product and counts results per task, so a task done twice would show.
#include <gpuipc/channel.hpp>
#include <gpuipc/segment.hpp>

#include <cstring>
#include <thread>
#include <vector>

#include "common.hpp"
#include "tiles.hpp"

using namespace std::chrono_literals;
using example::Result;
using example::Task;

constexpr const char* kUsage =
    "gpuipc-example-master [--name NAME] [--kind host|device] [--tile 64 (1-1024)] [--tiles 8 (1-64)]\n"
    "                      [--k 512 (1-16384)] [--spawn WORKERS] [--task-ms MS] [--crash-one] [--timeout-s 60]\n"
    "Queues tiles*tiles tasks; start workers with gpuipc-example-worker --name NAME, or let --spawn start them\n"
    "(--task-ms: each spends MS more per task; --crash-one: the first one SIGKILLs itself in its second task).\n"
    "Fails at once when every spawned worker has ended and no other works on the queue.\n";

namespace {

int master(int argc, char** argv) {
  const example::Args args(
      argc, argv, kUsage,
      {"--name", "--kind", "--tile", "--tiles", "--k", "--spawn", "--task-ms", "--crash-one", "--timeout-s"});
  const std::string name = args.get("--name", "tiles");
  const bool device = args.choice("--kind", "host", {"host", "device"}) == "device";
  // Tiles of up to 1024x1024 floats (4 MiB a result slot), C up to 65536 wide, A and B up to 4 GiB each.
  const auto tile = static_cast<std::uint32_t>(args.num("--tile", 64, 1, 1024));
  const auto tiles = static_cast<std::uint32_t>(args.num("--tiles", 8, 1, 64));
  const auto k = static_cast<std::uint32_t>(args.num("--k", 512, 1, 16384));
  const long long spawn = args.num("--spawn", 0, 0, 256);
  const long long task_ms = args.num("--task-ms", 0, 0, 3600000);
  const long long timeout_s = args.num("--timeout-s", 60, 1, 86400);
  const std::uint32_t n = tile * tiles, tasks = tiles * tiles;
  std::string why;
  if (device && example::gpu_count(&why) == 0) {
    std::fprintf(stderr, "master: --kind device needs a GPU (%s); run with --kind host\n", why.c_str());
    return 3;
  }

  // A and B, row-major, in one segment the workers open read-only.
  std::vector<float> a(std::size_t{n} * k), b(std::size_t{k} * n);
  for (std::uint32_t i = 0; i < n; ++i)
    for (std::uint32_t j = 0; j < k; ++j) a[std::size_t{i} * k + j] = example::a_at(i, j);
  for (std::uint32_t i = 0; i < k; ++i)
    for (std::uint32_t j = 0; j < n; ++j) b[std::size_t{i} * n + j] = example::b_at(i, j);
  const std::size_t a_bytes = a.size() * sizeof(float), b_bytes = b.size() * sizeof(float);
  const auto kind = device ? gpuipc::SegmentKind::Device : gpuipc::SegmentKind::Host;
  gpuipc::Segment matrices = gpuipc::Segment::create(name + ".matrices", a_bytes + b_bytes, {.kind = kind});
  example::remove_at_exit(name + ".matrices", gpuipc::Segment::unlink);
  auto* base = static_cast<char*>(matrices.data());
  if (device) {
    CUDA_CHECK(cudaMemcpy(base, a.data(), a_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(base + a_bytes, b.data(), b_bytes, cudaMemcpyHostToDevice));
  } else {
    std::memcpy(base, a.data(), a_bytes);
    std::memcpy(base + a_bytes, b.data(), b_bytes);
  }

  // Tasks are only headers, so their channel is host memory whatever the kind; results carry a tile each.
  const std::size_t tile_elements = std::size_t{tile} * tile, tile_bytes = tile_elements * sizeof(float);
  gpuipc::Channel task_queue = gpuipc::Channel::create(
      name + ".tasks",
      {.slots = 16, .slot_bytes = 256, .header_bytes = sizeof(Task), .kind = gpuipc::SegmentKind::Host},
      gpuipc::ChannelRole::Producer);
  example::remove_at_exit(name + ".tasks", gpuipc::Channel::unlink);
  gpuipc::Channel results = gpuipc::Channel::create(
      name + ".results", {.slots = 16, .slot_bytes = tile_bytes, .header_bytes = sizeof(Result), .kind = kind},
      gpuipc::ChannelRole::Consumer);
  example::remove_at_exit(name + ".results", gpuipc::Channel::unlink);

  std::vector<pid_t> workers;
  for (long long w = 0; w < spawn; ++w) {
    std::vector<std::string> wargs{
        "--name", name, "--kind", device ? "device" : "host", "--task-ms", std::to_string(task_ms)};
    if (w == 0 && args.flag("--crash-one")) wargs.insert(wargs.end(), {"--die-in-task", "2"});
    workers.push_back(example::spawn("gpuipc-example-worker", wargs));
  }
  std::printf("master: %u tasks (tiles of %ux%u of C = A x B, %ux%ux%u) on %s memory, %zu workers spawned\n", tasks,
              tile, tile, n, k, n, device ? "GPU" : "host", workers.size());
  // Spawned workers that have ended (reaped: their exit codes), and how many are left.
  std::vector<int> code(workers.size(), -1);
  std::size_t running = workers.size();
  auto notice_exits = [&](const char* when) {
    for (std::size_t w = 0; w < workers.size(); ++w) {
      if (code[w] >= 0 || !example::has_exited(workers[w])) continue;
      code[w] = example::wait_exit(workers[w]);
      --running;
      std::fprintf(stderr, "master: worker %d %s (it %s)\n", workers[w], when, example::exit_text(code[w]).c_str());
    }
  };
  // The workers it spawned join the task queue once they can work (a GPU context takes a second or more to make):
  // tasks go out once all have, so each gets its share (with --crash-one, the first must get two). Workers that
  // join later, or that it did not spawn, take tasks as they come. One that exits before it joins is not waited for.
  const double joined_by = example::now_s() + static_cast<double>(timeout_s);
  while (task_queue.stats().consumers < running && example::now_s() < joined_by) {
    notice_exits("exited before it joined the task queue");
    std::this_thread::sleep_for(1ms);
  }

  cudaStream_t stream = nullptr;
  if (device) CUDA_CHECK(cudaStreamCreate(&stream));
  std::vector<float> got(tile_elements);
  std::vector<int> results_of(tasks, 0);
  std::uint32_t queued = 0, done = 0, wrong = 0, duplicates = 0, lost = 0;
  const double start = example::now_s(), deadline = start + static_cast<double>(timeout_s);
  while (done < tasks) {
    if (example::now_s() > deadline) {
      std::fprintf(stderr, "master: %u of %u tasks done after --timeout-s; are workers running (--name %s)?\n", done,
                   tasks, name.c_str());
      return 1;
    }
    // A worker that dies gives its task to another; with none of them left (and no other worker), nobody will.
    notice_exits("ended while tasks were queued");
    if (!workers.empty() && running == 0 && task_queue.stats().consumers == 0) {
      std::fprintf(stderr, "master: no worker left: %u of %u tasks done\n", done, tasks);
      return 1;
    }
    gpuipc::SlotView slot;
    if (queued < tasks && task_queue.acquire(nullptr, 0ns, slot) == gpuipc::Status::Ok) {
      const Task t{queued, queued / tiles, queued % tiles, tile, tiles, k};
      task_queue.publish(nullptr, std::as_bytes(std::span(&t, 1)), 0);
      ++queued;
      continue;
    }
    gpuipc::MessageView msg;
    const gpuipc::Status st = results.receive(stream, queued < tasks ? 1ms : 100ms, msg);
    if (st == gpuipc::Status::Timeout || st == gpuipc::Status::WouldBlock) continue;
    if (st == gpuipc::Status::PeerDied || st == gpuipc::Status::Closed) {  // no worker now; a new one may join
      std::this_thread::sleep_for(10ms);
      continue;
    }
    if (st != gpuipc::Status::Ok) {
      std::fprintf(stderr, "master: results: %s\n", gpuipc::to_string(st).data());
      return 1;
    }
    Result r;
    std::memcpy(&r, msg.header.data(), sizeof r);
    if (device) {
      CUDA_CHECK(cudaMemcpyAsync(got.data(), msg.data, tile_bytes, cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
    } else {
      std::memcpy(got.data(), msg.data, tile_bytes);
    }
    // (After the stream passed receive.) A worker died before its stream wrote this tile: its task was not
    // released yet, so another worker gets it and sends the tile again.
    const bool incomplete = msg.incomplete();
    results.release(stream);
    if (incomplete) {
      ++lost;
      continue;
    }
    if (r.id >= tasks || results_of[r.id]++ > 0) {
      ++duplicates;  // a worker died between sending its result and releasing its task (microseconds): done twice
      continue;
    }
    const Task t{r.id, r.id / tiles, r.id % tiles, tile, tiles, k};
    for (std::size_t i = 0; i < tile_elements; ++i)
      if (got[i] != example::tile_element(a.data(), b.data(), t, static_cast<std::uint32_t>(i / tile),
                                          static_cast<std::uint32_t>(i % tile))) {
        ++wrong;
        break;
      }
    ++done;
  }
  const double seconds = example::now_s() - start;
  const gpuipc::ChannelStats ts = task_queue.stats();
  std::printf("master: %u tiles back, %u wrong, %u duplicates; tasks redelivered after a worker died: %llu\n", done,
              wrong, duplicates, static_cast<unsigned long long>(ts.redelivered));
  std::printf("master: results lost with a worker that died before its stream wrote them (redone): %u\n", lost);
  std::printf("master: %.1f tasks/s (%.3f s)\n", tasks / seconds, seconds);

  task_queue = gpuipc::Channel();  // leaving: workers drain the queue, then their receive returns Closed
  for (std::size_t w = 0; w < workers.size(); ++w) {
    if (code[w] < 0) code[w] = example::wait_exit(workers[w]);
    std::printf("master: worker %d %s %d\n", workers[w], code[w] > 128 ? "killed by signal" : "exited with",
                code[w] % 128);
  }
  return wrong == 0 ? 0 : 1;  // the names go on the way out (run_main)
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("master", [&] { return master(argc, argv); });
}
