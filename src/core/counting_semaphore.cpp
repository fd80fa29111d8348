#include "gpuipc/counting_semaphore.hpp"

#include <fmt/format.h>

#include <mutex>
#include <thread>

#include "base/deadline.hpp"
#include "core/membership.hpp"
#include "core/segment_internal.hpp"
#include "core/shm_wait.hpp"
#include "cuda/trace.hpp"
#include "shm/counting_block.hpp"

namespace gpuipc {

using proto::atomic;

struct CountingSemaphore::Impl {
  Segment segment;
  proto::CountingBlock* block = nullptr;
  std::uint32_t max = 0;  // read once at attach: the broker's check made it valid at Create
  core::Membership member;
  std::mutex op;          // one operation on this member's words at a time (src/shm/counting_block.hpp)
  // One waiter per handle: the member has one place in the queue. A plain mutex taken with try_lock until the
  // deadline (threads of one handle that wait at once are rare): std::timed_mutex::try_lock_until goes through
  // pthread_mutex_clocklock, which ThreadSanitizer (GCC 12) does not see, so it reported every unlock as wrong.
  std::mutex wait;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() { leave(); }

  /// Releases what this handle holds and clears its entry: the same transition as the broker's repair.
  void leave() noexcept {
    if (!member || block == nullptr) return;
    // In a forked child the entry is the parent's: its permits and its place stay the parent's.
    if (core::joined_here(member)) shm::counting_remove_member(*block, member.index, member.token, max);
    core::forget_member(member);
    member = {};
  }

  bool try_take(std::uint32_t n) noexcept {
    std::lock_guard lock(op);
    return shm::counting_apply(*block, member.index, false, n, max) == shm::CountingResult::Done;
  }
};

namespace {

/// The block of `seg`, or InvalidArgument when it is not a counting semaphore of this version. Only a host
/// segment's data is read: another kind's address is GPU memory (or pages this process must not touch as a block).
proto::CountingBlock* block_of(const Segment& seg, const char* call) {
  proto::CountingBlock* block = seg.kind() == SegmentKind::Host ? shm::counting_block(seg.data(), seg.size()) : nullptr;
  if (block == nullptr) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is not a gpuipc counting semaphore (version {}); `gpuipc stat {}` says what it is",
                            seg.name(), proto::kCountingVersion, seg.name()),
                call);
  }
  return block;
}

std::unique_ptr<CountingSemaphore::Impl> attach(Segment seg, const char* call) {
  auto impl = std::make_unique<CountingSemaphore::Impl>();
  impl->block = block_of(seg, call);
  impl->max = std::min(atomic(impl->block->max_count).load(), proto::kCountingMaxPermits);
  impl->segment = std::move(seg);
  impl->member = core::join_member(impl->segment, proto::Role::Holder);
  return impl;
}

[[noreturn]] void throw_empty(const char* call) {
  throw Error(ErrorCode::InvalidArgument, "empty CountingSemaphore handle (moved from or default-made)", call);
}

/// The handle's Impl, for an operation on its permits: the handle is not empty, and is this process's own.
CountingSemaphore::Impl& usable(const std::unique_ptr<CountingSemaphore::Impl>& impl, const char* call) {
  if (!impl) throw_empty(call);
  if (!core::joined_here(impl->member)) {
    throw Error(ErrorCode::InvalidState,
                fmt::format("counting semaphore '{}': this handle was opened by the process this one was forked "
                            "from, and its permits are that process's; open the semaphore again in this process "
                            "(CountingSemaphore::open)",
                            impl->segment.name()),
                call);
  }
  return *impl;
}

}  // namespace

CountingSemaphore::CountingSemaphore() noexcept = default;
CountingSemaphore::CountingSemaphore(std::unique_ptr<Impl> impl) noexcept : m_impl(std::move(impl)) {}
CountingSemaphore::CountingSemaphore(CountingSemaphore&&) noexcept = default;
CountingSemaphore& CountingSemaphore::operator=(CountingSemaphore&&) noexcept = default;
CountingSemaphore::~CountingSemaphore() = default;

CountingSemaphore CountingSemaphore::create(std::string_view name, const CountingSemaphoreOptions& options) {
  if (options.max_count == 0 || options.max_count > kCountingSemaphoreMaxCount) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("counting semaphore '{}': max_count {} is not between 1 and {}", name, options.max_count,
                            kCountingSemaphoreMaxCount),
                "create");
  }
  if (options.initial > options.max_count) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("counting semaphore '{}': initial {} is above max_count {}", name, options.initial,
                            options.max_count),
                "create");
  }
  // The block is complete before the broker publishes the name (it checks it is in its initial state).
  CreateOptions co{.kind = SegmentKind::Host, .device = 0, .mode = options.mode};
  Segment seg = detail::create_segment(name, sizeof(proto::CountingBlock), co, proto::kFlagCounting, [&](void* p) {
    auto* b = static_cast<proto::CountingBlock*>(p);
    b->version = proto::kCountingVersion;
    b->max_count = options.max_count;
    b->initial = options.initial;
    atomic(b->state).store(options.initial, std::memory_order_relaxed);
    atomic(b->magic).store(proto::kCountingMagic, std::memory_order_release);
  });
  return CountingSemaphore(attach(std::move(seg), "create"));
}

CountingSemaphore CountingSemaphore::open(std::string_view name, const CountingSemaphoreOpenOptions& options) {
  OpenOptions oo;
  oo.access = Access::ReadWrite;
  oo.wait = options.wait;
  oo.device = -1;
  return CountingSemaphore(attach(Segment::open(name, oo), "open"));
}

void CountingSemaphore::unlink(std::string_view name) { Segment::unlink(name); }

