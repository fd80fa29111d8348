#include "gpuipc/semaphore.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "core/membership.hpp"
#include "core/segment_internal.hpp"
#include "core/shm_wait.hpp"
#include "core/stream_park.hpp"
#include "cuda/context.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/trace.hpp"
#include "shm/semaphore_block.hpp"
#include "shm/sync.hpp"

namespace gpuipc {

using proto::atomic;

namespace {

Status status_of(proto::PoisonReason why) noexcept {
  if (why == proto::PoisonReason::None) return Status::Ok;
  return why == proto::PoisonReason::Closed ? Status::Closed : Status::PeerDied;
}

/// Ok, or why block `b` is poisoned, given a value `v` read from it (shm::semaphore_poison).
Status poison_status_of(const proto::SemaphoreBlock& b, std::uint64_t v) noexcept {
  return status_of(shm::semaphore_poison(b, v));
}

/// What a handle's streams may still touch of its page (host_pinned) when it closes: a write of a `signal`, a
/// `wait` polling for its value, a `wake_host` callback bumping the wake word (src/core/stream_park.hpp says why a
/// close with any of it outstanding parks the segment). The callbacks get this as their data, and count it down
/// last: the page and this may go after that.
struct StreamUse final : core::StreamTouches {
  proto::SemaphoreBlock* block = nullptr;
  std::atomic<std::uint32_t> callbacks{0};  // wake_host callbacks enqueued and not yet run
  std::atomic<std::uint64_t> signalled{0};  // highest value handed to a stream to write
  std::atomic<std::uint64_t> waited{0};     // highest value a stream was told to wait for
  Segment segment;                          // parked: the page, kept until done()

  /// `word` = max(word, v): a handle may be used from several threads at once.
  static void raise(std::atomic<std::uint64_t>& word, std::uint64_t v) noexcept {
    std::uint64_t cur = word.load(std::memory_order_relaxed);
    while (cur < v && !word.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  }

  bool done() const noexcept override {
    if (callbacks.load(std::memory_order_acquire) != 0) return false;
    const std::uint64_t v = atomic(block->value).load(std::memory_order_acquire);
    // A queued write lands whatever the poison (it writes the whole word); a wait passes at the poison.
    const std::uint64_t value = v & proto::kMaxValue;
    return value >= signalled.load(std::memory_order_relaxed) &&
           (value >= waited.load(std::memory_order_relaxed) || (v & proto::kPoisonBit) != 0);
  }
};

void wake_host_waiters(void* data) {
  auto* use = static_cast<StreamUse*>(data);
  shm::bump_and_wake(use->block->wake_seq);
  use->callbacks.fetch_sub(1, std::memory_order_release);  // the last touch: the page and `use` may go after it
}

}  // namespace

struct Semaphore::Impl {
  Segment segment;
  proto::SemaphoreBlock* block = nullptr;
  // GPU address of block->value (host_pinned); 0 for host kind. Registered in `ctx`'s context but valid in every
  // context of this process: the page is registered CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP, and with unified
  // addressing (on in every 64-bit process) the pointer cuMemHostGetDevicePointer gives is "suitable for use on all
  // devices" (cuMemHostRegister's documentation), so a stream of whatever context the caller has current can write
  // and wait on it (tests/gpu/test_multigpu_device.cpp, Stream0 tests).
  std::uint64_t device_value = 0;
  cuda::PrimaryContext ctx;  // host_pinned: made current for stream operations on threads that have none
  SemaphoreRole role = SemaphoreRole::Waiter;
  std::uint32_t member = proto::kNoMember;
  std::uint32_t token = 0;             // the broker's token in our member entry
  std::uint32_t forks = 0;             // core::forks_so_far() at the join
  std::uint32_t opened_forks = core::forks_so_far();               // ... at the open (waiters too)
  std::unique_ptr<StreamUse> use = std::make_unique<StreamUse>();  // host_pinned: what its streams may still touch
  CUevent legacy_probe = nullptr;      // made at the first signal(wake_host) on the legacy default stream,
  CUcontext probe_ctx = nullptr;       // in this context (made again when the caller's current context is another)
  std::mutex probe_mutex;              // guards both: threads current on other contexts would each remake them

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    leave();
    if (legacy_probe != nullptr) cuda::destroy_event(legacy_probe);
    core::reap_parked();
    // (A forked child's copy parks nothing: the stream work it records is its parent's, whose callbacks never count
    // down in the child, which would keep the page until it exits.)
    if (device_value != 0 && block != nullptr && opened_forks == core::forks_so_far() && !use->done()) {
      use->segment = std::move(segment);
      core::park(std::move(use));
    }
  }

