// GPU tests: whether there is a GPU, asked in a forked child so the test process itself never initialises CUDA
// (a child forked after CUDA is initialised cannot use CUDA, and GPU tests fork their workers).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <optional>
#include <initializer_list>
#include <string>
#include <vector>

namespace gpuipc::test {

/// Why GPU tests cannot run here (no driver, no device), or nullopt when they can. Probed once per process.
std::optional<std::string> no_gpu_reason();

/// Free memory of GPU 0 in bytes as a fresh process sees it (a forked child creates a context and asks), or 0.
std::size_t gpu_free_memory();

/// The UUIDs ("GPU-…") of the GPUs a fresh process sees, by ordinal (probed once, in a child); empty without a GPU.
const std::vector<std::string>& gpu_uuids();

/// Why two-GPU tests cannot run here (no GPU, fewer than two, GPU 1 without device segments, or GPUs 0 and 1
/// without peer access to each other), or nullopt when they can.
std::optional<std::string> no_two_gpus_reason();

/// Whether GPUs 0 and 1 both exist and lack peer access one way or the other (what the Unsupported test needs).
bool two_gpus_without_peer_access();

/// A CUDA_VISIBLE_DEVICES value showing this process's GPUs `ordinals`, in that order, to a child that sets it
/// before its first CUDA call: "1,0" when the test runs with CUDA_VISIBLE_DEVICES unset, else their UUIDs (so that
/// "1" still means this process's GPU 1 under a CUDA_VISIBLE_DEVICES the test was started with).
std::string visible_devices(std::initializer_list<int> ordinals);

}  // namespace gpuipc::test

/// First statement of a GPU test: skips with the reason when there is no usable GPU.
#define GPUIPC_REQUIRE_GPU()                                                           \
  do {                                                                                 \
    if (auto why = ::gpuipc::test::no_gpu_reason()) GTEST_SKIP() << *why;              \
  } while (0)

/// First statement of a two-GPU test: skips with the reason when there are not two GPUs with peer access.
#define GPUIPC_REQUIRE_TWO_GPUS()                                                      \
  do {                                                                                 \
    if (auto why = ::gpuipc::test::no_two_gpus_reason()) GTEST_SKIP() << *why;         \
  } while (0)