CountingSemaphoreStats CountingSemaphore::stat(std::string_view name) {
  Segment seg = detail::look_at_segment(name);
  proto::CountingBlock* b = block_of(seg, "stat");
  CountingSemaphoreStats st;
  st.available = shm::counting_available(*b);
  st.max_count = atomic(b->max_count).load();
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) st.held += shm::counting_held(*b, i);
  st.holders = shm::counting_members(*b);
  st.waiting = atomic(b->waiting).load();
  return st;
}

Status CountingSemaphore::acquire(std::uint32_t n, std::chrono::nanoseconds timeout) {
  return acquire(n, timeout, nullptr, nullptr);
}

Status CountingSemaphore::acquire(std::uint32_t n, std::chrono::nanoseconds timeout, bool (*interrupted)(void*),
                                  void* context) {
  GPUIPC_TRACE("gpuipc::CountingSemaphore::acquire");
  Impl& s = usable(m_impl, "acquire");
  if (n == 0) return Status::Ok;
  if (n > s.max) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("acquire({}) of counting semaphore '{}': it has only {} permits in all, so this could "
                            "never succeed",
                            n, s.segment.name(), s.max),
                "acquire");
  }
  proto::CountingBlock& b = *s.block;
  // No overtaking: with anyone queued, a newcomer queues too. `waiting` says that nobody is, in one load; when it
  // says otherwise the queue itself is looked at, so that a count that is wrong (a member's scribble, or a member
  // of an older release killed as it left the queue) cannot keep try_acquire from ever taking free permits.
  if ((atomic(b.waiting).load(std::memory_order_seq_cst) == 0 || !shm::counting_queued(b)) && s.try_take(n)) {
    return Status::Ok;
  }
  if (timeout.count() == 0) return Status::WouldBlock;
  using clock = std::chrono::steady_clock;
  const auto deadline = base::deadline_after(clock::now(), timeout);
  const bool forever = deadline == clock::time_point::max();  // (also a timeout past what the clock holds)
  // Behind another thread of this handle that waits: its turn comes when that one is served or gives up. This
  // wait is interruptible like the one in the queue (a Ctrl-C must not wait for the other thread).
  std::unique_lock<std::mutex> waiting(s.wait, std::defer_lock);
  constexpr std::chrono::nanoseconds kTurnPoll = std::chrono::microseconds(200);
  constexpr int kPollsPerCheck = 250;  // `interrupted` about every 50 ms, as in the queue
  for (int polls = 1; !waiting.try_lock(); ++polls) {
    if (!forever && clock::now() >= deadline) return Status::Timeout;
    if (interrupted != nullptr && polls % kPollsPerCheck == 0 && interrupted(context)) return Status::Interrupted;
    std::this_thread::sleep_for(kTurnPoll);
  }
  shm::counting_enqueue(b, s.member.index, n);
  // Sleeps on the futex from the start (no spinning); the head of the queue alone takes permits, then leaves the
  // queue, which wakes the next.
  constexpr std::chrono::nanoseconds kSlice = std::chrono::milliseconds(50);
  Status st = Status::Timeout;
  for (;;) {
    std::chrono::nanoseconds wait_for = forever ? std::chrono::nanoseconds(-1) : deadline - clock::now();
    if (!forever && wait_for.count() <= 0) break;
    if (interrupted != nullptr) wait_for = wait_for.count() < 0 ? kSlice : std::min(wait_for, kSlice);
    st = core::wait_on(
        b.wake_seq, wait_for, [&] { return shm::counting_is_head(b, s.member.index) && s.try_take(n); }, &b.sleepers,
        std::chrono::nanoseconds(0));
    if (st == Status::Ok) break;
    st = Status::Timeout;
    if (interrupted != nullptr && interrupted(context)) {
      st = Status::Interrupted;
      break;
    }
  }
  // After a success, the next waiter can only proceed if permits are left; otherwise the next release wakes it.
  shm::counting_dequeue(b, s.member.index, st != Status::Ok || shm::counting_available(b) > 0);
  return st;
}

Status CountingSemaphore::try_acquire(std::uint32_t n) { return acquire(n, std::chrono::nanoseconds(0)); }

void CountingSemaphore::release(std::uint32_t n) {
  Impl& s = usable(m_impl, "release");
  if (n == 0) return;
  shm::CountingResult r;
  {
    std::lock_guard lock(s.op);
    r = shm::counting_apply(*s.block, s.member.index, true, n, s.max);
  }
  if (r == shm::CountingResult::OverRelease) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("release({}) of counting semaphore '{}': this handle holds {} permit{}; release only "
                            "permits it acquired (or, for its creator, the max_count - initial it was given)",
                            n, s.segment.name(), held(), held() == 1 ? "" : "s"),
                "release");
  }
  shm::bump_and_wake(s.block->wake_seq, &s.block->sleepers);
}

std::uint32_t CountingSemaphore::held() const noexcept {
  return m_impl && core::joined_here(m_impl->member) ? shm::counting_held(*m_impl->block, m_impl->member.index) : 0;
}
std::uint32_t CountingSemaphore::available() const noexcept {
  return m_impl ? shm::counting_available(*m_impl->block) : 0;
}
std::uint32_t CountingSemaphore::waiting() const noexcept { return m_impl ? atomic(m_impl->block->waiting).load() : 0; }
std::uint32_t CountingSemaphore::max_count() const noexcept { return m_impl ? m_impl->max : 0; }
const std::string& CountingSemaphore::name() const noexcept {
  static const std::string empty;
  return m_impl ? m_impl->segment.name() : empty;
}

}  // namespace gpuipc
