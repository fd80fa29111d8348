// Shared pieces of the nanobind module gpuipc._gpuipc: status errors, argument parsing, interruptible waits.
// The module is a thin front end (docs/architecture.md, Layers): it converts arguments, releases the GIL around anything that
// blocks, and turns errors into the gpuipc.Error hierarchy of python/gpuipc/errors.py. No logic of its own.
#pragma once

#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "gpuipc/channel.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "gpuipc/stream.hpp"

#ifdef Py_LIMITED_API
// Public C API since Python 3.4 that every CPython exports, but outside the 3.12 limited API the abi3 wheel builds
// against (drop_without_gil needs it: a handle's C++ copy may go on a thread that does not hold the GIL).
extern "C" int PyGILState_Check(void);
#endif

namespace gpuipc::py {

namespace nb = nanobind;

/// A non-Ok Status of a hot-path call, raised in Python as the matching gpuipc.Error subclass (errors.cpp).
class StatusError : public std::exception {
 public:
  StatusError(Status status, std::string message) : m_status(status), m_message(std::move(message)) {}
  Status status() const noexcept { return m_status; }
  const char* what() const noexcept override { return m_message.c_str(); }

 private:
  Status m_status;
  std::string m_message;
};

/// Raises gpuipc.Closed for a handle used after close(): "<what>: this handle was closed ...".
[[noreturn]] void raise_closed(const char* what);

/// Throws StatusError for anything but Ok; `what` names the call and the object ("receive on channel 'x'").
void check_status(Status status, std::string_view what);

/// Registers the translator of gpuipc::Error and StatusError into gpuipc.errors classes.
void register_errors(nb::module_& m);

/// "host" / "device" / "host_pinned" -> SegmentKind; InvalidArgument otherwise.
SegmentKind parse_kind(std::string_view kind);

/// A stream handle from Python: an int (CUstream / cudaStream_t value); 0 is the legacy default stream.
inline StreamHandle to_stream(std::uintptr_t handle) noexcept {
  return reinterpret_cast<StreamHandle>(handle);  // NOLINT(performance-no-int-to-ptr): a driver handle
}

/// Longest time a blocking call spends without the GIL before it looks for signals (Ctrl-C).
inline constexpr std::chrono::milliseconds kWaitSlice{50};

/// Seconds (None: forever) -> nanoseconds for the core (negative: forever). Negative or NaN seconds:
/// InvalidArgument.
std::chrono::nanoseconds to_timeout(std::optional<double> seconds, std::string_view what);

/// The git commit this module was built from ("-dirty" appended for a changed tree; "unknown" outside git): made at
/// each build by bench/commit.cmake (build_commit.cpp in the build folder).
const char* build_commit() noexcept;

/// Throws nb::python_error when a signal handler raised (KeyboardInterrupt for Ctrl-C). Needs the GIL.
void check_signals();

/// True in a thread other than the one that runs the interpreter's exit, once that exit has begun (gpuipc's atexit
/// hook, _gpuipc._exiting, says so). Such a thread must not take the GIL back: Python before 3.14 ends a thread that
/// takes it during finalization with pthread_exit, and its unwinding through a C++ destructor (noexcept) aborted
/// the process ("terminate called without an active exception") when a daemon thread was waiting in gpuipc.
bool must_not_take_the_gil() noexcept;
/// Called by the thread that runs the exit (gpuipc's atexit hook): from now on the others park.
void mark_interpreter_exiting() noexcept;
/// Never returns: such a thread waits here, holding nothing of Python's, until the process ends (what Python 3.14
/// itself does with threads that would take the GIL during finalization).
[[noreturn]] void park_until_exit() noexcept;

/// nb::gil_scoped_release, except that a thread that would take the GIL back once the interpreter is exiting parks
/// (park_until_exit) instead.
/// How many threads are in gpuipc calls without the GIL now (GilReleased), parked ones included.
inline std::atomic<int> g_threads_without_gil{0};

class GilReleased {
 public:
  GilReleased() noexcept : m_state(PyEval_SaveThread()) {
    g_threads_without_gil.fetch_add(1, std::memory_order_relaxed);
  }
  ~GilReleased() {
    if (must_not_take_the_gil()) park_until_exit();  // (still counted: it keeps what its call holds)
    g_threads_without_gil.fetch_sub(1, std::memory_order_relaxed);
    PyEval_RestoreThread(m_state);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* m_state;
};

/// Destroys what `handle` holds (a gpuipc handle) without the GIL when this thread holds it. Dropping a handle can
/// wait: its Close or Leave goes to the broker under the library's connection lock, which a reconnect holds while a
/// new broker starts (seconds), and a pool or channel whose stream still owes work may wait for that stream. Python
/// runs destructors with the GIL held (garbage, or a refcount that reached 0), so every other Python thread used
/// to wait too. On a thread without the GIL it is destroyed as it is. Only for handles (Segment, Pool, Channel,
/// Semaphore, CountingSemaphore): views, DLPack exports and blocks come and go by the thousand, and each release
/// could wait up to Python's switch interval (5 ms) for the GIL back while another thread runs Python.
template <class Handle>
void drop_without_gil(Handle& handle) noexcept {
  if (!handle) return;
  Handle gone = std::move(handle);
  // (Not after the interpreter has gone: a DLPack consumer may free its last export then.)
  if (Py_IsInitialized() == 0 || PyGILState_Check() == 0) return;
  GilReleased unlocked;
  Handle last = std::move(gone);  // destroyed before `unlocked` takes the GIL back
}

/// The same for a shared owner: only its last reference does anything worth the GIL's release (which can cost the
/// next turn of another thread holding it, up to Python's switch interval).
template <class T>
void drop_without_gil(std::shared_ptr<T>& owner) noexcept {
  if (owner && owner.use_count() == 1) {
    std::shared_ptr<T> gone = std::move(owner);
    if (Py_IsInitialized() == 0 || PyGILState_Check() == 0) return;
    GilReleased unlocked;
    gone.reset();
  }
  owner.reset();
}

/// A handle that its shared owners (shared_without_gil) drop without the GIL, when the last of them goes.
template <class Handle>
struct DroppedWithoutGil {
  Handle handle;
  explicit DroppedWithoutGil(Handle h) noexcept : handle(std::move(h)) {}
  DroppedWithoutGil(const DroppedWithoutGil&) = delete;
  DroppedWithoutGil& operator=(const DroppedWithoutGil&) = delete;
  ~DroppedWithoutGil() { drop_without_gil(handle); }
};

/// `handle` (a Segment or a Pool) as the one shared owner that a Python handle and everything made from it (views,
/// DLPack exports, blocks, holds) keep: whichever of them goes last, often a view the garbage collector frees
/// after the handle's close(), unmaps and tells the broker without the GIL (drop_without_gil), and only that one.
/// Views used to own a copy of the handle each: the last of those went with the GIL held, and every other Python
/// thread waited while its Close waited for the broker.
template <class Handle>
std::shared_ptr<Handle> shared_without_gil(Handle handle) {
  auto box = std::make_shared<DroppedWithoutGil<Handle>>(std::move(handle));
  return std::shared_ptr<Handle>(box, &box->handle);
}

/// Calls attempt(slice) without the GIL in slices of at most kWaitSlice until it returns anything but
/// Status::Timeout or `timeout` (negative: forever) has passed, checking for signals between slices. A zero
/// timeout makes one attempt with a zero slice (the core answers WouldBlock). Returns the last status.
template <class Attempt>
Status wait_in_slices(std::chrono::nanoseconds timeout, Attempt&& attempt) {
  using clock = std::chrono::steady_clock;
  if (timeout.count() == 0) {
    GilReleased unlocked;
    return attempt(std::chrono::nanoseconds(0));
  }
  const bool forever = timeout.count() < 0;
  const auto deadline = forever ? clock::time_point::max() : clock::now() + timeout;
  for (;;) {
    std::chrono::nanoseconds slice = kWaitSlice;
    if (!forever) slice = std::min<std::chrono::nanoseconds>(slice, std::max(deadline - clock::now(), {}));
    if (slice.count() == 0) return Status::Timeout;  // a zero slice would answer WouldBlock
    Status status;
    {
      GilReleased unlocked;
      status = attempt(slice);
    }
    if (status != Status::Timeout) return status;
    if (!forever && clock::now() >= deadline) return Status::Timeout;
    check_signals();
  }
}

/// Opens with the broker waiting for the name in slices (Ctrl-C works in between): calls open(wait) with the GIL
/// released; `wait` is the total in seconds (None or 0: no waiting). A NotFound/Timeout when the total has passed
/// becomes Error(Timeout) naming `what` and the total.
template <class Open>
auto open_in_slices(std::optional<double> wait, std::string_view what, Open&& open) -> decltype(open(kWaitSlice)) {
  using clock = std::chrono::steady_clock;
  const auto total = wait ? to_timeout(wait, "wait") : std::chrono::nanoseconds(0);
  if (total.count() == 0) {
    GilReleased unlocked;
    return open(std::chrono::milliseconds(0));
  }
  const bool forever = total.count() < 0;
  const auto deadline = forever ? clock::time_point::max() : clock::now() + total;
  for (;;) {
    auto slice = std::chrono::milliseconds(kWaitSlice);
    if (!forever) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now());
      slice = std::clamp(left, std::chrono::milliseconds(1), slice);
    }
    try {
      GilReleased unlocked;
      return open(slice);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::Timeout && e.code() != ErrorCode::NotFound) throw;
      if (!forever && clock::now() >= deadline) {
        throw Error(ErrorCode::Timeout,
                    fmt::format("{} did not appear within {:g} s (`gpuipc ls` lists what exists; does its creator use "
                                "the same GPUIPC_RUNTIME_DIR?)",
                                what, *wait),
                    "open");
      }
    }
    check_signals();
  }
}

