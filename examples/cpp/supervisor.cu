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

namespace {

constexpr const char* kUsage =
    "gpuipc-example-supervisor [--name NAME] [--kind host|device] [--jobs 40] [--kills 2] [--job-ms 20]\n"
    "                          [--timeout-s S]\n"
    "  --timeout-s: give up (and say so) when the jobs are not done in S seconds; default 30 + jobs x (job-ms +\n"
    "  100 ms). SIGINT and SIGTERM stop the worker and remove the pool and channels.\n";
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
    host.assign(job.bytes, 0);  // the sum below is of what the block holds, read back
    std::this_thread::sleep_for(std::chrono::milliseconds(job_ms));  // the "work": a kill lands here
    if (device)
      CUDA_CHECK(cudaMemcpy(host.data(), scratch.data(), job.bytes, cudaMemcpyDeviceToHost));
    else
      std::memcpy(host.data(), scratch.data(), job.bytes);
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

int supervisor(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage,
                           {"--name", "--kind", "--jobs", "--kills", "--job-ms", "--worker", "--timeout-s"});
  const std::string name = args.get("--name", "supervised");
  const bool device = args.choice("--kind", "host", {"host", "device"}) == "device";
  const long long job_ms = args.num("--job-ms", 20, 0, 3600000), kills = args.num("--kills", 2, 0, 1000000);
  const auto jobs_total = static_cast<std::uint32_t>(args.num("--jobs", 40, 1, 100000000));
  const long long timeout_s = args.num("--timeout-s", 30 + jobs_total * (job_ms + 100) / 1000, 1, LLONG_MAX / 1000);
  std::string why;
  if (device && example::gpu_count(&why) == 0) {
    std::fprintf(stderr, "supervisor: --kind device needs a GPU (%s); run with --kind host\n", why.c_str());
    return 3;
  }
  if (args.flag("--worker")) return worker(name, device, job_ms);

  const auto kind = device ? gpuipc::SegmentKind::Device : gpuipc::SegmentKind::Host;
  gpuipc::Pool pool =
      gpuipc::Pool::create(name + ".pool", {.kind = kind, .chunk_bytes = 4 << 20, .max_bytes = 4 << 20});
  example::remove_at_exit(name + ".pool", gpuipc::Pool::unlink);
  gpuipc::Channel jobs = gpuipc::Channel::create(
      name + ".jobs", {.slots = 4, .slot_bytes = 256, .header_bytes = sizeof(Job), .kind = gpuipc::SegmentKind::Host},
      gpuipc::ChannelRole::Producer);
  example::remove_at_exit(name + ".jobs", gpuipc::Channel::unlink);
  gpuipc::Channel done = gpuipc::Channel::create(
      name + ".done", {.slots = 4, .slot_bytes = 256, .header_bytes = sizeof(Done), .kind = gpuipc::SegmentKind::Host},
      gpuipc::ChannelRole::Consumer);
  example::remove_at_exit(name + ".done", gpuipc::Channel::unlink);
  const std::string before = snapshot(name);
  std::printf("supervisor: before any worker\n%s", before.c_str());

  const std::vector<std::string> wargs{
      "--worker", "--name", name, "--kind", device ? "device" : "host", "--job-ms", std::to_string(job_ms)};
  pid_t child = example::spawn("gpuipc-example-supervisor", wargs);
  std::printf("supervisor: started worker %d\n", child);
  std::vector<int> results_of(jobs_total, 0);
  std::uint32_t queued = 0, finished = 0, wrong = 0, restarts = 0;
  long long killed = 0;
  const double deadline = example::now_s() + static_cast<double>(timeout_s);
  bool timed_out = false;
  while (finished < jobs_total) {
    if (example::now_s() > deadline) {
      timed_out = true;
      break;
    }
    gpuipc::SlotView slot;
    if (queued < jobs_total && jobs.acquire(nullptr, 0ns, slot) == gpuipc::Status::Ok) {
      const Job job{queued++, 256u << 10};
      jobs.publish(nullptr, std::as_bytes(std::span(&job, 1)), 0);
      continue;
    }
    // Kill the worker in the middle of a job, evenly over the run: only while one is outstanding, and the death is
    // waited for below, so that each kill is a restart (a worker that has just finished its job dies all the same).
    bool kill_sent = false;
    if (killed < kills && queued > finished && finished >= (killed + 1) * jobs_total / (kills + 1)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(job_ms / 2));
      ::kill(child, SIGKILL);
      ++killed;
      kill_sent = true;
    }
    if (kill_sent || example::has_exited(child)) {  // it died: whatever the cause, start another
      const int code = example::wait_exit(child);
      std::printf("supervisor: worker %d %s; starting a new one\n", child,
                  code > 128 ? strsignal(code - 128) : ("exited with " + std::to_string(code)).c_str());
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
  int last_exit = 0;
  if (timed_out) {  // the worker may be stuck: it does not get a stop job
    std::fprintf(stderr, "supervisor: timed out after %lld s (--timeout-s) with %u of %u jobs done\n", timeout_s,
                 finished, jobs_total);
    last_exit = example::stop_children({child})[0];
  } else {
    // Stop the worker with a job of zero bytes; the supervisor keeps its own handles, as before the first worker.
    // A worker started after a kill may not have joined yet (acquire: PeerDied until it does): try again, within
    // 10 s, and stop it by signal if that does not end it.
    const double stop_by = example::now_s() + 10 + static_cast<double>(job_ms) / 1000 * 4;
    const Job stop{jobs_total, 0};
    for (bool sent = false; !sent && !example::has_exited(child) && example::now_s() < stop_by;) {
      gpuipc::SlotView slot;
      if (jobs.acquire(nullptr, 100ms, slot) == gpuipc::Status::Ok) {
        jobs.publish(nullptr, std::as_bytes(std::span(&stop, 1)), 0);
        sent = true;
      } else {
        std::this_thread::sleep_for(10ms);
      }
    }
    while (!example::has_exited(child) && example::now_s() < stop_by) std::this_thread::sleep_for(5ms);
    if (!example::has_exited(child)) std::fprintf(stderr, "supervisor: worker %d did not stop: killing it\n", child);
    last_exit = example::stop_children({child})[0];  // reaps it (a worker that has exited gets no signal)
  }
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
  // The names go on the way out (run_main). A job is done twice only when a worker dies between sending its result
  // and releasing the job (microseconds): results carry the job's id, so the supervisor counts it once.
  return !timed_out && finished == jobs_total && wrong == 0 && last_exit == 0 && !leaked ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return example::run_main("supervisor", [&] { return supervisor(argc, argv); });
}
