// What a GPU test's worker (a forked child, or the test process once it has forked what it needs) works with:
// GPU 0's primary context made current on this thread, a stream, and the test kernels (testkit/kernels): the benchmark
// harness's Gpu (bench/harness/gpu.hpp), the one definition. Included by tests/gpu only: they link the harness.
#pragma once

#include "harness/gpu.hpp"

namespace gpuipc::test {

using bench::Gpu;

}  // namespace gpuipc::test
