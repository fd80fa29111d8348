// The shared pool state (src/shm/pool_block) on control blocks built in memory: allocation in both modes, holds,
// stream-ordered frees, growth by chunks, member removal (a clean leave and a death at every step of a script,
// including inside the lock), threads racing a removal, and control blocks full of garbage.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "broker/repair.hpp"
#include "gpuipc/pool.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc::shm {
namespace {

using namespace std::chrono_literals;
using proto::atomic;

constexpr auto kTimeout = std::chrono::nanoseconds(1s);

template <typename Pred>
bool wait_for(Pred&& pred) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::yield();
  }
  return true;
}

/// A zeroed, 64-byte aligned control block with its geometry written and its first `ready` chunks ready.
struct TestPool {
  explicit TestPool(PoolMode mode, std::uint32_t records, std::uint64_t chunk_bytes, std::uint32_t max_chunks,
                    std::uint32_t ready = 1, std::uint64_t block_bytes = 0)
      : size(pool_control_bytes(records)), mem(static_cast<std::byte*>(std::aligned_alloc(64, size)), &std::free) {
    std::memset(mem.get(), 0, size);
    PoolGeometry g;
    g.pool_id = 0x1234;
    g.mode = mode;
    g.kind = 2;
    g.max_chunks = max_chunks;
    g.chunk_bytes = chunk_bytes;
    g.block_bytes = block_bytes;
    g.max_records = records;
    for (std::uint32_t c = 0; c < ready; ++c) {
      header().chunks[c].state = static_cast<std::uint32_t>(ChunkState::Ready);
      header().chunks[c].bytes = chunk_bytes;
    }
    init_pool(mem.get(), g);
    block = PoolBlock(mem.get(), size);
    scratch.reserve(records);
  }
  PoolHeader& header() { return *reinterpret_cast<PoolHeader*>(mem.get()); }
  PoolStatus alloc(std::uint32_t member, std::uint64_t bytes, BlockLocation& loc, std::uint64_t align = 256) {
    return block.allocate(member, bytes, align, loc, scratch, kTimeout);
  }
  int remove(std::uint32_t member) { return pool_remove_member(mem.get(), size, member); }
  /// No two live or draining blocks overlap, and every one lies inside its chunk (checked under the pool lock,
  /// taken as member 60, which no test uses).
  bool disjoint() {
    std::uint32_t free = 0;
    while (!atomic(header().lock).compare_exchange_weak(free, 61U)) free = 0;
    const bool ok = disjoint_unlocked();
    atomic(header().lock).store(0U);
    return ok;
  }
  bool disjoint_unlocked() {
    std::vector<OccupiedRange> r;
    r.reserve(block.geometry().max_records);
    for (std::uint32_t i = 0; i < block.geometry().max_records; ++i) {
      auto& rec = block.record(i);
      const auto s = static_cast<RecordState>(atomic(rec.state).load());
      if (s != RecordState::Live && s != RecordState::Draining) continue;
      if (rec.offset + rec.size > block.geometry().chunk_bytes) return false;
      r.push_back({rec.offset, rec.offset + rec.size, rec.chunk});
    }
    std::sort(r.begin(), r.end(), [](auto& a, auto& b) { return a.chunk != b.chunk ? a.chunk < b.chunk : a.begin < b.begin; });
    for (std::size_t i = 1; i < r.size(); ++i) {
      if (r[i].chunk == r[i - 1].chunk && r[i].begin < r[i - 1].end) return false;
    }
    return true;
  }
  std::size_t size;
  std::unique_ptr<std::byte, decltype(&std::free)> mem;
  PoolBlock block;
  std::vector<OccupiedRange> scratch;
};

TEST(ShmPool, GeometryValidates) {
  TestPool p(PoolMode::Variable, 16, 1 << 20, 4);
  EXPECT_TRUE(p.block.valid());
  EXPECT_FALSE(PoolBlock(p.mem.get(), p.size - 64).valid());  // records past the end
  p.header().max_chunks = kMaxChunks + 1;
  EXPECT_FALSE(PoolBlock(p.mem.get(), p.size).valid());
  p.header().max_chunks = 4;
  p.header().magic = 0;
  EXPECT_FALSE(PoolBlock(p.mem.get(), p.size).valid());
  EXPECT_EQ(pool_remove_member(p.mem.get(), p.size, 0), -1);
  EXPECT_EQ(pool_remove_member(nullptr, 0, 0), -1);
}

TEST(ShmPool, VariableAllocatesDisjointAlignedAndCoalescesFreedNeighbours) {
  TestPool p(PoolMode::Variable, 16, 4096, 1);
  BlockLocation a, b, c, d;
  ASSERT_EQ(p.alloc(0, 100, a), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 1000, b), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 1024, c, 1024), PoolStatus::Ok);
  EXPECT_EQ(a.offset, 0U);
  EXPECT_EQ(b.offset, 256U);
  EXPECT_EQ(c.offset % 1024, 0U);
  EXPECT_NE(a.generation, b.generation);
  EXPECT_TRUE(p.disjoint());
  ASSERT_EQ(p.alloc(0, 4096 - c.offset - c.size, d, 1), PoolStatus::Ok);  // the rest
  BlockLocation e;
  EXPECT_EQ(p.alloc(0, 900, e), PoolStatus::NoSpace);  // gaps of 156 and 792 bytes left, one chunk only
  // Free b and c: together they make room for one block larger than either.
  ASSERT_EQ(p.block.release(0, b, false, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, c, false, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 1500, e), PoolStatus::Ok);
  EXPECT_EQ(e.offset, 256U);
  EXPECT_TRUE(p.disjoint());
  EXPECT_EQ(p.block.check_live(b), PoolStatus::Stale);  // freed
  EXPECT_EQ(p.block.release(0, b, false, kTimeout), PoolStatus::Stale);  // a double free
  EXPECT_EQ(p.alloc(0, 4097, e), PoolStatus::Invalid);  // above the chunk
  EXPECT_EQ(p.alloc(0, 8, e, 3), PoolStatus::Invalid);  // not a power of two
  const auto counts = p.block.counts();
  EXPECT_EQ(counts.live_blocks, 3U);
  EXPECT_EQ(counts.chunks, 1U);
}

