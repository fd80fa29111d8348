#include "cuda/driver.hpp"

#include <cudaTypedefs.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>

#include "base/config.hpp"
#include "base/log.hpp"
#include "os/dynamic_library.hpp"
#include "os/path.hpp"
#include "os/process.hpp"

namespace gpuipc::cuda {
namespace {

// The ABI of every entry point, checked against cudaTypedefs.h (see driver.hpp). A failure here means the CUDA
// headers changed a declaration: update the version in driver.hpp to the new PFN_<name>_v<N>.
static_assert(std::is_same_v<decltype(&::cuGetErrorName), PFN_cuGetErrorName_v6000>);
static_assert(std::is_same_v<decltype(&::cuGetErrorString), PFN_cuGetErrorString_v6000>);
static_assert(std::is_same_v<decltype(&::cuInit), PFN_cuInit_v2000>);
static_assert(std::is_same_v<decltype(&::cuDriverGetVersion), PFN_cuDriverGetVersion_v2020>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetCount), PFN_cuDeviceGetCount_v2000>);
static_assert(std::is_same_v<decltype(&::cuDeviceGet), PFN_cuDeviceGet_v2000>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetName), PFN_cuDeviceGetName_v2000>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetUuid), PFN_cuDeviceGetUuid_v11040>);
static_assert(std::is_same_v<decltype(&::cuDeviceTotalMem), PFN_cuDeviceTotalMem_v3020>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetAttribute), PFN_cuDeviceGetAttribute_v2000>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetPCIBusId), PFN_cuDeviceGetPCIBusId_v4010>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetByPCIBusId), PFN_cuDeviceGetByPCIBusId_v4010>);
static_assert(std::is_same_v<decltype(&::cuDeviceCanAccessPeer), PFN_cuDeviceCanAccessPeer_v4000>);
static_assert(std::is_same_v<decltype(&::cuDevicePrimaryCtxRetain), PFN_cuDevicePrimaryCtxRetain_v7000>);
static_assert(std::is_same_v<decltype(&::cuDevicePrimaryCtxRelease), PFN_cuDevicePrimaryCtxRelease_v11000>);
static_assert(std::is_same_v<decltype(&::cuCtxSetCurrent), PFN_cuCtxSetCurrent_v4000>);
static_assert(std::is_same_v<decltype(&::cuCtxGetCurrent), PFN_cuCtxGetCurrent_v4000>);
static_assert(std::is_same_v<decltype(&::cuCtxGetDevice), PFN_cuCtxGetDevice_v2000>);
static_assert(std::is_same_v<decltype(&::cuCtxSynchronize), PFN_cuCtxSynchronize_v2000>);
static_assert(std::is_same_v<decltype(&::cuCtxEnablePeerAccess), PFN_cuCtxEnablePeerAccess_v4000>);
static_assert(std::is_same_v<decltype(&::cuMemCreate), PFN_cuMemCreate_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemRelease), PFN_cuMemRelease_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemExportToShareableHandle), PFN_cuMemExportToShareableHandle_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemImportFromShareableHandle), PFN_cuMemImportFromShareableHandle_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemAddressReserve), PFN_cuMemAddressReserve_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemAddressFree), PFN_cuMemAddressFree_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemMap), PFN_cuMemMap_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemUnmap), PFN_cuMemUnmap_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemSetAccess), PFN_cuMemSetAccess_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemGetAccess), PFN_cuMemGetAccess_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemGetAllocationGranularity), PFN_cuMemGetAllocationGranularity_v10020>);
static_assert(std::is_same_v<decltype(&::cuMemRetainAllocationHandle), PFN_cuMemRetainAllocationHandle_v11000>);
static_assert(std::is_same_v<decltype(&::cuMemGetInfo), PFN_cuMemGetInfo_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemAlloc), PFN_cuMemAlloc_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemFree), PFN_cuMemFree_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemcpyHtoD), PFN_cuMemcpyHtoD_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemcpyDtoH), PFN_cuMemcpyDtoH_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemcpyDtoD), PFN_cuMemcpyDtoD_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemcpyAsync), PFN_cuMemcpyAsync_v4000>);
static_assert(std::is_same_v<decltype(&::cuMemcpyHtoDAsync), PFN_cuMemcpyHtoDAsync_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemcpyDtoHAsync), PFN_cuMemcpyDtoHAsync_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemsetD8), PFN_cuMemsetD8_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemsetD32), PFN_cuMemsetD32_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemsetD8Async), PFN_cuMemsetD8Async_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemHostRegister), PFN_cuMemHostRegister_v6050>);
static_assert(std::is_same_v<decltype(&::cuMemHostUnregister), PFN_cuMemHostUnregister_v4000>);
static_assert(std::is_same_v<decltype(&::cuMemHostGetDevicePointer), PFN_cuMemHostGetDevicePointer_v3020>);
static_assert(std::is_same_v<decltype(&::cuMemHostAlloc), PFN_cuMemHostAlloc_v2020>);
static_assert(std::is_same_v<decltype(&::cuMemFreeHost), PFN_cuMemFreeHost_v2000>);
static_assert(std::is_same_v<decltype(&::cuStreamCreate), PFN_cuStreamCreate_v2000>);
static_assert(std::is_same_v<decltype(&::cuStreamDestroy), PFN_cuStreamDestroy_v4000>);
static_assert(std::is_same_v<decltype(&::cuStreamSynchronize), PFN_cuStreamSynchronize_v2000>);
static_assert(std::is_same_v<decltype(&::cuStreamQuery), PFN_cuStreamQuery_v2000>);
static_assert(std::is_same_v<decltype(&::cuStreamGetFlags), PFN_cuStreamGetFlags_v5050>);
static_assert(std::is_same_v<decltype(&::cuStreamGetCtx), PFN_cuStreamGetCtx_v9020>);
static_assert(std::is_same_v<decltype(&::cuStreamWaitValue32), PFN_cuStreamWaitValue32_v11070>);
static_assert(std::is_same_v<decltype(&::cuStreamWaitValue64), PFN_cuStreamWaitValue64_v11070>);
static_assert(std::is_same_v<decltype(&::cuStreamWriteValue32), PFN_cuStreamWriteValue32_v11070>);
static_assert(std::is_same_v<decltype(&::cuStreamWriteValue64), PFN_cuStreamWriteValue64_v11070>);
static_assert(std::is_same_v<decltype(&::cuStreamBatchMemOp), PFN_cuStreamBatchMemOp_v11070>);
static_assert(std::is_same_v<decltype(&::cuStreamWaitEvent), PFN_cuStreamWaitEvent_v3020>);
static_assert(std::is_same_v<decltype(&::cuEventCreate), PFN_cuEventCreate_v2000>);
static_assert(std::is_same_v<decltype(&::cuEventRecord), PFN_cuEventRecord_v2000>);
static_assert(std::is_same_v<decltype(&::cuEventSynchronize), PFN_cuEventSynchronize_v2000>);
static_assert(std::is_same_v<decltype(&::cuEventQuery), PFN_cuEventQuery_v2000>);
static_assert(std::is_same_v<decltype(&::cuEventElapsedTime), PFN_cuEventElapsedTime_v12080>);
static_assert(std::is_same_v<decltype(&::cuEventDestroy), PFN_cuEventDestroy_v4000>);
static_assert(std::is_same_v<decltype(&::cuIpcGetMemHandle), PFN_cuIpcGetMemHandle_v4010>);
static_assert(std::is_same_v<decltype(&::cuIpcOpenMemHandle), PFN_cuIpcOpenMemHandle_v11000>);
static_assert(std::is_same_v<decltype(&::cuIpcCloseMemHandle), PFN_cuIpcCloseMemHandle_v4010>);
static_assert(std::is_same_v<decltype(&::cuModuleLoadData), PFN_cuModuleLoadData_v2000>);
static_assert(std::is_same_v<decltype(&::cuModuleUnload), PFN_cuModuleUnload_v2000>);
static_assert(std::is_same_v<decltype(&::cuModuleGetFunction), PFN_cuModuleGetFunction_v2000>);
static_assert(std::is_same_v<decltype(&::cuLaunchKernel), PFN_cuLaunchKernel_v4000>);
static_assert(std::is_same_v<decltype(&::cuFuncSetAttribute), PFN_cuFuncSetAttribute_v9000>);
static_assert(std::is_same_v<decltype(&::cuPointerGetAttribute), PFN_cuPointerGetAttribute_v4000>);
static_assert(std::is_same_v<decltype(&::cuMemGetAddressRange), PFN_cuMemGetAddressRange_v3020>);
static_assert(std::is_same_v<decltype(&::cuPointerGetAttributes), PFN_cuPointerGetAttributes_v7000>);
static_assert(std::is_same_v<decltype(&::cuMemGetAllocationPropertiesFromHandle),
                             PFN_cuMemGetAllocationPropertiesFromHandle_v10020>);
