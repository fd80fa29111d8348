// Segment internals shared by the files of src/core that build segments: creation with broker flags (Semaphore,
// Channel), the per-process Mapping every handle shares, and adopted memory (share.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "core/gpu_memory.hpp"
#include "gpuipc/segment.hpp"
#include "os/fd.hpp"
#include "os/memfd.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"

namespace gpuipc::detail {

/// One mapping of one segment in this process, shared by every Segment handle and cache entry of it.
/// Members are declared in acquisition order; the destructor drops the broker reference last.
struct Mapping {
  std::string name;
  std::atomic<std::uint64_t> id{0};     // the broker's id (changes when a new broker gives the name back)
  SegmentKind kind = SegmentKind::Host;
  Access access = Access::ReadWrite;
  std::size_t size = 0;                 // usable bytes
  std::uint64_t view_offset = 0;        // device kinds: data() is gpu->device_pointer() + view_offset
  std::atomic<std::uint64_t> client_generation{0};  // the broker connection that holds our reference
  std::uint64_t broker_size = 0;        // SegmentInfo::size as the broker registered it (for Announce)
  std::uint32_t owner_uid = 0;          // SegmentInfo's owner and mode when this process created or opened it
  std::uint32_t owner_gid = 0;
  unsigned mode = 0;
  std::uint64_t created_unix_ns = 0;    // SegmentInfo::created_unix_ns: which segment of its name this is
  os::UniqueFd memory;                  // the memory's fd, kept to give the name back to a restarted broker
  os::Mapping host;                     // host kinds; device_ipc: its record (proto::DeviceIpcRecord)
  std::unique_ptr<core::GpuMemory> gpu; // device kinds, and the registration of host_pinned; set before the
                                        // mapping is shared, never after (readers take it without a lock)
  // A host_pinned mapping opened unregistered: its registration, made once by register_pinned_later (late_once
  // orders it with every later reader of late_gpu, which goes through register_pinned_later too).
  std::once_flag late_once;
  std::unique_ptr<core::GpuMemory> late_gpu;

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();

