// gpuipc._gpuipc.CountingSemaphore: gpuipc::CountingSemaphore with interruptible waits (Ctrl-C leaves the queue).
// python/gpuipc/counting_semaphore.py wraps it.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <atomic>
#include <mutex>
#include <shared_mutex>

#include "common.hpp"
#include "gpuipc/counting_semaphore.hpp"

namespace gpuipc::py {

using namespace nb::literals;

namespace {

/// Calls may come from several Python threads (acquires run without the GIL): they share the lock; close takes
/// it alone, so the semaphore is never destroyed under a waiter. close first sets `closing`, which waiting acquires
/// look at every 50 ms: they leave the queue and raise Closed, so close does not wait for them for ever.
struct PyCountingSemaphore {
  explicit PyCountingSemaphore(CountingSemaphore s) noexcept : sem(std::move(s)) {}
  PyCountingSemaphore(PyCountingSemaphore&&) noexcept = default;
  PyCountingSemaphore& operator=(PyCountingSemaphore&&) noexcept = default;
  ~PyCountingSemaphore() { drop_without_gil(sem); }  // a handle Python frees without close() (common.hpp)
  std::unique_ptr<std::shared_mutex> mutex = std::make_unique<std::shared_mutex>();
  std::unique_ptr<std::atomic<bool>> closing = std::make_unique<std::atomic<bool>>(false);
  CountingSemaphore sem;
  LiveCount<Live::CountingSemaphore> counted;
};

std::shared_lock<std::shared_mutex> lock_shared(PyCountingSemaphore& s, bool require_open = true) {
  std::shared_lock<std::shared_mutex> lock(*s.mutex, std::defer_lock);
  {
    GilReleased unlocked;
    lock.lock();
  }
  if (require_open && !s.sem) raise_closed("counting semaphore");
  return lock;
}

/// What an acquire's interruption check looks at: the handle being closed by another thread, then Python's signal
/// handlers.
struct Interruption {
  const std::atomic<bool>* closing = nullptr;
  bool closed = false;  ///< why it was interrupted: a close (else a signal handler raised, its exception is set)
};

/// Called without the GIL between sleeps of an acquire: true when another thread closes the handle, or when a
/// signal handler (run here, with the GIL) raised, leaving its exception set. The acquire then returns Interrupted.
bool interrupted(void* context) {
  auto* why = static_cast<Interruption*>(context);
  if (why->closing->load(std::memory_order_acquire)) {
    why->closed = true;
    return true;
  }
  if (must_not_take_the_gil()) park_until_exit();
  nb::gil_scoped_acquire held;
  return PyErr_CheckSignals() != 0;
}

}  // namespace

void bind_counting_semaphore(nb::module_& m) {
  nb::class_<PyCountingSemaphore>(m, "CountingSemaphore",
                                  "A named counting semaphore (low level; see gpuipc.CountingSemaphore).")
      .def_static(
          "create",
          [](std::string_view name, std::uint32_t initial, std::uint32_t max_count, unsigned mode) {
            CountingSemaphoreOptions o{.initial = initial, .max_count = max_count, .mode = mode};
            GilReleased unlocked;
            return PyCountingSemaphore(CountingSemaphore::create(name, o));
          },
          "name"_a, nb::kw_only(), "initial"_a, "max_count"_a, "mode"_a = 0600)
      .def_static(
          "open",
          [](std::string_view name, std::optional<double> wait) {
            return open_in_slices(wait, "counting semaphore '" + std::string(name) + "'",
                                  [&](std::chrono::milliseconds slice) {
                                    return PyCountingSemaphore(CountingSemaphore::open(name, {.wait = slice}));
                                  });
          },
          "name"_a, nb::kw_only(), "wait"_a = nb::none())
      .def_static(
          "unlink",
          [](std::string_view name) {
            GilReleased unlocked;
            CountingSemaphore::unlink(name);
          },
          "name"_a)
      .def_static(
          "stat",
          [](std::string_view name) {
            CountingSemaphoreStats st;
            {
              GilReleased unlocked;
              st = CountingSemaphore::stat(name);
            }
            nb::dict d;
            d["available"] = st.available;
            d["max_count"] = st.max_count;
            d["held"] = st.held;
            d["holders"] = st.holders;
            d["waiting"] = st.waiting;
            return d;
          },
          "name"_a)
      .def(
          "acquire",
          [](PyCountingSemaphore& s, std::uint32_t n, std::optional<double> timeout) {
            auto lock = lock_shared(s);
            const auto limit = to_timeout(timeout, "timeout");
            Status st;
            Interruption why{s.closing.get()};
            {
              GilReleased unlocked;
              st = s.sem.acquire(n, limit, interrupted, &why);
            }
            if (st == Status::Interrupted) {
              if (why.closed) raise_closed("counting semaphore");
              throw nb::python_error();
            }
            return st == Status::Ok;
          },
          "n"_a, "timeout"_a = nb::none(),
          "Takes n permits; False when the timeout passed (0: only try). Raises InvalidArgument for n > max_count.")
      .def(
          "release",
          [](PyCountingSemaphore& s, std::uint32_t n) {
            auto lock = lock_shared(s);
            GilReleased unlocked;
            s.sem.release(n);
          },
          "n"_a)
      .def_prop_ro("held",
                   [](PyCountingSemaphore& s) {
                     auto lock = lock_shared(s);
                     return s.sem.held();
                   })
      .def_prop_ro("available",
                   [](PyCountingSemaphore& s) {
                     auto lock = lock_shared(s);
                     return s.sem.available();
                   })
      .def_prop_ro("waiting",
                   [](PyCountingSemaphore& s) {
                     auto lock = lock_shared(s);
                     return s.sem.waiting();
                   })
      .def_prop_ro("max_count",
                   [](PyCountingSemaphore& s) {
                     auto lock = lock_shared(s);
                     return s.sem.max_count();
                   })
      .def_prop_ro("name",
                   [](PyCountingSemaphore& s) {
                     auto lock = lock_shared(s);
                     return s.sem.name();
                   })
      .def_prop_ro("closed",
                   [](PyCountingSemaphore& s) {
                     auto lock = lock_shared(s, false);
                     return !s.sem;
                   })
      .def("close", [](PyCountingSemaphore& s) {
        s.closing->store(true, std::memory_order_release);  // waiting acquires leave within 50 ms
        GilReleased unlocked;
        CountingSemaphore gone;
        {
          std::unique_lock<std::shared_mutex> lock(*s.mutex);
          gone = std::move(s.sem);
        }
      });
}

}  // namespace gpuipc::py
