// What bounding the record scans by record_end saves (014bd99): a member's leave (shm::pool_remove_member, the same
// function as the broker's repair) on a control block of 65536 records (gpuipc.torch.MemPool's) with 300 live
// blocks, timed with record_end as the allocator leaves it (300) and with record_end forced to 65536 (every record
// read, as before 014bd99). One process, the two in turns, 200 leaves each; prints the medians and p99s in us.
// Build (from the repo root, after make build):
//   g++ -std=c++20 -O2 -Isrc -Iinclude -Ibuild/include bench/results/experiments/record_end_scan.cpp \
//       build/src/libgpuipc_shm.a build/src/libgpuipc_proto.a build/src/libgpuipc_os.a build/src/libgpuipc_base.a \
//       -lfmt -o /tmp/record_end_scan
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "shm/pool_block.hpp"

using namespace gpuipc::shm;

int main() {
  constexpr std::uint32_t kRecords = 65536;
  const std::size_t size = pool_control_bytes(kRecords);
  auto* mem = static_cast<std::byte*>(std::aligned_alloc(64, size));
  std::memset(mem, 0, size);
  PoolGeometry g;
  g.pool_id = 1;
  g.mode = PoolMode::Variable;
  g.kind = 2;
  g.max_chunks = 1;
  g.chunk_bytes = 1ULL << 30;
  g.max_records = kRecords;
  auto& h = *reinterpret_cast<PoolHeader*>(mem);
  h.chunks[0].state = static_cast<std::uint32_t>(ChunkState::Ready);
  h.chunks[0].bytes = g.chunk_bytes;
  init_pool(mem, g);
  PoolBlock b(mem, size);
  std::vector<OccupiedRange> scratch;
  scratch.reserve(kRecords);
  for (int i = 0; i < 300; ++i) {
    BlockLocation loc;
    if (b.allocate(0, 1 << 20, 256, loc, scratch, std::chrono::seconds(1)) != PoolStatus::Ok) return 1;
  }
  std::printf("record_end after 300 allocations: %u\n", b.record_end());
  std::vector<double> bounded, full;
  for (int i = 0; i < 400; ++i) {
    const bool all = i % 2 == 1;
    h.record_end = all ? kRecords : 300;
    const auto t0 = std::chrono::steady_clock::now();
    if (pool_remove_member(mem, size, 1) < 0) return 2;  // member 1 holds nothing: the scan is the whole cost
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    (all ? full : bounded).push_back(us);
  }
  for (auto* v : {&bounded, &full}) std::sort(v->begin(), v->end());
  std::printf("leave, record_end 300: median %.2f us, p99 %.2f us\n", bounded[bounded.size() / 2],
              bounded[bounded.size() * 99 / 100]);
  std::printf("leave, record_end 65536 (every record, as before): median %.2f us, p99 %.2f us\n",
              full[full.size() / 2], full[full.size() * 99 / 100]);
  return 0;
}
