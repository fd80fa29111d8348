// gpuipc._gpuipc: the nanobind extension under the Python package gpuipc (python/gpuipc). Low level on purpose:
// python/gpuipc/*.py turn these objects into the documented Python API (keyword options, NumPy/DLPack arrays,
// send/recv, the exception classes).
#include <nanobind/stl/string.h>

#include <array>

#include "core/client.hpp"
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
        return d;
      },
      "Live C++ objects by kind (for leak tests).");
  m.def(
      "version", []() { return std::string(gpuipc::version()); },
      "The release version of the C++ library inside this module (gpuipc.__version__).");
  m.def(
      "protocol_version", []() { return gpuipc::protocol_version(); },
      "The broker wire protocol version this module speaks.");
  m.def(
      "_daemon_path", []() { return gpuipc::core::BrokerClient::find_daemon(); },
      "The gpuipcd the library would start (empty when none is found).");
}