TEST(ShmPool, GrowsByChunksReservedForOneCaller) {
  TestPool p(PoolMode::Variable, 16, 4096, 2, 1);
  BlockLocation a, b, n;
  ASSERT_EQ(p.alloc(0, 4096, a), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 10, n), PoolStatus::NeedChunk);
  EXPECT_EQ(n.chunk, 1U);
  EXPECT_EQ(p.alloc(1, 10, b), PoolStatus::ChunkBusy);  // member 1 waits for member 0's chunk
  p.block.chunk_created(1, 1, false);                           // not its chunk: no effect
  EXPECT_EQ(p.alloc(1, 10, b), PoolStatus::ChunkBusy);
  p.block.chunk_created(0, 1, true);
  ASSERT_EQ(p.alloc(1, 10, b), PoolStatus::Ok);
  EXPECT_EQ(b.chunk, 1U);
  ASSERT_EQ(p.alloc(1, 3800, b), PoolStatus::Ok);
  EXPECT_EQ(p.alloc(1, 3800, b), PoolStatus::NoSpace);  // max_chunks reached
  // A creator that dies gives its reservation back.
  TestPool q(PoolMode::Variable, 16, 4096, 2, 1);
  ASSERT_EQ(q.alloc(0, 4096, a), PoolStatus::Ok);
  ASSERT_EQ(q.alloc(3, 10, n), PoolStatus::NeedChunk);
  EXPECT_EQ(q.remove(3), 0);
  EXPECT_EQ(q.alloc(0, 10, n), PoolStatus::NeedChunk);  // reserved again, for a live member
}

TEST(ShmPool, FixedModeHandsOutWholeBlocksUntilNoneIsLeft) {
  TestPool p(PoolMode::Fixed, 4, 4 * 1024, 1, 1, 1024);
  std::vector<BlockLocation> got(4);
  for (auto& l : got) ASSERT_EQ(p.alloc(0, 1000, l), PoolStatus::Ok);
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i].offset, got[i].record * 1024ULL);
  BlockLocation x;
  EXPECT_EQ(p.alloc(0, 1, x), PoolStatus::NoSpace);
  EXPECT_EQ(p.alloc(0, 1025, x), PoolStatus::Invalid);
  EXPECT_EQ(p.block.largest_free(p.scratch), 0U);
  ASSERT_EQ(p.block.release(0, got[2], false, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.block.largest_free(p.scratch), 1024U);
  ASSERT_EQ(p.alloc(1, 1, x), PoolStatus::Ok);
  EXPECT_EQ(x.offset, 2048U);
}

