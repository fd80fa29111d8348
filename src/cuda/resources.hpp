// RAII owners of driver objects and the VMM primitives the segment layer builds on. Every owner is move-only
// (copy deleted, move noexcept); its destructor releases the object and never throws: a failed release is logged
// with GPUIPC_LOG_WARN. Every throwing function throws gpuipc::Error naming the driver call and the object
// (size, device), via cuda::check. In a child forked after CUDA was initialised, destructors release nothing:
// the objects belong to the parent.
//
// Context rules: VMM calls (create, export, import, reserve, map, set_access) need no particular context. Copies,
// streams, events, host registration, plain allocation, legacy IPC and modules work in the context current on the
// calling thread (make one current with PrimaryContext::make_current); their owners remember that context and
// make it current again, for the call only, when they are released from a thread where it is not.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "cuda/driver.hpp"
#include "os/fd.hpp"

namespace gpuipc::cuda {

/// A retained primary context of one device (cuDevicePrimaryCtxRetain / cuDevicePrimaryCtxRelease). Keep it alive
/// as long as anything allocated in it: the context is destroyed when its last retain is released.
class PrimaryContext {
 public:
  PrimaryContext() noexcept = default;
  /// Retains device `ordinal`'s primary context (creating it: ~100 ms and some GPU memory the first time). Throws
  /// Error(NoDevice) for a bad ordinal, Error(NoDriver) without a driver.
  explicit PrimaryContext(int ordinal);
  PrimaryContext(const PrimaryContext&) = delete;
  PrimaryContext& operator=(const PrimaryContext&) = delete;
  PrimaryContext(PrimaryContext&& other) noexcept;
  PrimaryContext& operator=(PrimaryContext&& other) noexcept;
  ~PrimaryContext();

  /// Binds the context to the calling thread (cuCtxSetCurrent). Throws Error(Cuda).
  void make_current() const;
  CUcontext get() const noexcept { return m_ctx; }
  CUdevice device() const noexcept { return m_device; }
  int ordinal() const noexcept { return m_ordinal; }
  explicit operator bool() const noexcept { return m_ctx != nullptr; }

 private:
  void reset() noexcept;
  int m_ordinal = -1;
  CUdevice m_device = 0;
  CUcontext m_ctx = nullptr;
};

/// Makes `ctx` current on this thread for its lifetime and restores the previous context after. Throws
/// Error(Cuda) when the switch fails; the restore never throws (logged).
class ScopedContext {
 public:
  explicit ScopedContext(CUcontext ctx);
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  ScopedContext(ScopedContext&&) = delete;
  ScopedContext& operator=(ScopedContext&&) = delete;
  ~ScopedContext();

 private:
  CUcontext m_previous = nullptr;
  bool m_switched = false;
};

/// The context current on the calling thread (nullptr when none). Throws Error(NoDriver).
CUcontext current_context();

/// The ordinal of the device of the current context. Throws Error(Cuda) when no context is current.
int current_ordinal();

/// cuDeviceGetAttribute for device `ordinal`. Throws Error naming the attribute number.
int device_attribute(CUdevice_attribute attribute, int ordinal);

/// A physical allocation (CUmemGenericAllocationHandle); cuMemRelease on destruction. The memory itself lives
/// until every handle, exported fd and mapping of it is gone.
class AllocationHandle {
 public:
  AllocationHandle() noexcept = default;
  /// Takes ownership of `handle`.
  explicit AllocationHandle(CUmemGenericAllocationHandle handle) noexcept : m_handle(handle), m_valid(true) {}
  AllocationHandle(const AllocationHandle&) = delete;
  AllocationHandle& operator=(const AllocationHandle&) = delete;
  AllocationHandle(AllocationHandle&& other) noexcept;
  AllocationHandle& operator=(AllocationHandle&& other) noexcept;
  ~AllocationHandle();

  CUmemGenericAllocationHandle get() const noexcept { return m_handle; }
  bool valid() const noexcept { return m_valid; }
  explicit operator bool() const noexcept { return m_valid; }

 private:
  void reset() noexcept;
  CUmemGenericAllocationHandle m_handle = 0;
  bool m_valid = false;
};

/// A reserved range of virtual addresses; cuMemAddressFree on destruction (unmap what is mapped in it first:
/// declare the MemMapping after the VaRange so it is destroyed before).
class VaRange {
 public:
  VaRange() noexcept = default;
  /// Takes ownership of a range from cuMemAddressReserve.
  VaRange(CUdeviceptr base, std::size_t size) noexcept : m_base(base), m_size(size) {}
  VaRange(const VaRange&) = delete;
  VaRange& operator=(const VaRange&) = delete;
  VaRange(VaRange&& other) noexcept;
  VaRange& operator=(VaRange&& other) noexcept;
  ~VaRange();

