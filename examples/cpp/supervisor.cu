// gpuipc example: crash recovery. The supervisor owns a pool (NAME.pool) and two channels (NAME.jobs out,
// NAME.done back) and runs a worker process (this program with --worker). Each job, the worker allocates a scratch
// block from the pool, fills it, sums it, sends the sum back, frees the block and only then releases the job.
// The supervisor SIGKILLs the worker mid-job --kills times and starts a new one each time (as it would for any crash).
// The broker repairs what the dead worker held: its block goes back to the pool and its job to the queue. At the end
// the supervisor compares the broker's segment list and the pool's statistics with those from before any worker ran.
// --kind host (default) needs no GPU; --kind device puts the pool in GPU 0's memory.
#include <gpuipc/channel.hpp>
#include <gpuipc/pool.hpp>

#include <csignal>
#include <cstring>
#include <thread>
#include <vector>

#include "common.hpp"

using namespace std::chrono_literals;

constexpr const char* kUsage =
    "gpuipc-example-supervisor [--name NAME] [--kind host|device] [--jobs 40] [--kills 2] [--job-ms 20]\n";
struct Job {
  std::uint32_t id, bytes;
};
struct Done {
  std::uint32_t id;
  std::uint64_t sum;
};

int worker(const std::string& name, bool device, long job_ms) {
  gpuipc::Pool pool = gpuipc::Pool::open(name + ".pool");
  gpuipc::Channel jobs = gpuipc::Channel::open(name + ".jobs", gpuipc::ChannelRole::Consumer, {.wait = 10s});
  gpuipc::Channel done = gpuipc::Channel::open(name + ".done", gpuipc::ChannelRole::Producer, {.wait = 10s});
  std::vector<unsigned char> host;
  for (;;) {
    gpuipc::MessageView msg;
    const gpuipc::Status st = jobs.receive(nullptr, 1s, msg);
    if (st == gpuipc::Status::Timeout) continue;
    if (st != gpuipc::Status::Ok) return 1;  // the supervisor is gone
    Job job;
    std::memcpy(&job, msg.header.data(), sizeof job);
    if (job.bytes == 0) return jobs.release(nullptr) == gpuipc::Status::Ok ? 0 : 1;  // "stop"
    gpuipc::Block scratch = pool.allocate(job.bytes);
    host.assign(job.bytes, static_cast<unsigned char>(job.id));
    if (device)
      CUDA_CHECK(cudaMemcpy(scratch.data(), host.data(), job.bytes, cudaMemcpyHostToDevice));
    else
      std::memcpy(scratch.data(), host.data(), job.bytes);
    std::this_thread::sleep_for(std::chrono::milliseconds(job_ms));  // the "work": a kill lands here
    if (device) CUDA_CHECK(cudaMemcpy(host.data(), scratch.data(), job.bytes, cudaMemcpyDeviceToHost));
    Done d{job.id, 0};
    for (unsigned char c : host) d.sum += c;
    std::uint64_t seq;
    if (done.send(nullptr, nullptr, 0, std::as_bytes(std::span(&d, 1)), 10s, seq) != gpuipc::Status::Ok) return 1;
    pool.free(std::move(scratch));
    jobs.release(nullptr);
  }
}

/// The broker's segments of this example and the pool's statistics, as text to print and compare.
std::string snapshot(const std::string& name) {
  std::string text;
  for (const gpuipc::SegmentInfo& s : gpuipc::Segment::list())
    if (s.name.rfind(name + ".", 0) == 0)
      text += "  segment " + s.name + " (" + std::string(gpuipc::to_string(s.kind)) + ", " + std::to_string(s.size) +
              " bytes): " + std::to_string(s.references) + " references\n";
  const gpuipc::PoolStats p = gpuipc::Pool::stat(name + ".pool");
  text += "  pool: " + std::to_string(p.live_blocks) + " live blocks, " + std::to_string(p.used_bytes) +
          " bytes used, " + std::to_string(p.chunks) + " chunks, " + std::to_string(p.members) + " members\n";
  return text;
}