TEST(ShmPool, MemoryIsNotReusedWhileAnyMemberHoldsIt) {
  TestPool p(PoolMode::Variable, 8, 1024, 1);
  BlockLocation a, b;
  ASSERT_EQ(p.alloc(0, 1024, a), PoolStatus::Ok);
  ASSERT_EQ(p.block.hold(1, a, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.block.hold(2, a, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, a, false, kTimeout), PoolStatus::Ok);  // the allocator frees
  EXPECT_EQ(p.block.release(0, a, false, kTimeout), PoolStatus::NotHeld);
  EXPECT_EQ(p.alloc(0, 1, b), PoolStatus::NoSpace);
  ASSERT_EQ(p.block.release(1, a, false, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.alloc(0, 1, b), PoolStatus::NoSpace);
  ASSERT_EQ(p.block.release(2, a, false, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 1, b), PoolStatus::Ok);
  EXPECT_EQ(p.block.hold(1, a, kTimeout), PoolStatus::Stale);  // the old reference names a dead generation
  BlockLocation forged = b;
  forged.offset += 1;
  EXPECT_EQ(p.block.hold(1, forged, kTimeout), PoolStatus::Stale);
  forged = b;
  forged.record = 1000;
  EXPECT_EQ(p.block.hold(1, forged, kTimeout), PoolStatus::Invalid);
  EXPECT_EQ(p.block.hold(64, b, kTimeout), PoolStatus::Invalid);
}

TEST(ShmPool, RecordsInUseStayPackedBelowTheirEndThroughChurn) {
  TestPool p(PoolMode::Variable, 1024, 1 << 20, 1);
  EXPECT_EQ(p.block.record_end(), 0U);
  // Thousands of allocations, never more than four live at once: the records come from the bottom again and
  // again, so every scan (a leave, an allocation's first fit, stats) reads four records, not 1024.
  for (int round = 0; round < 3000; ++round) {
    BlockLocation loc[4];
    for (auto& l : loc) ASSERT_EQ(p.alloc(0, 64, l), PoolStatus::Ok) << round;
    for (const auto& l : loc) ASSERT_EQ(p.block.release(0, l, false, kTimeout), PoolStatus::Ok);
  }
  EXPECT_EQ(p.block.record_end(), 4U);
  // Ten live, the middle ones freed: new blocks take the lowest free records first.
  BlockLocation ten[10];
  for (auto& l : ten) ASSERT_EQ(p.alloc(0, 64, l), PoolStatus::Ok);
  EXPECT_EQ(p.block.record_end(), 10U);
  ASSERT_EQ(p.block.release(0, ten[6], false, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, ten[3], false, kTimeout), PoolStatus::Ok);
  BlockLocation x, y;
  ASSERT_EQ(p.alloc(0, 64, x), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 64, y), PoolStatus::Ok);
  EXPECT_EQ(x.record, ten[3].record);
  EXPECT_EQ(y.record, ten[6].record);
  EXPECT_EQ(p.block.record_end(), 10U);
  // A drained stream-ordered free and a removed member's holds give their records back to the bottom too.
  ASSERT_EQ(p.block.release(0, ten[1], true, kTimeout), PoolStatus::Ok);
  atomic(p.block.record(ten[1].record).released).store(ten[1].generation);
  ASSERT_EQ(p.block.hold(5, ten[2], kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, ten[2], false, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.remove(5), 1);
  BlockLocation u, v;
  ASSERT_EQ(p.alloc(0, 64, u), PoolStatus::Ok);  // sweeps the drained record first
  ASSERT_EQ(p.alloc(0, 64, v), PoolStatus::Ok);
  EXPECT_EQ(u.record, ten[1].record);
  EXPECT_EQ(v.record, ten[2].record);
  EXPECT_EQ(p.block.record_end(), 10U);
  EXPECT_EQ(p.block.counts().live_blocks, 10U);
  EXPECT_TRUE(p.disjoint());
}

TEST(ShmPool, AControlBlockOfAnotherLayoutVersionIsRefusedAndNamed) {
  TestPool p(PoolMode::Variable, 16, 1 << 20, 1);
  EXPECT_EQ(pool_version_of(p.mem.get(), p.size), kPoolVersion);
  p.header().version = 1;  // a pool of a release without record_end
  EXPECT_FALSE(PoolBlock(p.mem.get(), p.size).valid());
  EXPECT_EQ(pool_version_of(p.mem.get(), p.size), 1U);
  p.header().magic = 0;
  EXPECT_EQ(pool_version_of(p.mem.get(), p.size), 0U);
  EXPECT_EQ(pool_version_of(p.mem.get(), 16), 0U);
}

TEST(ShmPool, StreamOrderedFreeDrainsUntilTheReleasedWordReachesTheGeneration) {
  TestPool p(PoolMode::Variable, 8, 1024, 1);
  BlockLocation a, b;
  ASSERT_EQ(p.alloc(0, 1024, a), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, a, true, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.block.counts().draining_blocks, 1U);
  EXPECT_EQ(p.alloc(0, 1, b), PoolStatus::NoSpace);
  atomic(p.block.record(a.record).released).store(a.generation);  // what the stream writes
  ASSERT_EQ(p.alloc(0, 1024, b), PoolStatus::Ok);
  // A member that dies with its stream-ordered free pending: its stream will never write the word.
  ASSERT_EQ(p.block.release(0, b, true, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.alloc(1, 1, a), PoolStatus::NoSpace);
  p.remove(0);
  EXPECT_EQ(p.alloc(1, 1, a), PoolStatus::Ok);
}

// A live member leaving while its stream has not reached a free (the broker removes its entry later): its holds go
// at once, the block it freed on the stream stays draining until the stream writes `released`.
TEST(ShmPool, ALeaveKeepingPendingFreesReleasesHoldsAndLeavesThoseBlocksDraining) {
  TestPool p(PoolMode::Variable, 8, 2048, 1);
  BlockLocation held, freed, x;
  ASSERT_EQ(p.alloc(0, 1024, held), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 1024, freed), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, freed, true, kTimeout), PoolStatus::Ok);
  EXPECT_TRUE(pool_member_frees_pending(p.mem.get(), p.size, 0));
  EXPECT_FALSE(pool_member_frees_pending(p.mem.get(), p.size, 1));
  EXPECT_EQ(pool_members_with_frees_pending(p.mem.get(), p.size), 1U);
  EXPECT_EQ(pool_remove_member(p.mem.get(), p.size, 0, /*keep_pending_frees=*/true), 1);
  EXPECT_EQ(p.block.check_live(held), PoolStatus::Stale);  // freed
  EXPECT_EQ(p.block.counts().draining_blocks, 1U);
  EXPECT_TRUE(pool_member_frees_pending(p.mem.get(), p.size, 0));
  ASSERT_EQ(p.alloc(1, 1024, x), PoolStatus::Ok);  // the held block's memory
  EXPECT_EQ(x.offset, held.offset);
  EXPECT_EQ(p.alloc(1, 1024, x), PoolStatus::NoSpace);                    // not the draining one
  atomic(p.block.record(freed.record).released).store(freed.generation);  // what the stream writes
  EXPECT_FALSE(pool_member_frees_pending(p.mem.get(), p.size, 0));
  EXPECT_EQ(pool_members_with_frees_pending(p.mem.get(), p.size), 0U);
  EXPECT_EQ(p.alloc(1, 1024, x), PoolStatus::Ok);
  EXPECT_EQ(x.offset, freed.offset);
}

// What a closing handle parks on (core/stream_park.hpp): the frees its member's stream has not reached, and when
// they have landed; a record reused later (a higher generation, after the write) still counts as landed.
TEST(ShmPool, PendingFreesOfAMemberAreListedUntilTheirStreamWritesReleased) {
  TestPool p(PoolMode::Variable, 8, 2048, 1);
  BlockLocation a, b, c, x;
  ASSERT_EQ(p.alloc(0, 512, a), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 512, b), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(1, 512, c), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, a, true, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.block.release(0, b, false, kTimeout), PoolStatus::Ok);  // freed at once: nothing to wait for
  ASSERT_EQ(p.block.release(1, c, true, kTimeout), PoolStatus::Ok);   // another member's
  const auto frees = pool_member_pending_frees(p.mem.get(), p.size, 0);
  ASSERT_EQ(frees.size(), 1U);
  EXPECT_EQ(frees[0].index, a.record);
  EXPECT_EQ(frees[0].generation, a.generation);
  EXPECT_TRUE(pool_member_pending_frees(p.mem.get(), p.size, 2).empty());
  EXPECT_TRUE(pool_member_pending_frees(p.mem.get(), p.size, proto::kMaxMembers).empty());
  EXPECT_FALSE(pool_frees_landed(p.mem.get(), p.size, frees));
  atomic(p.block.record(c.record).released).store(c.generation);  // the other member's stream: not ours
  EXPECT_FALSE(pool_frees_landed(p.mem.get(), p.size, frees));
  atomic(p.block.record(a.record).released).store(a.generation);  // what the stream writes
  EXPECT_TRUE(pool_frees_landed(p.mem.get(), p.size, frees));
  for (int i = 0; i < 4; ++i) {  // the records go round again
    ASSERT_EQ(p.alloc(1, 512, x), PoolStatus::Ok);
    ASSERT_EQ(p.block.release(1, x, false, kTimeout), PoolStatus::Ok);
  }
  EXPECT_TRUE(pool_frees_landed(p.mem.get(), p.size, frees));
  EXPECT_TRUE(pool_frees_landed(p.mem.get(), p.size, {{1U << 30, ~0ULL}}));  // out of range: nothing to wait for
}

