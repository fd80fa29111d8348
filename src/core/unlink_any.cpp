// gpuipc::unlink_any: removes a name with whatever belongs to it, picking the unlink by the control block's magic.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "core/segment_internal.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "proto/shm.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc {
namespace {

/// `unlink` of `name`, when there is such a name to remove (NotFound, or a name too long to be one: nothing).
template <class Unlink>
void unlink_if_there(Unlink&& unlink, const std::string& name) {
  try {
    unlink(name);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound && e.code() != ErrorCode::InvalidArgument) throw;
  }
}

/// The channel or pool that `name` is a part of (its `X.slots`, its `X.chunk.<n>`), when that object is there now:
/// (its name, "channel" or "pool"); else nullopt (a plain name, or a part left behind by a killed create or an older
/// release, which may go on its own).
std::optional<std::pair<std::string, const char*>> live_owner(std::string_view name) {
  std::string owner;
  std::uint32_t want = 0;
  const char* kind = nullptr;
  if (name.ends_with(".slots")) {
    owner = name.substr(0, name.size() - 6);
    want = proto::kChannelMagic;
    kind = "channel";
  } else if (const std::string_view pool = proto::pool_of_chunk(name); !pool.empty()) {
    owner = pool;
    want = shm::kPoolMagic;
    kind = "pool";
  } else {
    return std::nullopt;
  }
  try {
    // (A device segment is no control block, and is not imported to tell.)
    if (!detail::host_readable(Segment::stat(owner).kind) || detail::control_magic(owner) != want) return std::nullopt;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::PermissionDenied) return std::make_pair(owner, kind);  // there, unreadable to us
    return std::nullopt;  // (NotFound, or a name too long to be one)
  }
  return std::make_pair(owner, kind);
}

}  // namespace

void unlink_any(std::string_view name) {
  // A part of a live channel or pool alone is refused: the object would be left broken (a channel whose members
  // cannot open its buffers, a pool listed as a plain segment), and `gpuipc rm` removed it, exit 0.
  if (const auto owner = live_owner(name)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("'{}' is part of {} '{}', which is in use; remove the {} as a whole: gpuipc rm {}", name,
                            owner->second, owner->first, owner->second, owner->first),
                "unlink");
  }
  std::optional<SegmentInfo> info;
  try {
    info = Segment::stat(name);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
    // A pool's chunks may outlive its control block (a `gpuipc rm` of the block alone by an older release), and a
    // channel's slots its (a creator killed between the two): Pool::unlink and Channel::unlink sweep them. None
    // there: the name's own NotFound.
    bool swept = false;
    for (const auto& unlink : {&Pool::unlink, &Channel::unlink}) {
      try {
        unlink(name);
        swept = true;
      } catch (const Error&) {  // NOLINT(bugprone-empty-catch): nothing of that kind left
      }
    }
    if (!swept) throw e;
    return;
  }
  // Control blocks are host memory (host_pinned where a stream writes them); device memory is a plain segment, and
  // is not imported just to be removed.
  if (detail::host_readable(info->kind)) {
    std::uint32_t magic = 0;
    try {
      magic = detail::control_magic(name);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::PermissionDenied) throw;
      // Its mode keeps even its owner from reading what it is, yet the owner may unlink it (mode bits do not grant
      // that): the name goes, and whatever a channel's or a pool's would leave (NAME.slots, NAME.chunk.N).
      Segment::unlink(name);
      unlink_if_there([](const std::string& n) { Segment::unlink(n); }, std::string(name) + ".slots");
      unlink_if_there([](const std::string& n) { Pool::unlink(n); }, std::string(name));
      return;
    }
    if (magic == shm::kPoolMagic) return Pool::unlink(name);
    if (magic == proto::kChannelMagic) return Channel::unlink(name);
  }
  Segment::unlink(name);
}

}  // namespace gpuipc