  /// device_ipc: the shared record; nullptr for other kinds.
  proto::DeviceIpcRecord* record() const noexcept {
    return kind == SegmentKind::DeviceIpc ? static_cast<proto::DeviceIpcRecord*>(host.data()) : nullptr;
  }
  /// False once a device_ipc segment's exporter is gone (the broker wrote exporter_gone).
  bool alive() const noexcept {
    auto* r = record();
    return r == nullptr || std::atomic_ref<std::uint32_t>(r->exporter_gone).load(std::memory_order_acquire) == 0;
  }
};

/// Builds Segment handles (Segment's constructor is private).
struct SegmentAccess {
  static Segment make(std::shared_ptr<Mapping> map) noexcept { return Segment(std::move(map)); }
  /// The mapping behind a handle (null for an empty one).
  static const std::shared_ptr<Mapping>& mapping(const Segment& s) noexcept { return s.m_map; }
  /// Sends `req` with `fd` (the memory) to the broker, records the id in `map` and caches it for this process's
  /// own opens: under access ReadWrite for devices -1 and `device`, and also ReadOnly when `read_only_too`.
  /// `cached` false: keep it out of the cache (a mapping placed in the caller's VaSlot).
  static Segment register_created(std::shared_ptr<Mapping> map, const proto::Create& req, os::UniqueFd fd, int device,
                                  bool read_only_too, bool cached = true);
};

/// Segment::create with broker flags (semaphores, channels, counting semaphores, pools). `init` (host kinds) fills
/// the memory in before the broker registers the name, so nobody sees it half made. `place_at` (device kind): map
/// the memory at this address of a core::VaSlot the caller keeps, and keep the mapping out of the process's cache
/// (a pool chunk, remapped at the same address after a pause).
/// `also_map_for`: device kinds, a second GPU of this process given access to the mapping (a pool member whose
/// chunks live on another GPU than the one it maps them from); -1 for none.
Segment create_segment(std::string_view name, std::size_t bytes, const CreateOptions& options, std::uint32_t flags,
                       const std::function<void(void*)>& init = {}, std::uint64_t place_at = 0,
                       int also_map_for = -1);
/// Segment::open, optionally without registering a host_pinned segment with the GPU (a CUDA-free reader);
/// `place_at` as for create_segment.
Segment open_segment(std::string_view name, const OpenOptions& options, bool register_pinned,
                     std::uint64_t place_at = 0, bool look = false);
/// Removes the name of the segment `s` maps while the name still stands for it (UnlinkId; an older broker: a Stat,
/// then the Unlink, which a removal in between could race). Returns false when the name is gone or stands for another
/// segment now, or when the running broker does not know `s` (it was restarted and did not take it back). Throws
/// what else the broker says.
bool unlink_if_still_named(const Segment& s);
/// Unlinks control block `name` of an object of kind `what` ("channel", "pool") when its magic is `magic`
/// (InvalidArgument otherwise: another kind of object is removed by its own unlink). When there is no such name,
/// returns its NotFound instead of throwing it: what the object keeps under other names (a channel's slots, a pool's
/// chunks) may outlive it, and the caller sweeps them before it throws that.
std::optional<Error> unlink_control(std::string_view name, std::uint32_t magic, std::string_view what);

/// A read-only look at segment `name` (unregistered, CUDA-free): what stat() and the CLI take to read a control block.
/// The broker counts it as no holder (proto::Access::Look): watchers hear nothing of it and holders() leaves it out.
/// A broker without kFeatureLook gets a plain read-only open.
Segment look_at_segment(std::string_view name);

/// One segment for open_segments: open_segment's arguments.
struct SegmentOpen {
  std::string name;
  OpenOptions options;
  bool register_pinned = true;
  std::uint64_t place_at = 0;
};
/// open_segment for several segments: those the process's mapping cache does not give (it is looked up as
/// open_segment looks it up, for unplaced ones) are asked for with one broker round trip (their Opens sent
/// together: BrokerClient::request_batch) and mapped as open_segment maps them. Each result, in order, is the
/// Segment, or the Error its open alone raised; a failed connection throws.
std::vector<std::variant<Segment, Error>> open_segments(std::span<const SegmentOpen> opens);

/// Registers a host_pinned mapping that open_segment left unregistered with GPU `ordinal` (once, thread-safe) and
/// returns its device pointer; a registered one's pointer at once. Registering pins every page (about 1 ms for the
/// 4 MiB control block of a 65536-block pool), so pool members do it only when a stream first writes to it.
std::uint64_t register_pinned_later(const Segment& segment, int ordinal);

/// The first 4 bytes of segment `name` read through a read-only mapping (the magic of a semaphore's, channel's, pool's
/// or counting semaphore's control block, whatever its version), or 0 for a segment too small or not in host
/// memory. Throws what Segment::open throws (NotFound, PermissionDenied).
std::uint32_t control_magic(std::string_view name);
/// The same, of a segment already mapped.
std::uint32_t control_magic(const Segment& segment) noexcept;
/// Whether this process reads `segment`'s bytes at data(): host or host_pinned. A device segment's data() is a GPU
/// address, which the host must not load from (a name taken by such a segment is not a control block).
constexpr bool host_readable(SegmentKind kind) noexcept {
  return kind == SegmentKind::Host || kind == SegmentKind::HostPinned;
}

/// The checked name, or throws Error(InvalidArgument) saying which names are allowed.
std::string check_name_or_throw(std::string_view name);

/// Opens the device_ipc segment whose record memfd is `fd` (share.cpp): fills m.host, m.gpu and m.view_offset.
/// Throws Error(PeerDied) when its exporter is gone, Error(Protocol) for a malformed record, Cuda, NoDriver.
void open_device_ipc(Mapping& m, int fd, const proto::SegmentInfo& info, int requested_device);

/// The PeerDied error for segment `name` whose exporter is gone.
Error exporter_gone_error(const std::string& name);

}  // namespace gpuipc::detail
