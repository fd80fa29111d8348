// Host-kind pools across real processes: a block allocated in one process, resolved and held in another, reused
// only after every holder released it; a SIGKILLed holder's holds released by the broker; four processes
// allocating and freeing for 10 s with every block's content checked; chunks added on demand and mapped lazily;
// every misuse answered with InvalidArgument or QuotaExceeded naming what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <span>
#include <thread>
#include <vector>

#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "proto/shm.hpp"
#include "shm/pool_block.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kChunk = 64 * 1024;

/// A one-chunk variable pool of kChunk bytes.
Pool one_chunk_pool(const std::string& name) {
  return Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = kChunk, .max_blocks = 64});
}

TEST(PoolsHost, AllocateInAResolveInBReuseOnlyAfterBReleased) {
  const auto name = unique_name("pool");
  auto pool = one_chunk_pool(name);
  Block block = pool.allocate(kChunk);
  fill_pattern(block.data(), block.size(), 42);
  Shared<BlockRef> ref;
  ref[0] = block.ref();
  SyncPipe holding, freed, released;
  const pid_t b = start_child([&] {
    auto p = Pool::open(name);
    p.hold(ref[0]);
    GPUIPC_CHILD_CHECK(holds_pattern(p.resolve(ref[0]), ref[0].size, 42));
    holding.notify();
    GPUIPC_CHILD_CHECK(freed.wait(10s));
    GPUIPC_CHILD_CHECK(holds_pattern(p.resolve(ref[0]), ref[0].size, 42));  // still ours after A freed it
    p.release(ref[0]);
    released.notify();
    return 0;
  });
  ASSERT_TRUE(holding.wait(10s));
  pool.free(std::move(block));
  EXPECT_EQ(pool.stats().live_blocks, 1U);
  Block again;
  EXPECT_EQ(pool.try_allocate(1, 256, again), Status::WouldBlock) << "reused while B holds it";
  freed.notify();
  ASSERT_TRUE(released.wait(10s));
  EXPECT_EQ(wait_child(b), 0);
  ASSERT_EQ(pool.try_allocate(kChunk, 256, again), Status::Ok);
  EXPECT_EQ(again.ref().offset, 0U);
  EXPECT_NE(again.ref().generation, ref[0].generation);
  EXPECT_TRUE(fails_with([&] { pool.resolve(ref[0]); }, ErrorCode::InvalidArgument, "generation"));
  Pool::unlink(name);
}

TEST(PoolsHost, ASigkilledHoldersHoldsAreReleasedByTheBroker) {
  const auto name = unique_name("pool");
  auto pool = one_chunk_pool(name);
  Shared<BlockRef> ref;
  {
    Block block = pool.allocate(4096);
    ref[0] = block.ref();
    SyncPipe holding;
    const pid_t victim = start_child([&] {
      auto p = Pool::open(name);
      p.hold(ref[0]);
      p.hold(ref[0]);                 // counted: one shared hold
      Block own = p.allocate(8192);  // and a block of its own, never freed
      holding.notify();
      ::pause();
      return 0;
    });
    ASSERT_TRUE(holding.wait(10s));
    EXPECT_EQ(pool.stats().members, 2U);
    EXPECT_EQ(pool.stats().live_blocks, 2U);
    pool.free(std::move(block));
    EXPECT_EQ(pool.stats().live_blocks, 2U);
    ::kill(victim, SIGKILL);
    EXPECT_EQ(wait_child(victim), 128 + SIGKILL);
  }
  // The broker releases a dead member's holds before it frees its entry: wait for both (the count of members read
  // between the two, 2, failed this test once in a make test run).
  EXPECT_TRUE(wait_until([&] { return pool.stats().live_blocks == 0 && pool.stats().members == 1; }, 5s))
      << "the dead holder's holds remain: " << pool.stats().live_blocks << " blocks live, " << pool.stats().members
      << " members";
  Block whole = pool.allocate(kChunk);  // every byte free again
  EXPECT_TRUE(fails_with([&] { pool.hold(ref[0]); }, ErrorCode::InvalidArgument, "not live"));
  Pool::unlink(name);
}

