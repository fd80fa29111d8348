// Does H2D from pinned host memory run slower into VMM (cuMemCreate) memory than into cudaMalloc memory? The
// benchmark example showed 45 vs 55 GB/s on an H100 for a gpuipc segment. Copies of 256 MiB into: cudaMalloc,
// cuMemCreate mapped here (POSIX fd handle type, as gpuipc's segments), the same with the fabric handle type too,
// and cuMemCreate with the gpuDirectRDMACapable flag; each measured in rounds that alternate the order.
//   nvcc -O2 -o h2d_vmm bench/analysis/experiments/h2d_vmm.cu -lcuda && ./h2d_vmm
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    auto r_ = (x);                                                             \
    if (r_ != 0) {                                                             \
      std::fprintf(stderr, "%s failed: %d (line %d)\n", #x, int(r_), __LINE__); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

static double gbs(void* dst, const void* src, size_t bytes, int reps, cudaStream_t s) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  std::vector<double> r;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    r.push_back(bytes / (ms * 1e-3) / 1e9);
  }
  std::sort(r.begin(), r.end());
  return r[r.size() / 2];
}

static void* vmm(size_t bytes, CUmemAllocationHandleType types, bool rdma) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  p.requestedHandleTypes = types;
  p.allocFlags.gpuDirectRDMACapable = rdma ? 1 : 0;
  size_t g = 0;
  CK(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  bytes = (bytes + g - 1) / g * g;
  CUmemGenericAllocationHandle h;
  if (cuMemCreate(&h, bytes, &p, 0) != CUDA_SUCCESS) return nullptr;
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, bytes, 0, 0, 0));
  CK(cuMemMap(va, bytes, 0, h, 0));
  CUmemAccessDesc d{};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CK(cuMemSetAccess(va, bytes, &d, 1));
  return reinterpret_cast<void*>(va);
}

int main() {
  const size_t bytes = 256ull << 20;
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));
  void *pinned, *dm;
  CK(cudaMallocHost(&pinned, bytes));
  CK(cudaMalloc(&dm, bytes));
  struct Target {
    std::string name;
    void* p;
  };
  std::vector<Target> t{{"cudaMalloc", dm},
                        {"cuMemCreate posix_fd", vmm(bytes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, false)},
                        {"cuMemCreate posix_fd+fabric",
                         vmm(bytes, CUmemAllocationHandleType(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC), false)},
                        {"cuMemCreate posix_fd rdma", vmm(bytes, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, true)},
                        {"cuMemCreate none", vmm(bytes, CU_MEM_HANDLE_TYPE_NONE, false)}};
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  for (int round = 0; round < 4; ++round) {
    std::printf("round %d\n", round);
    for (size_t k = 0; k < t.size(); ++k) {
      const Target& x = t[round % 2 ? t.size() - 1 - k : k];
      if (!x.p) {
        std::printf("  %-30s refused\n", x.name.c_str());
        continue;
      }
      std::printf("  %-30s H2D pinned %6.1f  D2H pinned %6.1f GB/s\n", x.name.c_str(), gbs(x.p, pinned, bytes, 20, s),
                  gbs(pinned, x.p, bytes, 20, s));
    }
  }
  return 0;
}
