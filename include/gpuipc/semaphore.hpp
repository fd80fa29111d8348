// gpuipc::Semaphore: a named cross-process timeline — a 64-bit counter that only grows — which GPU streams wait on
// and signal in stream order, and host threads too. When the last process allowed to signal it goes away (exit,
// crash, or closing its handle), the broker poisons it: every pending and later wait, GPU or host, returns at
// once and reports PeerDied (or Closed).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/stream.hpp"

namespace gpuipc {

/// Largest value a semaphore takes (2^62 - 1); bit 62 marks poison.
inline constexpr std::uint64_t kSemaphoreMaxValue = (1ULL << 62) - 1;

struct SemaphoreOptions {
  std::uint64_t initial = 0;
  /// host_pinned: GPU streams and host threads (needs a driver); host: host threads only (no GPU needed).
  SegmentKind kind = SegmentKind::HostPinned;
  int device = 0;        ///< the context that registers the page (host_pinned)
  unsigned mode = 0600;  ///< r: may wait, w: may signal
};

/// Which side of a semaphore a process is on.
enum class SemaphoreRole : std::uint8_t {
  Signaller,  ///< may signal and wait; counts towards "someone can still signal" (needs write permission)
  Waiter,     ///< may only wait; maps the page read-only (needs read permission)
};

struct SemaphoreOpenOptions {
  SemaphoreRole role = SemaphoreRole::Waiter;
  std::chrono::milliseconds wait{0};  ///< wait this long for the semaphore to be created
  /// host_pinned: the GPU whose context registers the page (usable from every context); -1: the calling thread's
  /// current context's GPU, else GPU 0.
  int device = 0;
};

/// How a host wait ended.
struct WaitResult {
  Status status = Status::Ok;
  std::uint64_t value = 0;  ///< the value seen (without the poison bit)
};

/// What Semaphore::stat reads from a semaphore's page (for monitoring: `gpuipc top`).
struct SemaphoreStats {
  std::uint64_t value = 0;       ///< the current value (without the poison bit)
  Status status = Status::Ok;    ///< Ok, or why it is poisoned (PeerDied, Closed)
  std::uint32_t signallers = 0;  ///< signaller handles joined now (a process may hold several)
};

/// A handle may be used from several threads at once (its calls keep no state a second thread could tear); moving
/// or destroying it while another thread uses it is the caller's to avoid, as for any object.
class Semaphore {
 public:
  /// Creates semaphore `name` with `options.initial`; the creator is a signaller. Throws Error like
  /// Segment::create.
  static Semaphore create(std::string_view name, const SemaphoreOptions& options = {});
  /// Opens semaphore `name` as a signaller or a waiter. Throws Error like Segment::open; InvalidArgument when the
  /// name is not a semaphore.
  static Semaphore open(std::string_view name, const SemaphoreOpenOptions& options = {});
  /// Removes the name (like Segment::unlink).
  static void unlink(std::string_view name);
  /// Reads semaphore `name` without joining it: maps its page read-only (no GPU needed). Throws Error like
  /// Segment::open (read permission needed), InvalidArgument when `name` is not a semaphore of this version.
  static SemaphoreStats stat(std::string_view name);

  Semaphore() noexcept;
  Semaphore(Semaphore&&) noexcept;
  Semaphore& operator=(Semaphore&&) noexcept;
  Semaphore(const Semaphore&) = delete;
  Semaphore& operator=(const Semaphore&) = delete;
  /// A signaller leaving: if it was the last, the semaphore is poisoned (Closed) so no waiter waits forever.
  ~Semaphore();

  /// Stream-ordered: once `stream` reaches this point, the value becomes `value` (cuStreamWriteValue64). With
  /// `wake_host`, a host function then wakes host waiters at once (otherwise they notice within their polling
  /// interval, at most 1 ms). With `wake_host`, when a write enqueued now would land at once (the stream and what
  /// it implicitly waits for are idle; on the legacy default stream, an event recorded there completes within
  /// 100 us), the value is raised from the host instead, as signal_host does, which wakes host waiters some 100 us
  /// sooner (docs/semaphores.md). Returns Ok, PeerDied/Closed (poisoned), InvalidState (a waiter, a forked child's
  /// copy of its parent's handle, a host-kind semaphore, or value > kSemaphoreMaxValue). Does not allocate or throw.
  /// `stream` nullptr (here and in wait): the legacy default stream of the calling thread's current context,
  /// whichever GPU registered the page (the options' `device`, made current, on a thread with none).
  Status signal(StreamHandle stream, std::uint64_t value, bool wake_host = false) noexcept;
  /// Stream-ordered: work enqueued on `stream` after this waits until the value reaches `value`
  /// (cuStreamWaitValue64, GEQ). A poison releases the wait. Returns Ok, PeerDied/Closed (already poisoned:
  /// nothing is enqueued), InvalidState (host-kind semaphore).
  Status wait(StreamHandle stream, std::uint64_t value) noexcept;
  /// Raises the value to `value` from the host (never lowers it) and wakes host waiters. InvalidState for a waiter,
  /// a forked child's copy of its parent's handle, or value > kSemaphoreMaxValue.
  Status signal_host(std::uint64_t value) noexcept;
  /// Waits on the host until the value reaches `value`: spins briefly, then sleeps (futex). Returns Ok, Timeout,
  /// PeerDied or Closed (poisoned), with the value seen; InvalidState for value > kSemaphoreMaxValue, which the
  /// value never reaches.
  WaitResult wait_host(std::uint64_t value, std::chrono::nanoseconds timeout) noexcept;
  /// wait_host polling for up to `spin` before it sleeps (the other overload: 20 us). A GPU stream's signal
  /// (signal(stream, v)) wakes no sleeper by itself (wake_host costs a host callback, ~100 us): a waiter that
  /// must see it within microseconds spins for as long as it expects to wait, at the cost of a CPU core.
  WaitResult wait_host(std::uint64_t value, std::chrono::nanoseconds timeout, std::chrono::nanoseconds spin) noexcept;
  /// The current value (without the poison bit).
  std::uint64_t value() const noexcept;
  /// Ok, or why it is poisoned (PeerDied, Closed).
  Status status() const noexcept;

  const std::string& name() const noexcept;
  SemaphoreRole role() const noexcept;
  explicit operator bool() const noexcept { return m_impl != nullptr; }

  struct Impl;

 private:
  explicit Semaphore(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> m_impl;
};

}  // namespace gpuipc