static_assert(std::is_same_v<decltype(&::cuLaunchHostFunc), PFN_cuLaunchHostFunc_v10000>);
static_assert(std::is_same_v<decltype(&::cuIpcGetEventHandle), PFN_cuIpcGetEventHandle_v4010>);
static_assert(std::is_same_v<decltype(&::cuIpcOpenEventHandle), PFN_cuIpcOpenEventHandle_v4010>);
static_assert(std::is_same_v<decltype(&::cuMemPoolCreate), PFN_cuMemPoolCreate_v11020>);
static_assert(std::is_same_v<decltype(&::cuMemPoolDestroy), PFN_cuMemPoolDestroy_v11020>);
static_assert(
    std::is_same_v<decltype(&::cuMemPoolExportToShareableHandle), PFN_cuMemPoolExportToShareableHandle_v11020>);
static_assert(
    std::is_same_v<decltype(&::cuMemPoolImportFromShareableHandle), PFN_cuMemPoolImportFromShareableHandle_v11020>);
static_assert(std::is_same_v<decltype(&::cuMemPoolExportPointer), PFN_cuMemPoolExportPointer_v11020>);
static_assert(std::is_same_v<decltype(&::cuMemPoolImportPointer), PFN_cuMemPoolImportPointer_v11020>);
static_assert(std::is_same_v<decltype(&::cuMemPoolSetAccess), PFN_cuMemPoolSetAccess_v11020>);
static_assert(std::is_same_v<decltype(&::cuMemAllocFromPoolAsync), PFN_cuMemAllocFromPoolAsync_v11020>);
static_assert(std::is_same_v<decltype(&::cuMemFreeAsync), PFN_cuMemFreeAsync_v11020>);
static_assert(std::is_same_v<decltype(&::cuMemAllocManaged), PFN_cuMemAllocManaged_v6000>);
static_assert(std::is_same_v<decltype(&::cuDeviceGetP2PAttribute), PFN_cuDeviceGetP2PAttribute_v8000>);
static_assert(std::is_same_v<decltype(&::cuMemcpyPeerAsync), PFN_cuMemcpyPeerAsync_v4000>);
// Below its ABI version the driver returns an older ABI of cuEventElapsedTime, of the same type.
static_assert(std::is_same_v<decltype(&::cuEventElapsedTime), PFN_cuEventElapsedTime_v2000>);

