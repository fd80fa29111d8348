// `gpuipc bench vmm`: does CUDA IPC work with VMM (cuMem*) memory?
//   (i)   The legacy way does not: cuIpcGetMemHandle on memory from cuMemCreate + cuMemMap fails; the exact CUresult
//         is recorded (and, should a driver ever accept it, the importer tries to open the handle).
//   (ii)  gpuipc's way does: A creates a device segment (cuMemCreate, exported once as a POSIX fd) and fills it with
//         a pattern; B opens it by name, verifies the pattern, writes another; A verifies B's pattern.
//   (iii) What each VMM step costs, over sizes: create (cuMemCreate) and export (cuMemExportToShareableHandle) in
//         A; import (cuMemImportFromShareableHandle), reserve (cuMemAddressReserve), map (cuMemMap), set access
//         (cuMemSetAccess), unmap (cuMemUnmap) and release (cuMemAddressFree + cuMemRelease) in B, which receives
//         the fds over a socket.
// The CLI process never touches CUDA: A and B are forked workers joined by a socketpair; A drives, B answers.
// At most 4 GiB of allocations exist at once (plus a 64 MiB segment). Every wait is bounded.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bench.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/legacy_ipc.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "os/fd.hpp"
#include "os/socket.hpp"
#include "pair.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/kernels/kernels.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using json = nlohmann::json;

constexpr int kDevice = 0;

// Two workers and the socket between them: bench/harness/pair.hpp.
using namespace pair;  // NOLINT(google-build-using-namespace): Link, Gpu, kKiB, kMiB, kGiB, size_label, to_hex
const SuitePair kPair{"vmm"};

// ---------------------------------------------------------------------------------------------------------------
// The measurement.

/// Most bytes of exported allocations alive at once (A holds them; B maps the same memory).
constexpr std::size_t kBatchBytes = 4 * kGiB;
/// The segment of part (ii).
constexpr std::size_t kCheckBytes = 64 * kMiB;
/// Longest A waits for one answer of B (the slowest: a batch of 4 GiB imports).
constexpr int kReplyTimeoutMs = 120'000;

/// A's steps and B's steps, in the order they happen.
constexpr std::array<const char*, 2> kExportSteps{"create", "export"};
constexpr std::array<const char*, 7> kImportSteps{"import", "reserve", "map", "set_access", "unmap", "free_va", "release"};

struct SizeCase {
  std::size_t bytes;
  int reps;
};

double us_between(std::int64_t t0, std::int64_t t1) { return static_cast<double>(t1 - t0) / 1e3; }

json values_json(const std::vector<double>& v) {
  json a = json::array();
  for (double x : v) a.push_back(std::round(x * 1e3) / 1e3);
  return a;
}

std::vector<double> values_of(const json& j, const char* key) {
  std::vector<double> v;
  for (const auto& x : j.at(key)) v.push_back(x.get<double>());
  return v;
}

/// What a failed driver call said, as data: the message, the CUresult number and name.
json error_json(const Error& e) {
  json j{{"ok", false},
         {"error", e.what()},
         {"code", std::string(to_string(e.code()))},
         {"call", e.call()},
         {"cu_result", e.cu_result()}};
  j["cu_result_name"] = e.cu_result() != 0 ? cuda::result_name(static_cast<CUresult>(e.cu_result())) : std::string();
  return j;
}

/// cuIpcGetMemHandle on `ptr`: {"ok": true, "handle": hex} or error_json.
json try_legacy_handle(CUdeviceptr ptr) {
  try {
    const CUipcMemHandle h = cuda::ipc_get_mem_handle(ptr);
    return {{"ok", true}, {"handle", to_hex(&h, sizeof h)}};
  } catch (const Error& e) {
    return error_json(e);
  }
}

