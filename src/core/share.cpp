// gpuipc::share: adopting device memory a process already has. VMM allocations are exported once (cuMem POSIX fd)
// as device segments with a view; cuMemAlloc memory travels as a legacy IPC handle in a device_ipc record.
#include "gpuipc/share.hpp"

#include <fmt/format.h>

#include <cstring>

#include "core/segment_internal.hpp"
#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/legacy_ipc.hpp"
#include "cuda/pointer.hpp"
#include "cuda/trace.hpp"
#include "cuda/vmm.hpp"
#include "os/identity.hpp"

namespace gpuipc {
namespace {

[[noreturn]] void refuse(ErrorCode code, std::string message) { throw Error(code, std::move(message), "share"); }

/// What share() found out about [ptr, ptr + bytes), checked: device memory of one allocation on the right device.
struct Adoptable {
  cuda::PointerInfo info;
  cuda::AddressRange range;  // the allocation (VMM: the one physical allocation mapped there)
  std::uint64_t offset = 0;  // of ptr inside it
};

/// Refuses what is not device memory of the right device (no context needed).
Adoptable check_pointer(const std::string& name, CUdeviceptr ptr, const ShareOptions& options) {
  Adoptable a;
  a.info = cuda::pointer_info(ptr);
  const auto& info = a.info;
  if (info.managed) {
    refuse(ErrorCode::InvalidArgument,
           fmt::format("share '{}': {:#x} is managed memory (cudaMallocManaged), which no IPC mechanism exports: "
                       "allocate it with cudaMalloc or cuMemCreate, or copy it into a device segment "
                       "(Segment::create)",
                       name, ptr));
  }
  if (info.memory_type == CU_MEMORYTYPE_HOST ||
      (info.memory_type == 0 && os::host_readable(reinterpret_cast<const void*>(ptr)))) {  // NOLINT
    refuse(ErrorCode::InvalidArgument,
           fmt::format("share '{}': {:#x} is host memory: use a host segment (Segment::create with kind host or "
                       "host_pinned) or copy it to the GPU first",
                       name, ptr));
  }
  if (info.memory_type != CU_MEMORYTYPE_DEVICE) {
    refuse(ErrorCode::InvalidArgument,
           fmt::format("share '{}': {:#x} is not allocated GPU memory (freed, or never allocated): share memory "
                       "while it is allocated, and keep it allocated while the share lives",
                       name, ptr));
  }
  if (options.device >= 0 && info.device != options.device) {
    refuse(ErrorCode::InvalidArgument,
           fmt::format("share '{}': {:#x} lives on GPU {}, not on GPU {} as ShareOptions::device says: pass "
                       "device = {} (or -1 for wherever it lives)",
                       name, ptr, info.device, options.device, info.device));
  }
  if (info.from_pool) {
    refuse(ErrorCode::Unsupported,
           fmt::format("share '{}': {:#x} comes from a stream-ordered memory pool (cudaMallocAsync), whose blocks "
                       "cannot be shared by pointer: allocate with cudaMalloc or cuMemCreate (POSIX fd handle type), "
                       "or export the pool itself",
                       name, ptr));
  }
  return a;
}

/// Finds the allocation around ptr (in its context) and refuses a range that does not lie inside it.
void check_range(const std::string& name, CUdeviceptr ptr, std::size_t bytes, Adoptable& a) {
  const auto& info = a.info;
  const auto range = cuda::address_range(ptr);
  if (!range) {
    refuse(ErrorCode::InvalidArgument,
           fmt::format("share '{}': no allocation contains {:#x} (freed?): share memory while it is allocated",
                       name, ptr));
  }
  a.range = *range;
  a.offset = ptr - range->base;
  if (bytes > range->size - a.offset) {
    refuse(ErrorCode::InvalidArgument,
           fmt::format("share '{}': {} bytes from {:#x} run {} bytes past the end of its allocation ({} bytes at "
                       "{:#x}; the pointer is {} bytes into it): share at most {} bytes from this pointer{}",
                       name, bytes, ptr, bytes - (range->size - a.offset), range->size, range->base, a.offset,
                       range->size - a.offset,
                       info.legacy_ipc ? ""
                                       : "; a VMM range mapped from several allocations (e.g. PyTorch's expandable "
                                         "segments) is shared one allocation at a time"));
  }
}

std::shared_ptr<detail::Mapping> exporter_mapping(const std::string& name, SegmentKind kind, CUdeviceptr ptr,
                                                  std::size_t bytes, int ordinal) {
  auto m = std::make_shared<detail::Mapping>();
  m->name = name;
  m->kind = kind;
  m->access = Access::ReadWrite;
  m->size = bytes;
  m->gpu = core::borrow_device_memory(ptr, ordinal);
  return m;
}

}  // namespace

Segment share(std::string_view name, const void* ptr, std::size_t bytes, const ShareOptions& options) {
  GPUIPC_TRACE("gpuipc::share");
  std::string n = detail::check_name_or_throw(name);
  if (bytes == 0 || bytes > proto::kMaxSegmentSize) {
    refuse(ErrorCode::InvalidArgument, fmt::format("share '{}': size {} is out of range (1 byte to 1 TiB)", n, bytes));
  }
  if ((options.mode & ~0777U) != 0) {
    refuse(ErrorCode::InvalidArgument, fmt::format("share '{}': mode {:o} has bits outside 0777", n, options.mode));
  }
  const auto dptr = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr));
  // The context: the one the memory was allocated in (cuMemAlloc), else the device's primary context (VMM memory
  // belongs to no context). Looking the pointer up needs none.
  Adoptable a = check_pointer(n, dptr, options);
  cuda::PrimaryContext primary(a.info.device);
  cuda::ScopedContext scope(a.info.context != nullptr ? a.info.context : primary.get());
  check_range(n, dptr, bytes, a);

  proto::Create req;
  req.name = n;
  req.mode = static_cast<std::uint16_t>(options.mode);
  req.device = cuda::query_device(a.info.device, false).uuid;
  os::UniqueFd fd;
  std::shared_ptr<detail::Mapping> m;
  if (a.info.legacy_ipc) {
    // Legacy IPC opens whole allocations: the handle of the base, and the offset beside it.
    const CUipcMemHandle handle = cuda::ipc_get_mem_handle(a.range.base);
    m = exporter_mapping(n, SegmentKind::DeviceIpc, dptr, bytes, a.info.device);
    fd = os::memfd_create("gpuipc:" + n, proto::kDeviceIpcRecordBytes);
    m->host = os::Mapping::map(fd.get(), proto::kDeviceIpcRecordBytes, true);
    auto* record = static_cast<proto::DeviceIpcRecord*>(m->host.data());
    record->magic = proto::kDeviceIpcMagic;
    record->version = proto::kDeviceIpcVersion;
    record->exporter_pid = static_cast<std::uint32_t>(os::current_pid());
    record->offset = a.offset;
    record->size = bytes;
    record->alloc_size = a.range.size;
    std::memcpy(record->device, req.device.data(), sizeof record->device);
    std::memcpy(record->handle, handle.reserved, sizeof record->handle);
    req.kind = proto::Kind::DeviceIpc;
    req.size = bytes;
  } else {
    cuda::AllocationHandle handle = cuda::retain_allocation(a.range.base);
    if (!handle) {
      refuse(ErrorCode::Unsupported,
             fmt::format("share '{}': {:#x} is neither cudaMalloc/cuMemAlloc memory nor a VMM (cuMemCreate) "
                         "allocation; copy it into a device segment (Segment::create) instead",
                         n, dptr));
    }
    const CUmemAllocationProp prop = cuda::allocation_properties(handle);
    if ((prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
      refuse(ErrorCode::Unsupported,
             fmt::format("share '{}': the VMM allocation at {:#x} is not exportable (handle types {:#x}): allocate "
                         "with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in CUmemAllocationProp::requestedHandleTypes "
                         "(PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True exports them), or copy it into "
                         "a device segment (Segment::create)",
                         n, a.range.base, static_cast<unsigned>(prop.requestedHandleTypes)));
    }
    fd = cuda::export_fd(handle);
    m = exporter_mapping(n, SegmentKind::Device, dptr, bytes, a.info.device);
    req.kind = proto::Kind::Device;
    req.size = a.range.size;
    req.view_offset = a.offset;
    req.view_size = bytes;
  }
  return detail::SegmentAccess::register_created(std::move(m), req, std::move(fd), a.info.device, true);
}

