// gpuipc._gpuipc: the nanobind extension under the Python package gpuipc (python/gpuipc). Low level on purpose:
// python/gpuipc/*.py turn these objects into the documented Python API (keyword options, NumPy/DLPack arrays,
// send/recv, the exception classes).
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <array>
#include <chrono>
#include <thread>

#include "gpuipc/broker.hpp"
#include "gpuipc/device.hpp"
#include "gpuipc/version.hpp"

#include "common.hpp"

namespace gpuipc::py {

std::atomic<long>& live_counter(Live kind) noexcept {
  static std::array<std::atomic<long>, static_cast<std::size_t>(Live::Count)> counters{};
  return counters[static_cast<std::size_t>(kind)];
}

}  // namespace gpuipc::py

NB_MODULE(_gpuipc, m) {
  namespace py = gpuipc::py;
  m.doc() = "gpuipc's C++ core, bound with nanobind. Use the gpuipc package, not this module.";
  py::register_errors(m);
  py::bind_views(m);
  py::bind_segment(m);
  py::bind_semaphore(m);
  py::bind_channel(m);
  py::bind_torch_allocator(m);
  py::bind_pool(m);
  py::bind_counting_semaphore(m);
  py::bind_liveness(m);
  m.def(
      "_live_objects",
      []() {
        py::nb::dict d;
        d["Segment"] = py::live_counter(py::Live::Segment).load();
        d["Semaphore"] = py::live_counter(py::Live::Semaphore).load();
        d["Channel"] = py::live_counter(py::Live::Channel).load();
        d["ArrayView"] = py::live_counter(py::Live::ArrayView).load();
        d["DLPackExport"] = py::live_counter(py::Live::DLPackExport).load();
        d["Pool"] = py::live_counter(py::Live::Pool).load();
        d["Block"] = py::live_counter(py::Live::Block).load();
        d["CountingSemaphore"] = py::live_counter(py::Live::CountingSemaphore).load();
        return d;
      },
      "Live C++ objects by kind (for leak tests).");
  m.def(
      "_doctor",
      []() {
        // What `python -m gpuipc doctor` reports (python/gpuipc/__main__.py); never starts a broker.
        py::nb::dict d;
        std::string why;
        bool driver = false;
        int devices = -1;
        std::string device_error;
        {
          py::GilReleased unlocked;
          driver = gpuipc::driver_available(&why);
          if (driver) {
            try {
              devices = gpuipc::device_count();
            } catch (const std::exception& e) {
              device_error = e.what();
            }
          }
        }
        d["driver_available"] = driver;
        d["driver_error"] = driver ? py::nb::none() : py::nb::cast(why);
        const gpuipc::DriverInfo info = driver ? gpuipc::driver_info() : gpuipc::DriverInfo{};
        d["driver_version"] = driver ? py::nb::cast(info.version) : py::nb::none();
        d["driver_library"] = driver ? py::nb::cast(info.library) : py::nb::none();
        d["device_count"] = devices >= 0 ? py::nb::cast(devices) : py::nb::none();
        d["device_error"] = device_error.empty() ? py::nb::none() : py::nb::cast(device_error);
        try {
          d["runtime_dir"] = gpuipc::runtime_dir();
          d["socket_path"] = gpuipc::socket_path();
          d["runtime_dir_error"] = py::nb::none();
        } catch (const std::exception& e) {
          d["runtime_dir"] = py::nb::none();
          d["socket_path"] = py::nb::none();
          d["runtime_dir_error"] = std::string(e.what());
        }
        {
          bool listening = false;
          {
            py::GilReleased unlocked;
            listening = gpuipc::broker_listening();
          }
          d["broker_listening"] = listening;
        }
        return d;
      },
      "Driver, runtime directory and broker socket as python -m gpuipc doctor reports them (starts nothing).");
  m.def(
      "_broker_pid",
      []() {
        py::GilReleased unlocked;
        return gpuipc::broker_info().pid;
      },
      "The broker's pid (connects, starting a broker when none runs and autostart is allowed).");
  m.def(
      "version", []() { return std::string(gpuipc::version()); },
      "The release version of the C++ library inside this module (gpuipc.__version__).");
  m.def(
      "_exiting",
      []() {
        py::mark_interpreter_exiting();
        {
          // A thread whose wait ended just before, and that waits for the GIL already, takes it now (it then parks
          // in its next wait) rather than at finalization, which would end it with pthread_exit.
          py::GilReleased unlocked;
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        // A thread parked in a call keeps that call's objects (the handle it waits on) to the end, as documented:
        // nanobind would report them at exit as leaks "likely caused by a reference counting issue".
        if (py::g_threads_without_gil.load(std::memory_order_relaxed) > 0) nanobind::set_leak_warnings(false);
      },
      "Internal: gpuipc's atexit hook. Threads waiting in gpuipc from now on park instead of taking the GIL back.");
  m.def(
      "build_commit", []() { return std::string(py::build_commit()); },
      "The git commit this module was built from, '-dirty' appended when the tree had changes; 'unknown' when it "
      "was built outside git (gpuipc.__commit__).");
  m.def(
      "protocol_version", []() { return gpuipc::protocol_version(); },
      "The broker wire protocol version this module speaks.");
  m.def(
      "device_ordinal",
      [](std::string_view uuid) {
        py::GilReleased unlocked;
        return gpuipc::device_ordinal(uuid);
      },
      py::nb::arg("uuid"),
      "The ordinal, in this process, of the GPU with this UUID (\"GPU-...\"), or -1 when this process does not see "
      "it (CUDA_VISIBLE_DEVICES). Raises InvalidArgument (malformed UUID), NoDriver.");
  m.def(
      "_daemon_path", []() { return gpuipc::daemon_path(); },
      "The gpuipcd the library would start (empty when none is found).");
}