/// Four processes allocate blocks of random sizes, fill each with a pattern of their own, publish the newest one
/// for the others to hold and check, and check their own before freeing; for 10 s.
TEST(PoolsHost, FourProcessesTenSecondsNoOverlapCheckedByContent) {
  const auto name = unique_name("pool");
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = 256 * 1024, .max_bytes = 1 << 20,
                                  .max_blocks = 256});
  constexpr int kProcs = 4;
  struct Posted {
    std::atomic<std::uint64_t> seq;  // odd while being written
    BlockRef ref;
    std::uint64_t seed;
  };
  Shared<Posted> posted(kProcs);
  Shared<std::atomic<std::uint64_t>> stats(kProcs * 3);  // allocations, foreign checks, failures
  const auto until = std::chrono::steady_clock::now() + 10s;
  std::vector<pid_t> kids;
  for (int id = 0; id < kProcs; ++id) {
    kids.push_back(start_child([&, id] {
      auto p = Pool::open(name);
      std::uint64_t seq = 0;
      std::vector<std::pair<Block, std::uint64_t>> mine;
      std::uint64_t rng = 0x9E3779B97F4A7C15ULL * (id + 1);
      auto next = [&] { return rng = rng * 6364136223846793005ULL + 1442695040888963407ULL, rng >> 33; };
      while (std::chrono::steady_clock::now() < until) {
        Block b;
        const std::uint64_t seed = (static_cast<std::uint64_t>(id) << 40) | ++seq;
        if (p.try_allocate(1 + next() % 20000, 64, b) == Status::Ok) {
          fill_pattern(b.data(), b.size(), seed);
          auto& post = posted[id];
          post.seq.fetch_add(1);
          post.ref = b.ref();
          post.seed = seed;
          post.seq.fetch_add(1);
          mine.emplace_back(std::move(b), seed);
          stats[id * 3].fetch_add(1);
        }
        // Hold another process's newest block and check it (it may be freed before the hold: a stale reference).
        auto& other = posted[(id + 1 + next() % (kProcs - 1)) % kProcs];
        const std::uint64_t s0 = other.seq.load();
        const BlockRef r = other.ref;
        const std::uint64_t theirs = other.seed;
        if (s0 % 2 == 0 && other.seq.load() == s0 && r.generation != 0) {
          try {
            p.hold(r);
            if (!holds_pattern(p.resolve(r), r.size, theirs)) stats[id * 3 + 2].fetch_add(1);
            p.release(r);
            stats[id * 3 + 1].fetch_add(1);
          } catch (const Error& e) {
            if (e.code() != ErrorCode::InvalidArgument) throw;
          }
        }
        if (mine.size() > 8 || (b.size() == 0 && !mine.empty())) {
          const std::size_t k = next() % mine.size();
          if (!holds_pattern(mine[k].first.data(), mine[k].first.size(), mine[k].second)) stats[id * 3 + 2].fetch_add(1);
          p.free(std::move(mine[k].first));
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
      for (auto& [b, seed] : mine) GPUIPC_CHILD_CHECK(holds_pattern(b.data(), b.size(), seed));
      return 0;
    }));
  }
  for (auto pid : kids) EXPECT_EQ(wait_child(pid, 60s), 0);
  std::uint64_t allocations = 0;
  std::uint64_t foreign = 0;
  for (int id = 0; id < kProcs; ++id) {
    allocations += stats[id * 3].load();
    foreign += stats[id * 3 + 1].load();
    EXPECT_EQ(stats[id * 3 + 2].load(), 0U) << "process " << id << " found a block overwritten";
  }
  EXPECT_GT(allocations, 1000U);
  EXPECT_GT(foreign, 100U);
  const auto st = pool.stats();
  EXPECT_EQ(st.live_blocks, 0U);
  EXPECT_EQ(st.members, 1U);
  EXPECT_GE(st.chunks, 2U) << "the pool should have grown";
  Pool::unlink(name);
}

/// Processes allocating and freeing in a tight loop are SIGKILLed at random moments (inside the pool lock too,
/// now and then): the survivors never stall, and once all are gone every byte is free again.
TEST(PoolsHost, RandomKillsDuringAllocationNeverDeadlockThePool) {
  const auto name = unique_name("pool");
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = 128 * 1024, .max_bytes = 256 * 1024,
                                  .max_blocks = 128});
  Shared<std::atomic<std::uint64_t>> progress(8);
  auto churn = [&](int slot) {
    return start_child([&, slot] {
      auto p = Pool::open(name);
      std::vector<Block> mine;
      for (std::uint64_t i = 1;; ++i) {
        Block b;
        if (p.try_allocate(64 + (i * 7919) % 8000, 64, b) == Status::Ok) mine.push_back(std::move(b));
        if (mine.size() > 4) mine.erase(mine.begin());
        progress[slot].fetch_add(1);
      }
      return 0;
    });
  };
  std::vector<pid_t> kids;
  for (int k = 0; k < 4; ++k) kids.push_back(churn(k));
  std::uint64_t rng = 12345;
  for (int round = 0; round < 40; ++round) {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + (rng >> 40) % 20000));
    const int k = static_cast<int>((rng >> 33) % 4);
    ::kill(kids[k], SIGKILL);
    EXPECT_EQ(wait_child(kids[k]), 128 + SIGKILL);
    kids[k] = churn(k);
    // Every other process keeps going: none waits on the dead one's lock for long.
    for (int j = 0; j < 4; ++j) {
      if (j == k) continue;
      const std::uint64_t before = progress[j].load();
      EXPECT_TRUE(wait_until([&] { return progress[j].load() > before + 10; }, 5s)) << "process " << j << " stalled";
    }
  }
  for (auto pid : kids) {
    ::kill(pid, SIGKILL);
    EXPECT_EQ(wait_child(pid), 128 + SIGKILL);
  }
  EXPECT_TRUE(wait_until([&] { return pool.stats().live_blocks == 0 && pool.stats().members == 1; }, 5s))
      << pool.stats().live_blocks << " blocks live, " << pool.stats().members << " members";
  Block whole = pool.allocate(128 * 1024);  // the chunks hold nothing any more
  Pool::unlink(name);
}

