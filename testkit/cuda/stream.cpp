#include "testkit/cuda/stream.hpp"

#include "cuda/context.hpp"

namespace gpuipc::cuda {

Stream Stream::create(bool non_blocking) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_context();
  CUstream stream = nullptr;
  check(api.cuStreamCreate(&stream, non_blocking ? CU_STREAM_NON_BLOCKING : CU_STREAM_DEFAULT), "cuStreamCreate",
        "new stream");
  return Stream(Created{stream, ctx});
}

void Stream::Release::operator()(const Created& created) const noexcept {
  release_in(
      created.ctx, "cuStreamDestroy", [&](const DriverApi& api) { return api.cuStreamDestroy(created.stream); },
      [] { return "stream"; });
}

void Stream::synchronize() const { check(driver().cuStreamSynchronize(get()), "cuStreamSynchronize", "stream"); }

bool Stream::query() const {
  const CUresult r = driver().cuStreamQuery(get());
  if (r == CUDA_ERROR_NOT_READY) return false;
  check(r, "cuStreamQuery", "stream");
  return true;
}

}  // namespace gpuipc::cuda
