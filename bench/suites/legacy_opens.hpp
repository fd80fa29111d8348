// Legacy CUDA IPC beside gpuipc::share, as the segments and pools suites measure it: an exporter process keeps
// fresh cuMemAlloc allocations, with raw legacy IPC handles or shared under gpuipc names (device_ipc); an importer
// process times cuIpcOpenMemHandle of each handle and Segment::open of each name. One allocation per open, so no
// driver-side reuse of a mapping that is still open is counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpuipc/segment.hpp"
#include "testkit/cuda/device_memory.hpp"

namespace gpuipc::bench::legacy {

/// The exporter's side. Needs a current CUDA context; destroy it before that context goes.
class Exports {
 public:
  /// `count` fresh cuMemAlloc allocations of `size` bytes, physically touched (0xa5). Returns {"ids": [...],
  /// "handles": [hex of each CUipcMemHandle]}.
  nlohmann::json alloc(std::size_t size, std::size_t count);
  /// Frees the allocations `ids` (alloc's) names.
  void free(const nlohmann::json& ids);
  /// gpuipc::share of a fresh, touched cuMemAlloc allocation of `size` bytes under each of `names`.
  void share(const nlohmann::json& names, std::size_t size);
  /// Drops the shares `names` (the broker removes the names), then every shared allocation.
  void unshare(const nlohmann::json& names);

 private:
  std::map<std::string, Segment> m_shares;
  std::map<std::uint64_t, cuda::DeviceBuffer> m_buffers;  // alloc's, by id
  std::vector<cuda::DeviceBuffer> m_shared;               // share's
  std::uint64_t m_next_id = 1;
};

/// The importer's side: cuIpcOpenMemHandle of each hex handle, timed; each mapping closed after, untimed.
/// Returns microseconds per open.
std::vector<double> time_legacy_opens(const nlohmann::json& handles);
/// Segment::open of each shared name, timed; checks it mapped as device_ipc; closed after, untimed.
std::vector<double> time_share_opens(const nlohmann::json& names);

}  // namespace gpuipc::bench::legacy
