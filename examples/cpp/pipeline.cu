// gpuipc example: a rendering pipeline in three processes joined by two channels.
//   render (draws frame f)  --NAME.raw-->  post (a 1-2-1 horizontal blur)  --NAME.post-->  sink (checks each frame,
//   writes a PPM every N frames)
// --kind device: frames are GPU memory and each stage is a kernel, the sink's check too (it counts wrong pixels on
// the GPU); with two GPUs, post runs on the second one and maps the render's slots through peer access. --kind host:
// host memory and the CPU, no GPU needed. --stage all (the default) starts the three stages as processes of this
// program; with --compare it then runs --stage one: the same three kernels in one process on one stream.
#include <gpuipc/channel.hpp>

#include <csignal>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "common.hpp"

using namespace std::chrono_literals;

namespace {

constexpr const char* kUsage =
    "gpuipc-example-pipeline [--stage all|render|post|sink|one] [--compare] [--name NAME] [--kind host|device]\n"
    "                        [--frames 300] [--width W] [--height H] [--ppm-every 100] [--out DIR] [--wait-s 30]\n"
    "  Frames are 1920x1080 with --kind device, else 256x256. --stage one: the three kernels in one process (device\n"
    "  only). --compare: then run --stage one and print the ratio of the frame rates (--ppm-every defaults to 0).\n"
    "  --wait-s: how long a stage waits for the stage next to it to join its channel. When a stage fails, the\n"
    "  others are stopped; SIGINT and SIGTERM stop them all, and each removes the channel it made.\n";

/// The header of every frame: its number and when each stage had it (steady clock, seconds; host-side times). A
/// stage's times are taken once it has its input and a free slot downstream: waits for a slot (back-pressure) are
/// in the queue before the stage, not in its own row.
struct Frame {
  std::uint64_t number;
  double t_render_start, t_render_out, t_post_in, t_post_out;
};

/// Pixel (x, y) of frame f as render draws it: RGBA, moving gradients.
__host__ __device__ inline std::uint32_t draw(std::uint64_t f, std::uint32_t x, std::uint32_t y) {
  const std::uint32_t r = (x + 3 * f) & 255, g = (y + 2 * f) & 255, b = (x ^ y) & 255;
  return r | g << 8 | b << 16 | 255u << 24;
}
/// Pixel x of a row after post's 1-2-1 blur along the row (edges clamped), per channel.
__host__ __device__ inline std::uint32_t blur(const std::uint32_t* row, std::uint32_t x, std::uint32_t width) {
  const std::uint32_t l = row[x > 0 ? x - 1 : 0], m = row[x], r = row[x + 1 < width ? x + 1 : x];
  std::uint32_t out = 0;
  for (int s = 0; s < 32; s += 8) out |= ((((l >> s) & 255) + 2 * ((m >> s) & 255) + ((r >> s) & 255)) / 4) << s;
  return out;
}
/// Pixel (x, y) of frame f after render and post: what the sink expects, from the pixel and its two neighbours.
__host__ __device__ inline std::uint32_t expected(std::uint64_t f, std::uint32_t x, std::uint32_t y, std::uint32_t w) {
  const std::uint32_t row[3] = {draw(f, x > 0 ? x - 1 : 0, y), draw(f, x, y), draw(f, x + 1 < w ? x + 1 : x, y)};
  return blur(row, 1, 3);
}

__global__ void render_kernel(std::uint32_t* px, std::uint64_t f, std::uint32_t w, std::uint32_t h) {
  const std::uint32_t x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
  if (x < w && y < h) px[y * w + x] = draw(f, x, y);
}
__global__ void post_kernel(const std::uint32_t* in, std::uint32_t* out, std::uint32_t w, std::uint32_t h) {
  const std::uint32_t x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
  if (x < w && y < h) out[y * w + x] = blur(in + y * w, x, w);
}
/// Adds the number of pixels of `px` that are not frame f, as render and post make it, to `*bad`.
__global__ void check_kernel(const std::uint32_t* px, std::uint64_t f, std::uint32_t w, std::uint32_t h,
                             unsigned long long* bad) {
  const std::uint32_t x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
  if (x < w && y < h && px[y * w + x] != expected(f, x, y, w)) atomicAdd(bad, 1ull);
}

struct Config {
  std::string name, out;
  bool device;
  std::uint64_t frames;
  std::uint32_t w, h;
  long long ppm_every;
  double wait_s;
  std::size_t pixels() const { return std::size_t{w} * h; }
  std::size_t bytes() const { return pixels() * 4; }
  dim3 grid() const { return dim3((w + 255) / 256, h); }  // a thread per pixel, blocks of 256 along a row
  gpuipc::ChannelOptions channel(int gpu) const {
    return {.slots = 4,
            .slot_bytes = bytes(),
            .header_bytes = sizeof(Frame),
            .kind = device ? gpuipc::SegmentKind::Device : gpuipc::SegmentKind::Host,
            .device = gpu};
  }
  std::chrono::milliseconds wait() const { return std::chrono::milliseconds(static_cast<long long>(wait_s * 1000)); }
};

/// Why a channel call ended a stage: the other side left (Closed) or died (PeerDied), or something else.
void say_why(const char* stage, const gpuipc::Channel& ch, const char* call, gpuipc::Status st, std::uint64_t frames) {
  const char* what = st == gpuipc::Status::Closed     ? "the other side left"
                     : st == gpuipc::Status::PeerDied ? "the other side died"
                                                      : "failed";
  std::fprintf(stderr, "pipeline %s: %s on %s: %s (%s) after %llu frames\n", stage, call, ch.name().c_str(), what,
               gpuipc::to_string(st).data(), static_cast<unsigned long long>(frames));
}

/// Made by this stage: the channel it publishes on, removed whichever way the stage ends.
gpuipc::Channel create_out(const Config& c, const std::string& name, int gpu) {
  gpuipc::Channel ch = gpuipc::Channel::create(name, c.channel(gpu), gpuipc::ChannelRole::Producer);
  example::remove_at_exit(name, gpuipc::Channel::unlink);
  return ch;
}

/// Whether `out` has had its consumer (the next stage) by now, or gets one within what is left of --wait-s from
/// `since` (when it was made); says so when not.
bool consumer_joined(const gpuipc::Channel& out, const Config& c, const char* stage, double since) {
  while (out.stats().consumers == 0 && out.stats().tail == 0) {
    if (example::now_s() - since > c.wait_s) {
      std::fprintf(stderr, "pipeline %s: no consumer joined %s within %g s (--wait-s): is the next stage running?\n",
                   stage, out.name().c_str(), c.wait_s);
      return false;
    }
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

/// Waits for a free slot (back-pressure); false, saying why, when the next stage has gone or never joined.
bool acquire(gpuipc::Channel& ch, cudaStream_t s, gpuipc::SlotView& slot, const Config& c, const char* stage,
             double since, std::uint64_t frames) {
  for (;;) {
    const gpuipc::Status st = ch.acquire(s, 100ms, slot);
    if (st == gpuipc::Status::Ok) return true;
    if (st != gpuipc::Status::Timeout) {
      say_why(stage, ch, "acquire", st, frames);
      return false;
    }
    if (!consumer_joined(ch, c, stage, since)) return false;
  }
}
/// Waits for a message; Ok, or why none will come (Closed: the previous stage is done; PeerDied: it died).
gpuipc::Status receive(gpuipc::Channel& ch, cudaStream_t s, gpuipc::MessageView& msg) {
  gpuipc::Status st;
  while ((st = ch.receive(s, 1s, msg)) == gpuipc::Status::Timeout) {
  }
  return st;
}

int render(const Config& c, cudaStream_t s) {
  gpuipc::Channel out = create_out(c, c.name + ".raw", 0);
  const double made = example::now_s();
  for (std::uint64_t f = 0; f < c.frames; ++f) {
    gpuipc::SlotView slot;
    if (!acquire(out, s, slot, c, "render", made, f)) return 1;
    Frame h{f, example::now_s(), 0, 0, 0};
    auto* px = static_cast<std::uint32_t*>(slot.data);
    if (c.device)
      render_kernel<<<c.grid(), 256, 0, s>>>(px, f, c.w, c.h);
    else
      for (std::size_t i = 0; i < c.pixels(); ++i) px[i] = draw(f, i % c.w, i / c.w);
    h.t_render_out = example::now_s();
    out.publish(s, std::as_bytes(std::span(&h, 1)), c.bytes());
  }
  if (c.device) example::synchronize(s);  // leave only once the last frame is written
  // Its channel goes with it: not before post has it open (with few frames, render may be done first).
  return consumer_joined(out, c, "render", made) ? 0 : 1;
}

int post(const Config& c, cudaStream_t s, int gpu) {
  gpuipc::Channel in =
      gpuipc::Channel::open(c.name + ".raw", gpuipc::ChannelRole::Consumer, {.wait = c.wait(), .device = gpu});
  gpuipc::Channel out = create_out(c, c.name + ".post", gpu);
  const double made = example::now_s();
  gpuipc::MessageView msg;
  std::uint64_t forwarded = 0;
  gpuipc::Status st;
  while ((st = receive(in, s, msg)) == gpuipc::Status::Ok) {
    Frame h;
    std::memcpy(&h, msg.header.data(), sizeof h);
    gpuipc::SlotView slot;
    if (!acquire(out, s, slot, c, "post", made, forwarded)) return 1;
    h.t_post_in = example::now_s();
    const auto* src = static_cast<const std::uint32_t*>(msg.data);
    auto* dst = static_cast<std::uint32_t*>(slot.data);
    if (c.device)
      post_kernel<<<c.grid(), 256, 0, s>>>(src, dst, c.w, c.h);
    else
      for (std::size_t i = 0; i < c.pixels(); ++i) dst[i] = blur(src + i / c.w * c.w, i % c.w, c.w);
    h.t_post_out = example::now_s();
    out.publish(s, std::as_bytes(std::span(&h, 1)), c.bytes());
    in.release(s);
    ++forwarded;
  }
  // Closed after every frame: render is done. Anything else (render died, or left early) fails the run.
  if (st != gpuipc::Status::Closed || forwarded != c.frames) {
    say_why("post", in, "receive", st, forwarded);
    return 1;
  }
  if (c.device) example::synchronize(s);
  return consumer_joined(out, c, "post", made) ? 0 : 1;
}

/// A zeroed counter in GPU memory for check_kernel, whose code is loaded now (not lazily in the timed loop).
unsigned long long* new_counter(cudaStream_t s) {
  unsigned long long* n = nullptr;
  cudaFuncAttributes loaded;
  CUDA_CHECK(cudaFuncGetAttributes(&loaded, check_kernel));
  CUDA_CHECK(cudaMalloc(&n, sizeof *n));
  CUDA_CHECK(cudaMemsetAsync(n, 0, sizeof *n, s));
  return n;
}

/// Writes frame `f` (host memory) as DIR/frame-F.ppm; true when it was written.
bool write_ppm(const Config& c, std::uint64_t f, const std::uint32_t* px) {
  std::string rgb;
  for (std::size_t i = 0; i < c.pixels(); ++i) rgb += {char(px[i]), char(px[i] >> 8), char(px[i] >> 16)};  // R, G, B
  std::ofstream ppm(c.out + "/frame-" + std::to_string(f) + ".ppm", std::ios::binary);
  ppm << "P6\n" << c.w << " " << c.h << "\n255\n" << rgb;
  return ppm.good();
}

int sink(const Config& c, cudaStream_t s, int gpu) {
  gpuipc::Channel in =
      gpuipc::Channel::open(c.name + ".post", gpuipc::ChannelRole::Consumer, {.wait = c.wait(), .device = gpu});
  unsigned long long* bad_gpu = c.device ? new_counter(s) : nullptr;  // wrong pixels, counted by check_kernel
  std::vector<std::uint32_t> got(c.device && c.ppm_every > 0 ? c.pixels() : 0);  // a frame copied for its PPM
  // Host clock when each stage's thread had the frame. In device mode that is when the work was enqueued, the GPU
  // runs it later and nothing waits for it per frame: the table shows how each process keeps pace, not GPU time.
  std::vector<double> lat[6];                         // render, raw queue, post, post queue, sink, end to end
  unsigned long long checked = 0, bad = 0, ppms = 0;  // bad: wrong pixels, and frames out of order
  double first = 0;
  gpuipc::MessageView msg;
  gpuipc::Status st = gpuipc::Status::Ok;
  while (checked < c.frames && (st = receive(in, s, msg)) == gpuipc::Status::Ok) {
    const double t_in = example::now_s();
    if (checked == 0) first = t_in;
    Frame h;
    std::memcpy(&h, msg.header.data(), sizeof h);
    bad += h.number != checked;
    const auto* px = static_cast<const std::uint32_t*>(msg.data);
    if (c.device)
      check_kernel<<<c.grid(), 256, 0, s>>>(px, h.number, c.w, c.h, bad_gpu);
    else
      for (std::size_t i = 0; i < c.pixels(); ++i) bad += px[i] != expected(h.number, i % c.w, i / c.w, c.w);
    if (c.ppm_every > 0 && h.number % c.ppm_every == 0) {
      if (c.device) {  // the only frames that come to the host, and the only waits for the GPU in the loop
        CUDA_CHECK(cudaMemcpyAsync(got.data(), px, c.bytes(), cudaMemcpyDeviceToHost, s));
        example::synchronize(s);
      }
      ppms += write_ppm(c, h.number, c.device ? got.data() : px);
    }
    in.release(s);
    const double t_done = example::now_s();
    const double t[] = {h.t_render_start, h.t_render_out, h.t_post_in, h.t_post_out, t_in, t_done};
    for (int i = 0; i < 5; ++i) lat[i].push_back((t[i + 1] - t[i]) * 1e6);
    lat[5].push_back((t_done - h.t_render_start) * 1e6);
    ++checked;
  }
  if (checked < c.frames) say_why("sink", in, "receive", st, checked);
  // The frame rate runs from the first frame's arrival to the GPU finishing the last check, as --stage one's does.
  const double seconds = (c.device ? example::synchronize(s) : example::now_s()) - first;
  unsigned long long wrong = 0;
  if (c.device) CUDA_CHECK(cudaMemcpy(&wrong, bad_gpu, sizeof wrong, cudaMemcpyDeviceToHost));
  bad += wrong;
  std::printf("sink: %llu of %llu frames checked, %llu bad, %llu PPM files in %s\n", checked,
              (unsigned long long)c.frames, bad, ppms, c.out.c_str());
  std::printf("sink: %.1f frames/s (%ux%u RGBA, %s channels)\n", checked > 1 ? (checked - 1) / seconds : 0.0, c.w, c.h,
              c.device ? "device" : "host");
  const char* names[] = {"render", "queue render->post", "post", "queue post->sink", "sink (check)", "end to end"};
  std::printf("%-20s %10s %10s\n", "latency (host clock)", "p50 us", "p99 us");
  for (int i = 0; i < 6; ++i)
    std::printf("%-20s %10.1f %10.1f\n", names[i], example::median(lat[i]), example::percentile(lat[i], 99));
  return checked == c.frames && bad == 0 ? 0 : 1;
}

/// --stage one: the same three kernels on one stream, frames cycling through 4 buffers per stage as through the
/// channels' 4 slots (the same memory footprint); timed after a few frames of warm-up, to a final synchronize.
int one_process(const Config& c, cudaStream_t s) {
  std::uint32_t* buf[8];  // render's 4, then post's 4
  for (auto*& b : buf) CUDA_CHECK(cudaMalloc(&b, c.bytes()));
  unsigned long long* bad_gpu = new_counter(s);
  constexpr std::uint64_t kWarmup = 20;
  double t0 = 0;
  for (std::uint64_t f = 0; f < kWarmup + c.frames; ++f) {
    if (f == kWarmup) t0 = example::synchronize(s);
    render_kernel<<<c.grid(), 256, 0, s>>>(buf[f % 4], f, c.w, c.h);
    post_kernel<<<c.grid(), 256, 0, s>>>(buf[f % 4], buf[4 + f % 4], c.w, c.h);
    check_kernel<<<c.grid(), 256, 0, s>>>(buf[4 + f % 4], f, c.w, c.h, bad_gpu);
  }
  const double seconds = example::synchronize(s) - t0;
  unsigned long long bad = 0;
  CUDA_CHECK(cudaMemcpy(&bad, bad_gpu, sizeof bad, cudaMemcpyDeviceToHost));
  std::printf("one process: %llu frames, %.1f frames/s (%ux%u RGBA), %llu bad\n", (unsigned long long)c.frames,
              c.frames / seconds, c.w, c.h, bad);
  return bad == 0 ? 0 : 1;
}

/// The GPU of stage `stage`: post on GPU 1 when there are two GPUs that can map each other's memory (post maps
/// render's slots on GPU 0, the sink post's on GPU 1), else all on GPU 0.
int gpu_of(const std::string& stage, int gpus) {
  return stage == "post" && gpus > 1 && example::peer_access(0, 1) ? 1 : 0;
}

/// --stage all: the three stages as processes of this program. When one fails, the others are stopped (wait_all);
/// each removes the channel it made, whichever way it ends, except when SIGKILLed: that one this driver removes.
int run_all(const Config& c, int argc, char** argv, int gpus, bool compare) {
  std::printf("pipeline: %llu frames, %s channels%s\n", (unsigned long long)c.frames, c.device ? "device" : "host",
              !c.device                   ? ""
              : gpus == 1                 ? ", one GPU"
              : gpu_of("post", gpus) == 1 ? ", post on GPU 1"
                                          : ", post on GPU 0 (GPUs 0 and 1 have no peer access)");
  std::fflush(stdout);
  auto as_stage = [&](std::string_view s) {  // this command line with --stage s (the last --stage wins)
    std::vector<std::string> a(argv + 1, argv + argc);
    a.insert(a.end(), {"--stage", std::string(s)});
    return a;
  };
  std::vector<example::Child> stages;
  for (const char* s : {"render", "post"})
    stages.push_back({example::spawn("gpuipc-example-pipeline", as_stage(s)), s});
  int sink_out = -1;
  stages.push_back({example::spawn("gpuipc-example-pipeline", as_stage("sink"), &sink_out), "sink"});
  std::string sink_said, one_said;  // what they print, passed on, and their frame rates read from it
  bool ok = example::wait_all(stages, sink_out, sink_said);
  for (std::size_t i = 0; i < 2; ++i)
    if (stages[i].code == 128 + SIGKILL) {
      try {
        gpuipc::Channel::unlink(c.name + (i == 0 ? ".raw" : ".post"));
      } catch (const gpuipc::Error&) {  // NOLINT(bugprone-empty-catch): it had not made it yet
      }
    }
  if (compare && ok) {
    ok = example::run_tee("gpuipc-example-pipeline", as_stage("one"), one_said) == 0;
    const double one = example::number_before(one_said, " frames/s");
    if (one > 0) std::printf("pipeline / one process: %.3f\n", example::number_before(sink_said, " frames/s") / one);
  }
  return ok ? 0 : 1;
}

int pipeline(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage,
                           {"--stage", "--compare", "--name", "--kind", "--frames", "--width", "--height",
                            "--ppm-every", "--out", "--wait-s"});
  const bool device = args.choice("--kind", "host", {"host", "device"}) == "device", compare = args.flag("--compare");
  const std::string stage = args.choice("--stage", "all", {"all", "render", "post", "sink", "one"});
  const Config c{args.get("--name", "pipeline"),
                 args.get("--out", "."),
                 device,
                 static_cast<std::uint64_t>(args.num("--frames", 300, 1, 1LL << 40)),
                 static_cast<std::uint32_t>(args.num("--width", device ? 1920 : 256, 1, 16384)),
                 static_cast<std::uint32_t>(args.num("--height", device ? 1080 : 256, 1, 16384)),
                 args.num("--ppm-every", compare ? 0 : 100, 0, LLONG_MAX),
                 static_cast<double>(args.num("--wait-s", 30, 1, 86400))};
  if (!device && (compare || stage == "one")) {
    std::fprintf(stderr, "pipeline: --stage one and --compare are device-only (--kind device)\n%s", kUsage);
    return 64;
  }
  std::string why;
  // cudaGetDeviceCount makes no context, and the stages are new programs (fork + exec): they can all use CUDA.
  const int gpus = c.device ? example::gpu_count(&why) : 0;
  if (c.device && gpus == 0) {
    std::fprintf(stderr, "pipeline: --kind device needs a GPU (%s); run with --kind host\n", why.c_str());
    return 3;
  }
  if (stage == "all") return run_all(c, argc, argv, gpus, compare);
  const int gpu = c.device ? gpu_of(stage, gpus) : 0;
  cudaStream_t s = nullptr;
  if (c.device) {
    CUDA_CHECK(cudaSetDevice(gpu));
    CUDA_CHECK(cudaStreamCreate(&s));
  }
  if (stage == "render") return render(c, s);
  if (stage == "post") return post(c, s, gpu);
  if (stage == "sink") return sink(c, s, gpu);
  return one_process(c, s);
}

}  // namespace

int main(int argc, char** argv) {
  const char* stage = "pipeline";
  for (int i = 1; i + 1 < argc; ++i)  // messages say which stage (the last --stage wins)
    if (std::strcmp(argv[i], "--stage") == 0) stage = argv[i + 1];
  static std::string program;
  program = std::string("pipeline") +
            (std::strcmp(stage, "pipeline") == 0 || std::strcmp(stage, "all") == 0 ? "" : std::string(" ") + stage);
  return example::run_main(program.c_str(), [&] { return pipeline(argc, argv); });
}
