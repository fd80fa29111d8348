// The `faults` suite: what happens to shared GPU memory when a process dies at a bad moment. Scenarios: the
// creator of a segment is killed; an opener is killed; a writer is killed in the middle of writing a large segment
// with kernels; a channel producer is killed after publishing but before its stream wrote the data; the broker
// (gpuipcd) is killed. Each outcome is checked, not assumed: does the memory survive (a survivor or a fresh process
// maps it and runs a kernel on it), is the data intact (a pattern verified on the GPU), is anything leaked (broker
// fds from /proc/<broker>/fd, free GPU memory seen by a fresh worker, the broker's segment list), does anyone hang
// (every wait is bounded; the time to the outcome is recorded).
//
// Everything runs against a private broker: workers set GPUIPC_RUNTIME_DIR to a fresh directory and GPUIPC_DAEMON
// to the gpuipcd next to this executable, so killing "the daemon" kills only the suite's own broker. The suite
// stops that broker and removes the directory at the end.
#include <dirent.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "bench.hpp"
#include "core/client.hpp"
#include "cuda/resources.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/segment.hpp"
#include "kernels/kernels.hpp"
#include "os/process.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;
using Env = std::vector<std::pair<std::string, std::string>>;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kSeedOld = 0xfa17'0001;
constexpr std::uint64_t kSeedNewA = 0xfa17'0002;
constexpr std::uint64_t kSeedNewB = 0xfa17'0003;
/// Free GPU memory may differ by this much between two fresh workers without anything leaking.
constexpr std::int64_t kGpuTolerance = 64LL << 20;

/// What every worker sets up first.
struct Gpu {
  cuda::PrimaryContext ctx{0};
  int current = (ctx.make_current(), 0);
  cuda::Stream stream = cuda::Stream::create();
};

/// Shared by the parent and the workers of one scenario (a SharedPage made before the forks).
struct Sync {
  std::atomic<std::uint64_t> ready_a, ready_b, killed, done, failed, broker_pid;
};

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