  /// Whether a write enqueued on `s` now would land at once (see signal): the stream and whatever it would wait
  /// for are done. Asked in the context the write goes to (the current one: see StreamTarget::HostWords), whose
  /// legacy stream the probe is recorded on; an event records only on streams of its own context.
  bool reached_now(CUstream s) noexcept {
    if (s != nullptr && s != CU_STREAM_LEGACY) return cuda::stream_reached_now(s);
    const CUcontext current = cuda::current_context_or_null();
    if (current == nullptr) return false;
    const std::lock_guard lock(probe_mutex);
    if (legacy_probe == nullptr || probe_ctx != current) {
      if (legacy_probe != nullptr) cuda::destroy_event(legacy_probe);
      legacy_probe = cuda::create_probe_event();
      probe_ctx = legacy_probe != nullptr ? current : nullptr;
    }
    return cuda::legacy_stream_reached_now(legacy_probe, std::chrono::microseconds(100));
  }

  void join() {
    if (role != SemaphoreRole::Signaller) return;
    const auto m = core::join_member(segment, proto::Role::Signaller);
    member = m.index;
    token = m.token;
    forks = m.forks;
  }

  /// A signaller leaving cleanly. The last one poisons the semaphore (Closed): no stream waits forever for a
  /// value nobody can signal any more.
  void leave() noexcept {
    if (member == proto::kNoMember || block == nullptr) return;
    if (!core::joined_here(core::Membership{member, token, forks})) {
      // A forked child's copy of its parent's handle: the entry is the parent's, which signals on (and whose
      // leave, or death, poisons the semaphore when it was the last signaller).
      core::forget_member(core::Membership{member, token});
      member = proto::kNoMember;
      return;
    }
    // A signal still queued on a stream would land after the poison and erase it: wait for ours (bounded).
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((atomic(block->value).load(std::memory_order_acquire) & proto::kMaxValue) < use->signalled.load() &&
           (atomic(block->value).load() & proto::kPoisonBit) == 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    shm::semaphore_remove_member(*block, member, token, proto::PoisonReason::Closed);
    core::forget_member(core::Membership{member, token});
    member = proto::kNoMember;
    token = 0;
  }

  Status poison_status(std::uint64_t v) const noexcept { return poison_status_of(*block, v); }

  /// Whether this signaller's entry was joined by this process: a forked child's copy of its parent's handle holds
  /// the parent's entry, and its signals are refused (the child is no signaller: open the semaphore again there).
  bool signaller_here() const noexcept {
    return role == SemaphoreRole::Signaller && member != proto::kNoMember &&
           core::joined_here(core::Membership{member, token, forks});
  }
};

namespace {

/// The semaphore block of `seg`, or Error(InvalidArgument): a segment of another kind of object (or a device
/// segment, whose data() the host cannot read) is not one.
proto::SemaphoreBlock* block_of(const Segment& seg, std::string_view name, const char* call) {
  proto::SemaphoreBlock* b = detail::host_readable(seg.kind()) ? shm::semaphore_block(seg.data(), seg.size()) : nullptr;
  if (b == nullptr) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a gpuipc semaphore (version {}); `gpuipc stat {}` says what it is", name,
                            proto::kSemaphoreVersion, name),
                call);
  }
  return b;
}

