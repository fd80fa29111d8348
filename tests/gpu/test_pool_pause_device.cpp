// Pause and resume of device pools on a real GPU (Pool::pause, resume, refresh): the GPU memory goes back to the
// driver (cuMemGetInfo's free memory rises by about the pool's bytes) when no other process maps it, and comes back
// with its contents at the same addresses; a reader process that mapped the pool is told (InvalidState), never
// crashed: its mapping keeps the old memory (and the memory stays taken) until it calls refresh(), after which it
// maps the resumed memory at the same address. All CUDA work happens in forked children.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "cuda/vmm.hpp"
#include "gpuipc/pool.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/gpu_worker.hpp"
#include "support/support.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kChunk = 512ULL << 20;

CUdeviceptr dptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

std::size_t free_now() { return cuda::memory_info(0).free; }

/// Free GPU memory once it rose to at least `at_least` (the broker closes its fd of a released chunk a moment after
/// the last process lets go), or what it is after 5 s.
std::size_t free_once_at_least(std::size_t at_least) {
  std::size_t f = free_now();
  wait_until([&] { return (f = free_now()) >= at_least; }, 5s, 10ms);
  return f;
}

TEST(PoolPauseDevice, PauseReturnsTheMemoryAndResumeRestoresItAtTheSameAddress) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pause");
  EXPECT_EQ(run_child(
                [&] {
                  Gpu g;
                  auto pool = Pool::create(
                      name, {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = kChunk, .max_bytes = 2 * kChunk});
                  Block a = pool.allocate(kChunk - 4096);
                  Block b = pool.allocate(kChunk / 2);  // in the second chunk
                  GPUIPC_CHILD_CHECK(pool.stats().chunks == 2);
                  g.k.fill_pattern(g.stream.get(), dptr(a.data()), a.size() / 4, 11);
                  g.k.fill_pattern(g.stream.get(), dptr(b.data()), b.size() / 4, 12);
                  void* const pa = a.data();
                  void* const pb = b.data();
                  const std::size_t before = free_now();
                  pool.pause({.keep_contents = true});  // synchronizes the context itself
                  const std::size_t paused = free_once_at_least(before + 2 * kChunk * 9 / 10);
                  std::fprintf(stderr, "free before %zu MiB, paused %zu MiB (pool %zu MiB)\n", before >> 20,
                               paused >> 20, (2 * kChunk) >> 20);
                  GPUIPC_CHILD_CHECK(paused > before && paused - before >= 2 * kChunk * 9 / 10);
                  GPUIPC_CHILD_CHECK(pool.paused());
                  GPUIPC_CHILD_CHECK(
                      fails_with([&] { pool.resolve(a.ref()); }, ErrorCode::InvalidState, "paused by pid"));
                  GPUIPC_CHILD_CHECK(
                      fails_with([&] { pool.allocate(4096); }, ErrorCode::InvalidState, "paused by pid"));
                  pool.resume();
                  const std::size_t resumed = free_now();
                  GPUIPC_CHILD_CHECK(resumed < paused && paused - resumed >= 2 * kChunk * 9 / 10);
                  GPUIPC_CHILD_CHECK(a.data() == pa && pool.resolve(a.ref()) == pa);
                  GPUIPC_CHILD_CHECK(pool.resolve(b.ref()) == pb);
                  GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(pa), a.size() / 4, 11) == 0);
                  GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(pb), b.size() / 4, 12) == 0);
                  // Writable at the same address, and a pause without keeping contents cycles too.
                  g.k.fill_pattern(g.stream.get(), dptr(pa), a.size() / 4, 13);
                  GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(pa), a.size() / 4, 13) == 0);
                  pool.pause();
                  pool.resume();
                  g.k.fill_pattern(g.stream.get(), dptr(pb), b.size() / 4, 14);
                  GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(pb), b.size() / 4, 14) == 0);
                  Block c = pool.allocate(4096);
                  GPUIPC_CHILD_CHECK(c);
                  return 0;
                },
                120s),
            0);
  Pool::unlink(name);
}

TEST(PoolPauseDevice, AKeptPinnedBufferIsReusedAndEachPauseSavesTheBytesOfItsOwnTime) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pause");
  EXPECT_EQ(
      run_child(
          [&] {
            Gpu g;
            auto pool = Pool::create(
                name, {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = kChunk, .max_bytes = 2 * kChunk});
            Block a = pool.allocate(kChunk - 4096);
            for (std::uint32_t cycle = 0; cycle < 3; ++cycle) {
              g.k.fill_pattern(g.stream.get(), dptr(a.data()), a.size() / 4, 40 + cycle);
              pool.pause({.keep_contents = true, .keep_buffer = true});
              pool.resume();
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(a.data()), a.size() / 4, 40 + cycle) == 0);
            }
            Block b = pool.allocate(kChunk / 2);  // more live bytes than the kept buffer holds
            g.k.fill_pattern(g.stream.get(), dptr(a.data()), a.size() / 4, 50);
            g.k.fill_pattern(g.stream.get(), dptr(b.data()), b.size() / 4, 51);
            pool.pause({.keep_contents = true, .keep_buffer = true});
            pool.resume();
            GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(a.data()), a.size() / 4, 50) == 0);
            GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(b.data()), b.size() / 4, 51) == 0);
            g.k.fill_pattern(g.stream.get(), dptr(b.data()), b.size() / 4, 52);
            pool.pause({.keep_contents = true});  // reuses it; resume frees it
            pool.resume();
            GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(a.data()), a.size() / 4, 50) == 0);
            GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(b.data()), b.size() / 4, 52) == 0);
            return 0;
          },
          120s),
      0);
  Pool::unlink(name);
}