/// Worker B's answer to one command of A.
json importer_command(Gpu& g, const std::string& cmd, const json& in, std::vector<os::UniqueFd>& fds) {
  if (cmd == "legacy_open") {
    // Only reached if a driver ever hands out a legacy handle for cuMem memory: does it open?
    CUipcMemHandle h{};
    kPair.from_hex(in.at("handle").get<std::string>(), &h, sizeof h);
    try {
      auto mapping = cuda::IpcMapping::open(h);
      return {{"ok", true}, {"opened", mapping.get() != 0}};
    } catch (const Error& e) {
      return error_json(e);
    }
  }
  if (cmd == "verify") {
    const auto name = in.at("name").get<std::string>();
    Segment seg = Segment::open(name);
    if (!seg || seg.kind() != SegmentKind::Device || seg.device_pointer() == 0 ||
        seg.size() != in.at("size").get<std::size_t>()) {
      throw Error(ErrorCode::Protocol, fmt::format("bench vmm: segment '{}' did not open as the device segment A made", name));
    }
    const std::size_t words = seg.size() / 4;
    const auto bad = g.k.count_mismatches(g.stream.get(), seg.device_pointer(), words, in.at("seed").get<std::uint64_t>());
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), words, in.at("seed2").get<std::uint64_t>());
    g.stream.synchronize();
    return {{"ok", true}, {"mismatches", bad}, {"words", words}};
  }
  if (cmd == "import") {
    const auto size = in.at("size").get<std::size_t>();
    const std::size_t granularity = cuda::allocation_granularity(kDevice, false);
    if (size == 0 || size % granularity != 0) throw Error(ErrorCode::InvalidArgument, "bench vmm: size is not a granularity multiple");
    const int devices[] = {kDevice};
    std::map<std::string, std::vector<double>> v;
    for (auto& fd : fds) {
      const auto t0 = now_ns();
      auto handle = cuda::import_fd(fd.get());
      const auto t1 = now_ns();
      auto range = cuda::reserve_va(size, granularity);
      const auto t2 = now_ns();
      auto mapping = cuda::map(range.base(), size, handle);
      const auto t3 = now_ns();
      cuda::set_access(range.base(), size, devices, false);
      const auto t4 = now_ns();
      // Untimed: the mapping is usable (a fault here would throw).
      cuda::memset_d8(range.base(), 0x5a, std::min(size, granularity));
      const auto t5 = now_ns();
      mapping = cuda::MemMapping();
      const auto t6 = now_ns();
      range = cuda::VaRange();
      const auto t7 = now_ns();
      handle = cuda::AllocationHandle();
      const auto t8 = now_ns();
      fd.reset();
      v["import"].push_back(us_between(t0, t1));
      v["reserve"].push_back(us_between(t1, t2));
      v["map"].push_back(us_between(t2, t3));
      v["set_access"].push_back(us_between(t3, t4));
      v["unmap"].push_back(us_between(t5, t6));
      v["free_va"].push_back(us_between(t6, t7));
      v["release"].push_back(us_between(t7, t8));
    }
    json r{{"ok", true}};
    for (const char* step : kImportSteps) r[step] = values_json(v[step]);
    return r;
  }
  throw Error(ErrorCode::Protocol, fmt::format("bench vmm: the importer got an unknown command '{}'", cmd));
}

/// Worker B: answers A's commands until "quit".
json importer(const Link& link) {
  Gpu g;
  try {
    for (;;) {
      std::vector<os::UniqueFd> fds;
      const json in = link.receive(kReplyTimeoutMs, &fds);
      const auto cmd = in.value("cmd", std::string());
      if (cmd == "quit") {
        link.send({{"ok", true}});
        return {{"ok", true}};
      }
      link.send(importer_command(g, cmd, in, fds));
    }
  } catch (const std::exception& e) {
    try {
      link.send({{"error", e.what()}});  // A reports it
    } catch (...) {
    }
    throw;
  }
}