/// In a worker: waits for `pred` at most `timeout`; throws then (the worker never hangs).
template <typename P>
void await(P&& pred, const char* what, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() > deadline) {
      throw Error(ErrorCode::Timeout, fmt::format("faults worker: timed out waiting for {}", what), "bench");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

/// In the parent: waits for `pred`, at most `timeout`, giving up early when a worker reported failure.
template <typename P>
bool wait_for(const Sync* sync, P&& pred, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!pred()) {
    if (sync != nullptr && sync->failed.load() != 0) return false;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  return true;
}

/// Waits for `stream` by polling, at most `timeout`; throws Error(Timeout) then.
void sync_bounded(const cuda::Stream& stream, std::chrono::milliseconds timeout, const char* what) {
  const auto deadline = Clock::now() + timeout;
  while (!stream.query()) {
    if (Clock::now() > deadline) {
      throw Error(ErrorCode::Timeout, fmt::format("faults worker: {} did not finish within {} ms", what,
                                                  timeout.count()),
                  "bench");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

/// A worker whose failure is visible to the parent at once (sync->failed).
Worker spawn(Sync* sync, std::function<json()> body, const Env& env) {
  return spawn_worker(
      [sync, body = std::move(body)]() -> json {
        try {
          return body();
        } catch (...) {
          sync->failed = 1;
          throw;
        }
      },
      env);
}

void sigkill(Worker& w) {
  if (w.child.pid > 0) ::kill(w.child.pid, SIGKILL);
}

/// Open fds of `pid`, or -1 when /proc does not show them.
int count_fds(pid_t pid) {
  if (pid <= 0) return -1;
  DIR* d = ::opendir(fmt::format("/proc/{}/fd", pid).c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n;
}

/// What a fresh worker sees: the broker's pid (connecting starts one if none runs), its segment list, free GPU memory.
struct Probe {
  bool ok = false;
  std::string error;
  pid_t broker = -1;
  json segments = json::array();
  std::int64_t gpu_free = -1;
};

Probe probe(const Env& env) {
  SharedPage page;
  auto* sync = new (page.as<Sync>()) Sync{};
  auto w = spawn(sync, [] {
    const auto pid = core::BrokerClient::instance().broker_pid();
    json segs = json::array();
    for (const auto& s : Segment::list()) {
      segs.push_back({{"name", s.name}, {"id", s.id}, {"references", s.references}, {"mappers", s.mapper_pids}});
    }
    const auto mem = cuda::memory_info(0);
    return json{{"broker", pid}, {"segments", segs}, {"gpu_free", mem.free}};
  }, env);
  const json r = join_worker(w, std::chrono::seconds(60));
  Probe p;
  if (r.contains("error")) {
    p.error = r["error"].dump();
    return p;
  }
  p.ok = true;
  p.broker = static_cast<pid_t>(r["broker"].get<std::uint32_t>());
  p.segments = r["segments"];
  p.gpu_free = r["gpu_free"].get<std::int64_t>();
  return p;
}

/// The state a scenario must leave behind.
struct Baseline {
  int broker_fds = -1;
  std::int64_t gpu_free = -1;
};

/// Broker fds once the connections of exited workers are closed: polls until at most `target`, up to 3 s.
int settled_fds(pid_t broker, int target) {
  int n = count_fds(broker);
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  while (n > target && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    n = count_fds(broker);
  }
  return n;
}

/// After a scenario (all its workers gone): is anything left? Fills `leaked` and appends to `detail`.
struct LeakReport {
  bool leaked = false;
  bool checked = false;
  std::string detail;
  pid_t broker = -1;
};

LeakReport check_leaks(const Env& env, const Baseline& base) {
  LeakReport out;
  Probe p;
  std::int64_t drop = 0;
  // GPU memory of a dead process is returned when the driver tears its context down: give it a moment.
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    p = probe(env);
    if (!p.ok) break;
    drop = base.gpu_free - p.gpu_free;
    if (drop <= kGpuTolerance && p.segments.empty()) break;
  }
  if (!p.ok) {
    out.leaked = true;
    out.detail = fmt::format("leak check failed: {}", p.error);
    return out;
  }
  out.checked = true;
  out.broker = p.broker;
  const int fds = settled_fds(p.broker, base.broker_fds);
  std::vector<std::string> what;
  if (!p.segments.empty()) what.push_back(fmt::format("segments still registered: {}", p.segments.dump()));
  if (drop > kGpuTolerance) what.push_back(fmt::format("{} MiB of GPU memory not returned", drop >> 20));
  if (fds >= 0 && base.broker_fds >= 0 && fds > base.broker_fds) {
    what.push_back(fmt::format("broker holds {} fds, {} before", fds, base.broker_fds));
  }
  out.leaked = !what.empty();
  out.detail = out.leaked ? fmt::format("LEAK: {}", fmt::join(what, "; "))
                          : fmt::format("no leak (segments 0, GPU free within {} MiB of the start ({:+.0f} MiB), "
                                        "broker fds {}{})",
                                        kGpuTolerance >> 20, static_cast<double>(-drop) / (1 << 20),
                                        fds >= 0 ? std::to_string(fds) : std::string("unreadable"),
                                        fds >= 0 ? fmt::format(" vs {} before", base.broker_fds) : "");
  return out;
}

/// One row of the table.
struct Outcome {
  std::string scenario;
  bool memory_survives = false;
  bool data_intact = false;
  bool leaked = true;
  bool hang = false;
  double time_to_outcome_ms = -1;
  std::vector<std::string> detail;
  json extra = json::object();
  bool extra_ok = true;  ///< scenario-specific expectations (e.g. a broker restarts)
  bool passed() const { return memory_survives && data_intact && !leaked && !hang && extra_ok; }
  json to_json() const {
    json j{{"scenario", scenario},       {"memory_survives", memory_survives}, {"data_intact", data_intact},
           {"leaked", leaked},           {"hang", hang},                       {"passed", passed()},
           {"time_to_outcome_ms", time_to_outcome_ms}, {"detail", fmt::format("{}", fmt::join(detail, "; "))}};
    for (const auto& [k, v] : extra.items()) j[k] = v;
    return j;
  }
};

/// Joins a worker; a timeout counts as a hang, an error goes to the detail. Returns the report.
json finish(Worker& w, Outcome& o, const char* who, std::chrono::seconds timeout = std::chrono::seconds(60)) {
  json r = join_worker(w, timeout);
  if (r.contains("error")) {
    const std::string e = r["error"].is_string() ? r["error"].get<std::string>() : r["error"].dump();
    if (e.find("did not finish") != std::string::npos || e.find("timed out") != std::string::npos) o.hang = true;
    o.detail.push_back(fmt::format("{}: {}", who, e));
  }
  return r;
}

/// Kills `w` with SIGKILL and reaps it (it reports nothing).
void kill_and_reap(Worker& w) {
  sigkill(w);
  [[maybe_unused]] const json ignored = join_worker(w, std::chrono::seconds(30));
}

std::string seg_name(const char* what) { return fmt::format("faults-{}-{}", what, now_ns() % 1000000); }

// --- 1. the creator dies ------------------------------------------------------------------------------------------
Outcome kill_creator(const Env& env, std::size_t bytes) {
  Outcome o;
  o.scenario = "kill_creator";
  SharedPage page;
  auto* sync = new (page.as<Sync>()) Sync{};
  const std::string name = seg_name("creator");
  auto a = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    auto seg = Segment::create(name, bytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    k.fill_pattern(g.stream.get(), seg.device_pointer(), bytes / 4, kSeedOld);
    sync_bounded(g.stream, std::chrono::seconds(30), "fill");
    sync->ready_a = 1;
    await([&] { return sync->done.load() != 0; }, "being killed", std::chrono::seconds(120));
    return json::object();
  }, env);
  if (!wait_for(sync, [&] { return sync->ready_a.load() == 1; }, std::chrono::seconds(60))) {
    sigkill(a);
    finish(a, o, "creator");
    o.detail.push_back("the creator did not get ready");
    return o;
  }
  const auto t_kill = Clock::now();
  kill_and_reap(a);
  auto b = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    const auto t0 = Clock::now();
    auto seg = Segment::open(name, {.access = Access::ReadWrite});
    const double open_ms = ms_since(t0);
    const auto mismatches = k.count_mismatches(g.stream.get(), seg.device_pointer(), bytes / 4, kSeedOld);
    const auto info = Segment::stat(name);
    Segment::unlink(name);
    seg.close();
    return json{{"open_ms", open_ms}, {"mismatches", mismatches}, {"references", info.references},
                {"mappers", info.mapper_pids}};
  }, env);
  const json rb = finish(b, o, "opener after the creator's death");
  if (!rb.contains("error")) {
    o.time_to_outcome_ms = ms_since(t_kill);
    o.memory_survives = true;
    o.data_intact = rb["mismatches"].get<std::uint64_t>() == 0;
    const auto refs = rb["references"].get<std::uint32_t>();
    o.detail.push_back(fmt::format("a fresh process opened '{}' after its creator was SIGKILLed ({:.1f} ms to open) "
                                   "and verified {} MiB on the GPU: {} mismatching words; references then {} "
                                   "(the opener's own: the creator's was dropped{})",
                                   name, rb["open_ms"].get<double>(), bytes >> 20,
                                   rb["mismatches"].get<std::uint64_t>(), refs, refs == 1 ? "" : ": NOT dropped"));
    o.extra["creator_reference_dropped"] = refs == 1;
    o.extra_ok = refs == 1;
  }
  return o;
}

// --- 2. an opener dies --------------------------------------------------------------------------------------------
Outcome kill_opener(const Env& env, std::size_t bytes) {
  Outcome o;
  o.scenario = "kill_opener";
  SharedPage page;
  auto* sync = new (page.as<Sync>()) Sync{};
  const std::string name = seg_name("opener");
  auto a = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    auto seg = Segment::create(name, bytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    k.fill_pattern(g.stream.get(), seg.device_pointer(), bytes / 4, kSeedOld);
    sync_bounded(g.stream, std::chrono::seconds(30), "fill");
    sync->ready_a = 1;
    await([&] { return sync->killed.load() != 0; }, "the opener to be killed");
    const auto t0 = Clock::now();
    std::uint32_t refs = 0;
    bool dropped = false;
    while (ms_since(t0) < 10000) {
      refs = Segment::stat(name).references;
      if (refs == 1) {
        dropped = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const double dropped_ms = ms_since(t0);
    const auto mismatches = k.count_mismatches(g.stream.get(), seg.device_pointer(), bytes / 4, kSeedOld);
    Segment::unlink(name);
    return json{{"dropped", dropped}, {"references", refs}, {"dropped_ms", dropped_ms}, {"mismatches", mismatches}};
  }, env);
  auto b = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    await([&] { return sync->ready_a.load() == 1; }, "the segment");
    auto seg = Segment::open(name, {.access = Access::ReadWrite});
    auto out = cuda::DeviceBuffer::allocate(8);
    cuda::memset_d8(out.get(), 0, 8);
    // Reading the segment with kernels when the SIGKILL comes.
    for (int i = 0; i < 8; ++i) k.read_sum(g.stream.get(), seg.device_pointer(), bytes / 16, out.get());
    sync->ready_b = 1;
    const auto t0 = Clock::now();
    while (ms_since(t0) < 120000) {
      k.read_sum(g.stream.get(), seg.device_pointer(), bytes / 16, out.get());
      sync_bounded(g.stream, std::chrono::seconds(30), "read");
    }
    return json::object();
  }, env);
  if (!wait_for(sync, [&] { return sync->ready_b.load() == 1; }, std::chrono::seconds(60))) {
    sigkill(a);
    sigkill(b);
    finish(a, o, "creator");
    finish(b, o, "opener");
    o.detail.push_back("the workers did not get ready");
    return o;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t_kill = Clock::now();
  kill_and_reap(b);
  sync->killed = 1;
  const json ra = finish(a, o, "creator");
  if (!ra.contains("error")) {
    o.time_to_outcome_ms = ms_since(t_kill);
    o.memory_survives = true;
    o.data_intact = ra["mismatches"].get<std::uint64_t>() == 0;
    const bool dropped = ra["dropped"].get<bool>();
    o.extra["opener_reference_dropped"] = dropped;
    o.extra["reference_dropped_ms"] = ra["dropped_ms"];
    o.extra_ok = dropped;
    if (!dropped) o.hang = true;  // a reference that is never dropped: the broker did not notice the death in 10 s
    o.detail.push_back(fmt::format("opener SIGKILLed while its kernels read the segment; the broker dropped its "
                                   "reference {} ({:.1f} ms after the creator started polling); the creator's "
                                   "mapping still works: {} mismatching words",
                                   dropped ? "yes" : "NO (10 s)", ra["dropped_ms"].get<double>(),
                                   ra["mismatches"].get<std::uint64_t>()));
  }
  return o;
}

// --- 3. a writer dies in the middle of writing ----------------------------------------------------------------------
Outcome kill_mid_write(const Env& env, std::size_t bytes) {
  Outcome o;
  o.scenario = "kill_mid_write";
  SharedPage page;
  auto* sync = new (page.as<Sync>()) Sync{};
  const std::string name = seg_name("midwrite");
  const std::size_t words = bytes / 4;
  auto a = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    auto seg = Segment::create(name, bytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    k.fill_pattern(g.stream.get(), seg.device_pointer(), words, kSeedOld);
    sync_bounded(g.stream, std::chrono::seconds(30), "fill");
    sync->ready_a = 1;
    await([&] { return sync->killed.load() != 0; }, "the writer to be killed");
    auto counts = cuda::DeviceBuffer::allocate(4 * sizeof(std::uint64_t));
    cuda::memset_d8(counts.get(), 0, 4 * sizeof(std::uint64_t));
    k.classify_patterns(g.stream.get(), seg.device_pointer(), words, kSeedOld, kSeedNewA, kSeedNewB, counts.get());
    sync_bounded(g.stream, std::chrono::seconds(30), "classify");
    std::uint64_t c[4] = {};
    cuda::copy_to_host(c, counts.get(), sizeof c);
    Segment::unlink(name);
    return json{{"old", c[0]}, {"new_a", c[1]}, {"new_b", c[2]}, {"garbage", c[3]}};
  }, env);
  auto b = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    await([&] { return sync->ready_a.load() == 1; }, "the segment");
    auto seg = Segment::open(name, {.access = Access::ReadWrite});
    // Rewrites the whole segment, alternating two patterns, far longer than the kill takes to land.
    const auto t0 = Clock::now();
    for (int i = 0; ms_since(t0) < 120000; ++i) {
      k.fill_pattern(g.stream.get(), seg.device_pointer(), words, (i % 2) == 0 ? kSeedNewA : kSeedNewB);
      if (i == 16) sync->ready_b = 1;  // the GPU is busy writing (launches block once the queue is full)
    }
    return json::object();
  }, env);
  if (!wait_for(sync, [&] { return sync->ready_b.load() == 1; }, std::chrono::seconds(60))) {
    sigkill(a);
    sigkill(b);
    finish(a, o, "creator");
    finish(b, o, "writer");
    o.detail.push_back("the workers did not get ready");
    return o;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto t_kill = Clock::now();
  kill_and_reap(b);
  sync->killed = 1;
  const json ra = finish(a, o, "creator");
  if (!ra.contains("error")) {
    o.time_to_outcome_ms = ms_since(t_kill);
    o.memory_survives = true;
    const auto old = ra["old"].get<std::uint64_t>();
    const auto na = ra["new_a"].get<std::uint64_t>();
    const auto nb = ra["new_b"].get<std::uint64_t>();
    const auto garbage = ra["garbage"].get<std::uint64_t>();
    // Intact = every word is a whole word of one of the writes; which mix of them is the writer's timing.
    o.data_intact = garbage == 0 && old + na + nb == words;
    o.extra["words_old"] = old;
    o.extra["words_new"] = na + nb;
    o.extra["words_garbage"] = garbage;
    const bool mixed = (old != 0 ? 1 : 0) + (na != 0 ? 1 : 0) + (nb != 0 ? 1 : 0) > 1;
    o.detail.push_back(fmt::format(
        "writer SIGKILLed while its kernels rewrote {} MiB: the survivor's mapping works; words: {} old pattern, {} "
        "and {} of the two new ones, {} of none (garbage){}",
        bytes >> 20, old, na, nb, garbage,
        mixed ? "; the buffer is a MIX of writes: a reader cannot tell a half-written buffer from a whole one "
                "(hand buffers over with a channel or a semaphore signalled after the writing kernel)"
              : "; the buffer holds one whole pattern"));
  }
  return o;
}