/// Live C++ objects of each bound kind, for the leak tests (gpuipc._gpuipc._live_objects()).
enum class Live : std::uint8_t {
  Segment,
  Semaphore,
  Channel,
  ArrayView,
  DLPackExport,
  Pool,
  Block,
  CountingSemaphore,
  Count
};
std::atomic<long>& live_counter(Live kind) noexcept;

/// A member that counts the objects of kind K alive (copies and moves included).
template <Live K>
struct LiveCount {
  LiveCount() noexcept { live_counter(K).fetch_add(1, std::memory_order_relaxed); }
  LiveCount(const LiveCount&) noexcept : LiveCount() {}
  LiveCount(LiveCount&&) noexcept : LiveCount() {}
  LiveCount& operator=(const LiveCount&) noexcept = default;
  LiveCount& operator=(LiveCount&&) noexcept = default;
  ~LiveCount() { live_counter(K).fetch_sub(1, std::memory_order_relaxed); }
};

void bind_views(nb::module_& m);
void bind_segment(nb::module_& m);
void bind_semaphore(nb::module_& m);
void bind_channel(nb::module_& m);
void bind_torch_allocator(nb::module_& m);
void bind_pool(nb::module_& m);
void bind_counting_semaphore(nb::module_& m);
void bind_liveness(nb::module_& m);

}  // namespace gpuipc::py