TEST(PoolsHost, ChunksAreAddedOnDemandAndMappedWhenFirstResolved) {
  const auto name = unique_name("pool");
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = 3 * kChunk});
  std::vector<Block> blocks;
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(pool.allocate(kChunk));
    fill_pattern(blocks.back().data(), kChunk, i);
  }
  EXPECT_EQ(pool.stats().chunks, 3U);
  EXPECT_EQ(blocks[2].ref().chunk, 2U);
  EXPECT_TRUE(fails_with([&] { pool.allocate(1); }, ErrorCode::QuotaExceeded, "used 192.0 KiB of max 192.0 KiB"));
  Shared<BlockRef> refs(3);
  for (int i = 0; i < 3; ++i) refs[i] = blocks[i].ref();
  EXPECT_EQ(run_child([&] {
              auto p = Pool::open(name, {.access = Access::ReadOnly});
              for (int i = 2; i >= 0; --i) GPUIPC_CHILD_CHECK(holds_pattern(p.resolve(refs[i]), kChunk, i));
              // The best of 100 batches of 100 (robust to a loaded machine): cache hits, no broker round trip.
              auto best = std::chrono::steady_clock::duration::max();
              for (int batch = 0; batch < 100; ++batch) {
                const auto t0 = std::chrono::steady_clock::now();
                for (int k = 0; k < 100; ++k) GPUIPC_CHILD_CHECK(p.resolve(refs[k % 3]) != nullptr);
                best = std::min(best, (std::chrono::steady_clock::now() - t0) / 100);
              }
              std::fprintf(stderr, "resolve, chunk mapped: %lld ns\n", static_cast<long long>(best.count()));
              GPUIPC_CHILD_CHECK(best < 5us);  // < 1 us on an idle machine; sanitizers are slower
              return 0;
            }),
            0);
  blocks.clear();
  EXPECT_EQ(pool.stats().used_bytes, 0U);
  Pool::unlink(name);
  EXPECT_TRUE(fails_with([&] { Segment::stat(name + ".chunk.2"); }, ErrorCode::NotFound, "chunk.2"));
}

