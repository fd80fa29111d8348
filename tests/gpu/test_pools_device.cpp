// Device pools on a real GPU, across real processes: blocks written by kernels in one process and checked by
// kernels in another (chunks mapped lazily), stream-ordered free (no reuse before the stream passed the free), and
// a SIGKILLed holder's references released. All CUDA work happens in forked children.
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <functional>
#include <span>
#include <thread>

#include "gpuipc/pool.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/gpu_worker.hpp"
#include "support/support.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kChunk = 64ULL << 20;
constexpr int kBlocks = 6;  // three per chunk: the pool grows to two chunks

CUdeviceptr dptr(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }

/// A child makes device pool `name` (two chunks) and fills kBlocks blocks with pattern 100 + i; then another
/// child runs `check(pool, refs, g)` on the pool opened read-only (its exit code: 0 passes); then the first frees
/// the blocks. Returns check's exit code.
int check_filled_pool(const std::string& name, const std::function<int(Pool&, Shared<BlockRef>&, Gpu&)>& check) {
  Shared<BlockRef> refs(kBlocks);
  SyncPipe filled, checked;
  const pid_t a = start_child([&] {
    Gpu g;
    auto pool = Pool::create(name, {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = kChunk,
                                    .max_bytes = 2 * kChunk});
    std::vector<Block> blocks;
    for (int i = 0; i < kBlocks; ++i) {
      blocks.push_back(pool.allocate(kChunk / 3 - 4096));
      g.k.fill_pattern(g.stream.get(), dptr(blocks.back().data()), blocks.back().size() / 4, 100 + i);
      refs[i] = blocks.back().ref();
    }
    g.stream.synchronize();
    GPUIPC_CHILD_CHECK(pool.stats().chunks == 2);
    filled.notify();
    GPUIPC_CHILD_CHECK(checked.wait(120s));
    for (auto& b : blocks) pool.free(std::move(b), g.stream.get());
    g.stream.synchronize();
    GPUIPC_CHILD_CHECK(pool.stats().live_blocks == 0);
    return 0;
  });
  if (!filled.wait(120s)) {
    ADD_FAILURE() << "the filler did not fill the pool";
    return wait_child(a, 1s);
  }
  const int rc = run_child(
      [&] {
        Gpu g;
        auto pool = Pool::open(name, {.access = Access::ReadOnly});
        return check(pool, refs, g);
      },
      120s);
  checked.notify();
  EXPECT_EQ(wait_child(a, 120s), 0);
  return rc;
}

/// Whether block i of `refs`, at `p` in this process, holds pattern 100 + i (counted by a kernel).
bool reads_as_written(Gpu& g, Shared<BlockRef>& refs, int i, void* p) {
  return g.k.count_mismatches(g.stream.get(), dptr(p), refs[i].size / 4, 100 + i) == 0;
}

TEST(PoolsDevice, BlocksWrittenInAAreReadInBFromTwoChunks) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pool");
  EXPECT_EQ(check_filled_pool(name,
                              [](Pool& pool, Shared<BlockRef>& refs, Gpu& g) {
                                for (int i = kBlocks - 1; i >= 0; --i) {
                                  pool.hold(refs[i]);
                                  GPUIPC_CHILD_CHECK(reads_as_written(g, refs, i, pool.resolve(refs[i])));
                                  pool.release(refs[i]);
                                }
                                return 0;
                              }),
            0);
  Pool::unlink(name);
}

TEST(PoolsDevice, MapChunksImportsBothChunksAtOnceAndTheyReadAsWritten) {
  GPUIPC_REQUIRE_GPU();
  EXPECT_EQ(check_filled_pool(unique_name("pool"),
                              [](Pool& pool, Shared<BlockRef>& refs, Gpu& g) {
                                pool.map_chunks(std::span<const BlockRef>(&refs[0], kBlocks));
                                // Both chunks are mapped now: with the names gone, a resolve that had to open
                                // one would fail.
                                Pool::unlink(pool.name());
                                for (int i = 0; i < kBlocks; ++i) {
                                  GPUIPC_CHILD_CHECK(reads_as_written(g, refs, i, pool.resolve(refs[i])));
                                }
                                return 0;
                              }),
            0);
}

TEST(PoolsDevice, StreamOrderedFreeIsReusedOnlyAfterTheStreamPassedIt) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pool");
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto gate = Semaphore::create(name + "-gate", {.initial = 0, .kind = SegmentKind::HostPinned, .device = 0,
                                                              .mode = 0600});
              auto pool = Pool::create(name, {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = kChunk,
                                              .max_bytes = kChunk});
              Block b = pool.allocate(kChunk);
              GPUIPC_CHILD_CHECK(gate.wait(g.stream.get(), 1) == Status::Ok);  // the stream stops here
              g.k.fill_pattern(g.stream.get(), dptr(b.data()), kChunk / 4, 5);
              pool.free(std::move(b), g.stream.get());
              Block again;
              GPUIPC_CHILD_CHECK(pool.try_allocate(kChunk, 256, again) == Status::WouldBlock);
              GPUIPC_CHILD_CHECK(pool.stats().draining_blocks == 1);
              GPUIPC_CHILD_CHECK(gate.signal_host(1) == Status::Ok);
              g.stream.synchronize();
              GPUIPC_CHILD_CHECK(pool.try_allocate(kChunk, 256, again) == Status::Ok);
              Semaphore::unlink(name + "-gate");
              Pool::unlink(name);
              return 0;
            },
                      120s),
            0);
}

TEST(PoolsDevice, ASigkilledHoldersReferencesAreReleased) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name("pool");
  Shared<BlockRef> ref;
  SyncPipe allocated, holding, found_held, done;
  const pid_t owner = start_child([&] {
    Gpu g;
    auto pool = Pool::create(name, {.kind = SegmentKind::Device, .device = 0, .chunk_bytes = kChunk,
                                    .max_bytes = kChunk});
    {
      Block b = pool.allocate(kChunk);
      ref[0] = b.ref();
      allocated.notify();
      GPUIPC_CHILD_CHECK(holding.wait(120s));
      pool.free(std::move(b), g.stream.get());
    }
    g.stream.synchronize();
    Block again;
    GPUIPC_CHILD_CHECK(pool.try_allocate(1, 256, again) == Status::WouldBlock);  // the victim holds it
    found_held.notify();
    GPUIPC_CHILD_CHECK(done.wait(120s));  // the victim is dead
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (pool.try_allocate(kChunk, 256, again) != Status::Ok && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(1ms);
    }
    GPUIPC_CHILD_CHECK(again);
    return 0;
  });
  ASSERT_TRUE(allocated.wait(120s));
  const pid_t victim = start_child([&] {
    Gpu g;
    auto pool = Pool::open(name);
    pool.hold(ref[0]);
    g.k.fill_pattern(g.stream.get(), dptr(pool.resolve(ref[0])), kChunk / 4, 9);
    g.stream.synchronize();
    holding.notify();  // one byte for the owner, one for the test
    holding.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(holding.wait(120s));
  ASSERT_TRUE(found_held.wait(120s));
  ::kill(victim, SIGKILL);
  EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  done.notify();
  EXPECT_EQ(wait_child(owner, 120s), 0);
  Pool::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
