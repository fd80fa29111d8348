// gpuipc._gpuipc.Semaphore: gpuipc::Semaphore with interruptible host waits. python/gpuipc/semaphore.py wraps it.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <atomic>
#include <cmath>
#include <mutex>
#include <shared_mutex>

#include "common.hpp"

namespace gpuipc::py {

using namespace nb::literals;

namespace {

/// Calls may come from several Python threads (waits run without the GIL): they share the lock; close takes it
/// alone, so the semaphore is never destroyed under a waiter.
struct PySemaphore {
  explicit PySemaphore(Semaphore s) noexcept : sem(std::move(s)) {}
  PySemaphore(PySemaphore&&) noexcept = default;
  PySemaphore& operator=(PySemaphore&&) noexcept = default;
  ~PySemaphore() { drop_without_gil(sem); }  // a handle Python frees without close() (common.hpp)
  std::unique_ptr<std::shared_mutex> mutex = std::make_unique<std::shared_mutex>();
  /// Set by close before it takes the lock alone: a wait_host looks at it between its 50 ms slices and raises
  /// Closed, so close does not wait for a waiter with no timeout for ever.
  std::unique_ptr<std::atomic<bool>> closing = std::make_unique<std::atomic<bool>>(false);
  Semaphore sem;
  LiveCount<Live::Semaphore> counted;
};

/// A shared lock on `s`, taken without the GIL (a holder may need the GIL between wait slices).
std::shared_lock<std::shared_mutex> lock_shared(PySemaphore& s, bool require_open = true) {
  std::shared_lock<std::shared_mutex> lock(*s.mutex, std::defer_lock);
  {
    GilReleased unlocked;
    lock.lock();
  }
  if (require_open && !s.sem) raise_closed("semaphore");
  return lock;
}

/// wait_host's spin: None is the library's 20 us; infinite or huge spins for the whole wait (to_timeout would make
/// them "forever", which for a spin reads as none).
std::chrono::nanoseconds to_spin(std::optional<double> seconds) {
  if (!seconds) return std::chrono::microseconds(20);
  if (std::isnan(*seconds) || *seconds < 0) {
    throw Error(ErrorCode::InvalidArgument, "spin must be None (20 us) or a number of seconds >= 0", "wait_host");
  }
  if (*seconds > 1e9) return std::chrono::nanoseconds::max();
  return std::chrono::nanoseconds(static_cast<std::int64_t>(*seconds * 1e9));
}

std::string status_name(Status s) {
  switch (s) {
    case Status::Ok: return "ok";
    case Status::PeerDied: return "peer_died";
    case Status::Closed: return "closed";
    default: return std::string(to_string(s));
  }
}

}  // namespace

void bind_semaphore(nb::module_& m) {
  nb::class_<PySemaphore>(m, "Semaphore", "A cross-process timeline semaphore (low level; see gpuipc.Semaphore).")
      .def_static(
          "create",
          [](std::string_view name, std::uint64_t initial, std::string_view kind, int device, unsigned mode) {
            SemaphoreOptions o{.initial = initial, .kind = parse_kind(kind), .device = device, .mode = mode};
            GilReleased unlocked;
            return PySemaphore(Semaphore::create(name, o));
          },
          "name"_a, nb::kw_only(), "initial"_a = 0, "kind"_a = "host_pinned", "device"_a = 0, "mode"_a = 0600)
      .def_static(
          "open",
          [](std::string_view name, std::string_view role, std::optional<double> wait, int device) {
            SemaphoreRole r;
            if (role == "signaller") {
              r = SemaphoreRole::Signaller;
            } else if (role == "waiter") {
              r = SemaphoreRole::Waiter;
            } else {
              throw Error(ErrorCode::InvalidArgument, "role must be 'signaller' or 'waiter'", "open");
            }
            return open_in_slices(wait, "semaphore '" + std::string(name) + "'", [&](std::chrono::milliseconds slice) {
              return PySemaphore(Semaphore::open(name, {.role = r, .wait = slice, .device = device}));
            });
          },
          "name"_a, nb::kw_only(), "role"_a = "waiter", "wait"_a = nb::none(), "device"_a = 0)
      .def_static(
          "unlink",
          [](std::string_view name) {
            GilReleased unlocked;
            Semaphore::unlink(name);
          },
          "name"_a)
      .def(
          "signal",
          [](PySemaphore& s, std::uint64_t value, std::uintptr_t stream, bool wake_host) {
            auto lock = lock_shared(s);
            check_status(s.sem.signal(to_stream(stream), value, wake_host), "signal of semaphore '" + s.sem.name() + "'");
          },
          "value"_a, "stream"_a, "wake_host"_a)
      .def(
          "wait",
          [](PySemaphore& s, std::uint64_t value, std::uintptr_t stream) {
            auto lock = lock_shared(s);
            check_status(s.sem.wait(to_stream(stream), value), "wait on semaphore '" + s.sem.name() + "'");
          },
          "value"_a, "stream"_a)
      .def(
          "signal_host",
          [](PySemaphore& s, std::uint64_t value) {
            auto lock = lock_shared(s);
            check_status(s.sem.signal_host(value), "signal_host of semaphore '" + s.sem.name() + "'");
          },
          "value"_a)
      .def(
          "wait_host",
          [](PySemaphore& s, std::uint64_t value, std::optional<double> timeout, std::optional<double> spin) {
            auto lock = lock_shared(s);
            WaitResult r;
            const auto limit = to_timeout(timeout, "timeout");
            const auto spin_for = to_spin(spin);
            bool closed = false;
            Status st = wait_in_slices(limit, [&](std::chrono::nanoseconds slice) {
              if (s.closing->load(std::memory_order_acquire)) {
                closed = true;
                return Status::Closed;
              }
              r = s.sem.wait_host(value, slice, spin_for);
              return r.status;
            });
            if (closed) raise_closed("semaphore");
            if (st == Status::Timeout && limit.count() == 0) st = Status::WouldBlock;  // as channels say it
            check_status(st, "wait_host(" + std::to_string(value) + ") on semaphore '" + s.sem.name() + "'");
            return r.value;
          },
          "value"_a, "timeout"_a = nb::none(), "spin"_a = nb::none())
      .def_prop_ro("value",
                   [](PySemaphore& s) {
                     auto lock = lock_shared(s);
                     return s.sem.value();
                   })
      .def_prop_ro("status",
                   [](PySemaphore& s) {
                     auto lock = lock_shared(s);
                     return status_name(s.sem.status());
                   })
      .def_prop_ro("name",
                   [](PySemaphore& s) {
                     auto lock = lock_shared(s);
                     return s.sem.name();
                   })
      .def_prop_ro("role",
                   [](PySemaphore& s) {
                     auto lock = lock_shared(s);
                     return std::string(s.sem.role() == SemaphoreRole::Signaller ? "signaller" : "waiter");
                   })
      .def_prop_ro("closed",
                   [](PySemaphore& s) {
                     auto lock = lock_shared(s, false);
                     return !s.sem;
                   })
      .def("close", [](PySemaphore& s) {
        s.closing->store(true, std::memory_order_release);  // a waiting wait_host leaves within 50 ms
        GilReleased unlocked;
        Semaphore gone;
        {
          std::unique_lock<std::shared_mutex> lock(*s.mutex);
          gone = std::move(s.sem);
        }
      });
}

}  // namespace gpuipc::py