  CUdeviceptr base() const noexcept { return m_base; }
  std::size_t size() const noexcept { return m_size; }
  explicit operator bool() const noexcept { return m_base != 0; }

 private:
  void reset() noexcept;
  CUdeviceptr m_base = 0;
  std::size_t m_size = 0;
};

/// An allocation mapped at an address; cuMemUnmap on destruction.
class MemMapping {
 public:
  MemMapping() noexcept = default;
  /// Takes ownership of a mapping made by cuMemMap.
  MemMapping(CUdeviceptr ptr, std::size_t size) noexcept : m_ptr(ptr), m_size(size) {}
  MemMapping(const MemMapping&) = delete;
  MemMapping& operator=(const MemMapping&) = delete;
  MemMapping(MemMapping&& other) noexcept;
  MemMapping& operator=(MemMapping&& other) noexcept;
  ~MemMapping();

  CUdeviceptr ptr() const noexcept { return m_ptr; }
  std::size_t size() const noexcept { return m_size; }
  explicit operator bool() const noexcept { return m_ptr != 0; }

 private:
  void reset() noexcept;
  CUdeviceptr m_ptr = 0;
  std::size_t m_size = 0;
};

/// Host memory registered with the driver (page-locked, GPU-visible); cuMemHostUnregister on destruction. The
/// caller keeps the memory mapped for as long as the registration lives.
class HostRegistration {
 public:
  HostRegistration() noexcept = default;
  /// cuMemHostRegister(ptr, size, CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP, plus READ_ONLY when `read_only`) in
  /// the current context. ptr and size must be page-aligned (a memfd mapping is). Throws Error naming the size;
  /// Error(Unsupported) when the device cannot register host memory (or read-only memory).
  static HostRegistration register_memory(void* ptr, std::size_t size, bool read_only = false);
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  HostRegistration(HostRegistration&& other) noexcept;
  HostRegistration& operator=(HostRegistration&& other) noexcept;
  ~HostRegistration();

  /// The address GPU code and stream memory operations use for the registered memory (cuMemHostGetDevicePointer;
  /// with unified addressing it equals the host address). Throws Error(Cuda).
  CUdeviceptr device_pointer() const;
  void* host_pointer() const noexcept { return m_ptr; }
  std::size_t size() const noexcept { return m_size; }
  explicit operator bool() const noexcept { return m_ptr != nullptr; }

 private:
  HostRegistration(void* ptr, std::size_t size, CUcontext ctx) noexcept : m_ptr(ptr), m_size(size), m_ctx(ctx) {}
  void reset() noexcept;
  void* m_ptr = nullptr;
  std::size_t m_size = 0;
  CUcontext m_ctx = nullptr;
};

/// A stream of the current context; cuStreamDestroy on destruction (pending work still completes).
class Stream {
 public:
  Stream() noexcept = default;
  /// cuStreamCreate with CU_STREAM_NON_BLOCKING (no implicit sync with the legacy default stream) unless
  /// `non_blocking` is false. Throws Error(Cuda).
  static Stream create(bool non_blocking = true);
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Stream(Stream&& other) noexcept;
  Stream& operator=(Stream&& other) noexcept;
  ~Stream();

  CUstream get() const noexcept { return m_stream; }
  /// Blocks until the stream's work is done. Throws Error(Cuda) when it failed.
  void synchronize() const;
  /// True when the stream's work is done, false while some is pending. Throws Error(Cuda) when it failed.
  bool query() const;
  explicit operator bool() const noexcept { return m_stream != nullptr; }

 private:
  Stream(CUstream stream, CUcontext ctx) noexcept : m_stream(stream), m_ctx(ctx) {}
  void reset() noexcept;
  CUstream m_stream = nullptr;
  CUcontext m_ctx = nullptr;
};

/// An event of the current context; cuEventDestroy on destruction.
class Event {
 public:
  Event() noexcept = default;
  /// cuEventCreate(flags) (CU_EVENT_DEFAULT records timing; add CU_EVENT_DISABLE_TIMING for pure sync). Throws.
  static Event create(unsigned flags = CU_EVENT_DEFAULT);
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  ~Event();

  CUevent get() const noexcept { return m_event; }
  void record(CUstream stream) const;
  void synchronize() const;
  /// True when the recorded work is done.
  bool query() const;
  /// Milliseconds between two recorded, completed events (cuEventElapsedTime). Throws Error(Cuda).
  static float elapsed_ms(const Event& start, const Event& end);
  explicit operator bool() const noexcept { return m_event != nullptr; }

