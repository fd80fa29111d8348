#include "cuda/legacy_ipc.hpp"

#include <fmt/format.h>

#include "cuda/context.hpp"

namespace gpuipc::cuda {

CUipcMemHandle ipc_get_mem_handle(CUdeviceptr ptr) {
  CUipcMemHandle handle{};
  check(driver().cuIpcGetMemHandle(&handle, ptr), "cuIpcGetMemHandle", fmt::format("device memory at {:#x}", ptr));
  return handle;
}

IpcMapping IpcMapping::open(const CUipcMemHandle& handle, unsigned flags) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_context();
  CUdeviceptr ptr = 0;
  check(api.cuIpcOpenMemHandle(&ptr, handle, flags), "cuIpcOpenMemHandle", "legacy IPC memory handle");
  return IpcMapping(Opened{ptr, ctx});
}

void IpcMapping::Release::operator()(const Opened& opened) const noexcept {
  release_in(
      opened.ctx, "cuIpcCloseMemHandle", [&](const DriverApi& api) { return api.cuIpcCloseMemHandle(opened.ptr); },
      [&] { return fmt::format("legacy IPC mapping at {:#x}", opened.ptr); });
}

}  // namespace gpuipc::cuda