TEST(ShmPool, PauseRefusesAllocationAndHoldsUntilResumedByThePauser) {
  TestPool p(PoolMode::Variable, 8, 4096, 1);
  BlockLocation a, b;
  ASSERT_EQ(p.alloc(0, 1024, a), PoolStatus::Ok);
  EXPECT_EQ(p.block.pause_info().state, PauseState::Active);
  ASSERT_EQ(p.block.begin_pause(0, 4242, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.block.begin_pause(1, 1, kTimeout), PoolStatus::Paused) << "paused twice";
  EXPECT_EQ(p.alloc(1, 16, b), PoolStatus::Paused);
  EXPECT_EQ(p.block.hold(1, a, kTimeout), PoolStatus::Paused);
  EXPECT_EQ(p.block.begin_resume(0, 4242, kTimeout), PoolStatus::NotPaused) << "resumed while still pausing";
  p.block.end_pause(0, true);
  auto info = p.block.pause_info();
  EXPECT_EQ(info.state, PauseState::Paused);
  EXPECT_EQ(info.member, 0U);
  EXPECT_EQ(info.pid, 4242U);
  EXPECT_EQ(info.epoch, 1U);
  EXPECT_EQ(p.block.counts().state, gpuipc::PoolState::Paused);
  EXPECT_EQ(p.block.counts().paused_by_pid, 4242U);
  // Releasing what one holds is allowed while paused (a tensor dropped meanwhile).
  EXPECT_EQ(p.block.release(0, a, false, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.block.begin_resume(1, 7, kTimeout), PoolStatus::NotPaused) << "another live member resumed it";
  ASSERT_EQ(p.block.begin_resume(0, 4242, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.alloc(1, 16, b), PoolStatus::Paused) << "allocated while resuming";
  p.block.end_resume(0, true);
  EXPECT_EQ(p.block.pause_info().state, PauseState::Active);
  EXPECT_EQ(p.block.pause_info().epoch, 1U) << "resume does not move the epoch";
  EXPECT_EQ(p.alloc(1, 16, b), PoolStatus::Ok);
  EXPECT_EQ(p.block.begin_resume(0, 4242, kTimeout), PoolStatus::NotPaused) << "resumed an active pool";
  // A pause that released nothing goes back to Active with the epoch unchanged.
  ASSERT_EQ(p.block.begin_pause(1, 5, kTimeout), PoolStatus::Ok);
  p.block.end_pause(1, false);
  EXPECT_EQ(p.block.pause_info().state, PauseState::Active);
  EXPECT_EQ(p.block.pause_info().epoch, 1U);
}

TEST(ShmPool, AFailedResumeMakesWhatWasMappedDuringItStale) {
  // A resume backs the chunks with new memory, one by one, under their names; when a later one fails it unlinks
  // them again. A member that mapped one in between did so at the epoch of the pause, and kept that memory as the
  // chunk's after the next resume made new memory.
  TestPool p(PoolMode::Variable, 8, 4096, 1);
  ASSERT_EQ(p.block.begin_pause(0, 4242, kTimeout), PoolStatus::Ok);
  p.block.end_pause(0, true);
  ASSERT_EQ(p.block.pause_info().epoch, 1U);
  ASSERT_EQ(p.block.begin_resume(0, 4242, kTimeout), PoolStatus::Ok);
  const std::uint64_t mapped_at = p.block.pause_info().epoch;  // a member maps a chunk the resume made
  p.block.end_resume(0, false);
  EXPECT_EQ(p.block.pause_info().state, PauseState::Paused);
  EXPECT_GT(p.block.pause_info().epoch, mapped_at) << "a mapping of the released memory looks current";
  ASSERT_EQ(p.block.begin_resume(0, 4242, kTimeout), PoolStatus::Ok);
  const std::uint64_t resumed_at = p.block.pause_info().epoch;
  p.block.end_resume(0, true);
  EXPECT_EQ(p.block.pause_info().epoch, resumed_at) << "a resume that succeeds does not move it";
}

TEST(ShmPool, APauserThatDiesLeavesThePoolPausedForAnyMemberToResume) {
  for (const bool during : {false, true}) {
    TestPool p(PoolMode::Variable, 8, 4096, 1);
    ASSERT_EQ(p.block.begin_pause(2, 99, kTimeout), PoolStatus::Ok);
    if (!during) p.block.end_pause(2, true);
    EXPECT_EQ(p.remove(1), 0);  // another member leaving changes nothing
    EXPECT_EQ(p.block.pause_info().member, 2U);
    p.remove(2);
    const auto info = p.block.pause_info();
    EXPECT_EQ(info.state, PauseState::Paused) << "died " << (during ? "pausing" : "paused");
    EXPECT_EQ(info.member, kNoPauser);
    EXPECT_EQ(info.epoch, 1U) << "memory it may have released makes mappings stale";
    EXPECT_TRUE(p.block.counts().pauser_gone);
    p.block.end_pause(2, true);  // a late call of the dead pauser (or its reused index) changes nothing
    EXPECT_EQ(p.block.pause_info().epoch, 1U);
    ASSERT_EQ(p.block.begin_resume(3, 100, kTimeout), PoolStatus::Ok);
    p.remove(3);  // and a resumer that dies: paused again, for anyone
    EXPECT_EQ(p.block.pause_info().state, PauseState::Paused);
    EXPECT_EQ(p.block.pause_info().member, kNoPauser);
    ASSERT_EQ(p.block.begin_resume(4, 101, kTimeout), PoolStatus::Ok);
    p.block.end_resume(4, true);
    EXPECT_EQ(p.block.pause_info().state, PauseState::Active);
  }
}

TEST(ShmPool, OccupiedMergesOverlappingRangesPerChunk) {
  TestPool p(PoolMode::Variable, 8, 4096, 2, 2);
  BlockLocation a, b, c;
  ASSERT_EQ(p.alloc(0, 1000, a), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 1000, b), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 4096, c), PoolStatus::Ok);
  std::vector<OccupiedRange> r;
  r.reserve(8);
  ASSERT_TRUE(p.block.occupied(r));
  ASSERT_EQ(r.size(), 3U) << "two blocks with a gap of alignment, and a chunk of its own";
  EXPECT_EQ(r[0].chunk, 0U);
  EXPECT_EQ(r[0].end - r[0].begin, 1000U);
  EXPECT_EQ(r[1].begin, b.offset);
  EXPECT_EQ(r[2].chunk, 1U);
  EXPECT_EQ(r[2].end - r[2].begin, 4096U);
}

TEST(ShmPool, RemovingAMemberReleasesEveryHoldItHas) {
  TestPool p(PoolMode::Variable, 16, 3072, 1);
  BlockLocation mine, shared, theirs, x;
  ASSERT_EQ(p.alloc(0, 1024, mine), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(0, 1024, shared), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(1, 1024, theirs), PoolStatus::Ok);
  ASSERT_EQ(p.block.hold(0, theirs, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.block.hold(1, shared, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(p.remove(0), 3);
  EXPECT_EQ(p.block.check_live(mine), PoolStatus::Stale);  // freed: member 0 was its only holder
  EXPECT_EQ(p.block.check_live(shared), PoolStatus::Ok);   // member 1 still holds these
  EXPECT_EQ(p.block.check_live(theirs), PoolStatus::Ok);
  EXPECT_EQ(p.remove(0), 0);  // idempotent
  ASSERT_EQ(p.alloc(2, 1024, x), PoolStatus::Ok);
  EXPECT_EQ(x.offset, mine.offset);
  EXPECT_EQ(p.remove(1), 2);
  EXPECT_EQ(p.remove(2), 1);
  EXPECT_EQ(p.block.counts().live_blocks, 0U);
  EXPECT_EQ(p.remove(64), -1);
}

TEST(ShmPool, ADeathInsideTheLockIsRepaired) {
  TestPool p(PoolMode::Variable, 8, 4096, 1);
  BlockLocation a, b;
  ASSERT_EQ(p.alloc(1, 512, a), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(2, 512, b), PoolStatus::Ok);
  // Member 2 died in allocate (a record claimed, the lock held) right after clearing its bit in a release of b.
  // find_record raises record_end before it claims a record: a claimed record always lies below it.
  atomic(p.header().lock).store(2 + 1);
  p.header().record_end = 6;
  p.block.record(5).state = static_cast<std::uint32_t>(RecordState::Claimed);
  atomic(p.block.record(b.record).holders).store(0);
  BlockLocation x;
  EXPECT_EQ(p.block.allocate(1, 1, 256, x, p.scratch, 20ms), PoolStatus::LockTimeout);  // nobody may pass ...
  EXPECT_GE(p.remove(2), 0);                                                          // ... until the repair
  EXPECT_EQ(atomic(p.header().lock).load(), 0U);
  EXPECT_EQ(p.block.record(5).state, static_cast<std::uint32_t>(RecordState::Unused));
  EXPECT_EQ(p.block.check_live(b), PoolStatus::Stale);
  EXPECT_EQ(p.block.check_live(a), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(1, 512, x), PoolStatus::Ok);
  EXPECT_TRUE(p.disjoint());
  // A lock held by another member is not broken by the removal of member 3: the removal is deferred (bounded
  // wait), and the next holder of the lock finishes it and frees member 3's entry.
  BlockLocation y;
  p.header().members[3].token = 300;
  ASSERT_EQ(p.alloc(3, 256, y), PoolStatus::Ok);
  atomic(p.header().lock).store(1 + 1);
  EXPECT_EQ(p.remove(3), -1);
  EXPECT_EQ(p.block.check_live(y), PoolStatus::Ok);
  EXPECT_EQ(p.header().members[3].token, 300U);  // nobody may claim the entry yet
  atomic(p.header().lock).store(0);
  ASSERT_EQ(p.alloc(1, 1, x), PoolStatus::Ok);
  EXPECT_EQ(p.block.check_live(y), PoolStatus::Stale);
  EXPECT_EQ(p.header().members[3].token, 0U);
  EXPECT_EQ(p.header().deferred, 0U);
}

TEST(ShmPool, SeveralDeferredRemovalsAreFinishedTogetherByTheNextLockHolder) {
  // Members 3 and 4 die while member 1 holds the lock: both removals are deferred, and member 1's next lock finishes
  // them in one pass. A block both held is freed; one member 5 also holds stays, held by 5 alone.
  TestPool p(PoolMode::Variable, 16, 1 << 16, 1);
  BlockLocation only3, only4, both, with5;
  for (const std::uint32_t m : {3U, 4U, 5U}) p.header().members[m].token = 100 + m;
  ASSERT_EQ(p.alloc(3, 256, only3), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(4, 256, only4), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(3, 256, both), PoolStatus::Ok);
  ASSERT_EQ(p.block.hold(4, both, kTimeout), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(4, 256, with5), PoolStatus::Ok);
  ASSERT_EQ(p.block.hold(5, with5, kTimeout), PoolStatus::Ok);
  atomic(p.header().lock).store(1 + 1);
  EXPECT_EQ(p.remove(3), -1);
  EXPECT_EQ(p.remove(4), -1);
  EXPECT_EQ(p.header().deferred, (1ULL << 3) | (1ULL << 4));
  atomic(p.header().lock).store(0);
  BlockLocation x;
  ASSERT_EQ(p.alloc(1, 1, x), PoolStatus::Ok);  // takes the lock: finishes both removals
  EXPECT_EQ(p.header().deferred, 0U);
  EXPECT_EQ(p.header().members[3].token, 0U);
  EXPECT_EQ(p.header().members[4].token, 0U);
  EXPECT_EQ(p.header().members[5].token, 105U);
  EXPECT_EQ(p.block.check_live(only3), PoolStatus::Stale);
  EXPECT_EQ(p.block.check_live(only4), PoolStatus::Stale);
  EXPECT_EQ(p.block.check_live(both), PoolStatus::Stale);
  EXPECT_EQ(p.block.check_live(with5), PoolStatus::Ok);
  EXPECT_EQ(atomic(p.block.record(with5.record).holders).load(), 1ULL << 5);
  EXPECT_EQ(p.block.counts().live_blocks, 2U);  // with5 and x
  EXPECT_TRUE(p.disjoint());
}

/// A death at every step of a script: member 0 runs the first k operations, dies, and the repair leaves exactly
/// member 1's blocks and nothing else, with the pool usable.
TEST(ShmPool, DeathAtEveryStepOfAScriptLeavesOnlyTheSurvivorsBlocks) {
  enum Op { Alloc0, Alloc1, Hold0On1, Hold1On0, Free0, Free1, Stream0 };
  const std::vector<Op> script = {Alloc0, Alloc1, Hold0On1, Alloc0, Hold1On0, Free0, Alloc1, Stream0, Free1, Alloc0};
  for (std::size_t k = 0; k <= script.size(); ++k) {
    SCOPED_TRACE(k);
    TestPool p(PoolMode::Variable, 16, 8192, 1);
    std::vector<BlockLocation> zero, one;
    std::vector<BlockLocation> held_by_one;  // blocks of member 0 that member 1 holds
    for (std::size_t i = 0; i < k; ++i) {
      BlockLocation l;
      switch (script[i]) {
        case Alloc0: ASSERT_EQ(p.alloc(0, 700, l), PoolStatus::Ok); zero.push_back(l); break;
        case Alloc1: ASSERT_EQ(p.alloc(1, 900, l), PoolStatus::Ok); one.push_back(l); break;
        case Hold0On1: ASSERT_EQ(p.block.hold(0, one.back(), kTimeout), PoolStatus::Ok); break;
        case Hold1On0: ASSERT_EQ(p.block.hold(1, zero.back(), kTimeout), PoolStatus::Ok); held_by_one.push_back(zero.back()); break;
        case Free0: ASSERT_EQ(p.block.release(0, zero.front(), false, kTimeout), PoolStatus::Ok); zero.erase(zero.begin()); break;
        case Free1: ASSERT_EQ(p.block.release(1, one.front(), false, kTimeout), PoolStatus::Ok); one.erase(one.begin()); break;
        case Stream0: ASSERT_EQ(p.block.release(0, zero.back(), true, kTimeout), PoolStatus::Ok); zero.pop_back(); break;
      }
    }
    ASSERT_GE(p.remove(0), 0);
    for (const auto& l : one) EXPECT_EQ(p.block.check_live(l), PoolStatus::Ok);
    std::uint32_t expect_live = static_cast<std::uint32_t>(one.size());
    for (const auto& l : held_by_one) expect_live += p.block.check_live(l) == PoolStatus::Ok ? 1 : 0;
    const auto c = p.block.counts();
    EXPECT_EQ(c.live_blocks, expect_live);
    EXPECT_EQ(c.draining_blocks, 0U);
    for (std::uint32_t i = 0; i < 16; ++i) EXPECT_EQ(p.block.record(i).holders & 1U, 0U);
    EXPECT_TRUE(p.disjoint());
    ASSERT_GE(p.remove(1), 0);
    EXPECT_EQ(p.block.counts().live_blocks, 0U);
    EXPECT_EQ(p.block.counts().largest_free_block, 8192U);  // everything coalesced back
  }
}

/// Three threads (members 0-2) allocate, write their mark, hold each other's blocks and free, while member 3 lives
/// short lives on the main thread: it allocates and holds, then dies (sometimes inside the pool lock) and is
/// removed. Every block's content is checked before it is freed, and no two blocks ever overlap.
TEST(ShmPool, ThreadsRacingRemovalNeverOverlap) {
  TestPool p(PoolMode::Variable, 64, 1 << 14, 4, 1);  // 4 chunks of 16 KiB: it grows, and it runs full
  std::vector<std::atomic<std::uint8_t>> memory(4 << 16);
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::vector<std::atomic<std::uint64_t>> last(3);  // each worker's newest block, for member 3 to hold
  auto worker = [&](std::uint32_t m) {
    std::mt19937 rng(m);
    std::vector<BlockLocation> mine;
    std::vector<OccupiedRange> scratch;
    scratch.reserve(64);
    while (!stop.load()) {
      BlockLocation l;
      const auto st = p.block.allocate(m, 64 + rng() % 4000, 64, l, scratch, kTimeout);
      if (st == PoolStatus::NeedChunk) {
        p.block.chunk_created(m, l.chunk, true);
      } else if (st == PoolStatus::Ok) {
        for (std::uint64_t i = 0; i < l.size; ++i) memory[(l.chunk << 16) + l.offset + i].store(m + 1);
        mine.push_back(l);
        last[m].store(l.record);
      }
      if (mine.size() > 6 || (st != PoolStatus::Ok && !mine.empty())) {
        const BlockLocation f = mine.front();
        mine.erase(mine.begin());
        for (std::uint64_t i = 0; i < f.size; ++i) {
          if (memory[(f.chunk << 16) + f.offset + i].load() != m + 1) ++failures;
        }
        (void)p.block.hold((m + 1) % 3, f, kTimeout);  // a neighbour holds it a moment
        EXPECT_EQ(p.block.release(m, f, false, kTimeout), PoolStatus::Ok);
        p.block.release((m + 1) % 3, f, false, kTimeout);
      }
    }
  };
  std::vector<std::thread> threads;
  for (std::uint32_t m = 0; m < 3; ++m) threads.emplace_back(worker, m);
  std::mt19937 rng(3);
  const auto until = std::chrono::steady_clock::now() + 1s;
  for (int life = 0; life < 1000 || std::chrono::steady_clock::now() < until; ++life) {
    BlockLocation l;
    for (int i = 0; i < 3; ++i) {
      const auto st = p.alloc(3, 64 + rng() % 2000, l, 64);
      if (st == PoolStatus::NeedChunk && rng() % 2 == 0) p.block.chunk_created(3, l.chunk, true);
      if (st == PoolStatus::NeedChunk) break;  // sometimes it dies creating the chunk
      // Member 3 holds another member's block: a guess at its record, checked by hold like a forged reference.
      auto& r = p.block.record(static_cast<std::uint32_t>(last[rng() % 3].load()));
      BlockLocation other{atomic(r.chunk).load(), static_cast<std::uint32_t>(&r - &p.block.record(0)),
                          atomic(r.offset).load(), atomic(r.size).load(), atomic(r.generation).load()};
      (void)p.block.hold(3, other, kTimeout);
    }
    if (rng() % 4 == 0) {  // dies inside the lock
      std::uint32_t free = 0;
      while (!atomic(p.header().lock).compare_exchange_weak(free, 3U + 1)) free = 0;
    }
    if (p.remove(3) < 0) {  // deferred: a worker taking the lock finishes it
      EXPECT_TRUE(wait_for([&] { return atomic(p.header().deferred).load() == 0; }));
    }
    EXPECT_TRUE(p.disjoint());
  }
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0) << "a live block's content was overwritten by another member";
  for (std::uint32_t m = 0; m < 4; ++m) EXPECT_GE(p.remove(m), 0);
  EXPECT_EQ(p.block.counts().live_blocks, 0U);
  EXPECT_GE(p.block.counts().chunks, 2U);
}

/// Garbage in a control block: every function returns, whatever it reads.
TEST(ShmPool, GarbageNeverCrashesOrHangs) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 300; ++round) {
    TestPool p(PoolMode::Variable, 32, 1 << 20, 8, 2);
    BlockLocation l;
    for (int i = 0; i < 5; ++i) ASSERT_EQ(p.alloc(i % 3, 1000, l), PoolStatus::Ok);
    auto* words = reinterpret_cast<std::uint64_t*>(p.mem.get());
    const std::size_t n = p.size / 8;
    const std::size_t header_words = offsetof(PoolHeader, members) / 8;
    for (int i = 0; i < 40; ++i) {
      const std::size_t w = header_words + rng() % (n - header_words);  // the geometry stays valid
      words[w] = rng() % 3 == 0 ? rng() : rng() % 70;
    }
    atomic(p.header().lock).store(0);
    p.block.allocate(1, 1 + rng() % 5000, 256, l, p.scratch, 10ms);
    l.record = static_cast<std::uint32_t>(rng() % 40);
    l.chunk = static_cast<std::uint32_t>(rng() % 10);
    p.block.hold(2, l, 10ms);
    p.block.release(2, l, rng() % 2 == 0, 10ms);
    p.block.counts();
    for (std::uint32_t m = 0; m < 4; ++m) p.remove(m);
  }
}

/// What the broker does for a connection that joined with `token`: removes its entries with their holds.
int repair_pool(void* control, std::size_t size, std::uint32_t token) {
  broker::ControlBlock b{control, size, proto::kFlagPool, {}};
  if (!broker::check_control(b).empty()) return 0;
  int removed = 0;
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    if (static_cast<PoolHeader*>(control)->members[i].token != token) continue;
    removed += broker::remove_member(b, broker::Joined{i, token, proto::Role::Holder}) ? 1 : 0;
  }
  return removed;
}

