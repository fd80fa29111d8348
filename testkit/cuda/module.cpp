#include "testkit/cuda/module.hpp"

#include <fmt/format.h>

#include "cuda/context.hpp"

namespace gpuipc::cuda {

Module Module::load(const void* image, std::string_view what) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_context();
  CUmodule module = nullptr;
  check(api.cuModuleLoadData(&module, image), "cuModuleLoadData", what);
  return Module(Loaded{module, ctx, std::string(what)});
}

void Module::Release::operator()(const Loaded& loaded) const noexcept {
  release_in(
      loaded.ctx, "cuModuleUnload", [&](const DriverApi& api) { return api.cuModuleUnload(loaded.module); },
      [&]() -> std::string_view { return loaded.what; });
}

CUfunction Module::function(const char* name) const {
  const std::string& what = m_owned.get().what;
  CUfunction fn = nullptr;
  const CUresult r = driver().cuModuleGetFunction(&fn, get(), name);
  if (r == CUDA_ERROR_NOT_FOUND) {
    throw Error(ErrorCode::NotFound, fmt::format("{}: no kernel named '{}'", what, name), "cuModuleGetFunction", 0,
                static_cast<int>(r));
  }
  check(r, "cuModuleGetFunction", fmt::format("{}: kernel '{}'", what, name));
  return fn;
}

void launch(CUfunction function, unsigned grid, unsigned block, unsigned shared_bytes, CUstream stream, void** args,
            const char* name) {
  check(driver().cuLaunchKernel(function, grid, 1, 1, block, 1, 1, shared_bytes, stream, args, nullptr),
        "cuLaunchKernel", fmt::format("kernel {} ({} blocks of {} threads)", name, grid, block));
}

}  // namespace gpuipc::cuda