TEST(PoolsHost, AChunkGrownAfterUnlinkLeavesNoNameBehind) {
  // Pool::unlink removes the names of the pool and of its chunks. A member that grew the pool afterwards
  // registered the new chunk's name, which then kept its memory after every member had gone.
  const auto name = unique_name("pool");
  {
    auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = 3 * kChunk});
    Block first = pool.allocate(kChunk);
    Pool::unlink(name);
    Block grown = pool.allocate(kChunk);  // a new chunk, made after the unlink
    ASSERT_EQ(grown.ref().chunk, 1U);
    static_cast<char*>(grown.data())[kChunk - 1] = 'g';  // its maker maps it
    EXPECT_EQ(pool.resolve(grown.ref()), grown.data());
    EXPECT_TRUE(fails_with([&] { Segment::stat(name + ".chunk.1"); }, ErrorCode::NotFound, "chunk.1"));
  }
  for (const auto& info : Segment::list()) EXPECT_NE(info.name.rfind(name, 0), 0U) << info.name << " stayed";
}

// A pool made again under the name of one unlinked while in use (the same user: a service restarted, weights shared
// again) has its chunks under the same names. A member of the old pool that grew it adopted the new pool's chunk as
// its own (both wrote the same memory) and removed its name; one that mapped a chunk for the first time mapped the new
// pool's.
TEST(PoolsHost, APoolMadeAgainUnderAnUnlinkedPoolsNameKeepsItsChunks) {
  const auto name = unique_name("pool");
  const PoolOptions three{.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = 3 * kChunk};
  auto old_pool = Pool::create(name, three);
  const Block old_first = old_pool.allocate(kChunk);
  const Block old_second = old_pool.allocate(kChunk);  // chunk 1, mapped here only
  std::memset(old_second.data(), 'A', kChunk);
  Shared<BlockRef> refs(2);
  refs[0] = old_second.ref();
  refs[1] = old_first.ref();
  SyncPipe opened, remade;
  const pid_t reader = start_child([&] {
    auto p = Pool::open(name, {.access = Access::ReadOnly});  // maps no chunk yet
    opened.notify();
    GPUIPC_CHILD_CHECK(remade.wait(30s));
    GPUIPC_CHILD_CHECK(fails_with([&] { (void)p.resolve(refs[0]); }, ErrorCode::InvalidArgument,
                                  "is not its chunk 1 but a later segment of that name"));
    GPUIPC_CHILD_CHECK(fails_with([&] { (void)p.resolve(refs[1]); }, ErrorCode::InvalidArgument,
                                  "is not its chunk 0 but a later segment of that name"));
    return 0;
  });
  ASSERT_TRUE(opened.wait(30s));
  Pool::unlink(name);
  auto new_pool = Pool::create(name, three);
  std::vector<Block> made;
  for (char c : {'B', 'C', 'D'}) {
    made.push_back(new_pool.allocate(kChunk));
    std::memset(made.back().data(), c, kChunk);
  }
  ASSERT_EQ(made.back().ref().chunk, 2U);
  remade.notify();
  EXPECT_EQ(wait_child(reader, 30s), 0);
  // The old pool grows to its chunk 2: not into the new pool's.
  EXPECT_TRUE(fails_with([&] { (void)old_pool.allocate(kChunk); }, ErrorCode::System,
                         "was unlinked, and segment '" + name + ".chunk.2' is another's"));
  EXPECT_EQ(static_cast<const char*>(made[2].data())[kChunk - 1], 'D');
  EXPECT_EQ(Segment::stat(name + ".chunk.2").references, 1U);
  Pool::unlink(name);
}

