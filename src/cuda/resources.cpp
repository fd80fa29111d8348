#include "cuda/resources.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "base/log.hpp"

namespace gpuipc::cuda {
namespace {

// Logs a failed release. CUDA_ERROR_DEINITIALIZED is what every call returns while the process exits after the
// driver tore itself down: nothing is left to release then, so it is not worth a warning.
void warn_release(CUresult r, const char* call, std::string_view what) noexcept {
  if (r == CUDA_SUCCESS || r == CUDA_ERROR_DEINITIALIZED) return;
  GPUIPC_LOG_WARN("{}: {} failed while releasing it: {} ({})", what, call, result_name(r), static_cast<int>(r));
}

// Runs `release` with `ctx` current, switching (and back) only when another context, or none, is current.
template <typename F>
CUresult with_context(const DriverApi& api, CUcontext ctx, F&& release) noexcept {
  CUcontext previous = nullptr;
  bool switched = false;
  if (ctx != nullptr && api.cuCtxGetCurrent(&previous) == CUDA_SUCCESS && previous != ctx) {
    switched = api.cuCtxSetCurrent(ctx) == CUDA_SUCCESS;
  }
  const CUresult r = release();
  if (switched) api.cuCtxSetCurrent(previous);
  return r;
}

CUcontext current_or_null(const DriverApi& api) {
  CUcontext ctx = nullptr;
  check(api.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent", "current context");
  return ctx;
}

CUmemAllocationProp exportable_prop(int ordinal) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// An attribute newer than the driver reads as absent (CUDA_ERROR_INVALID_VALUE) rather than failing.
int attribute_or_zero(const DriverApi& api, CUdevice_attribute attribute, CUdevice device) noexcept {
  int value = 0;
  return api.cuDeviceGetAttribute(&value, attribute, device) == CUDA_SUCCESS ? value : 0;
}

CUdevice device_of(const DriverApi& api, int ordinal) {
  CUdevice device = 0;
  check(api.cuDeviceGet(&device, ordinal), "cuDeviceGet", fmt::format("GPU {}", ordinal));
  return device;
}

}  // namespace

// ---- PrimaryContext ----

PrimaryContext::PrimaryContext(int ordinal) {
  const DriverApi& api = driver();
  const CUdevice device = device_of(api, ordinal);
  CUcontext ctx = nullptr;
  check(api.cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain",
        fmt::format("primary context of GPU {}", ordinal));
  m_ordinal = ordinal;
  m_device = device;
  m_ctx = ctx;
}

PrimaryContext::PrimaryContext(PrimaryContext&& other) noexcept
    : m_ordinal(std::exchange(other.m_ordinal, -1)),
      m_device(std::exchange(other.m_device, 0)),
      m_ctx(std::exchange(other.m_ctx, nullptr)) {}

PrimaryContext& PrimaryContext::operator=(PrimaryContext&& other) noexcept {
  if (this != &other) {
    reset();
    m_ordinal = std::exchange(other.m_ordinal, -1);
    m_device = std::exchange(other.m_device, 0);
    m_ctx = std::exchange(other.m_ctx, nullptr);
  }
  return *this;
}

PrimaryContext::~PrimaryContext() { reset(); }

void PrimaryContext::reset() noexcept {
  if (m_ctx == nullptr) return;
  if (const DriverApi* api = loaded_driver()) {
    warn_release(api->cuDevicePrimaryCtxRelease(m_device), "cuDevicePrimaryCtxRelease",
                 fmt::format("primary context of GPU {}", m_ordinal));
  }
  m_ctx = nullptr;
  m_device = 0;
  m_ordinal = -1;
}

void PrimaryContext::make_current() const {
  check(driver().cuCtxSetCurrent(m_ctx), "cuCtxSetCurrent", fmt::format("primary context of GPU {}", m_ordinal));
}

// ---- ScopedContext ----

ScopedContext::ScopedContext(CUcontext ctx) {
  const DriverApi& api = driver();
  m_previous = current_or_null(api);
  if (m_previous != ctx) {
    check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent", "switching context");
    m_switched = true;
  }
}

ScopedContext::~ScopedContext() {
  if (!m_switched) return;
  if (const DriverApi* api = loaded_driver()) {
    warn_release(api->cuCtxSetCurrent(m_previous), "cuCtxSetCurrent", "restoring the previous context");
  }
}

CUcontext current_context() { return current_or_null(driver()); }

int current_ordinal() {
  const DriverApi& api = driver();
  CUdevice device = 0;
  check(api.cuCtxGetDevice(&device), "cuCtxGetDevice", "device of the current context");
  // CUdevice is a handle, not formally the ordinal: find the ordinal that maps to it.
  int count = 0;
  check(api.cuDeviceGetCount(&count), "cuDeviceGetCount", "devices");
  for (int i = 0; i < count; ++i) {
    CUdevice d = 0;
    if (api.cuDeviceGet(&d, i) == CUDA_SUCCESS && d == device) return i;
  }
  return static_cast<int>(device);
}

int device_attribute(CUdevice_attribute attribute, int ordinal) {
  const DriverApi& api = driver();
  int value = 0;
  check(api.cuDeviceGetAttribute(&value, attribute, device_of(api, ordinal)), "cuDeviceGetAttribute",
        fmt::format("attribute {} of GPU {}", static_cast<int>(attribute), ordinal));
  return value;
}

// ---- AllocationHandle ----

AllocationHandle::AllocationHandle(AllocationHandle&& other) noexcept
    : m_handle(std::exchange(other.m_handle, 0)), m_valid(std::exchange(other.m_valid, false)) {}

AllocationHandle& AllocationHandle::operator=(AllocationHandle&& other) noexcept {
  if (this != &other) {
    reset();
    m_handle = std::exchange(other.m_handle, 0);
    m_valid = std::exchange(other.m_valid, false);
  }
  return *this;
}

AllocationHandle::~AllocationHandle() { reset(); }

void AllocationHandle::reset() noexcept {
  if (!m_valid) return;
  if (const DriverApi* api = loaded_driver()) {
    warn_release(api->cuMemRelease(m_handle), "cuMemRelease", "GPU allocation handle");
  }
  m_valid = false;
  m_handle = 0;
}

// ---- VaRange ----

VaRange::VaRange(VaRange&& other) noexcept
    : m_base(std::exchange(other.m_base, 0)), m_size(std::exchange(other.m_size, 0)) {}

VaRange& VaRange::operator=(VaRange&& other) noexcept {
  if (this != &other) {
    reset();
    m_base = std::exchange(other.m_base, 0);
    m_size = std::exchange(other.m_size, 0);
  }
  return *this;
}

VaRange::~VaRange() { reset(); }

void VaRange::reset() noexcept {
  if (m_base == 0) return;
  if (const DriverApi* api = loaded_driver()) {
    warn_release(api->cuMemAddressFree(m_base, m_size), "cuMemAddressFree",
                 fmt::format("virtual address range {:#x} of {} bytes", m_base, m_size));
  }
  m_base = 0;
  m_size = 0;
}

// ---- MemMapping ----

MemMapping::MemMapping(MemMapping&& other) noexcept
    : m_ptr(std::exchange(other.m_ptr, 0)), m_size(std::exchange(other.m_size, 0)) {}

MemMapping& MemMapping::operator=(MemMapping&& other) noexcept {
  if (this != &other) {
    reset();
    m_ptr = std::exchange(other.m_ptr, 0);
    m_size = std::exchange(other.m_size, 0);
  }
  return *this;
}

MemMapping::~MemMapping() { reset(); }

void MemMapping::reset() noexcept {
  if (m_ptr == 0) return;
  if (const DriverApi* api = loaded_driver()) {
    warn_release(api->cuMemUnmap(m_ptr, m_size), "cuMemUnmap",
                 fmt::format("mapping at {:#x} of {} bytes", m_ptr, m_size));
  }
  m_ptr = 0;
  m_size = 0;
}

// ---- HostRegistration ----

HostRegistration HostRegistration::register_memory(void* ptr, std::size_t size, bool read_only) {
  const DriverApi& api = driver();
  unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP;
  if (read_only) flags |= CU_MEMHOSTREGISTER_READ_ONLY;
  const CUcontext ctx = current_or_null(api);
  check(api.cuMemHostRegister(ptr, size, flags), "cuMemHostRegister",
        fmt::format("registering {} bytes of host memory at {}{}", size, ptr, read_only ? " read-only" : ""));
  return HostRegistration(ptr, size, ctx);
}

HostRegistration::HostRegistration(HostRegistration&& other) noexcept
    : m_ptr(std::exchange(other.m_ptr, nullptr)),
      m_size(std::exchange(other.m_size, 0)),
      m_ctx(std::exchange(other.m_ctx, nullptr)) {}

HostRegistration& HostRegistration::operator=(HostRegistration&& other) noexcept {
  if (this != &other) {
    reset();
    m_ptr = std::exchange(other.m_ptr, nullptr);
    m_size = std::exchange(other.m_size, 0);
    m_ctx = std::exchange(other.m_ctx, nullptr);
  }
  return *this;
}

HostRegistration::~HostRegistration() { reset(); }

void HostRegistration::reset() noexcept {
  if (m_ptr == nullptr) return;
  if (const DriverApi* api = loaded_driver()) {
    const CUresult r = with_context(*api, m_ctx, [&] { return api->cuMemHostUnregister(m_ptr); });
    warn_release(r, "cuMemHostUnregister", "registered host memory");
  }
  m_ptr = nullptr;
  m_size = 0;
  m_ctx = nullptr;
}

CUdeviceptr HostRegistration::device_pointer() const {
  const DriverApi& api = driver();
  CUdeviceptr dptr = 0;
  const CUresult r = with_context(api, m_ctx, [&] { return api.cuMemHostGetDevicePointer(&dptr, m_ptr, 0); });
  check(r, "cuMemHostGetDevicePointer", fmt::format("registered host memory at {}", m_ptr));
  return dptr;
}

// ---- Stream ----

Stream Stream::create(bool non_blocking) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_or_null(api);
  CUstream stream = nullptr;
  check(api.cuStreamCreate(&stream, non_blocking ? CU_STREAM_NON_BLOCKING : CU_STREAM_DEFAULT), "cuStreamCreate",
        "new stream");
  return Stream(stream, ctx);
}

Stream::Stream(Stream&& other) noexcept
    : m_stream(std::exchange(other.m_stream, nullptr)), m_ctx(std::exchange(other.m_ctx, nullptr)) {}

Stream& Stream::operator=(Stream&& other) noexcept {
  if (this != &other) {
    reset();
    m_stream = std::exchange(other.m_stream, nullptr);
    m_ctx = std::exchange(other.m_ctx, nullptr);
  }
  return *this;
}

Stream::~Stream() { reset(); }

void Stream::reset() noexcept {
  if (m_stream == nullptr) return;
  if (const DriverApi* api = loaded_driver()) {
    const CUresult r = with_context(*api, m_ctx, [&] { return api->cuStreamDestroy(m_stream); });
    warn_release(r, "cuStreamDestroy", "stream");
  }
  m_stream = nullptr;
  m_ctx = nullptr;
}

void Stream::synchronize() const { check(driver().cuStreamSynchronize(m_stream), "cuStreamSynchronize", "stream"); }

bool Stream::query() const {
  const CUresult r = driver().cuStreamQuery(m_stream);
  if (r == CUDA_ERROR_NOT_READY) return false;
  check(r, "cuStreamQuery", "stream");
  return true;
}

// ---- Event ----

Event Event::create(unsigned flags) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_or_null(api);
  CUevent event = nullptr;
  check(api.cuEventCreate(&event, flags), "cuEventCreate", "new event");
  return Event(event, ctx);
}

