// NVTX ranges on the library calls that can block or enqueue, so that `nsys profile -t cuda,nvtx` shows where a
// process spends its time in gpuipc (docs/profiling.md). NVTX 3 is header-only (the CUDA toolkit's nvtx3/): with no
// tool attached a range costs a check of a function pointer. GPUIPC_NVTX=0 turns the ranges off.
#pragma once

namespace gpuipc::trace {

/// False when GPUIPC_NVTX is 0 (read once; docs/env/GPUIPC_NVTX.md).
bool enabled() noexcept;

/// A range of the "gpuipc" NVTX domain for this object's lifetime. `name` must outlive it (a string literal).
class Range {
 public:
  explicit Range(const char* name) noexcept;
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  bool m_open = false;
};

}  // namespace gpuipc::trace

/// Names the rest of the enclosing scope as an NVTX range.
#define GPUIPC_TRACE(name) const ::gpuipc::trace::Range gpuipc_trace_range_(name)
