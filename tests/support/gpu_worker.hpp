// What a GPU test's worker (a forked child, or the test process once it has forked what it needs) works with:
// GPU 0's primary context made current on this thread, a stream, and the test kernels (testkit/kernels). Included by
// tests/gpu only: they link gpuipc_testkit.
#pragma once

#include "cuda/context.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {

struct Gpu {
  cuda::PrimaryContext ctx{0};
  int made_current = (ctx.make_current(), 0);
  cuda::Stream stream = cuda::Stream::create();
  kernels::Kernels k;
};

}  // namespace gpuipc::test