Event::Event(Event&& other) noexcept
    : m_event(std::exchange(other.m_event, nullptr)), m_ctx(std::exchange(other.m_ctx, nullptr)) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    reset();
    m_event = std::exchange(other.m_event, nullptr);
    m_ctx = std::exchange(other.m_ctx, nullptr);
  }
  return *this;
}

Event::~Event() { reset(); }

void Event::reset() noexcept {
  if (m_event == nullptr) return;
  if (const DriverApi* api = loaded_driver()) {
    const CUresult r = with_context(*api, m_ctx, [&] { return api->cuEventDestroy(m_event); });
    warn_release(r, "cuEventDestroy", "event");
  }
  m_event = nullptr;
  m_ctx = nullptr;
}

void Event::record(CUstream stream) const { check(driver().cuEventRecord(m_event, stream), "cuEventRecord", "event"); }

void Event::synchronize() const { check(driver().cuEventSynchronize(m_event), "cuEventSynchronize", "event"); }

bool Event::query() const {
  const CUresult r = driver().cuEventQuery(m_event);
  if (r == CUDA_ERROR_NOT_READY) return false;
  check(r, "cuEventQuery", "event");
  return true;
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0.0F;
  check(driver().cuEventElapsedTime(&ms, start.m_event, end.m_event), "cuEventElapsedTime", "event pair");
  return ms;
}

