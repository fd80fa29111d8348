// gpuipc::share: adopt GPU memory a process already has (a PyTorch tensor, a CuPy array, a cuMemCreate
// allocation) under a name, so that other processes open it with Segment::open and map it with no copy.
#pragma once

#include <cstddef>
#include <string_view>

#include "gpuipc/segment.hpp"

namespace gpuipc {

/// Options of share().
struct ShareOptions {
  /// The device the memory must live on; -1: whichever it lives on. A pointer on another device is refused.
  int device = -1;
  unsigned mode = 0600;  ///< permission bits for owner/group/other, as for Segment::create
};

/// Shares bytes [ptr, ptr + bytes) of device memory as segment `name` and returns the exporter's handle (data() is
/// ptr). Openers' data() points at the same bytes. Two cases, chosen from the pointer:
/// - VMM memory (cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, e.g. PyTorch's expandable segments):
///   the allocation is exported once (kind device); the broker keeps it alive like any device segment, also after
///   the exporter frees it or exits, until the name is unlinked and nobody maps it.
/// - cudaMalloc / cuMemAlloc memory (kind device_ipc, legacy IPC handle of the allocation's base): it lives only as
///   long as the exporter keeps it. When the exporter's last handle goes or the exporter exits, the name is
///   removed and openers' alive() turns false (their next open or check_alive() reports PeerDied). Keep the memory
///   and the returned Segment alive together. An opener maps each allocation once, however many names share it.
/// Throws Error: InvalidArgument (host, managed, freed memory; another device than options.device; a range past
/// the end of the allocation; name, size, mode), Unsupported (a VMM allocation not exportable as a POSIX fd,
/// stream-ordered pool memory), AlreadyExists, QuotaExceeded, NoDriver, Cuda. Each message says what to do instead.
Segment share(std::string_view name, const void* ptr, std::size_t bytes, const ShareOptions& options = {});

}  // namespace gpuipc