int main(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage, {"--name", "--kind", "--jobs", "--kills", "--job-ms", "--worker"});
  const std::string name = args.get("--name", "supervised");
  const bool device = args.get("--kind", "host") == "device";
  const long job_ms = args.num("--job-ms", 20), kills = args.num("--kills", 2);
  const auto jobs_total = static_cast<std::uint32_t>(args.num("--jobs", 40));
  std::string why;
  if (device && example::gpu_count(&why) == 0) {
    std::fprintf(stderr, "supervisor: --kind device needs a GPU (%s); run with --kind host\n", why.c_str());
    return 3;
  }
  if (args.flag("--worker")) return worker(name, device, job_ms);

  const auto kind = device ? gpuipc::SegmentKind::Device : gpuipc::SegmentKind::Host;
  gpuipc::Pool pool =
      gpuipc::Pool::create(name + ".pool", {.kind = kind, .chunk_bytes = 4 << 20, .max_bytes = 4 << 20});
  gpuipc::Channel jobs = gpuipc::Channel::create(
      name + ".jobs", {.slots = 4, .slot_bytes = 256, .header_bytes = sizeof(Job), .kind = gpuipc::SegmentKind::Host},
      gpuipc::ChannelRole::Producer);
  gpuipc::Channel done = gpuipc::Channel::create(
      name + ".done", {.slots = 4, .slot_bytes = 256, .header_bytes = sizeof(Done), .kind = gpuipc::SegmentKind::Host},
      gpuipc::ChannelRole::Consumer);
  const std::string before = snapshot(name);
  std::printf("supervisor: before any worker\n%s", before.c_str());

  const std::vector<std::string> wargs{
      "--worker", "--name", name, "--kind", device ? "device" : "host", "--job-ms", std::to_string(job_ms)};
  pid_t child = example::spawn("gpuipc-example-supervisor", wargs);
  std::printf("supervisor: started worker %d\n", child);
  std::vector<int> results_of(jobs_total, 0);
  std::uint32_t queued = 0, finished = 0, wrong = 0, restarts = 0;
  long killed = 0;
  const double deadline = example::now_s() + 60;
  while (finished < jobs_total && example::now_s() < deadline) {
    gpuipc::SlotView slot;
    if (queued < jobs_total && jobs.acquire(nullptr, 0ns, slot) == gpuipc::Status::Ok) {
      const Job job{queued++, 256u << 10};
      jobs.publish(nullptr, std::as_bytes(std::span(&job, 1)), 0);
      continue;
    }
    // Kill the worker in the middle of a job, evenly over the run.
    if (killed < kills && finished >= (killed + 1) * jobs_total / (kills + 1)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(job_ms / 2));
      ::kill(child, SIGKILL);
      ++killed;
    }
    int status = 0;
    if (::waitpid(child, &status, WNOHANG) == child) {  // it died: whatever the cause, start another
      std::printf("supervisor: worker %d %s; starting a new one\n", child,
                  WIFSIGNALED(status) ? strsignal(WTERMSIG(status)) : "exited");
      child = example::spawn("gpuipc-example-supervisor", wargs);
      ++restarts;
    }
    gpuipc::MessageView msg;
    if (done.receive(nullptr, 5ms, msg) != gpuipc::Status::Ok) continue;
    Done d;
    std::memcpy(&d, msg.header.data(), sizeof d);
    done.release(nullptr);
    if (d.id >= jobs_total || results_of[d.id]++ > 0) continue;  // done twice: counted below
    wrong += d.sum != std::uint64_t{256u << 10} * (d.id & 255);
    ++finished;
  }
  // Stop the worker with a job of zero bytes; the supervisor keeps its own handles, as before the first worker.
  gpuipc::SlotView slot;
  const Job stop{jobs_total, 0};
  if (jobs.acquire(nullptr, 10s, slot) == gpuipc::Status::Ok)
    jobs.publish(nullptr, std::as_bytes(std::span(&stop, 1)), 0);
  const int last_exit = example::wait_exit(child);
  std::uint32_t twice = 0;
  for (int n : results_of) twice += n > 1;
  std::printf("supervisor: %u of %u jobs done (%u wrong, %u done twice), %u restarts, last worker exited %d\n",
              finished, jobs_total, wrong, twice, restarts, last_exit);

  // The broker repairs a dead member within milliseconds of its death; give it that long.
  std::string after;
  for (int i = 0; i < 100 && (after = snapshot(name)) != before; ++i) std::this_thread::sleep_for(20ms);
  std::printf("supervisor: after the last worker\n%s", after.c_str());
  const bool leaked = after != before;
  std::printf("supervisor: %s\n", leaked ? "LEAK: the broker's view differs from before" : "nothing leaked");
  gpuipc::Pool::unlink(name + ".pool");
  gpuipc::Channel::unlink(name + ".jobs");
  gpuipc::Channel::unlink(name + ".done");
  // A job is done twice only when a worker dies between sending its result and releasing the job (microseconds):
  // results carry the job's id, so the supervisor counts it once.
  return finished == jobs_total && wrong == 0 && last_exit == 0 && !leaked ? 0 : 1;
}