// ---- DeviceBuffer ----

DeviceBuffer DeviceBuffer::allocate(std::size_t size) {
  if (size == 0) throw Error(ErrorCode::InvalidArgument, "device buffer: size must be positive", "cuMemAlloc");
  const DriverApi& api = driver();
  const CUcontext ctx = current_or_null(api);
  CUdeviceptr ptr = 0;
  check(api.cuMemAlloc(&ptr, size), "cuMemAlloc", fmt::format("device buffer of {} bytes", size));
  return DeviceBuffer(ptr, size, ctx);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : m_ptr(std::exchange(other.m_ptr, 0)),
      m_size(std::exchange(other.m_size, 0)),
      m_ctx(std::exchange(other.m_ctx, nullptr)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    m_ptr = std::exchange(other.m_ptr, 0);
    m_size = std::exchange(other.m_size, 0);
    m_ctx = std::exchange(other.m_ctx, nullptr);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() { reset(); }

void DeviceBuffer::reset() noexcept {
  if (m_ptr == 0) return;
  if (const DriverApi* api = loaded_driver()) {
    const CUresult r = with_context(*api, m_ctx, [&] { return api->cuMemFree(m_ptr); });
    warn_release(r, "cuMemFree", fmt::format("device buffer at {:#x} of {} bytes", m_ptr, m_size));
  }
  m_ptr = 0;
  m_size = 0;
  m_ctx = nullptr;
}

// ---- legacy IPC ----

CUipcMemHandle ipc_get_mem_handle(CUdeviceptr ptr) {
  CUipcMemHandle handle{};
  check(driver().cuIpcGetMemHandle(&handle, ptr), "cuIpcGetMemHandle", fmt::format("device memory at {:#x}", ptr));
  return handle;
}

IpcMapping IpcMapping::open(const CUipcMemHandle& handle, unsigned flags) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_or_null(api);
  CUdeviceptr ptr = 0;
  check(api.cuIpcOpenMemHandle(&ptr, handle, flags), "cuIpcOpenMemHandle", "legacy IPC memory handle");
  return IpcMapping(ptr, ctx);
}

IpcMapping::IpcMapping(IpcMapping&& other) noexcept
    : m_ptr(std::exchange(other.m_ptr, 0)), m_ctx(std::exchange(other.m_ctx, nullptr)) {}

IpcMapping& IpcMapping::operator=(IpcMapping&& other) noexcept {
  if (this != &other) {
    reset();
    m_ptr = std::exchange(other.m_ptr, 0);
    m_ctx = std::exchange(other.m_ctx, nullptr);
  }
  return *this;
}

IpcMapping::~IpcMapping() { reset(); }

void IpcMapping::reset() noexcept {
  if (m_ptr == 0) return;
  if (const DriverApi* api = loaded_driver()) {
    const CUresult r = with_context(*api, m_ctx, [&] { return api->cuIpcCloseMemHandle(m_ptr); });
    warn_release(r, "cuIpcCloseMemHandle", fmt::format("legacy IPC mapping at {:#x}", m_ptr));
  }
  m_ptr = 0;
  m_ctx = nullptr;
}

// ---- Module ----

Module Module::load(const void* image, std::string_view what) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_or_null(api);
  CUmodule module = nullptr;
  check(api.cuModuleLoadData(&module, image), "cuModuleLoadData", what);
  return Module(module, ctx, std::string(what));
}

