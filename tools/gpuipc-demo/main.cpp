// gpuipc-demo, which `gpuipc demo` runs (docs/cli/demo.md): the README's main job. A producer process and a consumer
// process stream frames through a channel: on GPU 0, the producer's kernel writes each frame into a slot and the
// consumer's kernel verifies it, all in stream order; without a GPU, a host channel (clearly labelled) does the same
// with the CPU. A program apart from the CLI because it launches the GPU kernels (testkit/kernels) through src/cuda, which
// the CLI, a front end of the public API, must not link (docs/architecture.md#layers).
#include <fmt/format.h>

#include <array>
#include <chrono>
#include <csignal>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/stream_ops.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/log.hpp"
#include "os/child.hpp"
#include "os/epoll.hpp"
#include "os/identity.hpp"
#include "os/process.hpp"
#include "testkit/kernels/pattern.hpp"  // host code too: the host channel's frames carry the pattern without nvcc
#if defined(GPUIPC_HAVE_KERNELS)
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"
#endif

namespace gpuipc::cli {
namespace {

struct FrameHeader {
  std::uint64_t frame;
  std::uint64_t seed;
  std::int64_t published_ns;  // CLOCK_MONOTONIC of the producer's publish (same machine, same clock)
};

struct DemoOptions {
  std::uint64_t frames = 0;
  std::size_t frame_bytes = 0;
  std::uint32_t slots = 4;
  bool host = false;
};

/// Whether GPU 0 can run the device demo; asked in a child so this process can still fork CUDA workers.
std::string gpu_unavailable_reason() {
  auto child = os::fork_reporting([]() -> std::string {
    std::string why;
    if (!cuda::driver_available(&why)) return why;  // "no CUDA driver: ..."
    if (cuda::device_count() == 0) return "no GPU";
    if (const auto info = cuda::query_device(0, false); !info.vmm || !info.posix_fd_handles) {
      return "GPU 0 cannot export memory as POSIX fds";
    }
    return "";
  });
  std::string out = os::join_reporting(child, std::chrono::seconds(120)).text;
#if !defined(GPUIPC_HAVE_KERNELS)
  if (out.empty()) out = "this build has no GPU kernels (built without nvcc)";
#endif
  return out;
}

std::string status_error(const char* what, Status st) { return fmt::format("{}: {}", what, to_string(st)); }

/// The producer: acquire, write the frame, publish. Returns a JSON report.
nlohmann::json produce(const std::string& name, const DemoOptions& o) {
  nlohmann::json r;
  ChannelOptions co{.slots = o.slots, .slot_bytes = o.frame_bytes, .header_bytes = sizeof(FrameHeader),
                    .kind = o.host ? SegmentKind::Host : SegmentKind::Device, .device = 0, .mode = 0600};
  const std::size_t words = o.frame_bytes / 4;
#if defined(GPUIPC_HAVE_KERNELS)
  std::unique_ptr<cuda::PrimaryContext> ctx;
  std::unique_ptr<cuda::Stream> stream;
  std::unique_ptr<kernels::Kernels> k;
  if (!o.host) {
    ctx = std::make_unique<cuda::PrimaryContext>(0);
    ctx->make_current();
    stream = std::make_unique<cuda::Stream>(cuda::Stream::create());
    k = std::make_unique<kernels::Kernels>();
  }
#endif
  auto ch = Channel::create(name, co, ChannelRole::Producer);
  for (std::uint64_t f = 0; f < o.frames; ++f) {
    SlotView slot;
    StreamHandle s = nullptr;
#if defined(GPUIPC_HAVE_KERNELS)
    if (stream) s = stream->get();
#endif
    if (const Status st = ch.acquire(s, std::chrono::seconds(30), slot); st != Status::Ok) {
      r["error"] = status_error("acquire", st);
      return r;
    }
    FrameHeader h{f, 0x9e3779b97f4a7c15ULL ^ f, 0};
    if (o.host) {
      auto* p = static_cast<std::uint32_t*>(slot.data);
      for (std::size_t i = 0; i < words; ++i) p[i] = kernels::pattern_word(h.seed, i);
    } else {
#if defined(GPUIPC_HAVE_KERNELS)
      k->fill_pattern(stream->get(), slot.device_pointer, words, h.seed);
#endif
    }
    h.published_ns = os::monotonic_ns();
    if (const Status st = ch.publish(s, std::as_bytes(std::span(&h, 1)), o.frame_bytes); st != Status::Ok) {
      r["error"] = status_error("publish", st);
      return r;
    }
  }
#if defined(GPUIPC_HAVE_KERNELS)
  if (stream) stream->synchronize();
#endif
  // Stay until the consumer has everything (leaving early would only tell it "Closed" sooner: harmless, but the
  // slots must outlive the consumer's reads, which the names' references guarantee anyway).
  r["frames"] = o.frames;
  return r;
}

/// The consumer: receive, verify, release. Returns a JSON report with throughput and handoff latencies.
nlohmann::json consume(const std::string& name, const DemoOptions& o) {
  nlohmann::json r;
  const std::size_t words = o.frame_bytes / 4;
#if defined(GPUIPC_HAVE_KERNELS)
  std::unique_ptr<cuda::PrimaryContext> ctx;
  std::unique_ptr<cuda::Stream> stream;
  std::unique_ptr<kernels::Kernels> k;
  cuda::DeviceBuffer mismatches;
  if (!o.host) {
    ctx = std::make_unique<cuda::PrimaryContext>(0);
    ctx->make_current();
    stream = std::make_unique<cuda::Stream>(cuda::Stream::create());
    k = std::make_unique<kernels::Kernels>();
    mismatches = cuda::DeviceBuffer::allocate(8);
    cuda::memset_d8(mismatches.get(), 0, 8);
  }
#endif
  auto ch = Channel::open(name, ChannelRole::Consumer, {.wait = std::chrono::seconds(30), .device = 0});
  std::vector<double> handoff_us;
  handoff_us.reserve(o.frames);
  std::uint64_t host_mismatches = 0;
  std::uint64_t expected = 0;
  std::int64_t first_ns = 0;
  for (;;) {
    MessageView m;
    StreamHandle s = nullptr;
#if defined(GPUIPC_HAVE_KERNELS)
    if (stream) s = stream->get();
#endif
    const Status st = ch.receive(s, std::chrono::seconds(30), m);
    if (st == Status::Closed && expected == o.frames) break;
    if (st != Status::Ok) {
      r["error"] = status_error("receive", st);
      return r;
    }
    const std::int64_t now = os::monotonic_ns();
    if (first_ns == 0) first_ns = now;
    FrameHeader h{};
    std::memcpy(&h, m.header.data(), sizeof h);
    if (h.frame != expected) {
      r["error"] = fmt::format("frame {} arrived when {} was expected", h.frame, expected);
      return r;
    }
    ++expected;
    handoff_us.push_back(static_cast<double>(now - h.published_ns) / 1000.0);
    if (o.host) {
      const auto* p = static_cast<const std::uint32_t*>(m.data);
      for (std::size_t i = 0; i < words; ++i) host_mismatches += p[i] != kernels::pattern_word(h.seed, i);
    } else {
#if defined(GPUIPC_HAVE_KERNELS)
      k->verify_pattern(stream->get(), m.device_pointer, words, h.seed, mismatches.get());
#endif
    }
    if (const Status rs = ch.release(s); rs != Status::Ok) {
      r["error"] = status_error("release", rs);
      return r;
    }
    if (expected == o.frames) break;
  }
#if defined(GPUIPC_HAVE_KERNELS)
  if (stream) {
    stream->synchronize();
    cuda::copy_to_host(&host_mismatches, mismatches.get(), 8);
  }
#endif
  const double seconds = static_cast<double>(os::monotonic_ns() - first_ns) / 1e9;
  std::sort(handoff_us.begin(), handoff_us.end());
  auto pct = [&](double q) { return handoff_us.empty() ? 0.0 : handoff_us[static_cast<std::size_t>(q * (handoff_us.size() - 1))]; };
  r["frames"] = expected;
  r["mismatched_words"] = host_mismatches;
  r["seconds"] = seconds;
  r["frames_per_s"] = static_cast<double>(expected) / seconds;
  r["gb_per_s"] = static_cast<double>(expected) * static_cast<double>(o.frame_bytes) / seconds / 1e9;
  r["handoff_p50_us"] = pct(0.5);
  r["handoff_p99_us"] = pct(0.99);
  return r;
}

/// The signals that stop the demo (Ctrl-C, SIGTERM): blocked in the command from before it starts its workers, and
/// read from a signalfd (collect_both); the workers unblock them.
const std::vector<int> kStopSignals = {SIGINT, SIGTERM};

/// Runs `body` in a child process; its JSON report comes back through a pipe.
os::ReportingChild spawn(const std::function<nlohmann::json()>& body) {
  return os::fork_reporting([&] {
    os::unblock_signals(kStopSignals);
    auto r = body();
    if (r.contains("error")) throw std::runtime_error(r["error"].get<std::string>());
    return r.dump();
  });
}

nlohmann::json collect(os::ReportingChild& child) {
  const auto r = os::join_reporting(child, std::chrono::minutes(10));
  if (r.text.rfind("error: ", 0) == 0) return nlohmann::json{{"error", r.text.substr(7)}};
  try {
    return nlohmann::json::parse(r.text);
  } catch (const std::exception&) {
    return nlohmann::json{{"error", fmt::format("worker ended without a report (wait status {:#x})", r.wait_status)}};
  }
}

/// Ends the demo on a stop signal: the workers killed, the channel's name removed (its memory would stay registered:
/// 32 MiB of GPU memory a run at the defaults), then this process ended by that signal.
[[noreturn]] void stop(int sig, const std::string& name, os::ReportingChild& producer, os::ReportingChild& consumer) {
  for (auto* w : {&producer, &consumer}) {
    if (w->pid <= 0) continue;  // collected already (its pid may be another process's by now)
    try {
      os::send_signal(w->pid, SIGKILL);
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): gone already
    }
    (void)collect(*w);  // reaped
  }
  // Twice: a Create the producer sent before it died may reach the broker after the first (another connection's
  // requests are not ordered with this one's); a tenth of a second is far more than the broker takes to read it.
  for (int i = 0; i < 2; ++i) {
    try {
      Channel::unlink(name);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::NotFound) std::cerr << fmt::format("gpuipc demo: {} left: {}\n", name, e.what());
    }
    if (i == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  os::die_by_signal(sig);
}

/// The two workers' reports, each collected as it comes. When one fails, the other, which would wait for its peer
/// until its own time runs out (30 s), is stopped at once; a stop signal (`stop_fd`, a signalfd) ends it all (stop).
std::pair<nlohmann::json, nlohmann::json> collect_both(const std::string& name, os::ReportingChild& producer,
                                                       os::ReportingChild& consumer, int stop_fd) {
  os::Epoll ready;
  ready.add(producer.report.get(), EPOLLIN, 0);
  ready.add(consumer.report.get(), EPOLLIN, 1);
  ready.add(stop_fd, EPOLLIN, 2);
  std::array<epoll_event, 3> events{};
  std::optional<bool> producer_first;
  while (!producer_first) {
    const int n = ready.wait(events, -1);
    for (int i = 0; i < n; ++i) {
      if (events[static_cast<std::size_t>(i)].data.u64 == 2) {
        if (const int sig = os::read_signal(stop_fd); sig != 0) stop(sig, name, producer, consumer);
      } else if (!producer_first) {
        producer_first = events[static_cast<std::size_t>(i)].data.u64 == 0;
      }
    }
  }
  auto& first = *producer_first ? producer : consumer;
  auto& second = *producer_first ? consumer : producer;
  const auto a = collect(first);
  if (a.contains("error")) {
    try {
      os::send_signal(second.pid, SIGKILL);
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): it ended meanwhile
    }
  }
  auto b = collect(second);
  if (a.contains("error")) {
    b = nlohmann::json{{"error", fmt::format("stopped when the {} failed", *producer_first ? "producer" : "consumer")}};
  }
  // A stop signal that came meanwhile still stops it (the name may be half made)
  if (const int sig = os::read_signal(stop_fd); sig != 0) stop(sig, name, producer, consumer);
  return *producer_first ? std::make_pair(a, b) : std::make_pair(b, a);
}

}  // namespace

}  // namespace gpuipc::cli

