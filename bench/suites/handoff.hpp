// One-slot channel handoff round trips between a producer and a consumer process (the channels suite's
// handoff_rtt metrics; the multigpu suite's, with the two on different GPUs).
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>

#include "gpuipc/segment.hpp"
#include "streaming.hpp"

namespace gpuipc::bench {

/// `iterations` handoff round trips of `bytes` through a one-slot channel of `kind` whose slots live on the
/// producer's GPU, the producer on `gpus.producer`, the consumer mapping them from `gpus.consumer`.
/// {"rtt_us", "publish_call_us", "acquire_call_us", "receive_call_us", "release_call_us"}: summaries.
nlohmann::json handoff_rtt(std::size_t bytes, int iterations, SegmentKind kind, bool drained, FrameGpus gpus = {});

}  // namespace gpuipc::bench