/// The broker's repair: every member entry the dead connection joined goes, with its holds; others are untouched.
TEST(RepairPool, RemovesEveryMemberOfTheDeadConnectionWithItsHolds) {
  TestPool p(PoolMode::Variable, 16, 4096, 1);
  p.header().members[0] = {100, static_cast<std::uint32_t>(proto::Role::Holder)};
  p.header().members[1] = {200, static_cast<std::uint32_t>(proto::Role::Holder)};
  p.header().members[2] = {100, static_cast<std::uint32_t>(proto::Role::Holder)};  // a second join with token 100
  BlockLocation a, b, c;
  ASSERT_EQ(p.alloc(0, 1000, a), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(2, 1000, b), PoolStatus::Ok);
  ASSERT_EQ(p.alloc(1, 1000, c), PoolStatus::Ok);
  ASSERT_EQ(p.block.hold(2, c, kTimeout), PoolStatus::Ok);
  EXPECT_EQ(repair_pool(p.mem.get(), p.size, 100), 2);
  EXPECT_EQ(p.header().members[0].token, 0U);
  EXPECT_EQ(p.header().members[2].token, 0U);
  EXPECT_EQ(p.header().members[1].token, 200U);
  EXPECT_EQ(p.block.check_live(a), PoolStatus::Stale);
  EXPECT_EQ(p.block.check_live(b), PoolStatus::Stale);
  EXPECT_EQ(p.block.check_live(c), PoolStatus::Ok);
  EXPECT_EQ(p.block.record(c.record).holders, 1ULL << 1);
  EXPECT_EQ(repair_pool(p.mem.get(), p.size, 300), 0);
  EXPECT_EQ(repair_pool(p.mem.get(), 64, 200), 0);  // too small to be a pool
  EXPECT_GE(broker::min_control_bytes(proto::kFlagPool), sizeof(PoolHeader));
}