TEST(PoolPauseDevice, AReaderIsToldKeepsTheOldMemoryUntilRefreshThenSeesTheResumedOne) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pause");
  Shared<BlockRef> ref;
  SyncPipe filled, mapped, paused, told, refreshed, resumed, checked;
  const pid_t owner = start_child([&] {
    Gpu g;
    auto pool =
        Pool::create(name, {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = kChunk, .max_bytes = kChunk});
    Block a = pool.allocate(kChunk);
    g.k.fill_pattern(g.stream.get(), dptr(a.data()), a.size() / 4, 21);
    g.stream.synchronize();
    ref[0] = a.ref();
    filled.notify();
    GPUIPC_CHILD_CHECK(mapped.wait(120s));
    const std::size_t before = free_now();
    pool.pause({.keep_contents = true});
    const std::size_t while_mapped = free_now();
    // The reader still maps the chunk: its memory is not returned yet.
    GPUIPC_CHILD_CHECK(while_mapped < before + kChunk / 2);
    paused.notify();
    GPUIPC_CHILD_CHECK(refreshed.wait(120s));
    const std::size_t after_refresh = free_once_at_least(before + kChunk * 9 / 10);
    std::fprintf(stderr, "free before %zu MiB, paused with a reader %zu MiB, after its refresh %zu MiB\n", before >> 20,
                 while_mapped >> 20, after_refresh >> 20);
    GPUIPC_CHILD_CHECK(after_refresh > before && after_refresh - before >= kChunk * 9 / 10);
    pool.resume();
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(a.data()), a.size() / 4, 21) == 0);
    resumed.notify();
    GPUIPC_CHILD_CHECK(checked.wait(120s));
    return 0;
  });
  ASSERT_TRUE(filled.wait(120s));
  const pid_t reader = start_child([&] {
    Gpu g;
    auto pool = Pool::open(name, {.access = Access::ReadOnly});
    void* const p = pool.resolve(ref[0]);
    mapped.notify();
    GPUIPC_CHILD_CHECK(paused.wait(120s));
    const std::string by = "paused by pid " + std::to_string(owner);
    GPUIPC_CHILD_CHECK(fails_with([&] { pool.resolve(ref[0]); }, ErrorCode::InvalidState, by));
    GPUIPC_CHILD_CHECK(fails_with([&] { pool.hold(ref[0]); }, ErrorCode::InvalidState, by));
    // Not crashed: its mapping still holds the old memory and its bytes.
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(p), ref[0].size / 4, 21) == 0);
    pool.refresh();  // lets go of the old memory
    refreshed.notify();
    GPUIPC_CHILD_CHECK(resumed.wait(120s));
    void* const again = pool.resolve(ref[0]);
    GPUIPC_CHILD_CHECK(again == p);
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(p), ref[0].size / 4, 21) == 0);
    checked.notify();
    return 0;
  });
  EXPECT_EQ(wait_child(reader, 180s), 0);
  EXPECT_EQ(wait_child(owner, 180s), 0);
  Pool::unlink(name);
}

TEST(PoolPauseDevice, AReaderThatDoesNotRefreshUntilAfterResumeIsToldThenRemaps) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pause");
  Shared<BlockRef> ref;
  SyncPipe filled, mapped, cycled, checked;
  const pid_t owner = start_child([&] {
    Gpu g;
    auto pool = Pool::create(
        name, {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = 64ULL << 20, .max_bytes = 64ULL << 20});
    Block a = pool.allocate(1 << 20);
    g.k.fill_pattern(g.stream.get(), dptr(a.data()), a.size() / 4, 31);
    g.stream.synchronize();
    ref[0] = a.ref();
    filled.notify();
    GPUIPC_CHILD_CHECK(mapped.wait(120s));
    pool.pause({.keep_contents = true});
    pool.resume();
    g.k.fill_pattern(g.stream.get(), dptr(a.data()), a.size() / 4, 32);  // new bytes in the new memory
    g.stream.synchronize();
    cycled.notify();
    GPUIPC_CHILD_CHECK(checked.wait(120s));
    return 0;
  });
  ASSERT_TRUE(filled.wait(120s));
  EXPECT_EQ(run_child(
                [&] {
                  Gpu g;
                  auto pool = Pool::open(name);
                  void* const p = pool.resolve(ref[0]);
                  mapped.notify();
                  GPUIPC_CHILD_CHECK(cycled.wait(120s));
                  GPUIPC_CHILD_CHECK(fails_with([&] { pool.resolve(ref[0]); }, ErrorCode::InvalidState, "refresh()"));
                  // Its stale mapping still shows the old memory's bytes: stale, not a fault.
                  GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(p), ref[0].size / 4, 31) == 0);
                  pool.refresh();
                  GPUIPC_CHILD_CHECK(pool.resolve(ref[0]) == p);
                  GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), dptr(p), ref[0].size / 4, 32) == 0);
                  checked.notify();
                  return 0;
                },
                120s),
            0);
  EXPECT_EQ(wait_child(owner, 120s), 0);
  Pool::unlink(name);
}

TEST(PoolPauseDevice, HostPinnedPoolsRefuseToPause) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pause");
  EXPECT_EQ(run_child(
                [&] {
                  Gpu g;
                  auto pool = Pool::create(
                      name,
                      {.kind = SegmentKind::HostPinned, .device = 0, .chunk_bytes = 1 << 20, .max_bytes = 1 << 20});
                  GPUIPC_CHILD_CHECK(fails_with([&] { pool.pause(); }, ErrorCode::Unsupported, "pinned"));
                  GPUIPC_CHILD_CHECK(!pool.paused());
                  Block b = pool.allocate(4096);
                  GPUIPC_CHILD_CHECK(b);
                  return 0;
                },
                60s),
            0);
  Pool::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
