// One translation point from C++ errors to the gpuipc.Error hierarchy (python/gpuipc/errors.py): gpuipc::Error by
// its ErrorCode, StatusError by its Status. The classes live in Python (they inherit from builtin exceptions such
// as PermissionError); the translator looks them up by name.
#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>

#include "common.hpp"

namespace gpuipc::py {

using namespace nb::literals;

namespace {

/// The gpuipc.errors class name for a Status.
const char* status_class(Status status) noexcept {
  switch (status) {
    case Status::Timeout: return "Timeout";
    case Status::PeerDied: return "PeerDied";
    case Status::Interrupted: return "Interrupted";
    case Status::Closed: return "Closed";
    case Status::InvalidState: return "InvalidState";
    case Status::DriverError: return "CudaError";
    case Status::WouldBlock: return "WouldBlock";
    case Status::Ok: break;
  }
  return "Error";
}

/// Raises gpuipc.errors.<name>(message, code=..., call=..., errno=..., cu_result=...). Falls back to RuntimeError
/// when the Python package is not importable (the extension loaded on its own).
void raise(const char* class_name, const std::string& code, const char* message, const std::string& call,
           int sys_errno, int cu_result) noexcept {
  try {
    nb::object errors = nb::module_::import_("gpuipc.errors");
    nb::object cls = errors.attr("_class_for")(class_name);
    // A message may hold bytes that are not UTF-8 (a path from the environment): shown escaped, not lost to a
    // UnicodeDecodeError in place of the gpuipc error.
    nb::object text =
        nb::steal(PyUnicode_DecodeUTF8(message, static_cast<Py_ssize_t>(std::strlen(message)), "backslashreplace"));
    if (!text.is_valid()) throw nb::python_error();
    nb::object exc = cls(text, "code"_a = code, "call"_a = call, "errno"_a = sys_errno, "cu_result"_a = cu_result);
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (nb::python_error& e) {
    e.restore();
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_RuntimeError, "%s (gpuipc could not raise gpuipc.%s: %s)", message, class_name, e.what());
  }
}

}  // namespace

void raise_closed(const char* what) {
  throw StatusError(Status::Closed,
                    fmt::format("{}: this handle was closed (close() or with); open it again to use it", what));
}

void check_status(Status status, std::string_view what) {
  const char* why = "";
  switch (status) {
    case Status::Ok: return;
    case Status::Timeout: why = "timed out"; break;
    case Status::WouldBlock: why = "nothing is ready (timeout=0)"; break;
    case Status::PeerDied: why = "the other side is gone (it exited or crashed without closing)"; break;
    case Status::Closed: why = "the other side closed it"; break;
    case Status::Interrupted: why = "interrupted by a signal"; break;
    case Status::InvalidState:
      why = "not allowed here (wrong role, nothing held, too big, a host-kind object, or a handle this process got "
            "from its parent at fork: open it again here)";
      break;
    case Status::DriverError: why = "the CUDA driver refused the stream operation (bad stream, wrong context, no driver)"; break;
  }
  throw StatusError(status, fmt::format("{}: {}", what, why));
}

SegmentKind parse_kind(std::string_view kind) {
  if (kind == "host") return SegmentKind::Host;
  if (kind == "device") return SegmentKind::Device;
  if (kind == "host_pinned") return SegmentKind::HostPinned;
  throw Error(ErrorCode::InvalidArgument,
              "kind must be 'host', 'device' or 'host_pinned', not '" + std::string(kind) + "'", "kind");
}

std::chrono::nanoseconds to_timeout(std::optional<double> seconds, std::string_view what) {
  if (!seconds) return std::chrono::nanoseconds(-1);
  if (std::isnan(*seconds) || *seconds < 0) {
    // (For an open's `wait`, None is "do not wait"; for a timeout it is "wait for ever".)
    throw Error(ErrorCode::InvalidArgument,
                std::string(what) + (what == "wait" ? " must be None (do not wait)" : " must be None (wait forever)") +
                    " or a number of seconds >= 0",
                std::string(what));
  }
  if (std::isinf(*seconds) || *seconds > 1e9) return std::chrono::nanoseconds(-1);
  // A timeout under a nanosecond is still one (Timeout when it passes): only 0 means "only look" (WouldBlock).
  if (*seconds > 0)
    return std::max(std::chrono::nanoseconds(1), std::chrono::nanoseconds(static_cast<std::int64_t>(*seconds * 1e9)));
  return std::chrono::nanoseconds(0);
}

void check_signals() {
  if (PyErr_CheckSignals() != 0) throw nb::python_error();
}

namespace {
std::atomic<bool> g_exiting{false};
std::atomic<std::thread::id> g_exiting_thread{};  // the thread that runs the exit (Py_FinalizeEx): it goes on
}  // namespace

void mark_interpreter_exiting() noexcept {
  g_exiting_thread.store(std::this_thread::get_id(), std::memory_order_relaxed);
  g_exiting.store(true, std::memory_order_release);
}

bool must_not_take_the_gil() noexcept {
  return g_exiting.load(std::memory_order_acquire) &&
         std::this_thread::get_id() != g_exiting_thread.load(std::memory_order_relaxed);
}

void park_until_exit() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
}

void register_errors(nb::module_& /*m*/) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      const std::string_view code = to_string(e.code());
      const char* cls = e.code() == ErrorCode::Cuda     ? "CudaError"
                        : e.code() == ErrorCode::System ? "SystemCallError"
                        : e.code() == ErrorCode::Protocol ? "ProtocolError"
                                                          : nullptr;
      const std::string name = cls != nullptr ? std::string(cls) : std::string(code);
      raise(name.c_str(), std::string(code), e.what(), e.call(), e.sys_errno(), e.cu_result());
    } catch (const StatusError& e) {
      raise(status_class(e.status()), std::string(to_string(e.status())), e.what(), {}, 0, 0);
    }
  });
}

}  // namespace gpuipc::py