// A member grows the pool while another thread unlinks it: the unlink could not find the chunk's name yet, and the
// grower had asked whether the pool was linked before it made the chunk, so the name stayed with nobody holding it.
// (An audit's program showed it in 16 of 80 runs; neither that program nor this test showed it here on that code, in
// 120 runs: this guards the path, which now asks after the chunk is made.)
TEST(PoolsHost, AChunkMadeWhileThePoolIsUnlinkedLeavesNoNameBehind) {
  int left_behind = 0;
  for (int run = 0; run < 20; ++run) {
    const auto name = unique_name("pool" + std::to_string(run));
    auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = 4096, .max_bytes = 4096 * 1024});
    std::vector<Block> kept;
    std::atomic<bool> go{false};
    std::thread grower([&] {
      while (!go.load()) {
      }
      try {
        for (int i = 0; i < 200; ++i) kept.push_back(pool.allocate(4096));
      } catch (const Error& e) {
        ADD_FAILURE() << e.what();
      }
    });
    go.store(true);
    std::this_thread::sleep_for(std::chrono::microseconds(2000 + run * 300));
    Pool::unlink(name);
    grower.join();
    kept.clear();
    pool = Pool();
    for (const auto& info : Segment::list()) {
      if (info.name.rfind(name + ".chunk.", 0) != 0) continue;
      if (++left_behind <= 3) ADD_FAILURE() << "run " << run << ": " << info.name << " stayed";
      Segment::unlink(info.name);
    }
  }
  EXPECT_EQ(left_behind, 0);
}

// The pool lock stays busy (a member that died holding it, whose process has not exited yet): a release or a free
// fails with Timeout. Both dropped this process's own reference before they tried: a retry said "holds no
// reference", the Block was gone (and the error said InvalidArgument), and the block stayed held until the handle
// closed. Takes 10 s: two waits for the lock.
TEST(PoolsHost, AReleaseOrFreeThatFindsThePoolLockBusyCanBeMadeAgain) {
  const auto name = unique_name("pool");
  auto pool = one_chunk_pool(name);
  auto other = Pool::open(name);
  Block b = pool.allocate(4096);
  const BlockRef ref = b.ref();
  other.hold(ref);
  const Segment control = Segment::open(name);
  auto lock = proto::atomic(static_cast<shm::PoolHeader*>(control.data())->lock);
  lock.store(41);  // a member that is not this process's: nobody here breaks it
  EXPECT_TRUE(fails_with([&] { other.release(ref); }, ErrorCode::Timeout, "the pool lock stayed busy"));
  EXPECT_TRUE(fails_with([&] { pool.free(std::move(b)); }, ErrorCode::Timeout, "the pool lock stayed busy"));
  EXPECT_TRUE(static_cast<bool>(b)) << "the caller keeps a Block a failed free did not free";
  lock.store(0);
  other.release(ref);
  pool.free(std::move(b));
  EXPECT_EQ(pool.stats().live_blocks, 0U);
  Pool::unlink(name);
}

TEST(PoolsHost, MapChunksMapsEveryChunkTheRefsNameInOneCall) {
  const auto name = unique_name("pool");
  const auto other = unique_name("other");
  constexpr int kChunks = 70;  // more than one batch of requests (BrokerClient::kMaxBatch)
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = kChunks * kChunk});
  auto stranger = one_chunk_pool(other);
  std::vector<Block> blocks;
  Shared<BlockRef> refs(kChunks + 2);
  for (int i = 0; i < kChunks; ++i) {
    blocks.push_back(pool.allocate(kChunk));
    fill_pattern(blocks.back().data(), kChunk, i);
    refs[i] = blocks.back().ref();
  }
  Block foreign = stranger.allocate(64);
  refs[kChunks] = foreign.ref();  // another pool's: skipped
  refs[kChunks + 1] = refs[3];
  refs[kChunks + 1].chunk = 5000;  // no chunk of the pool: skipped
  EXPECT_EQ(run_child([&] {
              auto p = Pool::open(name, {.access = Access::ReadOnly});
              p.map_chunks(std::span<const BlockRef>(&refs[0], kChunks + 2));
              // Mapped now: with the names gone, a resolve that had to open its chunk would fail.
              Pool::unlink(name);
              for (int i = 0; i < kChunks; ++i) GPUIPC_CHILD_CHECK(holds_pattern(p.resolve(refs[i]), kChunk, i));
              p.map_chunks(std::span<const BlockRef>(&refs[0], kChunks));  // all mapped: nothing to ask
              return 0;
            }),
            0);
  blocks.clear();
}

