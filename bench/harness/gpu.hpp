// What a benchmark or GPU-test worker sets up first: GPU `ordinal`'s primary context made current on this thread, a
// stream, and the kernels (testkit/kernels). The one definition of it: the suites use it, and so do the GPU tests
// (tests/support/gpu_worker.hpp). Needs the kernels library, so only where nvcc built it.
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "cuda/context.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/error.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::bench {

/// Declare it first in a worker, so that it is destroyed after everything allocated in its context.
struct Gpu {
  explicit Gpu(int ordinal = 0) : ctx(ordinal) {}
  cuda::PrimaryContext ctx;
  // Members initialise in declaration order, before the constructor's body: the context must be current before
  // the stream and the kernels are made in it.
  int made_current = (ctx.make_current(), 0);
  cuda::Stream stream = cuda::Stream::create();
  kernels::Kernels k;
};

/// Waits for `stream` by polling, at most `timeout`, and throws Error(Timeout) naming `what` then: a kernel that does
/// not finish ends the worker (and with it its context) instead of blocking it in cuStreamSynchronize.
inline void sync_bounded(const cuda::Stream& stream, std::chrono::milliseconds timeout, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!stream.query()) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw Error(ErrorCode::Timeout,
                  fmt::format("bench worker: {} did not finish within {} ms", what, timeout.count()), "bench");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace gpuipc::bench