// --- 4. a channel producer dies between publish and the end of its writes ------------------------------------------
Outcome kill_mid_publish(const Env& env, std::size_t bytes) {
  Outcome o;
  o.scenario = "kill_mid_publish";
  SharedPage page;
  auto* sync = new (page.as<Sync>()) Sync{};
  const std::string name = seg_name("midpublish");
  auto p = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    auto ch = Channel::create(name, {.slots = 2, .slot_bytes = bytes, .header_bytes = 64,
                                     .kind = SegmentKind::Device, .device = 0, .mode = 0600},
                              ChannelRole::Producer);
    sync->ready_a = 1;
    await([&] { return sync->ready_b.load() == 1; }, "the consumer");
    SlotView slot;
    if (const auto st = ch.acquire(g.stream.get(), std::chrono::seconds(10), slot); st != Status::Ok) {
      throw Error(ErrorCode::System, fmt::format("acquire: {}", to_string(st)), "bench");
    }
    // The stream is held at a gate nobody opens (a word of registered host memory), so the writes and the
    // stream-ordered part of publish are still pending when the producer dies.
    void* gate = std::aligned_alloc(4096, 4096);
    std::memset(gate, 0, 4096);
    auto reg = cuda::HostRegistration::register_memory(gate, 4096);
    if (cuda::stream_wait_value64(g.stream.get(), reg.device_pointer(), 1) != CUDA_SUCCESS) {
      throw Error(ErrorCode::Cuda, "cuStreamWaitValue64 (gate) failed", "bench");
    }
    k.fill_pattern(g.stream.get(), slot.device_pointer, bytes / 4, kSeedNewA);
    if (const auto st = ch.publish(g.stream.get(), {}, bytes); st != Status::Ok) {
      throw Error(ErrorCode::System, fmt::format("publish: {}", to_string(st)), "bench");
    }
    sync->ready_a = 2;
    await([&] { return sync->done.load() != 0; }, "being killed", std::chrono::seconds(120));
    return json::object();
  }, env);
  auto c = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    await([&] { return sync->ready_a.load() >= 1; }, "the channel");
    auto ch = Channel::open(name, ChannelRole::Consumer);
    sync->ready_b = 1;
    await([&] { return sync->ready_a.load() == 2; }, "the publish");
    MessageView m;
    const auto t_recv = Clock::now();
    const Status st1 = ch.receive(g.stream.get(), std::chrono::seconds(10), m);
    const double recv_ms = ms_since(t_recv);
    sync->ready_b = 2;
    await([&] { return sync->killed.load() != 0; }, "the producer to be killed");
    const auto t0 = Clock::now();
    json out{{"first_receive", std::string(to_string(st1))}, {"first_receive_ms", recv_ms}};
    if (st1 == Status::Ok) {
      // The stream waits for the dead producer's `filled`: the broker must release it.
      sync_bounded(g.stream, std::chrono::seconds(20), "the consumer's stream (waiting for the dead producer)");
      out["stream_released_ms"] = ms_since(t0);
      out["incomplete"] = m.incomplete();
      out["mismatches"] = k.count_mismatches(g.stream.get(), m.device_pointer, bytes / 4, kSeedNewA);
      out["release"] = std::string(to_string(ch.release(g.stream.get())));
      sync_bounded(g.stream, std::chrono::seconds(20), "release");
    }
    MessageView m2;
    const auto t1 = Clock::now();
    const Status st2 = ch.receive(g.stream.get(), std::chrono::seconds(10), m2);
    out["second_receive"] = std::string(to_string(st2));
    out["second_receive_ms"] = ms_since(t1);
    out["outcome_ms"] = ms_since(t0);
    ch = Channel();
    Channel::unlink(name);
    return out;
  }, env);
  if (!wait_for(sync, [&] { return sync->ready_b.load() == 2; }, std::chrono::seconds(60))) {
    sigkill(p);
    sigkill(c);
    finish(p, o, "producer");
    finish(c, o, "consumer");
    o.detail.push_back("the workers did not get ready");
    return o;
  }
  const auto t_kill = Clock::now();
  kill_and_reap(p);
  sync->killed = 1;
  const json rc = finish(c, o, "consumer");
  if (!rc.contains("error")) {
    o.time_to_outcome_ms = ms_since(t_kill);
    const std::string first = rc["first_receive"].get<std::string>();
    const std::string second = rc["second_receive"].get<std::string>();
    const bool got = first == "Ok";
    const bool incomplete = got && rc["incomplete"].get<bool>();
    const std::uint64_t mism = got ? rc["mismatches"].get<std::uint64_t>() : 0;
    o.memory_survives = got;  // the consumer ran a kernel over the slot after the producer's death
    // Intact, or flagged: a consumer is told when the data is partial.
    o.data_intact = got && (mism == 0 || incomplete);
    const bool peer_reported = second == "PeerDied" || second == "Closed";
    o.extra["message_incomplete_flagged"] = incomplete;
    o.extra["next_receive"] = second;
    o.extra_ok = peer_reported;
    if (!peer_reported && second == "Timeout") o.hang = true;
    o.detail.push_back(fmt::format(
        "producer SIGKILLed after publish, its stream still held before the writes: the consumer received the "
        "message ({}), its stream was released {} ms after the kill, incomplete() = {}, {} words differ from what the "
        "producer meant to write ({}); the next receive returned {} in {:.1f} ms",
        first, got ? fmt::format("{:.1f}", rc["stream_released_ms"].get<double>()) : std::string("-"),
        incomplete, mism, mism == 0 ? "intact" : incomplete ? "partial, and flagged" : "partial and NOT flagged",
        second, rc["second_receive_ms"].get<double>()));
  }
  return o;
}

