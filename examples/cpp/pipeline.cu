// gpuipc example: a rendering pipeline in three processes joined by two channels.
//   render (draws frame f)  --NAME.raw-->  post (a 1-2-1 horizontal blur)  --NAME.post-->  sink (checks each frame,
//   writes a PPM every N frames)
// --kind device: frames are GPU memory and each stage is a kernel; with two GPUs, post runs on the second one and
// maps the render's slots through peer access. --kind host: host memory and the CPU, no GPU needed.
// --stage all (the default) starts the three stages as processes of this program and waits for them.
#include <gpuipc/channel.hpp>

#include <cstring>
#include <fstream>
#include <vector>

#include "common.hpp"

using namespace std::chrono_literals;

constexpr const char* kUsage =
    "gpuipc-example-pipeline [--stage all|render|post|sink] [--name NAME] [--kind host|device] [--frames 300]\n"
    "                        [--width 256] [--height 256] [--ppm-every 100] [--out DIR]\n";

/// The header of every frame: its number and when each stage had it (steady clock, seconds; host-side times).
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

__global__ void render_kernel(std::uint32_t* px, std::uint64_t f, std::uint32_t w, std::uint32_t h) {
  const std::uint32_t x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
  if (x < w && y < h) px[y * w + x] = draw(f, x, y);
}
__global__ void post_kernel(const std::uint32_t* in, std::uint32_t* out, std::uint32_t w, std::uint32_t h) {
  const std::uint32_t x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y;
  if (x < w && y < h) out[y * w + x] = blur(in + y * w, x, w);
}

struct Config {
  std::string name, out;
  bool device;
  std::uint64_t frames;
  std::uint32_t w, h;
  long ppm_every;
  std::size_t bytes() const { return std::size_t{w} * h * 4; }
  gpuipc::ChannelOptions channel(int gpu) const {
    return {.slots = 4,
            .slot_bytes = bytes(),
            .header_bytes = sizeof(Frame),
            .kind = device ? gpuipc::SegmentKind::Device : gpuipc::SegmentKind::Host,
            .device = gpu};
  }
};

/// Waits for a free slot (back-pressure) or a message; false when the other side has gone for good.
bool acquire(gpuipc::Channel& ch, cudaStream_t s, gpuipc::SlotView& slot) {
  gpuipc::Status st;
  while ((st = ch.acquire(s, 1s, slot)) == gpuipc::Status::Timeout) {
  }
  return st == gpuipc::Status::Ok;
}
bool receive(gpuipc::Channel& ch, cudaStream_t s, gpuipc::MessageView& msg) {
  gpuipc::Status st;
  while ((st = ch.receive(s, 1s, msg)) == gpuipc::Status::Timeout) {
  }
  return st == gpuipc::Status::Ok;
}

int render(const Config& c, cudaStream_t s) {
  gpuipc::Channel out = gpuipc::Channel::create(c.name + ".raw", c.channel(0), gpuipc::ChannelRole::Producer);
  for (std::uint64_t f = 0; f < c.frames; ++f) {
    Frame h{f, example::now_s(), 0, 0, 0};
    gpuipc::SlotView slot;
    if (!acquire(out, s, slot)) return 1;
    auto* px = static_cast<std::uint32_t*>(slot.data);
    if (c.device) {
      render_kernel<<<dim3((c.w + 255) / 256, c.h), 256, 0, s>>>(px, f, c.w, c.h);
      CUDA_CHECK(cudaGetLastError());
    } else {
      for (std::uint32_t y = 0; y < c.h; ++y)
        for (std::uint32_t x = 0; x < c.w; ++x) px[y * c.w + x] = draw(f, x, y);
    }
    h.t_render_out = example::now_s();
    out.publish(s, std::as_bytes(std::span(&h, 1)), c.bytes());
  }
  if (c.device) CUDA_CHECK(cudaStreamSynchronize(s));  // leave only once the last frame is written
  return 0;
}

int post(const Config& c, cudaStream_t s, int gpu) {
  gpuipc::Channel in =
      gpuipc::Channel::open(c.name + ".raw", gpuipc::ChannelRole::Consumer, {.wait = 10s, .device = gpu});
  gpuipc::Channel out = gpuipc::Channel::create(c.name + ".post", c.channel(gpu), gpuipc::ChannelRole::Producer);
  gpuipc::MessageView msg;
  while (receive(in, s, msg)) {
    Frame h;
    std::memcpy(&h, msg.header.data(), sizeof h);
    h.t_post_in = example::now_s();
    gpuipc::SlotView slot;
    if (!acquire(out, s, slot)) return 1;
    const auto* src = static_cast<const std::uint32_t*>(msg.data);
    auto* dst = static_cast<std::uint32_t*>(slot.data);
    if (c.device) {
      post_kernel<<<dim3((c.w + 255) / 256, c.h), 256, 0, s>>>(src, dst, c.w, c.h);
      CUDA_CHECK(cudaGetLastError());
    } else {
      for (std::uint32_t y = 0; y < c.h; ++y)
        for (std::uint32_t x = 0; x < c.w; ++x) dst[y * c.w + x] = blur(src + y * c.w, x, c.w);
    }
    h.t_post_out = example::now_s();
    out.publish(s, std::as_bytes(std::span(&h, 1)), c.bytes());
    in.release(s);
  }
  if (c.device) CUDA_CHECK(cudaStreamSynchronize(s));
  return 0;
}

