// How long the broker's repair of one dead pool member (pool_remove_member: one pool lock) takes when a member
// scribbled PoolHeader::deferred = ~0 into a pool whose record table is in use to its end (kMaxRecords). Built by
// hand against a build tree, once with src/shm/pool_block.cpp of the commit to measure (see
// bench/results/experiments/pool-deferred-scan-local-20261129.txt for the command lines):
//   g++ -std=c++20 -O2 -DFMT_HEADER_ONLY=1 -Iinclude -Ibuild/generated/include -Isrc \
//     bench/analysis/experiments/pool_deferred_scan.cpp src/shm/pool_block.cpp \
//     build/src/libgpuipc_shm.a build/src/libgpuipc_os.a build/src/libgpuipc_base.a -lpthread -o /tmp/deferred
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>
#include <algorithm>
#include "shm/pool_block.hpp"
using namespace gpuipc::shm;
int main() {
  const std::uint32_t records = kMaxRecords;
  const std::size_t size = pool_control_bytes(records);
  std::unique_ptr<std::byte, decltype(&std::free)> mem(static_cast<std::byte*>(std::aligned_alloc(64, size)), &std::free);
  std::memset(mem.get(), 0, size);
  auto& h = *reinterpret_cast<PoolHeader*>(mem.get());
  PoolGeometry g; g.pool_id = 1; g.mode = PoolMode::Fixed; g.kind = 2; g.max_chunks = 1; g.chunk_bytes = 1ULL << 40;
  g.block_bytes = 256; g.max_records = records;
  h.chunks[0].state = static_cast<std::uint32_t>(ChunkState::Ready); h.chunks[0].bytes = g.chunk_bytes;
  init_pool(mem.get(), g);
  PoolBlock b(mem.get(), size);
  h.record_end = records;  // every record in the scan
  std::vector<double> ms;
  for (int i = 0; i < 7; ++i) {
    std::atomic_ref<std::uint64_t>(h.deferred).store(~0ULL);
    const auto t0 = std::chrono::steady_clock::now();
    if (pool_remove_member(mem.get(), size, 63) < 0) return 1;  // the broker's repair of a dead member: one lock
    const auto t1 = std::chrono::steady_clock::now();
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("records %u: one repair (pool_remove_member) after deferred = ~0: median %.2f ms (min %.2f, max %.2f)\n", records, ms[3], ms[0], ms[6]);
}