TEST(PoolsHost, MapChunksInAProcessThatMapsTheChunksMapsNothingAnew) {
  const auto name = unique_name("pool");
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = 3 * kChunk});
  std::vector<Block> blocks;
  std::vector<BlockRef> refs;
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(pool.allocate(kChunk));
    refs.push_back(blocks.back().ref());
  }
  // A second handle in the creator's process (as open_tensors of one's own tensors makes) takes the process's
  // mappings of the chunks, as resolve does: the same addresses, not a second mapping of each.
  auto again = Pool::open(name);
  again.map_chunks(refs);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(again.resolve(refs[i]), blocks[i].data()) << i;
  blocks.clear();
  Pool::unlink(name);
}

TEST(PoolsHost, MapChunksThrowsTheFirstFailureAfterMappingTheRest) {
  const auto name = unique_name("pool");
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = 4 * kChunk});
  std::vector<Block> blocks;
  Shared<BlockRef> refs(4);
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(pool.allocate(kChunk));
    fill_pattern(blocks.back().data(), kChunk, i);
    refs[i] = blocks.back().ref();
  }
  Segment::unlink(name + ".chunk.1");  // its memory stays (the creator maps it); its name is gone
  EXPECT_EQ(run_child([&] {
              auto p = Pool::open(name);
              GPUIPC_CHILD_CHECK(fails_with([&] { p.map_chunks(std::span<const BlockRef>(&refs[0], 4)); },
                                            ErrorCode::NotFound, "chunk.1"));
              Pool::unlink(name);
              for (int i : {0, 2, 3}) GPUIPC_CHILD_CHECK(holds_pattern(p.resolve(refs[i]), kChunk, i));
              GPUIPC_CHILD_CHECK(fails_with([&] { p.resolve(refs[1]); }, ErrorCode::NotFound, "chunk.1"));
              return 0;
            }),
            0);
  blocks.clear();
}

TEST(PoolsHost, APoolOfAnotherReleaseIsRefusedSayingSo) {
  const auto name = unique_name("pool");
  auto pool = one_chunk_pool(name);
  {
    auto control = Segment::open(name);  // the control block: its layout version is the second word
    static_cast<std::uint32_t*>(control.data())[1] = 1;
  }
  EXPECT_TRUE(fails_with([&] { Pool::open(name); }, ErrorCode::InvalidArgument, "made by another gpuipc release"));
  EXPECT_TRUE(fails_with([&] { Pool::stat(name); }, ErrorCode::InvalidArgument, "control block is version 1"));
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolsHost, MaxBytesIsHonouredOrRefusedNeverCut) {
  const auto name = unique_name("pool");
  auto create = [&](std::uint64_t chunk, std::uint64_t max) {
    return Pool::create(name, {.kind = SegmentKind::Host, .chunk_bytes = chunk, .max_bytes = max, .max_blocks = 64});
  };
  // 16384 chunks of 64 KiB: it was cut to 1024 (64 MiB) without a word.
  EXPECT_TRUE(fails_with([&] { create(64 << 10, 1ULL << 30); }, ErrorCode::InvalidArgument,
                         "max_bytes 1073741824 is 16384 chunks of 65536 bytes, and a pool holds at most 1024: raise "
                         "chunk_bytes to at least 1048576 or lower max_bytes to at most 67108864"));
  EXPECT_TRUE(fails_with([&] { create(64 << 10, 1ULL << 62); }, ErrorCode::InvalidArgument, "at most 1024"));
  // 5000 bytes is a chunk of 8192.
  EXPECT_TRUE(fails_with([&] { create(5000, 5000); }, ErrorCode::InvalidArgument, "less than one chunk (8192 bytes"));
  EXPECT_TRUE(fails_with([&] { Pool::stat(name); }, ErrorCode::NotFound, name));  // nothing left behind
  {
    auto pool = create(64 << 10, 64 << 20);  // exactly 1024 chunks
    EXPECT_EQ(pool.stats().max_bytes, 64u << 20);
    EXPECT_EQ(pool.stats().max_chunks, 1024u);
  }
  Pool::unlink(name);
}