int sink(const Config& c, cudaStream_t s, int gpu) {
  gpuipc::Channel in =
      gpuipc::Channel::open(c.name + ".post", gpuipc::ChannelRole::Consumer, {.wait = 20s, .device = gpu});
  std::vector<std::uint32_t> got(c.bytes() / 4), want(c.bytes() / 4), row(c.w);
  std::vector<double> lat[6];  // render, raw queue, post, post queue, sink, end to end
  std::uint64_t checked = 0, bad = 0, ppms = 0;
  double first = 0;
  gpuipc::MessageView msg;
  while (receive(in, s, msg)) {
    const double t_in = example::now_s();
    if (checked == 0) first = t_in;
    Frame h;
    std::memcpy(&h, msg.header.data(), sizeof h);
    if (c.device) {
      CUDA_CHECK(cudaMemcpyAsync(got.data(), msg.data, c.bytes(), cudaMemcpyDeviceToHost, s));
      CUDA_CHECK(cudaStreamSynchronize(s));
    } else {
      std::memcpy(got.data(), msg.data, c.bytes());
    }
    in.release(s);
    for (std::uint32_t y = 0; y < c.h; ++y) {
      for (std::uint32_t x = 0; x < c.w; ++x) row[x] = draw(h.number, x, y);
      for (std::uint32_t x = 0; x < c.w; ++x) want[y * c.w + x] = blur(row.data(), x, c.w);
    }
    bad += h.number != checked || got != want;
    if (c.ppm_every > 0 && h.number % c.ppm_every == 0) {
      std::ofstream ppm(c.out + "/frame-" + std::to_string(h.number) + ".ppm", std::ios::binary);
      ppm << "P6\n" << c.w << " " << c.h << "\n255\n";
      for (std::uint32_t p : got) ppm.put(char(p & 255)).put(char(p >> 8 & 255)).put(char(p >> 16 & 255));
      ppms += ppm.good();
    }
    const double t_done = example::now_s();
    const double t[] = {h.t_render_start, h.t_render_out, h.t_post_in, h.t_post_out, t_in, t_done};
    for (int i = 0; i < 5; ++i) lat[i].push_back((t[i + 1] - t[i]) * 1e6);
    lat[5].push_back((t_done - h.t_render_start) * 1e6);
    ++checked;
  }
  const double seconds = example::now_s() - first;
  std::printf("sink: %llu of %llu frames checked, %llu bad, %llu PPM files in %s\n", (unsigned long long)checked,
              (unsigned long long)c.frames, (unsigned long long)bad, (unsigned long long)ppms, c.out.c_str());
  std::printf("sink: %.1f frames/s (%ux%u RGBA, %s channels)\n", checked > 1 ? (checked - 1) / seconds : 0.0, c.w, c.h,
              c.device ? "device" : "host");
  const char* names[] = {"render", "queue render->post", "post", "queue post->sink", "sink (copy+check)", "end to end"};
  std::printf("%-20s %10s %10s\n", "latency (host clock)", "p50 us", "p99 us");
  for (int i = 0; i < 6; ++i)
    std::printf("%-20s %10.1f %10.1f\n", names[i], example::percentile(lat[i], 50), example::percentile(lat[i], 99));
  return checked == c.frames && bad == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  const example::Args args(argc, argv, kUsage,
                           {"--stage", "--name", "--kind", "--frames", "--width", "--height", "--ppm-every", "--out"});
  const Config c{args.get("--name", "pipeline"),
                 args.get("--out", "."),
                 args.get("--kind", "host") == "device",
                 static_cast<std::uint64_t>(args.num("--frames", 300)),
                 static_cast<std::uint32_t>(args.num("--width", 256)),
                 static_cast<std::uint32_t>(args.num("--height", 256)),
                 args.num("--ppm-every", 100)};
  const std::string stage = args.get("--stage", "all");
  std::string why;
  const int gpus = c.device ? example::gpu_count(&why) : 0;
  if (c.device && gpus == 0) {
    std::fprintf(stderr, "pipeline: --kind device needs a GPU (%s); run with --kind host\n", why.c_str());
    return 3;
  }
  if (stage == "all") {
    std::printf("pipeline: %llu frames, %s channels%s\n", (unsigned long long)c.frames, c.device ? "device" : "host",
                c.device ? (gpus > 1 ? ", post on GPU 1" : ", one GPU") : "");
    std::fflush(stdout);
    std::vector<pid_t> pids;
    for (const char* s : {"render", "post", "sink"}) {
      std::vector<std::string> a(argv + 1, argv + argc);
      a.insert(a.end(), {"--stage", s});  // the last --stage wins
      pids.push_back(example::spawn("gpuipc-example-pipeline", a));
    }
    int failed = 0;
    for (pid_t p : pids) failed += example::wait_exit(p) != 0;
    for (const char* ch : {".raw", ".post"}) {
      try {
        gpuipc::Channel::unlink(c.name + ch);
      } catch (const gpuipc::Error& e) {  // a stage that failed early may not have made it
        std::fprintf(stderr, "pipeline: %s\n", e.what());
      }
    }
    return failed ? 1 : 0;
  }
  const int gpu = stage == "post" && gpus > 1 ? 1 : 0;
  cudaStream_t s = nullptr;
  if (c.device) {
    CUDA_CHECK(cudaSetDevice(gpu));
    CUDA_CHECK(cudaStreamCreate(&s));
  }
  if (stage == "render") return render(c, s);
  if (stage == "post") return post(c, s, gpu);
  if (stage == "sink") return sink(c, s, gpu);
  std::fprintf(stderr, "unknown --stage %s\n%s", stage.c_str(), kUsage);
  return 64;
}