/// Worker A: drives the three parts.
json exporter(const Link& link, const std::vector<SizeCase>& sizes, const std::string& segment_name,
              std::uint64_t seed) {
  Gpu g;
  const CUstream s = g.stream.get();
  const std::size_t granularity = cuda::allocation_granularity(kDevice, false);
  json out{{"granularity_bytes", granularity}};

  // (i) Legacy IPC handle of cuMem memory, mapped and usable in this process.
  {
    cuda::AllocationHandle handle = cuda::create_exportable(kDevice, granularity);
    cuda::VaRange range = cuda::reserve_va(granularity, granularity);
    cuda::MemMapping mapping = cuda::map(range.base(), granularity, handle);
    const int devices[] = {kDevice};
    cuda::set_access(range.base(), granularity, devices, false);
    cuda::memset_d8(range.base(), 0xa5, granularity);  // CUDA itself uses the mapping
    json legacy = try_legacy_handle(range.base());
    legacy["bytes"] = granularity;
    if (legacy.value("ok", false)) {
      link.send({{"cmd", "legacy_open"}, {"handle", legacy["handle"]}});
      legacy["importer"] = link.receive(kReplyTimeoutMs);
    }
    out["legacy_on_vmm"] = legacy;
  }  // unmapped, range freed, released (reverse order of declaration)

  // (ii) gpuipc's fd path, both ways.
  {
    Segment seg = Segment::create(segment_name, kCheckBytes, {.kind = SegmentKind::Device, .device = kDevice, .mode = 0600});
    const std::size_t words = seg.size() / 4;
    g.k.fill_pattern(s, seg.device_pointer(), words, seed);
    g.stream.synchronize();
    json legacy = try_legacy_handle(seg.device_pointer());
    legacy.erase("handle");
    out["legacy_on_segment"] = legacy;
    const std::uint64_t seed2 = (seed * 0x9E3779B97F4A7C15ULL) ^ 0x5bd1e995ULL;
    link.send({{"cmd", "verify"}, {"name", segment_name}, {"seed", seed}, {"seed2", seed2}, {"size", seg.size()}});
    const json r = link.receive(kReplyTimeoutMs);
    const auto back = g.k.count_mismatches(s, seg.device_pointer(), words, seed2);
    Segment::unlink(segment_name);
    out["segment_check"] = {{"size_bytes", seg.size()},
                            {"words", words},
                            {"b_mismatches", r.at("mismatches")},
                            {"a_mismatches_after_b_wrote", back}};
  }

  // (iii) The cost of each step, fresh allocations every time, batches of at most kBatchBytes.
  json steps = json::array();
  for (const auto& sz : sizes) {
    const std::size_t size = cuda::round_up(sz.bytes, granularity);
    std::map<std::string, std::vector<double>> v;
    // One untimed batch of one first: the first allocation of a size pays one-time driver work.
    for (int done = -1; done < sz.reps;) {
      const bool warmup = done < 0;
      const std::size_t k = warmup ? 1
                                   : std::min({std::max<std::size_t>(1, kBatchBytes / size), os::kMaxFds,
                                               static_cast<std::size_t>(sz.reps - done)});
      std::map<std::string, std::vector<double>> b;
      std::vector<cuda::AllocationHandle> handles;
      std::vector<os::UniqueFd> fds;
      std::vector<int> raw;
      for (std::size_t i = 0; i < k; ++i) {
        const auto t0 = now_ns();
        handles.push_back(cuda::create_exportable(kDevice, size));
        const auto t1 = now_ns();
        fds.push_back(cuda::export_fd(handles.back()));
        const auto t2 = now_ns();
        b["create"].push_back(us_between(t0, t1));
        b["export"].push_back(us_between(t1, t2));
        raw.push_back(fds.back().get());
      }
      link.send({{"cmd", "import"}, {"size", size}}, raw);
      const json r = link.receive(kReplyTimeoutMs);
      for (const char* step : kImportSteps) {
        const auto got = values_of(r, step);
        if (got.size() != k) {
          throw Error(ErrorCode::Protocol, fmt::format("bench vmm: the importer timed {} {} steps, not {}", got.size(), step, k));
        }
        b[step] = got;
      }
      fds.clear();  // B has released its imports: this frees the batch
      handles.clear();
      if (!warmup) {
        for (const auto& [step, values] : b) v[step].insert(v[step].end(), values.begin(), values.end());
      }
      done = warmup ? 0 : done + static_cast<int>(k);
    }
    json entry{{"size_bytes", size}, {"label", size_label(size)}};
    for (const auto& [step, values] : v) entry[step] = values_json(values);
    steps.push_back(std::move(entry));
  }
  out["steps"] = std::move(steps);
  link.send({{"cmd", "quit"}});
  link.receive(10'000);
  return out;
}

Result run_vmm(const Options& options, const DeviceMeta& meta) {
  std::vector<SizeCase> sizes;
  if (options.quick) {
    sizes = {{2 * kMiB, 10}, {1 * kGiB, 5}};
  } else {
    sizes = {{2 * kMiB, 30}, {64 * kMiB, 20}, {1 * kGiB, 10}, {4 * kGiB, 6}};
  }
  const std::uint64_t seed = static_cast<std::uint64_t>(now_ns()) | 1U;
  const std::string name = fmt::format("gpuipc-bench-vmm-{}-{}", ::getpid(), now_ns() % 1'000'000);
  const auto timeout = std::chrono::seconds(options.quick ? 120 : 300);

  Result result;
  result.mps = meta.mps;
  progress(options, "vmm: legacy handles on cuMem memory, a segment across processes, the cost of each VMM step");
  std::pair<json, json> reports;
  try {
    reports = kPair.run([&](const Link& l) { return exporter(l, sizes, name, seed); },
                       [&](const Link& l) { return importer(l); }, timeout, false);
  } catch (...) {
    try {
      Segment::unlink(name);
    } catch (...) {
    }
    throw;
  }
  const json& a = reports.first;
  auto& notes = result.notes;

  // (i)
  const json& legacy = a.at("legacy_on_vmm");
  const bool legacy_ok = legacy.value("ok", false);
  result.metrics["vmm_legacy_handle_ok"] = legacy_ok ? 1 : 0;
  result.metrics["vmm_legacy_handle_cu_result"] = legacy.value("cu_result", 0);
  json s1 = legacy;
  s1["name"] = "legacy_handle_on_vmm";
  s1["what"] = "cuIpcGetMemHandle on memory from cuMemCreate + cuMemMap + cuMemSetAccess, in the process that made it";
  s1.erase("handle");
  result.samples.push_back(s1);
  if (!legacy_ok) {
    notes.push_back(fmt::format("(i) Legacy IPC does not work with VMM memory: cuIpcGetMemHandle on a mapped "
                                "cuMemCreate allocation fails with {} ({}). The driver said: {}",
                                legacy.value("cu_result_name", std::string("?")), legacy.value("cu_result", 0),
                                legacy.value("error", std::string())));
  } else {
    const json imp = legacy.value("importer", json::object());
    notes.push_back(fmt::format("(i) Unexpected: cuIpcGetMemHandle accepted cuMemCreate memory on this driver; "
                                "cuIpcOpenMemHandle in another process then {}.",
                                imp.value("ok", false) ? "succeeded"
                                                       : "failed with " + imp.value("cu_result_name", std::string("?"))));
  }
  const json& on_seg = a.at("legacy_on_segment");
  json s1b = on_seg;
  s1b["name"] = "legacy_handle_on_segment";
  s1b["what"] = "cuIpcGetMemHandle on the device pointer of a gpuipc device segment (cuMem memory too)";
  result.samples.push_back(s1b);
  notes.push_back(fmt::format("cuIpcGetMemHandle on a gpuipc device segment's pointer: {}.",
                              on_seg.value("ok", false) ? std::string("accepted")
                                                        : "fails with " + on_seg.value("cu_result_name", std::string("?"))));

  // (ii)
  const json& check = a.at("segment_check");
  const auto b_bad = check.at("b_mismatches").get<std::uint64_t>();
  const auto a_bad = check.at("a_mismatches_after_b_wrote").get<std::uint64_t>();
  result.metrics["vmm_segment_mismatches"] = b_bad + a_bad;
  json s2 = check;
  s2["name"] = "segment_fd_path";
  s2["ok"] = b_bad == 0 && a_bad == 0;
  s2["what"] = "A creates a device segment (cuMemCreate, exported once as a POSIX fd) and writes a pattern; B opens "
               "it by name, verifies it, writes another; A verifies B's";
  result.samples.push_back(s2);
  notes.push_back(fmt::format(
      "(ii) gpuipc's path {}: A created a {} MiB device segment (cuMemCreate memory exported as a POSIX fd) and wrote "
      "a pattern; B opened it by name and found {} of {} words wrong; B wrote another pattern and A found {} wrong.",
      b_bad == 0 && a_bad == 0 ? "works" : "FAILS", check.at("size_bytes").get<std::size_t>() / kMiB, b_bad,
      check.at("words").get<std::uint64_t>(), a_bad));

  // (iii)
  for (const auto& entry : a.at("steps")) {
    const auto label = entry.at("label").get<std::string>();
    const auto bytes = entry.at("size_bytes").get<std::size_t>();
    std::map<std::string, double> m;
    auto add = [&](const char* step) {
      const auto v = values_of(entry, step);
      const auto sum = summarize(v);
      m[step] = sum.median;
      result.metrics[fmt::format("vmm_{}_us_{}", step, label)] = sum.median;
      json smp{{"name", "vmm_step_us"}, {"step", step}, {"size_bytes", bytes}, {"label", label}, {"unit", "us"}};
      smp.update(to_json(sum));
      smp["values"] = values_json(v);
      result.samples.push_back(std::move(smp));
    };
    for (const char* step : kExportSteps) add(step);
    for (const char* step : kImportSteps) add(step);
    const double open = m["import"] + m["reserve"] + m["map"] + m["set_access"];
    result.metrics[fmt::format("vmm_open_total_us_{}", label)] = open;
    const char* biggest = "import";
    for (const char* step : {"reserve", "map", "set_access"}) {
      if (m[step] > m[biggest]) biggest = step;
    }
    notes.push_back(fmt::format(
        "(iii) {} (median of {}): exporter: create {:.1f} us, export {:.1f} us; importer: import {:.1f} + reserve {:.1f} "
        "+ map {:.1f} + set access {:.1f} = {:.1f} us ({} dominates); teardown: unmap {:.1f}, free VA {:.1f}, release "
        "{:.1f} us.",
        label, values_of(entry, "create").size(), m["create"], m["export"], m["import"], m["reserve"], m["map"],
        m["set_access"], open, biggest, m["unmap"], m["free_va"], m["release"]));
  }
  notes.push_back("Each step was timed with the host clock around one driver call, on a fresh exported allocation "
                  "per repetition; B imported fds A sent over a Unix socket. A gpuipc open pays import + map + set "
                  "access (the VA arena is reserved once per process) plus a broker round trip; see the segments suite.");
  return result;
}

}  // namespace

GPUIPC_BENCH_SUITE(Suite{
    .name = "vmm",
    .description = "IPC with VMM memory: legacy handles fail (CUresult), gpuipc fds work, cost of each cuMem step",
    .needs_gpu = true,
    .run = run_vmm,
});

}  // namespace gpuipc::bench