// --- 5. the broker dies ---------------------------------------------------------------------------------------------
Outcome kill_daemon(const Env& env, std::size_t bytes, pid_t* broker_out) {
  Outcome o;
  o.scenario = "kill_daemon";
  SharedPage page;
  auto* sync = new (page.as<Sync>()) Sync{};
  const std::string name = seg_name("daemon");
  auto verify_after_kill = [&](kernels::Kernels& k, Gpu& g, const Segment& seg) {
    await([&] { return sync->killed.load() != 0; }, "the broker to be killed");
    const auto t0 = Clock::now();
    const auto mismatches = k.count_mismatches(g.stream.get(), seg.device_pointer(), bytes / 4, kSeedOld);
    const double ms = ms_since(t0);
    await([&] { return sync->done.load() != 0; }, "the end of the scenario");
    return json{{"mismatches", mismatches}, {"verify_ms", ms}};
  };
  auto a = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    auto seg = Segment::create(name, bytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
    k.fill_pattern(g.stream.get(), seg.device_pointer(), bytes / 4, kSeedOld);
    sync_bounded(g.stream, std::chrono::seconds(30), "fill");
    sync->broker_pid = core::BrokerClient::instance().broker_pid();
    sync->ready_a = 1;
    return verify_after_kill(k, g, seg);
  }, env);
  auto b = spawn(sync, [&] {
    Gpu g;
    kernels::Kernels k;
    await([&] { return sync->ready_a.load() == 1; }, "the segment");
    auto seg = Segment::open(name, {.access = Access::ReadOnly});
    sync->ready_b = 1;
    return verify_after_kill(k, g, seg);
  }, env);
  auto give_up = [&](const char* why) {
    sync->done = 1;
    sigkill(a);
    sigkill(b);
    finish(a, o, "creator");
    finish(b, o, "opener");
    o.detail.push_back(why);
    return o;
  };
  if (!wait_for(sync, [&] { return sync->ready_b.load() == 1; }, std::chrono::seconds(60))) {
    return give_up("the workers did not get ready");
  }
  const auto broker = static_cast<pid_t>(sync->broker_pid.load());
  os::UniqueFd pidfd;
  try {
    pidfd = os::pidfd_open(broker);
  } catch (const std::exception& e) {
    return give_up(fmt::format("pidfd_open(broker {}): {}", broker, e.what()).c_str());
  }
  const auto t_kill = Clock::now();
  ::kill(broker, SIGKILL);
  const bool gone = os::pidfd_wait_exit(pidfd.get(), 5000);
  o.extra["old_broker_exited"] = gone;
  sync->killed = 1;
  // A fresh process's first request: does the library start a new broker, and does it know the old names?
  SharedPage page_c;
  auto* sync_c = new (page_c.as<Sync>()) Sync{};
  auto c = spawn(sync_c, [&] {
    const auto t0 = Clock::now();
    const auto segs = Segment::list();
    const double first_ms = ms_since(t0);
    const auto pid = core::BrokerClient::instance().broker_pid();
    bool old_name_gone = false;
    std::string open_error;
    try {
      const auto stale = Segment::open(name, {.access = Access::ReadOnly});
      open_error = fmt::format("opened (id {})", stale.id());
    } catch (const Error& e) {
      old_name_gone = e.code() == ErrorCode::NotFound;
      open_error = e.what();
    }
    bool create_ok = false;
    {
      cuda::PrimaryContext ctx(0);
      ctx.make_current();
      const std::string fresh = name + "-after";
      auto s = Segment::create(fresh, 2 << 20, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
      create_ok = static_cast<bool>(s);
      Segment::unlink(fresh);
    }
    return json{{"first_request_ms", first_ms}, {"listed", segs.size()}, {"broker", pid},
                {"old_name_gone", old_name_gone}, {"open_error", open_error}, {"create_ok", create_ok}};
  }, env);
  const json rc = finish(c, o, "fresh process after the broker's death");
  sync->done = 1;
  const json ra = finish(a, o, "creator");
  const json rb = finish(b, o, "opener");
  if (!ra.contains("error") && !rb.contains("error")) {
    o.time_to_outcome_ms = ms_since(t_kill);
    o.memory_survives = true;  // both existing mappings ran a kernel over the segment after the kill
    o.data_intact = ra["mismatches"].get<std::uint64_t>() == 0 && rb["mismatches"].get<std::uint64_t>() == 0;
    o.detail.push_back(fmt::format("broker {} SIGKILLed ({}): the creator's and the opener's existing mappings still "
                                   "work, {} and {} mismatching words",
                                   broker, gone ? "exited" : "STILL ALIVE after 5 s",
                                   ra["mismatches"].get<std::uint64_t>(), rb["mismatches"].get<std::uint64_t>()));
  }
  if (!rc.contains("error")) {
    const auto fresh = static_cast<pid_t>(rc["broker"].get<std::uint32_t>());
    const bool restarted = fresh > 0 && fresh != broker;
    const bool old_gone = rc["old_name_gone"].get<bool>() && rc["listed"].get<std::size_t>() == 0;
    *broker_out = fresh;
    o.extra["new_broker_started"] = restarted;
    o.extra["old_names_gone"] = old_gone;
    o.extra["first_request_ms"] = rc["first_request_ms"];
    o.extra_ok = restarted && rc["create_ok"].get<bool>();
    o.detail.push_back(fmt::format("a new request started a new broker: {} (pid {}, first request {:.1f} ms); old "
                                   "names gone: {} ({} segments listed; open: {}); creating a new segment works: {}",
                                   restarted ? "yes" : "NO", fresh, rc["first_request_ms"].get<double>(),
                                   old_gone ? "yes" : "no", rc["listed"].get<std::size_t>(),
                                   rc["open_error"].get<std::string>(), rc["create_ok"].get<bool>() ? "yes" : "no"));
  } else {
    o.extra_ok = false;
  }
  return o;
}