int main(int argc, char** argv) {
  using namespace gpuipc;
  using namespace gpuipc::cli;
  CLI::App app{"stream frames between a producer and a consumer process through a channel", "gpuipc demo"};
  auto* cmd = &app;
  int exit_code = kExitOk;
  DemoOptions o;
  std::uint64_t frames = 0;
  std::size_t frame_mib = 0;
  bool verbose = false;
  cmd->add_flag("-v,--verbose", verbose)->group("");  // gpuipc -v demo (tools/gpuipc/cmd_programs.cpp)
  cmd->add_option("--frames", frames, "frames to stream (default 2000 on a GPU, 500 on the host)")
      ->transform(kWholeNumber)
      ->check(CLI::Range(0.0, static_cast<double>(1ULL << 30)));
  cmd->add_option("--frame-mib", frame_mib, "frame size in MiB (default 8 on a GPU, 1 on the host)")
      ->transform(kWholeNumber)
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--slots", o.slots, "channel slots (frames in flight)")
      ->capture_default_str()
      ->transform(kWholeNumber)
      ->check(CLI::Range(1, 4096));
  cmd->add_flag("--host", o.host, "use a host channel even when there is a GPU");
  cmd->callback([&] {
    if (verbose) set_log_level(LogLevel::Debug);
    std::string why;
    if (!o.host) {
      why = gpu_unavailable_reason();
      if (!why.empty()) o.host = true;
    }
    o.frames = frames != 0 ? frames : (o.host ? 500 : 2000);
    o.frame_bytes = (frame_mib != 0 ? frame_mib : (o.host ? 1 : 8)) << 20;
    if (o.host) {
      std::cout << fmt::format("gpuipc demo: HOST channel ({}): frames are written and verified by the CPU\n",
                               why.empty() ? "--host" : "no GPU here: " + why);
    } else {
      std::cout << "gpuipc demo: device channel on GPU 0: a producer kernel writes each frame, a consumer kernel "
                   "verifies it, in stream order\n";
    }
    std::cout << fmt::format("{} frames of {} MiB through {} slots, producer and consumer in two processes\n",
                             o.frames, o.frame_bytes >> 20, o.slots);
    const std::string name = fmt::format("gpuipc-demo-{}", os::current_pid());
    const os::UniqueFd stop_fd = os::signal_fd(kStopSignals);  // blocked from here on (the workers unblock them)
    auto producer = spawn([&] { return produce(name, o); });
    auto consumer = spawn([&] { return consume(name, o); });
    const auto [p, c] = collect_both(name, producer, consumer, stop_fd.get());
    try {
      Channel::unlink(name);
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): the producer may not have created it
    }
    if (p.contains("error") || c.contains("error")) {
      std::cerr << fmt::format("gpuipc demo failed: producer: {}; consumer: {}\n", p.value("error", "ok"),
                               c.value("error", "ok"));
      exit_code = kExitFailure;
      return;
    }
    const auto bad = c["mismatched_words"].get<std::uint64_t>();
    std::cout << fmt::format("{} frames in {:.2f} s: {:.0f} frames/s, {:.2f} GB/s\n", c["frames"].get<std::uint64_t>(),
                             c["seconds"].get<double>(), c["frames_per_s"].get<double>(), c["gb_per_s"].get<double>());
    std::cout << fmt::format("publish -> receive latency (frames queue in the {} slots while the consumer works): "
                             "p50 {:.1f} us, p99 {:.1f} us\n",
                             o.slots,
                             c["handoff_p50_us"].get<double>(), c["handoff_p99_us"].get<double>());
    std::cout << (bad == 0 ? fmt::format("all {} frames verified{}\n", c["frames"].get<std::uint64_t>(),
                                         o.host ? "" : " on the GPU")
                           : fmt::format("VERIFICATION FAILED: {} words differ\n", bad));
    exit_code = bad == 0 ? kExitOk : kExitFailure;
  });
  return run(app, argc, argv, exit_code);
}
