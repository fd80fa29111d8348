// gpuipc::unlink_any: removes a name with whatever belongs to it, picking the unlink by the control block's magic.
#include <cstdint>
#include <optional>
#include <string_view>

#include "core/segment_internal.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "proto/shm.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc {

void unlink_any(std::string_view name) {
  std::optional<SegmentInfo> info;
  try {
    info = Segment::stat(name);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
    // A pool's chunks may outlive its control block (a `gpuipc rm` of the block alone by an older release):
    // Pool::unlink sweeps them. None there: the name's own NotFound.
    try {
      Pool::unlink(name);
      return;
    } catch (const Error&) {
      throw e;
    }
  }
  // Control blocks are host memory (host_pinned where a stream writes them); device memory is a plain segment, and
  // is not imported just to be removed.
  if (info->kind == SegmentKind::Host || info->kind == SegmentKind::HostPinned) {
    const std::uint32_t magic = detail::control_magic(name);
    if (magic == shm::kPoolMagic) return Pool::unlink(name);
    if (magic == proto::kChannelMagic) return Channel::unlink(name);
  }
  Segment::unlink(name);
}

}  // namespace gpuipc
