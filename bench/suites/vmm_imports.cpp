#include "vmm_imports.hpp"

#include "bench.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/error.hpp"

namespace gpuipc::bench {

nlohmann::json time_vmm_imports(int device, bool raw, std::size_t size, std::vector<os::UniqueFd>& fds) {
  const std::size_t granularity = cuda::allocation_granularity(device, false);
  if (size % granularity != 0) throw Error(ErrorCode::InvalidArgument, "vmm_open: size is not a granularity multiple");
  const int access[] = {device};
  cuda::VaRange reserved;
  if (!raw) reserved = cuda::reserve_va(size, granularity);
  std::vector<double> total, import, reserve, map, set_access;
  for (auto& fd : fds) {
    const auto t0 = now_ns();
    auto handle = cuda::import_fd(fd.get());
    const auto t1 = now_ns();
    cuda::VaRange range;
    if (raw) range = cuda::reserve_va(size, granularity);
    const CUdeviceptr at = raw ? range.base() : reserved.base();
    const auto t2 = now_ns();
    auto mapping = cuda::map(at, size, handle);
    const auto t3 = now_ns();
    cuda::set_access(at, size, access, false);
    const auto t4 = now_ns();
    total.push_back(static_cast<double>(t4 - t0) / 1e3);
    import.push_back(static_cast<double>(t1 - t0) / 1e3);
    reserve.push_back(static_cast<double>(t2 - t1) / 1e3);
    map.push_back(static_cast<double>(t3 - t2) / 1e3);
    set_access.push_back(static_cast<double>(t4 - t3) / 1e3);
    // Release, untimed, in reverse order: unmap, free the range, drop the handle, close the fd.
    mapping = cuda::MemMapping();
    range = cuda::VaRange();
    handle = cuda::AllocationHandle();
    fd.reset();
  }
  return {{"total", values_json(total)},
          {"import", values_json(import)},
          {"reserve", values_json(reserve)},
          {"map", values_json(map)},
          {"set_access", values_json(set_access)}};
}

}  // namespace gpuipc::bench