TEST(PoolsHost, AFixedPoolSaysWhyItsBlocksCannotHaveAnAlignment) {
  const auto name = unique_name("pool");
  auto pool = Pool::create(
      name, {.kind = SegmentKind::Host, .pool_mode = PoolMode::Fixed, .block_bytes = 256, .block_count = 4});
  EXPECT_TRUE(fails_with([&] { pool.allocate(10, 4096); }, ErrorCode::InvalidArgument,
                         "its fixed blocks are 256 bytes apart, so they are not aligned to 4096"));
  Block b = pool.allocate(10, 256);
  b = Block();
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolsHost, MisuseGetsInvalidArgumentNamingWhatIsWrong) {
  const auto name = unique_name("pool");
  auto pool = one_chunk_pool(name);
  auto other = one_chunk_pool(name + "-b");
  Block b = pool.allocate(1000);
  const BlockRef good = b.ref();
  auto forged = [&](auto change) {
    BlockRef r = good;
    change(r);
    return r;
  };
  EXPECT_TRUE(fails_with([&] { pool.resolve(forged([](BlockRef& r) { r.offset += 256; })); },
                         ErrorCode::InvalidArgument, "not live"));
  EXPECT_TRUE(fails_with([&] { pool.resolve(forged([](BlockRef& r) { r.offset = kChunk; })); },
                         ErrorCode::InvalidArgument, "out of range"));
  EXPECT_TRUE(fails_with([&] { pool.resolve(forged([](BlockRef& r) { r.generation += 1; })); },
                         ErrorCode::InvalidArgument, "generation"));
  EXPECT_TRUE(fails_with([&] { pool.resolve(forged([](BlockRef& r) { r.chunk = 5; })); }, ErrorCode::InvalidArgument,
                         "chunk 5"));
  EXPECT_TRUE(fails_with([&] { pool.resolve(forged([](BlockRef& r) { r.index = 1000; })); }, ErrorCode::InvalidArgument,
                         "block index 1000"));
  EXPECT_TRUE(fails_with([&] { other.resolve(good); }, ErrorCode::InvalidArgument, "belongs to pool id"));
  EXPECT_TRUE(fails_with([&] { pool.release(good); }, ErrorCode::InvalidArgument, "holds no reference"));
  pool.hold(good);
  pool.release(good);
  EXPECT_TRUE(fails_with([&] { pool.release(good); }, ErrorCode::InvalidArgument, "holds no reference"));
  Block c = pool.allocate(1000);
  EXPECT_TRUE(
      fails_with([&] { other.free(std::move(c)); }, ErrorCode::InvalidArgument, "free it through its own pool"));
  {
    // A second handle of the same pool in this process frees a block the first allocated (as the first's).
    Pool again = Pool::open(name);
    const auto live = Pool::stat(name).live_blocks;
    Block d = pool.allocate(1000);
    EXPECT_EQ(Pool::stat(name).live_blocks, live + 1);
    EXPECT_NO_THROW(again.free(std::move(d)));
    EXPECT_FALSE(d);
    EXPECT_EQ(Pool::stat(name).live_blocks, live);
    EXPECT_TRUE(fails_with([&] { again.free(std::move(d)); }, ErrorCode::InvalidArgument, "double free"));
  }
  pool.free(std::move(c));
  EXPECT_TRUE(fails_with([&] { pool.free(std::move(c)); }, ErrorCode::InvalidArgument, "double free"));
  EXPECT_TRUE(fails_with([&] { pool.allocate(kChunk + 1); }, ErrorCode::InvalidArgument, "chunk size"));
  EXPECT_TRUE(fails_with([&] { pool.allocate(8, 3); }, ErrorCode::InvalidArgument, "power of two"));
  EXPECT_TRUE(
      fails_with([&] { Pool::create(name + "-c", {.chunk_bytes = 0}); }, ErrorCode::InvalidArgument, "chunk_bytes"));
  EXPECT_TRUE(fails_with([&] { Pool::open(name + ".chunk.0"); }, ErrorCode::InvalidArgument, "not a gpuipc pool"));
  EXPECT_TRUE(fails_with([&] { Pool::open(name + "-missing"); }, ErrorCode::NotFound, "missing"));
  Block none;
  EXPECT_EQ(pool.try_allocate(0, 256, none), Status::InvalidState);
  b = Block();
  Pool::unlink(name + "-b");
  Pool::unlink(name);
}