// The built-in table for result_name when the driver (or its cuGetErrorName) is absent. From cuda.h (CUDA 13.0).
struct ResultName {
  int value;
  const char* name;
};
constexpr ResultName kResultNames[] = {
    {0, "CUDA_SUCCESS"},
    {1, "CUDA_ERROR_INVALID_VALUE"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY"},
    {3, "CUDA_ERROR_NOT_INITIALIZED"},
    {4, "CUDA_ERROR_DEINITIALIZED"},
    {5, "CUDA_ERROR_PROFILER_DISABLED"},
    {6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED"},
    {7, "CUDA_ERROR_PROFILER_ALREADY_STARTED"},
    {8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED"},
    {34, "CUDA_ERROR_STUB_LIBRARY"},
    {36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER"},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE"},
    {100, "CUDA_ERROR_NO_DEVICE"},
    {101, "CUDA_ERROR_INVALID_DEVICE"},
    {102, "CUDA_ERROR_DEVICE_NOT_LICENSED"},
    {200, "CUDA_ERROR_INVALID_IMAGE"},
    {201, "CUDA_ERROR_INVALID_CONTEXT"},
    {202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT"},
    {205, "CUDA_ERROR_MAP_FAILED"},
    {206, "CUDA_ERROR_UNMAP_FAILED"},
    {207, "CUDA_ERROR_ARRAY_IS_MAPPED"},
    {208, "CUDA_ERROR_ALREADY_MAPPED"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU"},
    {210, "CUDA_ERROR_ALREADY_ACQUIRED"},
    {211, "CUDA_ERROR_NOT_MAPPED"},
    {212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY"},
    {213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER"},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE"},
    {215, "CUDA_ERROR_UNSUPPORTED_LIMIT"},
    {216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE"},
    {217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED"},
    {218, "CUDA_ERROR_INVALID_PTX"},
    {219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT"},
    {220, "CUDA_ERROR_NVLINK_UNCORRECTABLE"},
    {221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND"},
    {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"},
    {223, "CUDA_ERROR_JIT_COMPILATION_DISABLED"},
    {224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY"},
    {225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC"},
    {226, "CUDA_ERROR_CONTAINED"},
    {300, "CUDA_ERROR_INVALID_SOURCE"},
    {301, "CUDA_ERROR_FILE_NOT_FOUND"},
    {302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND"},
    {303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM"},
    {400, "CUDA_ERROR_INVALID_HANDLE"},
    {401, "CUDA_ERROR_ILLEGAL_STATE"},
    {402, "CUDA_ERROR_LOSSY_QUERY"},
    {500, "CUDA_ERROR_NOT_FOUND"},
    {600, "CUDA_ERROR_NOT_READY"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"},
    {702, "CUDA_ERROR_LAUNCH_TIMEOUT"},
    {703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED"},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED"},
    {710, "CUDA_ERROR_ASSERT"},
    {711, "CUDA_ERROR_TOO_MANY_PEERS"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"},
    {714, "CUDA_ERROR_HARDWARE_STACK_ERROR"},
    {715, "CUDA_ERROR_ILLEGAL_INSTRUCTION"},
    {716, "CUDA_ERROR_MISALIGNED_ADDRESS"},
    {717, "CUDA_ERROR_INVALID_ADDRESS_SPACE"},
    {718, "CUDA_ERROR_INVALID_PC"},
    {719, "CUDA_ERROR_LAUNCH_FAILED"},
    {720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE"},
    {721, "CUDA_ERROR_TENSOR_MEMORY_LEAK"},
    {800, "CUDA_ERROR_NOT_PERMITTED"},
    {801, "CUDA_ERROR_NOT_SUPPORTED"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY"},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"},
    {804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE"},
    {805, "CUDA_ERROR_MPS_CONNECTION_FAILED"},
    {806, "CUDA_ERROR_MPS_RPC_FAILURE"},
    {807, "CUDA_ERROR_MPS_SERVER_NOT_READY"},
    {808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED"},
    {809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED"},
    {810, "CUDA_ERROR_MPS_CLIENT_TERMINATED"},
    {811, "CUDA_ERROR_CDP_NOT_SUPPORTED"},
    {812, "CUDA_ERROR_CDP_VERSION_MISMATCH"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"},
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE"},
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED"},
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"},
    {907, "CUDA_ERROR_CAPTURED_EVENT"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"},
    {909, "CUDA_ERROR_TIMEOUT"},
    {910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE"},
    {911, "CUDA_ERROR_EXTERNAL_DEVICE"},
    {912, "CUDA_ERROR_INVALID_CLUSTER_SIZE"},
    {913, "CUDA_ERROR_FUNCTION_NOT_LOADED"},
    {914, "CUDA_ERROR_INVALID_RESOURCE_TYPE"},
    {915, "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"},
    {916, "CUDA_ERROR_KEY_ROTATION"},
    {999, "CUDA_ERROR_UNKNOWN"},
};

using GetProcAddressV2 = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
using GetProcAddressV1 = CUresult (*)(const char*, void**, int, cuuint64_t);
using DriverGetVersion = CUresult (*)(int*);

constexpr const char* kDefaultLibrary = "libcuda.so.1";
constexpr const char* kNeedsDriver =
    "device and host_pinned segments need the NVIDIA driver; host segments work without it";

struct State {
  std::once_flag once;
  DriverApi api;
  std::optional<Error> error;
};

// Never destroyed: destructors of static RAII objects in other translation units may still release driver
// objects during exit. The library handle is never dlclose'd for the same reason.
State& state() {
  static State* s = new State();  // NOLINT(cppcoreguidelines-owning-memory): deliberately leaked
  return *s;
}

std::atomic<const DriverApi*> g_loaded{nullptr};
std::atomic<bool> g_forked_after_init{false};

void on_fork_child() noexcept { g_forked_after_init.store(true, std::memory_order_relaxed); }

std::string version_string(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

Error no_driver(const std::string& what) {
  return Error(ErrorCode::NoDriver, fmt::format("no CUDA driver: {}; {}", what, kNeedsDriver), "dlopen");
}

const char* name_from_table(CUresult r) noexcept {
  for (const auto& e : kResultNames) {
    if (e.value == static_cast<int>(r)) return e.name;
  }
  return nullptr;
}

std::string result_name_via(const DriverApi* api, CUresult r) noexcept {
  try {
    if (api != nullptr && api->cuGetErrorName != nullptr) {
      const char* s = nullptr;
      if (api->cuGetErrorName(r, &s) == CUDA_SUCCESS && s != nullptr) return s;
    }
    if (const char* s = name_from_table(r)) return s;
    return fmt::format("CUresult {}", static_cast<int>(r));
  } catch (...) {
    return "CUresult";
  }
}

std::string description_via(const DriverApi* api, CUresult r) {
  if (api != nullptr && api->cuGetErrorString != nullptr) {
    const char* s = nullptr;
    if (api->cuGetErrorString(r, &s) == CUDA_SUCCESS && s != nullptr) return s;
  }
  return {};
}

void load(DriverApi& api) {
  const std::string lib = config::env_raw("GPUIPC_CUDA_LIBRARY").value_or(kDefaultLibrary);
  api.library = lib;
  std::string dl_error;
  const os::DynamicLibrary library = os::DynamicLibrary::open(lib, dl_error);
  if (!library) throw no_driver(fmt::format("dlopen({}) failed: {}", lib, dl_error));

  auto get_proc_v2 = reinterpret_cast<GetProcAddressV2>(library.symbol("cuGetProcAddress_v2"));
  auto get_proc_v1 =
      get_proc_v2 != nullptr ? nullptr : reinterpret_cast<GetProcAddressV1>(library.symbol("cuGetProcAddress"));
  auto get_version = reinterpret_cast<DriverGetVersion>(library.symbol("cuDriverGetVersion"));
  if ((get_proc_v2 == nullptr && get_proc_v1 == nullptr) || get_version == nullptr) {
    throw no_driver(
        fmt::format("{} has no cuGetProcAddress or cuDriverGetVersion: it is not the NVIDIA driver "
                    "library, or one older than CUDA 11.3 (update the driver)",
                    lib));
  }
  if (std::string path = os::module_path(reinterpret_cast<const void*>(get_version)); !path.empty()) {
    api.library = std::move(path);
  }
  int version = 0;
  if (const CUresult r = get_version(&version); r != CUDA_SUCCESS || version <= 0) {
    throw no_driver(fmt::format("cuDriverGetVersion of {} failed (CUresult {})", api.library, static_cast<int>(r)));
  }
  api.driver_version = version;

  // Returns the entry point, or nullptr (symbol unknown, or only an ABI newer than asked for exists).
  auto fetch = [&](const char* name, int abi_version) -> void* {
    void* fn = nullptr;
    const int ask = std::min(abi_version, version);
    CUresult r = CUDA_SUCCESS;
    if (get_proc_v2 != nullptr) {
      CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
      r = get_proc_v2(name, &fn, ask, CU_GET_PROC_ADDRESS_DEFAULT, &status);
      if (status != CU_GET_PROC_ADDRESS_SUCCESS) fn = nullptr;
    } else {
      r = get_proc_v1(name, &fn, ask, CU_GET_PROC_ADDRESS_DEFAULT);
    }
    return r == CUDA_SUCCESS ? fn : nullptr;
  };
  auto require = [&](const char* name, void* fn) {
    if (fn == nullptr) {
      throw no_driver(fmt::format("the CUDA driver {} ({}) lacks the entry point {}: update the NVIDIA driver",
                                  version_string(version), api.library, name));
    }
  };
#define GPUIPC_CUDA_FETCH_REQUIRED(name, abi_version)    \
  {                                                      \
    void* fn = fetch(#name, abi_version);                \
    require(#name, fn);                                  \
    api.name = reinterpret_cast<decltype(api.name)>(fn); \
  }
#define GPUIPC_CUDA_FETCH_OPTIONAL(name, abi_version) \
  api.name = reinterpret_cast<decltype(api.name)>(fetch(#name, abi_version));
  GPUIPC_CUDA_REQUIRED_ENTRY_POINTS(GPUIPC_CUDA_FETCH_REQUIRED)
  GPUIPC_CUDA_OPTIONAL_ENTRY_POINTS(GPUIPC_CUDA_FETCH_OPTIONAL)
#undef GPUIPC_CUDA_FETCH_REQUIRED
#undef GPUIPC_CUDA_FETCH_OPTIONAL

  if (const CUresult r = api.cuInit(0); r != CUDA_SUCCESS) {
    const std::string name = result_name_via(&api, r);
    std::string desc = description_via(&api, r);
    if (!desc.empty()) desc = ": " + desc;
    if (r == CUDA_ERROR_NO_DEVICE) {
      throw Error(ErrorCode::NoDevice,
                  fmt::format("the CUDA driver {} ({}) loaded, but cuInit reports no GPU: {} ({}){}; check nvidia-smi "
                              "and CUDA_VISIBLE_DEVICES; host segments work without a GPU",
                              version_string(version), api.library, name, static_cast<int>(r), desc),
                  "cuInit", 0, static_cast<int>(r));
    }
    throw Error(ErrorCode::NoDriver,
                fmt::format("no CUDA driver: cuInit of {} ({}) failed: {} ({}){}; {}", api.library,
                            version_string(version), name, static_cast<int>(r), desc, kNeedsDriver),
                "cuInit", 0, static_cast<int>(r));
  }
  // A child forked from here on inherits the table but cannot use CUDA; driver() tells it so.
  os::at_fork(nullptr, nullptr, on_fork_child);
  GPUIPC_LOG_DEBUG("CUDA driver {} loaded from {}", version_string(version), api.library);
}

}  // namespace

const DriverApi& driver() {
  State& s = state();
  std::call_once(s.once, [&s] {
    try {
      load(s.api);
      g_loaded.store(&s.api, std::memory_order_release);
    } catch (const Error& e) {
      s.error = e;
    } catch (const std::exception& e) {
      s.error =
          Error(ErrorCode::NoDriver, fmt::format("no CUDA driver: loading it failed: {}; {}", e.what(), kNeedsDriver));
    }
  });
  if (s.error) throw *s.error;
  if (g_forked_after_init.load(std::memory_order_relaxed)) {
    throw Error(ErrorCode::Unsupported,
                "this process was forked after its parent initialised CUDA, and such a child cannot use CUDA: fork "
                "before the first CUDA call, or exec a new program",
                "fork");
  }
  return s.api;
}

bool driver_available(std::string* why) noexcept {
  try {
    driver();
    return true;
  } catch (const std::exception& e) {
    if (why != nullptr) {
      try {
        *why = e.what();
      } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory while reporting; the answer stands
      }
    }
    return false;
  }
}

const DriverApi* loaded_driver() noexcept {
  if (g_forked_after_init.load(std::memory_order_relaxed)) return nullptr;
  return g_loaded.load(std::memory_order_acquire);
}

std::string result_name(CUresult r) noexcept { return result_name_via(loaded_driver(), r); }

Error cuda_error(CUresult r, const char* call, std::string_view what) {
  const DriverApi* api = loaded_driver();
  ErrorCode code = ErrorCode::Cuda;
  std::string desc;
  switch (r) {
    case CUDA_ERROR_NOT_SUPPORTED:
      code = ErrorCode::Unsupported;
      break;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
      code = ErrorCode::NoDevice;
      break;
    case CUDA_ERROR_OUT_OF_MEMORY:
      desc = "out of GPU memory";
      break;
    default:
      break;
  }
  if (desc.empty()) desc = description_via(api, r);
  std::string message = fmt::format("{}: {} failed: {} ({})", what, call != nullptr ? call : "?",
                                    result_name_via(api, r), static_cast<int>(r));
  if (!desc.empty()) message += ": " + desc;
  return Error(code, message, call != nullptr ? call : "", 0, static_cast<int>(r));
}

}  // namespace gpuipc::cuda
