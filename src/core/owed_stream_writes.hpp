// Stream writes this process owes. Channel::publish and Channel::release make a message (or a free slot) visible
// on the host first (src/shm/channel_ring.hpp) and enqueue the stream write of `filled` (or `freed`) after, which
// keeps that driver call off the handoff's critical path. A peer that sees the host-visible state at once may
// enqueue its stream wait for the word before the write is enqueued. Across processes that is harmless; within one
// process it deadlocks the GPU when the wait and the write land on streams that are ordered with each other: one
// stream shared by two threads (the legacy default stream of the examples' `nullptr`), or the legacy stream and a
// blocking stream. The write would then queue behind the wait it is meant to release, and no timeout reaches a
// stream wait. So a call about to enqueue a stream wait first lets every publish or release of this process that
// is between its two steps finish them. Every wait then comes after, in this process's enqueue order, every write
// it can depend on, directly or through other processes (the chain of host-visible states that let it claim the
// word carries the count's increment), and implicit stream order only ever points from a later enqueue to an
// earlier one: no cycle. The window is one driver call (~0.7 us, bench/results/channels-*.json
// memop_write_enqueue_us); a process with no such window open pays one atomic load.
#pragma once

#include <atomic>
#include <cstdint>

namespace gpuipc::core {

/// How many OwedStreamWrite windows of this process are open now.
extern std::atomic<std::uint32_t> g_owed_stream_writes;  // NOLINT: process-wide by nature

/// Held from before the host-visible store until the stream write is enqueued (or given up). Counts only for
/// device channels (`gpu`): host channels have no stream write.
class OwedStreamWrite {
 public:
  explicit OwedStreamWrite(bool gpu) noexcept : m_gpu(gpu) {
    if (m_gpu) g_owed_stream_writes.fetch_add(1, std::memory_order_seq_cst);
  }
  ~OwedStreamWrite() {
    if (m_gpu) g_owed_stream_writes.fetch_sub(1, std::memory_order_release);
  }
  OwedStreamWrite(const OwedStreamWrite&) = delete;
  OwedStreamWrite& operator=(const OwedStreamWrite&) = delete;

 private:
  bool m_gpu;
};

/// Before a stream wait is enqueued: every owed write of this process is enqueued. Each window is one driver call,
/// so this spins briefly, then yields (threads publishing back to back can keep the count up for a while).
void settle_owed_stream_writes() noexcept;

}  // namespace gpuipc::core