 private:
  Event(CUevent event, CUcontext ctx) noexcept : m_event(event), m_ctx(ctx) {}
  void reset() noexcept;
  CUevent m_event = nullptr;
  CUcontext m_ctx = nullptr;
};

/// Plain device memory from cuMemAlloc in the current context (baselines and scratch); cuMemFree on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() noexcept = default;
  /// cuMemAlloc(size). Throws Error(Cuda) ("out of GPU memory" when it is) naming the size.
  static DeviceBuffer allocate(std::size_t size);
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer();

  CUdeviceptr get() const noexcept { return m_ptr; }
  std::size_t size() const noexcept { return m_size; }
  explicit operator bool() const noexcept { return m_ptr != 0; }

 private:
  DeviceBuffer(CUdeviceptr ptr, std::size_t size, CUcontext ctx) noexcept : m_ptr(ptr), m_size(size), m_ctx(ctx) {}
  void reset() noexcept;
  CUdeviceptr m_ptr = 0;
  std::size_t m_size = 0;
  CUcontext m_ctx = nullptr;
};

/// The legacy IPC handle of memory from cuMemAlloc (cudaMalloc) at `ptr`, which must be the allocation's base
/// (cuIpcGetMemHandle; the importer adds the offset). Throws Error(Cuda).
CUipcMemHandle ipc_get_mem_handle(CUdeviceptr ptr);

/// Another process's cuMemAlloc memory opened with cuIpcOpenMemHandle in the current context;
/// cuIpcCloseMemHandle on destruction. Lives no longer than the exporter's allocation.
class IpcMapping {
 public:
  IpcMapping() noexcept = default;
  /// cuIpcOpenMemHandle(handle, flags). Throws Error(Cuda); opening a handle of this same process fails with
  /// CUDA_ERROR_INVALID_CONTEXT (a driver rule).
  static IpcMapping open(const CUipcMemHandle& handle, unsigned flags = CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  IpcMapping(IpcMapping&& other) noexcept;
  IpcMapping& operator=(IpcMapping&& other) noexcept;
  ~IpcMapping();

  CUdeviceptr get() const noexcept { return m_ptr; }
  explicit operator bool() const noexcept { return m_ptr != 0; }

 private:
  IpcMapping(CUdeviceptr ptr, CUcontext ctx) noexcept : m_ptr(ptr), m_ctx(ctx) {}
  void reset() noexcept;
  CUdeviceptr m_ptr = 0;
  CUcontext m_ctx = nullptr;
};

/// A module (cubin, PTX or fatbinary) loaded into the current context; cuModuleUnload on destruction.
class Module {
 public:
  Module() noexcept = default;
  /// cuModuleLoadData(image). `what` names the image in errors ("embedded gpuipc kernels"). Throws Error(Cuda),
  /// e.g. CUDA_ERROR_NO_BINARY_FOR_GPU when the image has no code for this GPU.
  static Module load(const void* image, std::string_view what);
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  Module(Module&& other) noexcept;
  Module& operator=(Module&& other) noexcept;
  ~Module();

  /// cuModuleGetFunction. Throws Error(NotFound) naming the kernel when the module lacks it.
  CUfunction function(const char* name) const;
  CUmodule get() const noexcept { return m_module; }
  explicit operator bool() const noexcept { return m_module != nullptr; }