// A member that keeps the lock word taken (any value but a removed member's) made the broker wait 5 ms for each
// removal: a connection joined 64 times to a pool froze the broker for 320 ms at its close, and as long again for
// each further pool it had joined so. Now a removal that finds another deferred already does not wait, and the
// broker's own wait is 50 us. The time is printed, not asserted (old and new:
// bench/results/experiments/pool-repair-lock-wait-old-code-local-20261130.txt).
TEST(RepairPool, ALockKeptTakenDefersEveryRemovalWithoutAWaitForEach) {
  TestPool p(PoolMode::Variable, 16, 4096, 1);
  for (std::uint32_t m = 0; m < proto::kMaxMembers; ++m) {
    p.header().members[m] = {100, static_cast<std::uint32_t>(proto::Role::Holder)};
  }
  atomic(p.header().lock).store(1000);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(repair_pool(p.mem.get(), p.size, 100), static_cast<int>(proto::kMaxMembers));
  const auto took = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start);
  std::printf("repairing %u members with the lock kept taken took %lld us\n", proto::kMaxMembers,
              static_cast<long long>(took.count()));
  RecordProperty("repair_us", std::to_string(took.count()));
  EXPECT_EQ(p.header().deferred, ~0ULL);
  EXPECT_EQ(p.header().members[5].token, 100U);  // the lock's next holder frees the entries
  atomic(p.header().lock).store(0);
  BlockLocation x;
  ASSERT_EQ(p.alloc(0, 256, x), PoolStatus::Ok);  // takes the lock: finishes every removal
  EXPECT_EQ(p.header().deferred, 0U);
  for (std::uint32_t m = 0; m < proto::kMaxMembers; ++m) EXPECT_EQ(p.header().members[m].token, 0U) << m;
}