std::unique_ptr<Semaphore::Impl> attach(Segment seg, SemaphoreRole role) {
  core::reap_parked();
  auto impl = std::make_unique<Semaphore::Impl>();
  impl->block = block_of(seg, seg.name(), "open");
  impl->use->block = impl->block;
  if (seg.kind() == SegmentKind::HostPinned) {
    impl->device_value = seg.device_pointer() + offsetof(proto::SemaphoreBlock, value);
    impl->ctx = cuda::PrimaryContext(seg.device());
  }
  impl->role = role;
  impl->segment = std::move(seg);
  impl->join();
  return impl;
}

}  // namespace

Semaphore::Semaphore() noexcept = default;
Semaphore::Semaphore(std::unique_ptr<Impl> impl) noexcept : m_impl(std::move(impl)) {}
Semaphore::Semaphore(Semaphore&&) noexcept = default;
Semaphore& Semaphore::operator=(Semaphore&&) noexcept = default;
Semaphore::~Semaphore() = default;

Semaphore Semaphore::create(std::string_view name, const SemaphoreOptions& options) {
  GPUIPC_TRACE("gpuipc::Semaphore::create");
  if (options.kind != SegmentKind::HostPinned && options.kind != SegmentKind::Host) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("semaphore '{}': kind must be host_pinned (GPU and host) or host (host only)", name),
                "create");
  }
  if (options.initial > kSemaphoreMaxValue) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("semaphore '{}': initial value above 2^62 - 1", name),
                "create");
  }
  // The block is initialised before the broker publishes the name, through the creator's own mapping: a
  // host_pinned segment is a memfd mapped here first, so write it, then register.
  CreateOptions co{.kind = options.kind, .device = options.device, .mode = options.mode};
  Segment seg = detail::create_segment(name, sizeof(proto::SemaphoreBlock), co, proto::kFlagSemaphore,
                                       [&](void* block) { shm::semaphore_init(block, options.initial); });
  return Semaphore(attach(std::move(seg), SemaphoreRole::Signaller));
}

Semaphore Semaphore::open(std::string_view name, const SemaphoreOpenOptions& options) {
  GPUIPC_TRACE("gpuipc::Semaphore::open");
  OpenOptions oo;
  oo.access = options.role == SemaphoreRole::Signaller ? Access::ReadWrite : Access::ReadOnly;
  oo.wait = options.wait;
  oo.device = options.device;
  Segment seg = Segment::open(name, oo);
  return Semaphore(attach(std::move(seg), options.role));
}

void Semaphore::unlink(std::string_view name) { Segment::unlink(name); }

SemaphoreStats Semaphore::stat(std::string_view name) {
  // A CUDA-free read-only look: a host_pinned page is mapped without registering it with the GPU.
  Segment seg = detail::look_at_segment(name);
  proto::SemaphoreBlock* b = block_of(seg, name, "stat");
  SemaphoreStats st;
  const std::uint64_t v = atomic(b->value).load(std::memory_order_acquire);
  st.value = v & proto::kMaxValue;
  st.status = poison_status_of(*b, v);
  st.signallers = atomic(b->signallers).load();
  return st;
}

