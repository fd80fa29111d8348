// Stream memory operations kept off a caller's stream. A 64-bit wait or write enqueued on a stream costs that
// stream about 1.5 us of GPU time each, between its kernels (bench channels, stream_ordering samples: two
// processes streaming 8 MiB frames under MPS reach 0.81 of one process with only the waits or only the writes,
// 0.67 with both). A relay does them on two side streams of its own instead and ties them to the caller's stream
// with events, which cost the caller's stream what they cost within one process.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/resources.hpp"

namespace gpuipc::cuda {

class StreamRelay {
 public:
  /// Two non-blocking streams and two events in the current context. Throws Error.
  static StreamRelay create();

  StreamRelay() = default;

  /// Writes `value` at `addr` once everything enqueued on `stream` so far has finished (as stream_write_value64
  /// on `stream`), without making `stream` wait for the write. Hot path: returns the CUresult, no exception.
  CUresult write_after(CUstream stream, CUdeviceptr addr, std::uint64_t value) noexcept;
  /// Makes work enqueued on `stream` after this wait until the 64-bit word at `addr` is >= `value` (cyclically, as
  /// stream_wait_value64), through a side stream that waits and an event `stream` waits for.
  CUresult wait_before(CUstream stream, CUdeviceptr addr, std::uint64_t value) noexcept;
  explicit operator bool() const noexcept { return static_cast<bool>(m_writes); }

 private:
  /// Whether `stream` may be tied to the side streams: not while it is being captured into a graph (an event
  /// from a capturing stream cannot be waited on outside it); such streams get the memop directly.
  static bool relayable(CUstream stream) noexcept;

  Stream m_writes, m_waits;
  Event m_to_writes;    // recorded on the caller's stream; m_writes waits for it, then writes
  Event m_from_waits;   // recorded on m_waits after its wait; the caller's stream waits for it
};

}  // namespace gpuipc::cuda
