#include "cuda/unique_handle.hpp"

#include "base/log.hpp"

namespace gpuipc::cuda {

void warn_release(CUresult r, const char* call, std::string_view what) noexcept {
  if (r == CUDA_SUCCESS || r == CUDA_ERROR_DEINITIALIZED) return;
  GPUIPC_LOG_WARN("{}: {} failed while releasing it: {} ({})", what, call, result_name(r), static_cast<int>(r));
}

}  // namespace gpuipc::cuda