 private:
  Module(CUmodule module, CUcontext ctx, std::string what) noexcept
      : m_module(module), m_ctx(ctx), m_what(std::move(what)) {}
  void reset() noexcept;
  CUmodule m_module = nullptr;
  CUcontext m_ctx = nullptr;
  std::string m_what;
};

/// One kernel launch (cuLaunchKernel) of a 1-D grid. `args` as cuLaunchKernel's kernelParams; `name` for errors.
/// Throws Error(Cuda) (launch failures only: faults surface at the next synchronisation).
void launch(CUfunction function, unsigned grid, unsigned block, unsigned shared_bytes, CUstream stream, void** args,
            const char* name);

// ---- VMM primitives (device segments: docs/segments.md, Kinds) ----

/// cuMemGetAllocationGranularity for pinned device memory of `ordinal` with POSIX-fd handles: the minimum, or
/// the recommended (better performance) when `recommended`. Sizes passed to create_exportable must be multiples
/// of the minimum. Throws Error.
std::size_t allocation_granularity(int ordinal, bool recommended);

/// Rounds `size` up to a multiple of `granularity` (a power of two or not). Throws Error(InvalidArgument) on
/// overflow.
std::size_t round_up(std::size_t size, std::size_t granularity);

/// cuMemCreate of `size` bytes (already a multiple of allocation_granularity(ordinal, false): else
/// Error(InvalidArgument)) of pinned memory on device `ordinal`, exportable as a POSIX fd, and also as a fabric
/// handle when `fabric` is true and the device supports fabric handles (if the driver then refuses fabric, e.g.
/// no IMEX channel, it falls back to POSIX fd only, logged at info). Throws Error naming size and device
/// ("out of GPU memory" when it is).
AllocationHandle create_exportable(int ordinal, std::size_t size, bool fabric = false);

/// cuMemExportToShareableHandle as a POSIX fd (costs 0.6-0.8 ms: export once). The fd keeps the memory alive on
/// its own, in any process that holds it, CUDA or not. The driver returns it close-on-exec (driver 580; checked by
/// tests/gpu/test_cuda_layer.cpp). Throws Error.
os::UniqueFd export_fd(const AllocationHandle& handle);

/// cuMemImportFromShareableHandle of a POSIX fd from export_fd (any process). The caller keeps (and closes) its
/// fd. Throws Error.
AllocationHandle import_fd(int fd);

/// cuMemAddressReserve of `size` bytes aligned to `alignment` (0: the driver's default), anywhere. Throws Error.
VaRange reserve_va(std::size_t size, std::size_t alignment);

/// cuMemMap of `size` bytes of `handle`, from `offset` into the allocation, at `at` (inside a VaRange). The
/// mapping is not accessible until set_access. Throws Error.
MemMapping map(CUdeviceptr at, std::size_t size, const AllocationHandle& handle, std::size_t offset = 0);

/// cuMemSetAccess over [ptr, ptr + size): one descriptor per device ordinal, read-only (CU_MEM_ACCESS_FLAGS_PROT_READ:
/// a write faults the writer's context) or read-write. Throws Error.
void set_access(CUdeviceptr ptr, std::size_t size, std::span<const int> ordinals, bool read_only);

/// Free and total memory of a device.
struct MemoryInfo {
  std::size_t free = 0;
  std::size_t total = 0;
};

/// cuMemGetInfo in device `ordinal`'s primary context (retained for the call: this creates it if nothing holds
/// it, which costs ~100 ms). Throws Error.
MemoryInfo memory_info(int ordinal);

// ---- copies and stream memory operations ----

/// Synchronous copies and memset in the current context (cuMemcpyHtoD, cuMemcpyDtoH, cuMemcpyDtoD, cuMemsetD8): they
/// return once the work is done (the legacy stream is synchronised after those the driver returns from early).
/// Throw Error naming the size.
void copy_to_device(CUdeviceptr dst, const void* src, std::size_t size);
void copy_to_host(void* dst, CUdeviceptr src, std::size_t size);
void copy_device_to_device(CUdeviceptr dst, CUdeviceptr src, std::size_t size);
void memset_d8(CUdeviceptr dst, std::uint8_t value, std::size_t size);
/// cuMemsetD8Async: the same, in `stream` order. Throws Error.
void memset_d8_async(CUdeviceptr dst, std::uint8_t value, std::size_t size, CUstream stream);
/// cuStreamSynchronize of a stream the caller does not own as a Stream; `what` names it in errors. Throws Error.
void synchronize(CUstream stream, std::string_view what);
/// cuCtxSynchronize of the current context: every stream of it is done. `what` names the reason in errors.
/// Throws Error.
void synchronize_context(std::string_view what);

/// Stream-ordered 64-bit memory operations on registered host or device memory (the semaphore mechanism).
/// Hot path: no exception, no allocation; they return the CUresult (CUDA_ERROR_NOT_INITIALIZED without a
/// driver). write: cuStreamWriteValue64 (flags CU_STREAM_WRITE_VALUE_DEFAULT orders it after prior work).
/// wait: cuStreamWaitValue64 (CU_STREAM_WAIT_VALUE_GEQ by default).
CUresult stream_write_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value,
                              unsigned flags = CU_STREAM_WRITE_VALUE_DEFAULT) noexcept;
CUresult stream_wait_value64(CUstream stream, CUdeviceptr addr, std::uint64_t value,
                             unsigned flags = CU_STREAM_WAIT_VALUE_GEQ) noexcept;
/// Whether `stream` still has work to do (cuStreamQuery says CUDA_ERROR_NOT_READY). Hot path: false on any other
/// answer, including errors.
bool stream_busy(CUstream stream) noexcept;
/// cuMemcpyAsync in `stream` order (unified addresses: host or device on either side). Hot path: returns the
/// CUresult, no exception.
CUresult copy_async(CUdeviceptr dst, CUdeviceptr src, std::size_t size, CUstream stream) noexcept;

}  // namespace gpuipc::cuda