Module::Module(Module&& other) noexcept
    : m_module(std::exchange(other.m_module, nullptr)),
      m_ctx(std::exchange(other.m_ctx, nullptr)),
      m_what(std::move(other.m_what)) {}

Module& Module::operator=(Module&& other) noexcept {
  if (this != &other) {
    reset();
    m_module = std::exchange(other.m_module, nullptr);
    m_ctx = std::exchange(other.m_ctx, nullptr);
    m_what = std::move(other.m_what);
  }
  return *this;
}

Module::~Module() { reset(); }

void Module::reset() noexcept {
  if (m_module == nullptr) return;
  if (const DriverApi* api = loaded_driver()) {
    const CUresult r = with_context(*api, m_ctx, [&] { return api->cuModuleUnload(m_module); });
    warn_release(r, "cuModuleUnload", m_what);
  }
  m_module = nullptr;
  m_ctx = nullptr;
}

CUfunction Module::function(const char* name) const {
  CUfunction fn = nullptr;
  const CUresult r = driver().cuModuleGetFunction(&fn, m_module, name);
  if (r == CUDA_ERROR_NOT_FOUND) {
    throw Error(ErrorCode::NotFound, fmt::format("{}: no kernel named '{}'", m_what, name), "cuModuleGetFunction", 0,
                static_cast<int>(r));
  }
  check(r, "cuModuleGetFunction", fmt::format("{}: kernel '{}'", m_what, name));
  return fn;
}