TEST(BlockRefCodec, RoundTripsAndRefusesEveryOutOfRangeField) {
  const BlockRef r{0x1122334455667788ULL, 42, 4096, 1000, 3, 17};
  const auto bytes = encode_block_ref(r);
  EXPECT_EQ(std::to_integer<int>(bytes[0]), 0x88);  // little-endian
  EXPECT_EQ(decode_block_ref(bytes), r);
  auto refused = [](BlockRef bad, const std::string& needle) {
    const auto b = encode_block_ref(bad);
    try {
      decode_block_ref(b);
    } catch (const Error& e) {
      return e.code() == ErrorCode::InvalidArgument && std::string(e.what()).find(needle) != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(refused({0, 1, 0, 1, 0, 0}, "pool id 0"));
  EXPECT_TRUE(refused({1, 0, 0, 1, 0, 0}, "generation 0"));
  EXPECT_TRUE(refused({1, 1, 0, 0, 0, 0}, "size 0"));
  EXPECT_TRUE(refused({1, 1, 0, 1, kMaxChunks, 0}, "chunk 1024"));
  EXPECT_TRUE(refused({1, 1, 0, 1, 0, kMaxRecords}, "block index"));
  EXPECT_TRUE(refused({1, 1, UINT64_MAX, 2, 0, 0}, "past the largest chunk"));
  EXPECT_THROW(decode_block_ref(std::span(bytes).first(39)), Error);
}

}  // namespace
}  // namespace gpuipc::shm
