// GPU tests: whether there is a GPU, asked in a forked child so the test process itself never initialises CUDA
// (a child forked after CUDA is initialised cannot use CUDA, and GPU tests fork their workers).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <optional>
#include <string>

namespace gpuipc::test {

/// Why GPU tests cannot run here (no driver, no device), or nullopt when they can. Probed once per process.
std::optional<std::string> no_gpu_reason();

/// Free memory of GPU 0 in bytes as a fresh process sees it (a forked child creates a context and asks), or 0.
std::size_t gpu_free_memory();

}  // namespace gpuipc::test

/// First statement of a GPU test: skips with the reason when there is no usable GPU.
#define GPUIPC_REQUIRE_GPU()                                                           \
  do {                                                                                 \
    if (auto why = ::gpuipc::test::no_gpu_reason()) GTEST_SKIP() << *why;              \
  } while (0)
