// gpuipc doctor: what gpuipc can use on this machine (driver, GPUs and their capabilities, peer access, MPS, the
// runtime directory), with one line of advice for everything missing. Keys and exit codes: docs/cli/doctor.md.
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "commands.hpp"
#include "gpuipc/broker.hpp"
#include "gpuipc/device.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/format.hpp"

namespace gpuipc::cli {
namespace {

// Version of the JSON layout: bumped when a key changes meaning or goes; new keys do not bump it.
constexpr int kJsonSchema = 1;

struct DeviceReport {
  DeviceInfo info;
  std::optional<std::string> error;  ///< query_device failed
};

struct MpsReport {
  bool active = false;
  std::string method;  ///< "device_attribute" or "control_pipe"
  std::string detail;
  std::optional<bool> attribute;  ///< CU_DEVICE_ATTRIBUTE_MPS_ENABLED of any device, when the driver answers
  std::string control_pipe;
  bool control_pipe_exists = false;
};

struct RuntimeDirReport {
  std::string path;
  bool usable = false;
  std::optional<std::string> error;
};

struct Report {
  int exit_code = kExitOk;
  std::optional<std::string> error;  ///< no driver / no device
  bool driver_loaded = false;
  int driver_version = 0;
  std::string driver_library;
  std::vector<DeviceReport> devices;
  std::vector<std::vector<bool>> peer_access;
  Topology topology;                          ///< links between every ordered pair of GPUs (2 GPUs or more)
  std::optional<std::string> topology_error;  ///< the topology query failed
  MpsReport mps;
  RuntimeDirReport runtime_dir;
  std::vector<std::string> problems;  ///< something gpuipc needs is missing (exit code 1)
  std::vector<std::string> advice;    ///< one line per missing capability, needed or not
};


const char* yes_no(bool b) { return b ? "yes" : "no"; }

RuntimeDirReport check_runtime_dir() {
  RuntimeDirReport r;
  try {
    r.path = runtime_dir();
    ensure_runtime_dir();  // as the library makes it before it starts a broker
    // Writable for us: create and remove a probe file (the broker puts its socket and lock file here).
    std::random_device rd;
    const std::filesystem::path probe =
        std::filesystem::path(r.path) / fmt::format(".gpuipc-doctor-probe-{:08x}", rd());
    {
      std::ofstream out(probe);
      out << "probe\n";
      out.flush();
      if (!out) {
        r.error =
            fmt::format("cannot create a file in {}: check its owner and mode, or set GPUIPC_RUNTIME_DIR", r.path);
        return r;
      }
    }
    std::error_code ec;
    std::filesystem::remove(probe, ec);
    r.usable = true;
  } catch (const std::exception& e) {
    r.error = e.what();
    if (r.path.empty()) {
      // runtime_dir() refused the setting itself (a relative GPUIPC_RUNTIME_DIR): show the path as given.
      const char* given = std::getenv("GPUIPC_RUNTIME_DIR");  // NOLINT(concurrency-mt-unsafe): single-threaded CLI
      if (given != nullptr) r.path = given;
    }
  }
  return r;
}

void check_mps_pipe(MpsReport& mps) {
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");  // NOLINT(concurrency-mt-unsafe): single-threaded CLI
  mps.control_pipe = (dir != nullptr && *dir != '\0' ? std::string(dir) : std::string("/tmp/nvidia-mps")) + "/control";
  std::error_code ec;
  mps.control_pipe_exists = std::filesystem::exists(mps.control_pipe, ec);
}

void decide_mps(Report& r) {
  check_mps_pipe(r.mps);
  for (const auto& d : r.devices) {
    if (d.error || !d.info.mps_known) continue;
    r.mps.attribute = r.mps.attribute.value_or(false) || d.info.mps_enabled;
  }
  if (r.mps.attribute) {
    r.mps.active = *r.mps.attribute;
    r.mps.method = "device_attribute";
    r.mps.detail =
        fmt::format("CU_DEVICE_ATTRIBUTE_MPS_ENABLED is {} (control pipe {} {})", *r.mps.attribute ? "set" : "not set",
                    r.mps.control_pipe, r.mps.control_pipe_exists ? "exists" : "absent");
  } else {
    r.mps.active = r.mps.control_pipe_exists;
    r.mps.method = "control_pipe";
    r.mps.detail = r.mps.control_pipe_exists
                       ? fmt::format("an MPS control daemon pipe exists at {}", r.mps.control_pipe)
                       : fmt::format("no MPS control daemon pipe at {}", r.mps.control_pipe);
  }
}

bool device_segments_ok(const DeviceInfo& i) { return i.vmm && i.posix_fd_handles; }
bool host_pinned_ok(const DeviceInfo& i) { return i.host_register; }
bool semaphores_ok(const DeviceInfo& i) { return i.host_register && i.stream_mem_ops_64; }

/// The runtime directory's problem, which host segments have too: judged with or without a driver.
void judge_runtime_dir(Report& r) {
  if (!r.runtime_dir.usable) {
    r.problems.push_back(fmt::format("runtime directory {} is not usable: {}", r.runtime_dir.path,
                                     r.runtime_dir.error.value_or("unknown error")));
    r.advice.push_back(
        "the broker needs a private writable runtime directory: fix the one above or point GPUIPC_RUNTIME_DIR "
        "elsewhere");
  }
}

void judge(Report& r) {
  judge_runtime_dir(r);
  for (const auto& d : r.devices) {
    const int n = d.info.ordinal;
    if (d.error) {
      r.problems.push_back(fmt::format("GPU {}: {}", n, *d.error));
      continue;
    }
    const auto& i = d.info;
    if (!device_segments_ok(i)) {
      r.problems.push_back(
          fmt::format("GPU {}: no {}", n, !i.vmm ? "virtual memory management (VMM)" : "POSIX fd handles"));
      r.advice.push_back(fmt::format("GPU {}: no VMM/POSIX fd: device segments unavailable, use host_pinned", n));
    }
    if (!i.host_register) {
      r.problems.push_back(fmt::format("GPU {}: cannot register host memory", n));
      r.advice.push_back(fmt::format(
          "GPU {}: no host memory registration: host_pinned segments and semaphores unavailable, use host segments",
          n));
    } else if (!i.stream_mem_ops_64) {
      r.problems.push_back(fmt::format("GPU {}: no 64-bit stream memory operations", n));
      r.advice.push_back(fmt::format(
          "GPU {}: no 64-bit stream memory operations: stream-ordered semaphores and channels unavailable", n));
    }
    if (!i.memory_pool_ipc) {
      r.advice.push_back(
          fmt::format("GPU {}: no memory-pool IPC: shareable pools (variable-size channel payloads) unavailable", n));
    }
    if (!i.legacy_ipc) {
      r.advice.push_back(fmt::format(
          "GPU {}: no legacy IPC: existing cudaMalloc buffers (PyTorch, CuPy) cannot be shared as legacy imports", n));
    }
    if (!i.read_only_host_register) {
      r.advice.push_back(fmt::format(
          "GPU {}: no read-only host registration: read-only host_pinned opens are not enforced on the GPU side", n));
    }
    if (!i.fabric_handles) {
      r.advice.push_back(fmt::format(
          "GPU {}: no fabric handles: sharing beyond this machine (multi-node NVLink) unavailable; nothing on one "
          "machine needs them",
          n));
    }
  }
  for (std::size_t a = 0; a < r.peer_access.size(); ++a) {
    for (std::size_t b = 0; b < r.peer_access[a].size(); ++b) {
      if (!r.peer_access[a][b]) {
        r.advice.push_back(fmt::format(
            "GPU {} cannot access GPU {}'s memory (no peer access): open GPU {}'s device segments from GPU {} only", a,
            b, b, b));
      }
    }
  }
  for (const auto& l : r.topology.links) {
    if (l.peer_access && l.mapping_tried && !l.mapping_works) {
      r.advice.push_back(fmt::format(
          "GPU {} has peer access to GPU {} but mapping its memory failed ({}): device segments of GPU {} cannot be "
          "opened from GPU {}",
          l.from, l.to, l.mapping_error, l.to, l.from));
    } else if (l.peer_access && l.link == "pcie" && l.from < l.to) {
      r.advice.push_back(fmt::format(
          "GPUs {} and {} are joined by PCIe, not NVLink: reading a segment of one from the other runs at PCIe "
          "speed",
          l.from, l.to));
    }
  }
  if (!r.mps.active) {
    r.advice.push_back(
        "without MPS, kernels of different processes take turns on a GPU: a semaphore round trip takes 12 us (~6 us "
        "under MPS) and a pipeline of processes keeps a fraction of one process's frame rate (each switch between "
        "their contexts idles the GPU 150-240 us; rings of 64 slots or more amortise it: docs/channels.md#without-mps); "
        "`eval \"$(gpuipc mps start)\"` runs a private MPS control daemon for your processes (docs/mps.md)");
  }
  if (!r.problems.empty()) r.exit_code = kExitFailure;
}

Report examine() {
  Report r;
  r.runtime_dir = check_runtime_dir();
  try {
    const DriverInfo driver = driver_info();
    r.driver_loaded = true;
    r.driver_version = driver.version;
    r.driver_library = driver.library;
  } catch (const Error& e) {
    r.error = e.what();
    r.exit_code = e.code() == ErrorCode::NoDevice ? kExitNoDevice : kExitNoDriver;
    decide_mps(r);
    judge_runtime_dir(r);
    return r;
  }
  try {
    const int count = device_count();
    if (count == 0) {
      r.error =
          "the CUDA driver reports no GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES; host segments work "
          "without a GPU";
      r.exit_code = kExitNoDevice;
      decide_mps(r);
      judge_runtime_dir(r);
      return r;
    }
    for (int i = 0; i < count; ++i) {
      DeviceReport d;
      d.info.ordinal = i;
      try {
        d.info = device_info(i, true);
      } catch (const std::exception& e) {
        d.error = e.what();
      }
      r.devices.push_back(std::move(d));
    }
    r.peer_access = peer_access_matrix();
    try {
      r.topology = topology(true);
    } catch (const std::exception& e) {
      r.topology_error = e.what();
    }
  } catch (const std::exception& e) {
    r.problems.push_back(e.what());
  }
  decide_mps(r);
  judge(r);
  return r;
}

template <typename T>
nlohmann::json optional_json(const std::optional<T>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}

nlohmann::json to_json(const Report& r) {
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& d : r.devices) {
    const auto& i = d.info;
    devices.push_back({
        {"ordinal", i.ordinal},
        {"error", optional_json(d.error)},
        {"name", i.name},
        {"uuid", i.uuid_string},
        {"pci_bus_id", i.pci_bus_id},
        {"total_memory_bytes", i.total_memory},
        {"free_memory_bytes", i.free_memory},
        {"compute_capability", fmt::format("{}.{}", i.cc_major, i.cc_minor)},
        {"sm_count", i.sm_count},
        {"vmm", i.vmm},
        {"posix_fd_handles", i.posix_fd_handles},
        {"fabric_handles", i.fabric_handles},
        {"memory_pools", i.memory_pools},
        {"memory_pool_ipc", i.memory_pool_ipc},
        {"stream_mem_ops_64", i.stream_mem_ops_64},
        {"legacy_ipc", i.legacy_ipc},
        {"ipc_events", i.ipc_events},
        {"host_register", i.host_register},
        {"read_only_host_register", i.read_only_host_register},
        {"unified_addressing", i.unified_addressing},
        {"mps_enabled", i.mps_known ? nlohmann::json(i.mps_enabled) : nlohmann::json(nullptr)},
        {"granularity_min_bytes", i.granularity_min},
        {"granularity_recommended_bytes", i.granularity_recommended},
        {"supports",
         {{"device_segments", !d.error && device_segments_ok(i)},
          {"host_pinned_segments", !d.error && host_pinned_ok(i)},
          {"semaphores", !d.error && semaphores_ok(i)}}},
    });
  }
  nlohmann::json driver = nullptr;
  if (r.driver_loaded) {
    driver = {{"version", r.driver_version},
              {"version_string", format_driver_version(r.driver_version)},
              {"library", r.driver_library}};
  }
  nlohmann::json peer = nlohmann::json::array();
  for (const auto& row : r.peer_access) peer.push_back(row);
  nlohmann::json links = nlohmann::json::array();
  auto uuid_of = [&](int ordinal) {
    for (const auto& d : r.devices) {
      if (d.info.ordinal == ordinal) return d.info.uuid_string;
    }
    return std::string();
  };
  for (const auto& l : r.topology.links) {
    links.push_back({
        {"from", l.from},
        {"to", l.to},
        {"from_uuid", uuid_of(l.from)},
        {"to_uuid", uuid_of(l.to)},
        {"peer_access", l.peer_access},
        {"mapping_tried", l.mapping_tried},
        {"mapping_works", l.mapping_tried ? nlohmann::json(l.mapping_works) : nlohmann::json(nullptr)},
        {"mapping_error", l.mapping_error.empty() ? nlohmann::json(nullptr) : nlohmann::json(l.mapping_error)},
        {"link", l.link},
        {"link_source", l.link_source},
        {"nvlinks", l.nvlinks >= 0 ? nlohmann::json(l.nvlinks) : nlohmann::json(nullptr)},
        {"pcie_path", l.pcie_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(l.pcie_path)},
        {"performance_rank", l.performance_rank >= 0 ? nlohmann::json(l.performance_rank) : nlohmann::json(nullptr)},
        {"native_atomics", l.native_atomics},
        {"array_access", l.array_access},
    });
  }
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");  // NOLINT(concurrency-mt-unsafe): single-threaded CLI
  const nlohmann::json topology_json = {
      {"cuda_visible_devices", visible != nullptr ? nlohmann::json(visible) : nlohmann::json(nullptr)},
      {"nvml", r.topology.nvml},
      {"nvml_error", r.topology.nvml || r.topology.nvml_error.empty() ? nlohmann::json(nullptr)
                                                                     : nlohmann::json(r.topology.nvml_error)},
      {"error", optional_json(r.topology_error)},
      {"links", links},
  };
  return {
      {"schema", kJsonSchema},
      {"exit_code", r.exit_code},
      {"ok", r.exit_code == kExitOk},
      {"error", optional_json(r.error)},
      {"driver", driver},
      {"devices", devices},
      {"peer_access", peer},
      {"topology", topology_json},
      {"mps",
       {{"active", r.mps.active},
        {"method", r.mps.method},
        {"detail", r.mps.detail},
        {"attribute", optional_json(r.mps.attribute)},
        {"control_pipe", r.mps.control_pipe},
        {"control_pipe_exists", r.mps.control_pipe_exists}}},
      {"runtime_dir",
       {{"path", r.runtime_dir.path}, {"usable", r.runtime_dir.usable}, {"error", optional_json(r.runtime_dir.error)}}},
      {"problems", r.problems},
      {"advice", r.advice},
  };
}

void print_text(const Report& r) {
  if (r.error) {
    // One line: what is missing and what still works; then what host segments lack too, if anything.
    std::cout << "gpuipc doctor: " << *r.error << "\n";
    for (const auto& p : r.problems) std::cout << "gpuipc doctor: and " << p << "\n";
    for (const auto& a : r.advice) std::cout << "  - " << a << "\n";
    return;
  }
  std::cout << fmt::format("driver:       CUDA {} ({})\n", format_driver_version(r.driver_version),
                           r.driver_library);
  for (const auto& d : r.devices) {
    const auto& i = d.info;
    if (d.error) {
      std::cout << fmt::format("GPU {}:        cannot be queried: {}\n", i.ordinal, *d.error);
      continue;
    }
    std::cout << fmt::format("GPU {}:        {}\n", i.ordinal, i.name);
    std::cout << fmt::format("  uuid:                    {}\n", i.uuid_string);
    std::cout << fmt::format("  pci bus id:              {}\n", i.pci_bus_id);
    std::cout << fmt::format("  memory:                  {} total, {} free\n", human_bytes(i.total_memory),
                             human_bytes(i.free_memory));
    std::cout << fmt::format("  compute capability:      {}.{} ({} SMs)\n", i.cc_major, i.cc_minor, i.sm_count);
    std::cout << fmt::format("  VMM:                     {} (granularity {}, recommended {})\n", yes_no(i.vmm),
                             human_bytes(i.granularity_min), human_bytes(i.granularity_recommended));
    std::cout << fmt::format("  POSIX fd handles:        {}\n", yes_no(i.posix_fd_handles));
    std::cout << fmt::format("  fabric handles:          {}\n", yes_no(i.fabric_handles));
    std::cout << fmt::format("  memory-pool IPC:         {} (memory pools: {})\n", yes_no(i.memory_pool_ipc),
                             yes_no(i.memory_pools));
    std::cout << fmt::format("  64-bit stream memops:    {}\n", yes_no(i.stream_mem_ops_64));
    std::cout << fmt::format("  legacy IPC:              {} (IPC events: {})\n", yes_no(i.legacy_ipc),
                             yes_no(i.ipc_events));
    std::cout << fmt::format("  host registration:       {} (read-only: {})\n", yes_no(i.host_register),
                             yes_no(i.read_only_host_register));
    std::cout << fmt::format("  gpuipc here:             device segments {}, host_pinned segments {}, semaphores {}\n",
                             yes_no(device_segments_ok(i)), yes_no(host_pinned_ok(i)), yes_no(semaphores_ok(i)));
  }
  if (r.peer_access.size() > 1) {
    std::cout << "peer access (row can access column):\n      ";
    for (std::size_t j = 0; j < r.peer_access.size(); ++j) std::cout << fmt::format(" GPU{:<2}", j);
    std::cout << "\n";
    for (std::size_t i = 0; i < r.peer_access.size(); ++i) {
      std::cout << fmt::format("  GPU{:<2}", i);
      for (std::size_t j = 0; j < r.peer_access[i].size(); ++j) {
        std::cout << fmt::format(" {:<5}", i == j ? "-" : yes_no(r.peer_access[i][j]));
      }
      std::cout << "\n";
    }
  }
  if (!r.topology.links.empty() || r.topology_error) {
    std::cout << fmt::format("topology:     {}\n",
                             r.topology_error ? "cannot be queried: " + *r.topology_error
                             : r.topology.nvml ? std::string("links from the driver and NVML")
                                               : "links from the driver only (NVML: " + r.topology.nvml_error + ")");
    for (const auto& l : r.topology.links) {
      std::string how = l.link == "nvlink" ? "NVLink" : l.link == "pcie" ? "PCIe" : "link unknown";
      if (l.nvlinks > 0) how += fmt::format(" x{}", l.nvlinks);
      if (!l.pcie_path.empty() && l.link != "nvlink") how += fmt::format(" ({})", l.pcie_path);
      if (l.link_source == "cuda") how += " (inferred from peer atomics)";
      std::string mapping = !l.peer_access ? "no peer access"
                            : !l.mapping_tried ? "peer access"
                            : l.mapping_works ? "peer mapping works"
                                              : "peer mapping FAILS: " + l.mapping_error;
      std::cout << fmt::format("  GPU{} -> GPU{}:  {}; {}; performance rank {}, native atomics {}\n", l.from, l.to,
                               how, mapping, l.performance_rank, yes_no(l.native_atomics));
    }
  }
  std::cout << fmt::format("MPS:          {} ({})\n", r.mps.active ? "active" : "not active", r.mps.detail);
  std::cout << fmt::format("runtime dir:  {} ({})\n", r.runtime_dir.path,
                           r.runtime_dir.usable ? "usable" : r.runtime_dir.error.value_or("not usable"));
  if (!r.advice.empty()) {
    std::cout << "advice:\n";
    for (const auto& a : r.advice) std::cout << "  - " << a << "\n";
  }
  if (r.problems.empty()) {
    std::cout << "result:       OK: everything gpuipc needs works\n";
  } else {
    std::cout << "result:       PROBLEMS:\n";
    for (const auto& p : r.problems) std::cout << "  - " << p << "\n";
  }
}

}  // namespace

void register_doctor(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "doctor",
      "check what gpuipc can use here: CUDA driver, GPUs and their capabilities, peer access, MPS, runtime dir");
  static bool json = false;
  cmd->add_flag("--json", json, "print one JSON object instead of text (keys: docs/cli/doctor.md)");
  cmd->callback([&exit_code] {
    const Report report = examine();
    if (json) {
      std::cout << json_text(to_json(report), 2) << "\n";
    } else {
      print_text(report);
    }
    exit_code = report.exit_code;
  });
}

}  // namespace gpuipc::cli