void launch(CUfunction function, unsigned grid, unsigned block, unsigned shared_bytes, CUstream stream, void** args,
            const char* name) {
  check(driver().cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared_bytes, stream, args, nullptr),
        "cuLaunchKernel", fmt::format("kernel {} ({} blocks of {} threads)", name, grid, block));
}

// ---- VMM ----

std::size_t allocation_granularity(int ordinal, bool recommended) {
  const DriverApi& api = driver();
  const CUmemAllocationProp prop = exportable_prop(ordinal);
  std::size_t granularity = 0;
  check(api.cuMemGetAllocationGranularity(
            &granularity, &prop, recommended ? CU_MEM_ALLOC_GRANULARITY_RECOMMENDED : CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity", fmt::format("GPU {}", ordinal));
  return granularity;
}

std::size_t round_up(std::size_t size, std::size_t granularity) {
  if (granularity == 0) return size;
  const std::size_t rem = size % granularity;
  if (rem == 0) return size;
  if (size > std::numeric_limits<std::size_t>::max() - (granularity - rem)) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("size {} is too large", size), "round_up");
  }
  return size + (granularity - rem);
}

AllocationHandle create_exportable(int ordinal, std::size_t size, bool fabric) {
  const DriverApi& api = driver();
  const std::size_t granularity = allocation_granularity(ordinal, false);
  if (size == 0 || size % granularity != 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("GPU allocation of {} bytes on GPU {}: the size must be a positive multiple of the "
                            "allocation granularity ({} bytes)",
                            size, ordinal, granularity),
                "cuMemCreate");
  }
  CUmemAllocationProp prop = exportable_prop(ordinal);
  CUmemGenericAllocationHandle handle = 0;
  if (fabric &&
      attribute_or_zero(api, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, device_of(api, ordinal)) != 0) {
    CUmemAllocationProp with_fabric = prop;
    with_fabric.requestedHandleTypes =
        static_cast<CUmemAllocationHandleType>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC);
    const CUresult r = api.cuMemCreate(&handle, size, &with_fabric, 0);
    if (r == CUDA_SUCCESS) return AllocationHandle(handle);
    // Fabric handles also need an IMEX channel (/dev/nvidia-caps-imex-channels); without one the driver refuses
    // the request with NOT_PERMITTED or NOT_SUPPORTED although the device reports fabric support.
    if (r != CUDA_ERROR_NOT_PERMITTED && r != CUDA_ERROR_NOT_SUPPORTED) {
      check(r, "cuMemCreate", fmt::format("GPU allocation of {} bytes on GPU {} (POSIX fd + fabric)", size, ordinal));
    }
    GPUIPC_LOG_INFO("GPU {}: fabric handles refused ({}); allocating with POSIX fd handles only", ordinal,
                    result_name(r));
  }
  check(api.cuMemCreate(&handle, size, &prop, 0), "cuMemCreate",
        fmt::format("GPU allocation of {} bytes on GPU {}", size, ordinal));
  return AllocationHandle(handle);
}

