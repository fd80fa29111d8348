// The CUDA driver, loaded at run time: dlopen(libcuda.so.1) + cuGetProcAddress into one table, so gpuipc loads and
// works (host segments) on machines without a GPU and reports "no CUDA driver" instead of failing to link.
// This folder is the only code that calls the driver (docs/architecture.md, Layers); everything else goes through it.
#pragma once

#include <cuda.h>

#include <string>
#include <string_view>

#include "gpuipc/error.hpp"

namespace gpuipc::cuda {

// Every entry point of the table, as X(name, abi_version), like NCCL's cudawrap.h. `name` is the base name cuda.h
// declares; several are macros for a _v2 symbol, so decltype(&::name) is the newest declaration, and abi_version
// is the CUDA version that introduced exactly that ABI (the PFN_<name>_v<abi_version> typedef of cudaTypedefs.h;
// driver.cpp static_asserts every pair). The loader asks cuGetProcAddress for the base name at
// min(abi_version, driver version): a newer driver never hands back a newer ABI than the header declares. This
// matters: CUDA 13 added cuCtxSynchronize_v2(CUcontext) and cuCtxGetDevice_v2(CUdevice*, CUcontext) as separate
// declarations, yet cuGetProcAddress("cuCtxSynchronize", 13000) returns the new ABI. A header that changes a
// declaration fails the static_asserts instead of miscalling the driver.
#define GPUIPC_CUDA_REQUIRED_ENTRY_POINTS(X) \
  X(cuGetErrorName, 6000)                    \
  X(cuGetErrorString, 6000)                  \
  X(cuInit, 2000)                            \
  X(cuDriverGetVersion, 2020)                \
  X(cuDeviceGetCount, 2000)                  \
  X(cuDeviceGet, 2000)                       \
  X(cuDeviceGetName, 2000)                   \
  X(cuDeviceGetUuid, 11040)                  \
  X(cuDeviceTotalMem, 3020)                  \
  X(cuDeviceGetAttribute, 2000)              \
  X(cuDeviceGetPCIBusId, 4010)               \
  X(cuDeviceGetByPCIBusId, 4010)             \
  X(cuDeviceCanAccessPeer, 4000)             \
  X(cuDevicePrimaryCtxRetain, 7000)          \
  X(cuDevicePrimaryCtxRelease, 11000)        \
  X(cuCtxSetCurrent, 4000)                   \
  X(cuCtxGetCurrent, 4000)                   \
  X(cuCtxGetDevice, 2000)                    \
  X(cuCtxSynchronize, 2000)                  \
  X(cuCtxEnablePeerAccess, 4000)             \
  X(cuMemCreate, 10020)                      \
  X(cuMemRelease, 10020)                     \
  X(cuMemExportToShareableHandle, 10020)     \
  X(cuMemImportFromShareableHandle, 10020)   \
  X(cuMemAddressReserve, 10020)              \
  X(cuMemAddressFree, 10020)                 \
  X(cuMemMap, 10020)                         \
  X(cuMemUnmap, 10020)                       \
  X(cuMemSetAccess, 10020)                   \
  X(cuMemGetAccess, 10020)                   \
  X(cuMemGetAllocationGranularity, 10020)    \
  X(cuMemRetainAllocationHandle, 11000)      \
  X(cuMemGetInfo, 3020)                      \
  X(cuMemAlloc, 3020)                        \
  X(cuMemFree, 3020)                         \
  X(cuMemcpyHtoD, 3020)                      \
  X(cuMemcpyDtoH, 3020)                      \
  X(cuMemcpyDtoD, 3020)                      \
  X(cuMemcpyAsync, 4000)                     \
  X(cuMemcpyHtoDAsync, 3020)                 \
  X(cuMemcpyDtoHAsync, 3020)                 \
  X(cuMemsetD8, 3020)                        \
  X(cuMemsetD32, 3020)                       \
  X(cuMemsetD8Async, 3020)                   \
  X(cuMemHostRegister, 6050)                 \
  X(cuMemHostUnregister, 4000)               \
  X(cuMemHostGetDevicePointer, 3020)         \
  X(cuMemHostAlloc, 2020)                    \
  X(cuMemFreeHost, 2000)                     \
  X(cuStreamCreate, 2000)                    \
  X(cuStreamDestroy, 4000)                   \
  X(cuStreamSynchronize, 2000)               \
  X(cuStreamQuery, 2000)                     \
  X(cuStreamGetFlags, 5050)                  \
  X(cuStreamGetCtx, 9020)                    \
  X(cuStreamWaitValue32, 11070)              \
  X(cuStreamWaitValue64, 11070)              \
  X(cuStreamWriteValue32, 11070)             \
  X(cuStreamWriteValue64, 11070)             \
  X(cuStreamBatchMemOp, 11070)               \
  X(cuStreamWaitEvent, 3020)                 \
  X(cuEventCreate, 2000)                     \
  X(cuEventRecord, 2000)                     \
  X(cuEventSynchronize, 2000)                \
  X(cuEventQuery, 2000)                      \
  X(cuEventElapsedTime, 12080)               \
  X(cuEventDestroy, 4000)                    \
  X(cuIpcGetMemHandle, 4010)                 \
  X(cuIpcOpenMemHandle, 11000)               \
  X(cuIpcCloseMemHandle, 4010)               \
  X(cuModuleLoadData, 2000)                  \
  X(cuModuleUnload, 2000)                    \
  X(cuModuleGetFunction, 2000)               \
  X(cuLaunchKernel, 4000)                    \
  X(cuFuncSetAttribute, 9000)                \
  X(cuPointerGetAttribute, 4000)             \
  X(cuPointerGetAttributes, 7000)            \
  X(cuMemGetAddressRange, 3020)              \
  X(cuMemGetAllocationPropertiesFromHandle, 10020)

// Entry points gpuipc can do without (nullptr when the driver lacks them): features built on them report
// Error(Unsupported) instead.
#define GPUIPC_CUDA_OPTIONAL_ENTRY_POINTS(X)   \
  X(cuLaunchHostFunc, 10000)                   \
  X(cuIpcGetEventHandle, 4010)                 \
  X(cuIpcOpenEventHandle, 4010)                \
  X(cuMemPoolCreate, 11020)                    \
  X(cuMemPoolDestroy, 11020)                   \
  X(cuMemPoolExportToShareableHandle, 11020)   \
  X(cuMemPoolImportFromShareableHandle, 11020) \
  X(cuMemPoolExportPointer, 11020)             \
  X(cuMemPoolImportPointer, 11020)             \
  X(cuMemPoolSetAccess, 11020)                 \
  X(cuMemAllocFromPoolAsync, 11020)            \
  X(cuMemFreeAsync, 11020)                     \
  X(cuMemAllocManaged, 6000)                   \
  X(cuDeviceGetP2PAttribute, 8000)             \
  X(cuMemcpyPeerAsync, 4000)

/// The driver's entry points, fetched once. Call them as `driver().cuMemCreate(...)`: the member names go through
/// the same cuda.h macros as the declarations (cuMemGetInfo -> cuMemGetInfo_v2), so they match.
struct DriverApi {
#define GPUIPC_CUDA_DECLARE_ENTRY(name, version) decltype(&::name) name = nullptr;
  GPUIPC_CUDA_REQUIRED_ENTRY_POINTS(GPUIPC_CUDA_DECLARE_ENTRY)
  GPUIPC_CUDA_OPTIONAL_ENTRY_POINTS(GPUIPC_CUDA_DECLARE_ENTRY)
#undef GPUIPC_CUDA_DECLARE_ENTRY
  int driver_version = 0;  ///< cuDriverGetVersion, e.g. 13000
  std::string library;     ///< the file the driver was loaded from (dladdr), else the name passed to dlopen
};

/// The driver table: loaded on first use (thread-safe, once per process), cuInit(0) done. Throws
/// Error(NoDriver) when libcuda cannot be loaded or initialised (one line: what failed, that device and
/// host_pinned segments need the NVIDIA driver, that host segments work without it), Error(NoDevice) when cuInit
/// reports no GPU, and Error(Unsupported) in a child forked after the parent initialised CUDA (such a child cannot
/// use CUDA: fork before the first CUDA call, or exec). The outcome of the first load is kept: a failure is
/// reported again, the same way, by every later call.
const DriverApi& driver();

/// Whether driver() succeeds; never throws. On false, `why` (when given) gets driver()'s message.
bool driver_available(std::string* why = nullptr) noexcept;

/// "CUDA_ERROR_OUT_OF_MEMORY" for a known CUresult (from the driver when it is loaded, else a built-in table),
/// "CUresult 12345" for an unknown one. Never loads the driver, never throws.
std::string result_name(CUresult r) noexcept;

/// Builds the Error for a failed driver call: "<what>: <call> failed: CUDA_ERROR_X (n): <description>".
/// CUDA_ERROR_NOT_SUPPORTED -> Unsupported; CUDA_ERROR_NO_DEVICE / INVALID_DEVICE -> NoDevice;
/// CUDA_ERROR_OUT_OF_MEMORY stays Cuda and says "out of GPU memory"; everything else -> Cuda.
Error cuda_error(CUresult r, const char* call, std::string_view what);

/// Throws cuda_error(r, call, what) unless r is CUDA_SUCCESS.
inline void check(CUresult r, const char* call, std::string_view what) {
  if (r != CUDA_SUCCESS) throw cuda_error(r, call, what);
}

/// The table if driver() has succeeded in this process, else nullptr; never loads, never throws. For destructors
/// and hot paths. Also nullptr in a child forked after CUDA was initialised (its handles belong to the parent;
/// releasing them is neither possible nor needed).
const DriverApi* loaded_driver() noexcept;

}  // namespace gpuipc::cuda
