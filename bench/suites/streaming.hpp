// Streaming 8 MiB frames from a producer kernel to a consumer kernel, in two processes through a channel or in one
// process with two streams: what the channels suite's stream_throughput_ratio metric and the ordering suite's study
// of where that time goes share. Workers are forked (bench/harness/workers.hpp) and share a Sync (sync.hpp); the caller never touches CUDA.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cuda/context.hpp"
#include "gpu.hpp"
#include "gpuipc/error.hpp"
#include "sync.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::bench {

/// Bytes of one frame, and the buffers in flight on each side for the metric (channel slots; buffers of the
/// one-process version).
constexpr std::size_t kFrameBytes = 8 << 20;
constexpr std::uint32_t kStreamSlots = 8;

/// A name no other run uses: bench-<what>-<pid>-<n>.
std::string unique(const char* what);

/// The producer's and the consumer's kernel of a frame. Timed (`frames` > 0): every launch also records when it
/// ran on the GPU (Kernels::write_fill_timed), and stamps() returns them, [start, end] ns per frame.
class FrameKernels {
 public:
  explicit FrameKernels(int timed_frames = 0);
  /// Fills the frame's kFrameBytes at `data` with the frame number.
  void write(CUstream stream, CUdeviceptr data, int frame) const;
  /// Sums the frame's kFrameBytes at `data` into a counter of this object.
  void read(CUstream stream, CUdeviceptr data, int frame) const;
  /// [s0, e0, s1, e1, ...] (ns of %globaltimer) when timed, else null. Call after the streams it launched on are
  /// synchronised.
  nlohmann::json stamps() const;
  const kernels::Kernels& kernels() const noexcept { return m_k; }

 private:
  CUdeviceptr stamp(int frame) const noexcept { return m_stamps.get() + 16 * static_cast<CUdeviceptr>(frame); }
  kernels::Kernels m_k;
  cuda::DeviceBuffer m_out;
  cuda::DeviceBuffer m_stamps;
  int m_frames = 0;
};

/// Which GPU each side of a two-process stream runs on (ordinals of the worker processes, which see every GPU).
/// The channel's slots live on the producer's GPU; the consumer maps them from its own (a peer mapping when they
/// differ).
struct FrameGpus {
  int producer = 0;
  int consumer = 0;
};

/// How a two-process stream runs, beyond its ring's size.
struct StreamShape {
  bool timed = false;                                 ///< stamp every kernel (timeline_stats)
  std::optional<std::chrono::nanoseconds> pacing{};  ///< Channel::set_pacing on both sides, else the default
  std::optional<std::uint32_t> ahead{};               ///< the producer's Channel::set_pacing_ahead, else the default
  /// Frames each side claims before it launches their kernels, and launches before it hands them on: the producer
  /// acquires `batch` slots, writes them, publishes them; the consumer receives `batch` messages, reads them,
  /// releases them (a batch of frames per wake-up of each side; at most the ring's size).
  std::uint32_t batch = 1;
  FrameGpus gpus{};
};

/// A producer kernel writes and a consumer kernel reads `frames` 8 MiB frames in two processes through a device
/// channel of `slots` slots, shaped by `shape`. {"fps": the consumer's frames per second from the common start,
/// "producer_host"/"consumer_host": the host time of each side's calls}; timed, also {"timeline": timeline_stats(...)}.
nlohmann::json channel_stream(const Env& env, int frames, std::uint32_t slots, const StreamShape& shape = {});

/// How the one-process version orders its two streams.
enum class LocalOrder : std::uint8_t {
  Events,       ///< cuEventRecord / cuStreamWaitEvent per buffer (the metric's reference)
  None,         ///< not at all: the two streams run independently
  HostWords,    ///< stream memops on a pinned host page, as channels use, within one process
  DeviceWords,  ///< stream memops on device memory, within one process
};
const char* to_string(LocalOrder order) noexcept;

/// The same two kernels in one process: two streams, `slots` buffers, ordered by `order`. {"fps"}, and
/// {"timeline"} when timed.
nlohmann::json local_stream(const Env& env, int frames, std::uint32_t slots, LocalOrder order = LocalOrder::Events,
                            bool timed = false);

/// Where a streaming run's GPU time went, from the two sides' stamps (FrameKernels::stamps), skipping the first
/// 10% of frames: medians of the producer's and the consumer's kernel time, the idle time of each stream between
/// its kernels, the time from a frame's write ending to its read starting, the share of time both, one or neither
/// kernel ran, and the mean period per frame.
nlohmann::json timeline_stats(const nlohmann::json& producer, const nlohmann::json& consumer);

}  // namespace gpuipc::bench