os::UniqueFd export_fd(const AllocationHandle& handle) {
  int fd = -1;
  check(driver().cuMemExportToShareableHandle(&fd, handle.get(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle", "exporting a GPU allocation as a POSIX fd");
  return os::UniqueFd(fd);
}

AllocationHandle import_fd(int fd) {
  CUmemGenericAllocationHandle handle = 0;
  // The handle argument of a POSIX fd import is the fd itself, passed as a pointer-sized integer.
  check(driver().cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle", fmt::format("importing GPU allocation fd {}", fd));
  return AllocationHandle(handle);
}

VaRange reserve_va(std::size_t size, std::size_t alignment) {
  CUdeviceptr base = 0;
  check(driver().cuMemAddressReserve(&base, size, alignment, 0, 0), "cuMemAddressReserve",
        fmt::format("reserving {} bytes of GPU virtual addresses (alignment {})", size, alignment));
  return VaRange(base, size);
}

MemMapping map(CUdeviceptr at, std::size_t size, const AllocationHandle& handle, std::size_t offset) {
  check(driver().cuMemMap(at, size, offset, handle.get(), 0), "cuMemMap",
        fmt::format("mapping {} bytes (offset {}) at {:#x}", size, offset, at));
  return MemMapping(at, size);
}

void set_access(CUdeviceptr ptr, std::size_t size, std::span<const int> ordinals, bool read_only) {
  if (ordinals.empty()) {
    throw Error(ErrorCode::InvalidArgument, "set_access: no device to grant access to", "cuMemSetAccess");
  }
  std::vector<CUmemAccessDesc> descs;
  descs.reserve(ordinals.size());
  for (const int ordinal : ordinals) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = ordinal;
    desc.flags = read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    descs.push_back(desc);
  }
  check(driver().cuMemSetAccess(ptr, size, descs.data(), descs.size()), "cuMemSetAccess",
        fmt::format("{} access to {} bytes at {:#x} for GPU {}", read_only ? "read-only" : "read-write", size, ptr,
                    fmt::join(ordinals, ", ")));
}

MemoryInfo memory_info(int ordinal) {
  const PrimaryContext context(ordinal);
  const ScopedContext current(context.get());
  MemoryInfo info;
  check(driver().cuMemGetInfo(&info.free, &info.total), "cuMemGetInfo", fmt::format("memory of GPU {}", ordinal));
  return info;
}

// ---- copies and stream memory operations ----

namespace {
// cuMemcpyHtoD (from pageable memory), cuMemcpyDtoD and cuMemsetD8 on device memory may return before the work
// is done (CUDA's "API synchronization behavior"): wait for the legacy stream they ran on, so that "synchronous"
// means done — before a mapping is torn down, or a kernel on a non-blocking stream reads the result.
void finish_legacy_stream(const char* after) {
  check(driver().cuStreamSynchronize(nullptr), "cuStreamSynchronize", after);
}
}  // namespace

void copy_to_device(CUdeviceptr dst, const void* src, std::size_t size) {
  check(driver().cuMemcpyHtoD(dst, src, size), "cuMemcpyHtoD", fmt::format("copying {} bytes to {:#x}", size, dst));
  finish_legacy_stream("after cuMemcpyHtoD");
}

void copy_to_host(void* dst, CUdeviceptr src, std::size_t size) {
  check(driver().cuMemcpyDtoH(dst, src, size), "cuMemcpyDtoH", fmt::format("copying {} bytes from {:#x}", size, src));
}

void copy_device_to_device(CUdeviceptr dst, CUdeviceptr src, std::size_t size) {
  check(driver().cuMemcpyDtoD(dst, src, size), "cuMemcpyDtoD",
        fmt::format("copying {} bytes from {:#x} to {:#x}", size, src, dst));
  finish_legacy_stream("after cuMemcpyDtoD");
}

void memset_d8(CUdeviceptr dst, std::uint8_t value, std::size_t size) {
  check(driver().cuMemsetD8(dst, value, size), "cuMemsetD8", fmt::format("setting {} bytes at {:#x}", size, dst));
  finish_legacy_stream("after cuMemsetD8");
}

void memset_d8_async(CUdeviceptr dst, std::uint8_t value, std::size_t size, CUstream stream) {
  check(driver().cuMemsetD8Async(dst, value, size, stream), "cuMemsetD8Async",
        fmt::format("setting {} bytes at {:#x}", size, dst));
}

void synchronize(CUstream stream, std::string_view what) {
  check(driver().cuStreamSynchronize(stream), "cuStreamSynchronize", what);
}

void synchronize_context(std::string_view what) { check(driver().cuCtxSynchronize(), "cuCtxSynchronize", what); }

CUresult stream_write_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value, unsigned flags) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return api->cuStreamWriteValue64(stream, addr, value, flags);
}

CUresult stream_wait_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value, unsigned flags) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return api->cuStreamWaitValue64(stream, addr, value, flags);
}

bool stream_busy(CUstream stream) noexcept {
  const DriverApi* api = loaded_driver();
  return api != nullptr && api->cuStreamQuery(stream) == CUDA_ERROR_NOT_READY;
}

CUresult copy_async(CUdeviceptr dst, CUdeviceptr src, std::size_t size, CUstream stream) noexcept {
  const DriverApi* api = loaded_driver();
  if (api == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return api->cuMemcpyAsync(dst, src, size, stream);
}

}  // namespace gpuipc::cuda