TEST(PoolsHost, FixedBlocksAndStatFromANonMember) {
  const auto name = unique_name("fixed");
  auto pool = Pool::create(name, {.kind = SegmentKind::Host, .pool_mode = PoolMode::Fixed, .block_bytes = 1000,
                                  .block_count = 4});
  EXPECT_EQ(pool.block_bytes(), 1024U);
  std::vector<Block> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(pool.allocate(1024));
  EXPECT_TRUE(fails_with([&] { pool.allocate(1); }, ErrorCode::QuotaExceeded, "exhausted"));
  EXPECT_TRUE(fails_with([&] { pool.allocate(1025); }, ErrorCode::InvalidArgument, "block_bytes"));
  blocks.pop_back();
  const auto st = Pool::stat(name);
  EXPECT_EQ(st.live_blocks, 3U);
  EXPECT_EQ(st.used_bytes, 3072U);
  EXPECT_EQ(st.largest_free_block, 1024U);
  EXPECT_EQ(st.members, 1U);
  EXPECT_TRUE(fails_with([&] { Pool::stat(name + ".chunk.0"); }, ErrorCode::InvalidArgument, "not a gpuipc pool"));
  Pool::unlink(name);
}

TEST(PoolsHost, ClosingEverythingLeavesNoBrokerReference) {
  const std::uint64_t before = BrokerEnvironment::broker_references();
  const auto name = unique_name("pool");
  {
    auto pool = one_chunk_pool(name);
    Block b = pool.allocate(100);
    EXPECT_EQ(run_child([&] {
                auto p = Pool::open(name);
                p.resolve(b.ref());
                return 0;
              }),
              0);
    Pool::unlink(name);
  }
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == before; }, 5s));
}

/// The CLI of this build's stdout for `args` (the test's broker is in the environment).
std::string gpuipc_cli(const std::string& args) {
  std::string out;
  FILE* pipe = ::popen((GPUIPC_BUILD_BIN_DIR "/gpuipc " + args).c_str(), "r");  // NOLINT(cert-env33-c): a test
  if (pipe == nullptr) return out;
  char buffer[4096];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) out.append(buffer, n);
  ::pclose(pipe);
  return out;
}

TEST(PoolsHost, StatAndLsShowPoolStatistics) {
  const auto name = unique_name("pool");
  auto pool = one_chunk_pool(name);
  Block b = pool.allocate(4096);
  const std::string stat = gpuipc_cli("stat " + name);
  EXPECT_NE(stat.find("pool:       used 4.0 KiB, free 60.0 KiB, 1 of 1 chunks, largest free block 60.0 KiB, 1 blocks "
                      "live, 1 members"),
            std::string::npos)
      << stat;
  EXPECT_NE(gpuipc_cli("stat --json " + name).find("\"largest_free_block\": 61440"), std::string::npos);
  EXPECT_EQ(gpuipc_cli("stat " + name + ".chunk.0").find("pool:"), std::string::npos);
  const std::string ls = gpuipc_cli("ls");
  EXPECT_NE(ls.find("  pool: used 4.0 KiB"), std::string::npos) << ls;
  EXPECT_NE(gpuipc_cli("ls --json").find("\"live_blocks\": 1"), std::string::npos);
  Pool::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