Status Semaphore::signal(StreamHandle stream, std::uint64_t value, bool wake_host) noexcept {
  GPUIPC_TRACE("gpuipc::Semaphore::signal");
  if (!m_impl || !m_impl->signaller_here() || m_impl->device_value == 0 || value > kSemaphoreMaxValue) {
    return Status::InvalidState;
  }
  if (auto st = m_impl->poison_status(atomic(m_impl->block->value).load(std::memory_order_acquire)); st != Status::Ok) {
    return st;
  }
  auto s = static_cast<CUstream>(stream);
  // Host words: stream 0 is the caller's legacy stream, after the work it queued there (on any GPU).
  const cuda::StreamContextScope context(m_impl->ctx.get(), s, cuda::StreamTarget::HostWords);
  if (!context.ok()) return Status::DriverError;
  if (wake_host && m_impl->reached_now(s)) {
    // Everything the write would wait for has finished, so the stream's next step would be this write: do it from
    // here. Host waiters then wake at once, without a host callback (one costs ~20 us to enqueue and runs ~100 us
    // after the stream reaches it).
    return status_of(shm::semaphore_raise(*m_impl->block, value));
  }
  if (cuda::stream_write_value64(s, m_impl->device_value, value) != CUDA_SUCCESS) return Status::DriverError;
  auto& use = *m_impl->use;
  StreamUse::raise(use.signalled, value);
  if (wake_host) {
    use.callbacks.fetch_add(1, std::memory_order_relaxed);
    if (cuda::launch_host_func(s, wake_host_waiters, &use) != CUDA_SUCCESS) {
      use.callbacks.fetch_sub(1, std::memory_order_relaxed);
      return Status::DriverError;
    }
  }
  return Status::Ok;
}

Status Semaphore::wait(StreamHandle stream, std::uint64_t value) noexcept {
  GPUIPC_TRACE("gpuipc::Semaphore::wait");
  if (!m_impl || m_impl->device_value == 0 || value > kSemaphoreMaxValue) return Status::InvalidState;
  if (auto st = m_impl->poison_status(atomic(m_impl->block->value).load(std::memory_order_acquire)); st != Status::Ok) {
    return st;
  }
  const cuda::StreamContextScope context(m_impl->ctx.get(), static_cast<CUstream>(stream),
                                         cuda::StreamTarget::HostWords);
  if (!context.ok()) return Status::DriverError;
  if (cuda::stream_wait_value64(static_cast<CUstream>(stream), m_impl->device_value, value) != CUDA_SUCCESS) {
    return Status::DriverError;
  }
  StreamUse::raise(m_impl->use->waited, value);
  return Status::Ok;
}

Status Semaphore::signal_host(std::uint64_t value) noexcept {
  GPUIPC_TRACE("gpuipc::Semaphore::signal_host");
  if (!m_impl || !m_impl->signaller_here() || value > kSemaphoreMaxValue) return Status::InvalidState;
  return status_of(shm::semaphore_raise(*m_impl->block, value));
}

WaitResult Semaphore::wait_host(std::uint64_t value, std::chrono::nanoseconds timeout) noexcept {
  return wait_host(value, timeout, core::kDefaultSpin);
}

WaitResult Semaphore::wait_host(std::uint64_t value, std::chrono::nanoseconds timeout,
                                std::chrono::nanoseconds spin) noexcept {
  GPUIPC_TRACE("gpuipc::Semaphore::wait_host");
  WaitResult r;
  if (!m_impl || value > kSemaphoreMaxValue) {  // (a value it can never reach: refused, not waited for)
    r.status = Status::InvalidState;
    return r;
  }
  Status outcome = Status::Ok;
  const Status st = core::wait_on(
      m_impl->block->wake_seq, timeout,
      [&] {
        const std::uint64_t cur = atomic(m_impl->block->value).load(std::memory_order_acquire);
        r.value = cur & proto::kMaxValue;
        outcome = m_impl->poison_status(cur);
        return outcome != Status::Ok || r.value >= value;
      },
      nullptr, spin);
  r.status = st == Status::Ok ? outcome : st;
  return r;
}

std::uint64_t Semaphore::value() const noexcept {
  return m_impl ? atomic(m_impl->block->value).load(std::memory_order_acquire) & proto::kMaxValue : 0;
}

Status Semaphore::status() const noexcept {
  return m_impl ? m_impl->poison_status(atomic(m_impl->block->value).load(std::memory_order_acquire))
                : Status::InvalidState;
}

const std::string& Semaphore::name() const noexcept {
  static const std::string kEmpty;
  return m_impl ? m_impl->segment.name() : kEmpty;
}

SemaphoreRole Semaphore::role() const noexcept { return m_impl ? m_impl->role : SemaphoreRole::Waiter; }

}  // namespace gpuipc