/// Stops the suite's broker (it is ours: started in our private runtime directory).
void stop_broker(pid_t pid) {
  if (pid <= 0) return;
  try {
    auto fd = os::pidfd_open(pid);
    ::kill(pid, SIGTERM);
    if (!os::pidfd_wait_exit(fd.get(), 3000)) {
      ::kill(pid, SIGKILL);
      os::pidfd_wait_exit(fd.get(), 3000);
    }
  } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): already gone
  }
}

Result run(const Options& o, const DeviceMeta& /*meta*/) {
  Result r;
  r.mps = false;
  const std::size_t bytes = o.quick ? (256ULL << 20) : (1ULL << 30);
  const std::size_t channel_bytes = 64ULL << 20;

  namespace fs = std::filesystem;
  const std::string exe = os::self_exe_path();
  std::string daemon = exe.empty() ? std::string() : (fs::path(exe).parent_path() / "gpuipcd").string();
  if (daemon.empty() || !fs::exists(daemon)) {
    r.notes.push_back(fmt::format("gpuipcd not found next to {} ({}): build the gpuipcd target; no scenario ran",
                                  exe.empty() ? "this program" : exe, daemon));
    r.metrics["faults_scenarios"] = 0;
    r.metrics["faults_passed"] = 0;
    return r;
  }
  char tmpl[] = "/tmp/gpuipc-faults-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) {
    r.notes.push_back("mkdtemp failed: no private runtime directory; no scenario ran");
    return r;
  }
  const std::string dir = tmpl;
  const Env env{{"GPUIPC_RUNTIME_DIR", dir}, {"GPUIPC_DAEMON", daemon}, {"GPUIPC_IDLE_TIMEOUT_MS", "600000"}};

  progress(o, "faults: starting a private broker");
  pid_t broker = -1;
  Baseline base;
  {
    const Probe p0 = probe(env);  // starts the broker
    const Probe p1 = probe(env);  // the steady state, once the first probe's connection is gone
    if (!p0.ok || !p1.ok) {
      r.notes.push_back(fmt::format("faults: the private broker did not answer: {}", p0.ok ? p1.error : p0.error));
      stop_broker(p0.ok ? p0.broker : -1);
      std::error_code ec;
      fs::remove_all(dir, ec);
      return r;
    }
    broker = p1.broker;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    base.broker_fds = count_fds(broker);
    base.gpu_free = p1.gpu_free;
    r.samples.push_back({{"what", "baseline"}, {"broker_pid", broker}, {"broker_fds", base.broker_fds},
                         {"gpu_free_mib", base.gpu_free >> 20}, {"runtime_dir", dir}, {"daemon", daemon}});
    if (base.broker_fds < 0) r.notes.push_back("faults: /proc/<broker>/fd is not readable here: fd leaks unchecked");
  }

  std::vector<Outcome> outcomes;
  auto run_one = [&](const char* label, const std::function<Outcome()>& f) {
    progress(o, fmt::format("faults: {}", label));
    const auto t0 = Clock::now();
    Outcome out;
    try {
      out = f();
    } catch (const std::exception& e) {
      out.scenario = label;
      out.detail.push_back(fmt::format("the scenario failed: {}", e.what()));
    }
    const auto leaks = check_leaks(env, base);
    if (leaks.broker > 0) broker = leaks.broker;
    out.leaked = leaks.leaked;
    out.detail.push_back(leaks.detail);
    out.extra["scenario_s"] = ms_since(t0) / 1e3;
    outcomes.push_back(std::move(out));
  };
  run_one("kill_creator", [&] { return kill_creator(env, bytes); });
  run_one("kill_opener", [&] { return kill_opener(env, bytes); });
  run_one("kill_mid_write", [&] { return kill_mid_write(env, bytes); });
  run_one("kill_mid_publish", [&] { return kill_mid_publish(env, channel_bytes); });
  run_one("kill_daemon", [&] {
    // The fresh broker's idle fd count is the baseline's: compared by check_leaks as for the others.
    pid_t fresh = -1;
    auto out = kill_daemon(env, bytes, &fresh);
    if (fresh > 0) broker = fresh;
    return out;
  });

  stop_broker(broker);
  std::error_code ec;
  fs::remove_all(dir, ec);

  int passed = 0;
  for (const auto& out : outcomes) {
    r.samples.push_back(out.to_json());
    r.metrics[fmt::format("faults_{}_ok", out.scenario)] = out.passed() ? 1 : 0;
    r.metrics[fmt::format("faults_{}_ms", out.scenario)] =
        out.time_to_outcome_ms >= 0 ? json(out.time_to_outcome_ms) : json(nullptr);
    passed += out.passed() ? 1 : 0;
    r.notes.push_back(fmt::format("{}: {} (memory survives: {}, data intact: {}, leaked: {}, hang: {}{}) {}",
                                  out.scenario, out.passed() ? "PASS" : "FAIL", out.memory_survives ? "yes" : "no",
                                  out.data_intact ? "yes" : "no", out.leaked ? "YES" : "no", out.hang ? "YES" : "no",
                                  out.time_to_outcome_ms >= 0 ? fmt::format(", {:.0f} ms to the outcome", out.time_to_outcome_ms)
                                                              : std::string(),
                                  fmt::join(out.detail, "; ")));
  }
  r.metrics["faults_scenarios"] = outcomes.size();
  r.metrics["faults_passed"] = passed;
  return r;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{.name = "faults",
                         .description = "kill the creator, an opener, a writer mid-write, a channel producer "
                                        "mid-publish, the broker: does the memory survive, is the data intact, is "
                                        "anything leaked, does anyone hang",
                         .needs_gpu = true,
                         .run = run});

}  // namespace gpuipc::bench
