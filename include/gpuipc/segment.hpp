// gpuipc::Segment: named, access-controlled shared memory — GPU memory, pageable host memory or pinned host
// memory — that any permitted process opens by name, zero-copy. Like POSIX shm_open, for GPUs.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "gpuipc/error.hpp"

namespace gpuipc {

/// Where a segment's memory lives.
enum class SegmentKind : std::uint8_t {
  Device = 1,      ///< GPU memory (cuMemCreate, exported once as a POSIX fd); data() is a device pointer
  Host = 2,        ///< pageable host memory (memfd); works without any GPU
  HostPinned = 3,  ///< host memory (memfd) registered with the GPU in every process that maps it
  /// cudaMalloc / cuMemAlloc memory adopted with gpuipc::share (legacy IPC handle); data() is a device pointer.
  /// It lives only as long as its exporter keeps the share (include/gpuipc/share.hpp).
  DeviceIpc = 4,
};

/// How a process opens a segment.
enum class Access : std::uint8_t {
  /// mapped read-only: a write faults (host: SIGSEGV; device: the writer's context faults). device_ipc: legacy IPC
  /// has no read-only mapping; the broker checks the read permission but the mapping is writable (not enforced).
  ReadOnly = 1,
  ReadWrite = 2,
};

/// The name of a kind: "device", "host", "host_pinned", "device_ipc".
std::string_view to_string(SegmentKind kind) noexcept;

/// Options of Segment::create.
struct CreateOptions {
  SegmentKind kind = SegmentKind::Host;
  int device = 0;        ///< device kinds: CUDA device ordinal the memory lives on; host_pinned: the context used
  unsigned mode = 0600;  ///< permission bits for owner/group/other, read (4) and write (2), like a file
};

/// Options of Segment::open.
struct OpenOptions {
  Access access = Access::ReadWrite;
  /// Wait this long for the segment to be created when it does not exist yet (0: fail at once with NotFound). The
  /// process's other threads' calls go on meanwhile (the broker connection is not held while the open waits).
  std::chrono::milliseconds wait{0};
  /// Device kinds: the device whose context maps the segment. -1: the calling thread's current context's device,
  /// else the device the memory lives on. Another GPU than the owner's maps it through peer access. host_pinned:
  /// the device whose context registers it (usable from every context); -1: the current context's, else GPU 0.
  int device = -1;
};

/// What the broker reports about a segment (Segment::stat, list_segments, `gpuipc ls`).
struct SegmentInfo {
  std::uint64_t id = 0;          ///< unique for the broker's lifetime
  std::string name;              ///< empty once unlinked
  SegmentKind kind = SegmentKind::Host;
  std::size_t size = 0;          ///< usable bytes (device: rounded up to the allocation granularity; shared memory: as shared)
  std::string device_uuid;       ///< "GPU-…" for device kinds, empty for host kinds
  std::uint32_t owner_uid = 0;
  std::uint32_t owner_gid = 0;
  unsigned mode = 0;
  std::uint64_t created_unix_ns = 0;
  std::uint32_t references = 0;  ///< open references over all processes
  std::vector<std::uint32_t> mapper_pids;  ///< processes that hold references (at most 16 listed)
  std::uint32_t mapper_count = 0;
};

namespace detail {
struct Mapping;
/// Builds Segment handles from mappings (src/core/segment_internal.hpp).
struct SegmentAccess;
}  // namespace detail

/// A handle to a mapped segment. Copies share the mapping (opening the same name again in this process is a
/// cache hit, < 1 us, and shares it too). The mapping stays valid while any Segment of this process refers to
/// it; the memory stays alive while any process maps it or the name exists.
class Segment {
 public:
  /// Creates segment `name` of at least `bytes` and maps it read-write. Throws Error: AlreadyExists,
  /// QuotaExceeded, InvalidArgument (name, size), NoDriver/NoDevice/Unsupported (device kinds), Cuda, System.
  static Segment create(std::string_view name, std::size_t bytes, const CreateOptions& options = {});
  /// Opens segment `name`. Throws Error: NotFound (or Timeout when options.wait > 0), PermissionDenied (names the
  /// owner and mode), Unsupported (no peer access), PeerDied (a device_ipc segment whose exporter is gone),
  /// NoDriver, Cuda, System.
  static Segment open(std::string_view name, const OpenOptions& options = {});
  /// Removes the name. Processes that have it mapped keep their mapping; the memory is freed when the last one
  /// goes. Only the owner or root may unlink. Throws Error: NotFound, PermissionDenied.
  static void unlink(std::string_view name);
  /// The broker's view of segment `name`. Throws Error(NotFound).
  static SegmentInfo stat(std::string_view name);
  /// Every segment the broker knows (unlinked ones still mapped included).
  static std::vector<SegmentInfo> list();

  Segment() noexcept;
  Segment(Segment&&) noexcept;
  Segment& operator=(Segment&&) noexcept;
  Segment(const Segment&) noexcept;
  Segment& operator=(const Segment&) noexcept;
  ~Segment();

  /// Host kinds: the host address. Device: the device address (a CUdeviceptr as a pointer).
  void* data() const noexcept;
  /// The GPU-visible address: device kinds as data(); host_pinned: the registered device pointer; host: 0.
  std::uint64_t device_pointer() const noexcept;
  /// Usable bytes: what create asked for, rounded up to a page (host) or the allocation granularity (device).
  std::size_t size() const noexcept;
  SegmentKind kind() const noexcept;
  Access access() const noexcept;
  /// The device ordinal whose context mapped it (device kinds) or registered it (host_pinned); -1 for host.
  int device() const noexcept;
  const std::string& name() const noexcept;
  /// The broker's id of this segment.
  std::uint64_t id() const noexcept;
  /// Its owner's uid and gid, and its permission bits, as the broker said when this process created or opened it
  /// (SegmentInfo's; 0 for an empty handle).
  std::uint32_t owner_uid() const noexcept;
  std::uint32_t owner_gid() const noexcept;
  unsigned mode() const noexcept;
  explicit operator bool() const noexcept { return m_map != nullptr; }
  /// Drops this handle now (the mapping goes when the process's last handle does).
  void close() noexcept;
  /// False once the memory is gone: a device_ipc segment whose exporter exited or dropped its share (data() must
  /// not be used then). Always true for the other kinds, whose memory lives while mapped. One atomic load.
  bool alive() const noexcept;
  /// Throws Error(PeerDied) naming the segment when !alive().
  void check_alive() const;

 private:
  friend struct detail::SegmentAccess;
  explicit Segment(std::shared_ptr<detail::Mapping> map) noexcept;
  std::shared_ptr<detail::Mapping> m_map;
};

/// Removes `name` with whatever belongs to it: a pool with its chunks (Pool::unlink; chunks left after their control
/// block went are swept too), a channel with its buffers (Channel::unlink); a semaphore, a counting semaphore or a
/// plain segment is one name (Segment::unlink). What `gpuipc rm` does. The kind is read from the object's control
/// block, so a channel or a pool that another gpuipc release made goes whole as well. A part of a channel or a pool
/// that is there (`X.slots`, `X.chunk.<n>`) is refused with InvalidArgument: remove X; a part left behind without
/// its object goes. Throws Error as the unlink it picks: NotFound, PermissionDenied.
void unlink_any(std::string_view name);

}  // namespace gpuipc
