// Handles whose streams may still touch their memory when they close. A semaphore's waits and signals, a device
// channel's waits for `filled`/`freed` and its writes of them, are stream operations on a host_pinned page. The
// close of the process's last handle of that page unregisters and unmaps it, and the driver documents no order
// between that and the stream work still queued: on an H200 (driver 580) cuMemHostUnregister waited for it, so a
// close hung until the stream got past its wait (for good when what it waited for came only after the close), and
// a driver that did not wait would let the stream touch unmapped memory. A handle closing with such work
// outstanding parks its segments here instead, and the close returns at once: they stay mapped until the work is
// done, and are let go at later opens and closes of semaphores and channels in this process (reap_parked).
#pragma once

#include <memory>

#include "gpuipc/segment.hpp"

namespace gpuipc::core {

/// What a closed handle's streams may still touch, and how to tell that they no longer can.
class StreamTouches {
 public:
  virtual ~StreamTouches() = default;
  /// Whether no stream work of the handle can touch its segments any more. Called from any thread, under the
  /// list's lock: reads shared words only, never blocks.
  virtual bool done() const noexcept = 0;
};

/// Keeps `first` and `second` (either may be empty) mapped, with `use`, until use->done(): moves them into the
/// process-wide list. Without memory to do so, waits for use->done() (bounded, 10 s) and leaves the segments with
/// the caller, who lets them go (and `use` too, when done; else it is leaked).
void park(Segment& first, Segment& second, std::unique_ptr<StreamTouches>& use) noexcept;

/// Lets go of the parked segments whose streams are done with them. Called at opens and closes of semaphores and
/// channels (the last handle of a mapping going sends the broker a Close: done outside the list's lock).
void reap_parked() noexcept;

/// How many handles' segments are parked now (tests).
std::size_t parked_count() noexcept;

}  // namespace gpuipc::core