Error detail::exporter_gone_error(const std::string& name) {
  return Error(ErrorCode::PeerDied,
               fmt::format("segment '{}' was cudaMalloc memory shared by a process that has exited or dropped the "
                           "share: legacy IPC memory dies with its exporter (share VMM memory, or keep the exporter "
                           "and its Segment alive)",
                           name),
               "open");
}

void detail::open_device_ipc(Mapping& m, int fd, const proto::SegmentInfo& info, int requested_device) {
  m.host = os::Mapping::map(fd, proto::kDeviceIpcRecordBytes, false);
  // The exporter wrote the record; copy it once and check the copy, so that what is checked is what is used.
  proto::DeviceIpcRecord record{};
  std::memcpy(&record, m.host.data(), sizeof record);
  if (auto why = proto::check_device_ipc_record(record, info.size, info.device); !why.empty()) {
    throw Error(ErrorCode::Protocol, fmt::format("segment '{}': malformed device_ipc record: {}", m.name, why), "open");
  }
  if (!m.alive()) throw exporter_gone_error(m.name);
  std::uint64_t mapped = 0;
  try {
    m.gpu = core::open_legacy_memory(record.handle, info.device, requested_device, mapped);
  } catch (const Error&) {
    // The exporter may have gone between the check and the open: say so rather than the driver's error.
    if (!m.alive()) throw exporter_gone_error(m.name);
    throw;
  }
  // The record's range was checked against the record's own alloc_size only: against what the handle opened, so
  // that an exporter cannot hand out a view past its allocation (the opener's first kernel would fault there).
  if (record.size > mapped || record.offset > mapped - record.size) {
    m.gpu.reset();
    throw Error(ErrorCode::Protocol,
                fmt::format("segment '{}': malformed device_ipc record: bytes [{}, {} + {}) do not lie inside the "
                            "allocation the handle opens ({} bytes)",
                            m.name, record.offset, record.offset, record.size, mapped),
                "open");
  }
  m.view_offset = record.offset;
}

}  // namespace gpuipc
