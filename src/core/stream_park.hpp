// Handles whose streams may still touch their memory when they close. A semaphore's waits and signals, a device
// channel's waits for `filled`/`freed` and its writes of them, are stream operations on a host_pinned page. The
// close of the process's last handle of that page unregisters and unmaps it, and the driver documents no order
// between that and the stream work still queued: on an H200 (driver 580) cuMemHostUnregister waited for it, so a
// close hung until the stream got past its wait (for good when what it waited for came only after the close), and
// a driver that did not wait would let the stream touch unmapped memory. A handle closing with such work
// outstanding parks its segments here instead, and the close returns at once: they stay mapped until the work is
// done, and are let go by a reaper thread that runs while anything is parked (it looks after 1 ms, then at doubling
// pauses up to 100 ms), and at later opens and closes of semaphores, channels and pools in this process
// (reap_parked).
#pragma once

#include <cstddef>
#include <memory>

namespace gpuipc::core {

/// What a closed handle's streams may still touch, and how to tell that they no longer can. Parked, it owns what
/// must stay mapped until then (the handle moves its segments into it), and lets them go when destroyed.
class StreamTouches {
 public:
  StreamTouches() = default;
  StreamTouches(const StreamTouches&) = delete;
  StreamTouches& operator=(const StreamTouches&) = delete;
  virtual ~StreamTouches() = default;
  /// Whether no stream work of the handle can touch its segments any more. Called from any thread, under the
  /// list's lock: reads shared words only, never blocks.
  virtual bool done() const noexcept = 0;
};

/// Keeps `use`, and with it what it owns, until use->done(): moves it into the process-wide list, and starts the
/// reaper thread unless it runs (none starts once exit(3) began). Without memory to do so, waits for use->done()
/// (bounded, 10 s), then lets it go; when still not done, leaks it (a few bytes and mappings kept beat a stream or a
/// callback touching freed memory).
void park(std::unique_ptr<StreamTouches> use) noexcept;

/// Lets go of the parked segments whose streams are done with them. Called at opens and closes of semaphores,
/// channels and pools, besides the reaper (the last handle of a mapping going sends the broker a Close: done outside
/// the list's lock).
void reap_parked() noexcept;

/// How many handles' segments are parked now (tests).
std::size_t parked_count() noexcept;

}  // namespace gpuipc::core
