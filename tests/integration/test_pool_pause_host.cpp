// Pause and resume of host pools across real processes (Pool::pause, resume, refresh): the pages are released and
// the addresses kept; contents come back when asked for and are zeros when not; a reader is told (InvalidState
// naming the pauser), not crashed, and keeps its pointers after resume + refresh; a pauser SIGKILLed while the pool
// is paused leaves it paused for any writer to resume, with nothing leaked and the broker working.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/segment_internal.hpp"
#include "gpuipc/pool.hpp"
#include "shm/pool_block.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kChunk = 256 * 1024;

Pool make_pool(const std::string& name) {
  return Pool::create(name,
                      {.kind = SegmentKind::Host, .chunk_bytes = kChunk, .max_bytes = 2 * kChunk, .max_blocks = 64});
}

bool zeros(const void* p, std::size_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != 0) return false;
  }
  return true;
}

/// The member entries held in pool `control`'s table now (their indices).
std::set<std::uint32_t> members_of(const shm::PoolBlock& control) {
  std::set<std::uint32_t> out;
  for (std::uint32_t i = 0; i < proto::kMaxMembers; ++i) {
    if (proto::atomic(control.header().members[i].token).load() != 0) out.insert(i);
  }
  return out;
}

TEST(PoolPauseHost, AChunkBeingMadeWhenThePauseBeginsIsReleasedToo) {
  // Another member reserved chunk 1 before the pause began and makes it afterwards: the pause looked at the chunks
  // at once, released chunk 0 only, and chunk 1 kept its memory while the pool read paused.
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  Block first = pool.allocate(kChunk);  // chunk 0, full
  auto raw = Segment::open(name, {.access = Access::ReadWrite, .device = -1});
  shm::PoolBlock control(raw.data(), raw.size());
  const auto before = members_of(control);
  auto other = Pool::open(name);  // the member that grows the pool
  std::uint32_t maker = proto::kNoMember;
  for (const std::uint32_t m : members_of(control)) {
    if (before.count(m) == 0) maker = m;
  }
  ASSERT_NE(maker, proto::kNoMember);
  shm::BlockLocation loc;
  std::vector<shm::OccupiedRange> scratch;
  scratch.reserve(64);  // the allocator's scratch holds max_blocks ranges (it does not allocate)
  ASSERT_EQ(control.allocate(maker, kChunk, 256, loc, scratch, std::chrono::seconds(5)), shm::PoolStatus::NeedChunk);
  ASSERT_EQ(loc.chunk, 1U);
  std::atomic<bool> paused{false};
  std::thread pauser([&] {
    pool.pause();
    paused = true;
  });
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(paused.load()) << "the pause did not wait for the chunk being made";
  // What the maker does: the chunk's segment, its bytes written, then marked made.
  auto chunk = detail::create_segment(name + ".chunk.1", kChunk, {.kind = SegmentKind::Host}, 0);
  fill_pattern(chunk.data(), chunk.size(), 7);
  control.chunk_created(maker, 1, true);
  pauser.join();
  EXPECT_TRUE(pool.paused());
  EXPECT_TRUE(zeros(chunk.data(), chunk.size())) << "chunk 1 kept its pages through the pause";
  EXPECT_TRUE(zeros(first.data(), first.size()));
  pool.resume();
  Pool::unlink(name);
}

TEST(PoolPauseHost, KeepContentsReleasesThePagesAndRestoresThemAtTheSameAddress) {
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  Block a = pool.allocate(100000);
  Block b = pool.allocate(kChunk);  // the pool's second chunk
  fill_pattern(a.data(), a.size(), 1);
  fill_pattern(b.data(), b.size(), 2);
  void* const pa = a.data();
  EXPECT_FALSE(pool.paused());
  pool.pause({.keep_contents = true});
  EXPECT_TRUE(pool.paused());
  const PoolStats st = pool.stats();
  EXPECT_EQ(st.state, PoolState::Paused);
  EXPECT_EQ(st.paused_by_pid, static_cast<std::uint32_t>(::getpid()));
  EXPECT_FALSE(st.pauser_gone);
  EXPECT_EQ(st.epoch, 1U);
  EXPECT_EQ(st.live_blocks, 2U) << "blocks survive a pause";
  EXPECT_EQ(Pool::stat(name).state, PoolState::Paused);
  // The pages are gone (the memfd has a hole: reads see zeros), the addresses still mapped: nothing crashes.
  EXPECT_TRUE(zeros(pa, a.size()));
  EXPECT_TRUE(zeros(b.data(), b.size()));
  const std::string pid = std::to_string(::getpid());
  EXPECT_TRUE(fails_with([&] { pool.allocate(16); }, ErrorCode::InvalidState, "paused by pid " + pid));
  Block none;
  EXPECT_EQ(pool.try_allocate(16, 256, none), Status::InvalidState);
  EXPECT_TRUE(fails_with([&] { pool.resolve(a.ref()); }, ErrorCode::InvalidState, "resume"));
  EXPECT_TRUE(fails_with([&] { pool.hold(a.ref()); }, ErrorCode::InvalidState, "paused"));
  EXPECT_TRUE(fails_with([&] { pool.pause(); }, ErrorCode::InvalidState, "paused by pid"));
  pool.resume();
  EXPECT_FALSE(pool.paused());
  EXPECT_EQ(pool.stats().state, PoolState::Active);
  EXPECT_EQ(a.data(), pa);
  EXPECT_EQ(pool.resolve(a.ref()), pa) << "the pauser needs no refresh";
  EXPECT_TRUE(holds_pattern(pa, a.size(), 1));
  EXPECT_TRUE(holds_pattern(b.data(), b.size(), 2));
  EXPECT_TRUE(fails_with([&] { pool.resume(); }, ErrorCode::InvalidState, "not paused"));
  Block c = pool.allocate(1000);  // allocation works again
  EXPECT_TRUE(c);
  a = Block();
  b = Block();
  c = Block();
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolPauseHost, WithoutKeepContentsTheBlocksAreZerosAfterResume) {
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  Block a = pool.allocate(5000);
  fill_pattern(a.data(), a.size(), 3);
  pool.pause();
  pool.resume();
  EXPECT_EQ(pool.resolve(a.ref()), a.data());
  EXPECT_TRUE(zeros(a.data(), a.size()));
  fill_pattern(a.data(), a.size(), 4);  // and the memory is writable again
  EXPECT_TRUE(holds_pattern(pool.resolve(a.ref()), a.size(), 4));
  a = Block();
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolPauseHost, AKeptBufferIsReusedAndEachPauseSavesTheBytesOfItsOwnTime) {
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  Block a = pool.allocate(100000);
  // Cycles that reuse the buffer must bring back what was there at their pause, not an earlier one; one with more
  // live bytes than the buffer holds (b, the second chunk) gets a larger one; one without keep_buffer frees it.
  for (int cycle = 0; cycle < 3; ++cycle) {
    fill_pattern(a.data(), a.size(), 20 + cycle);
    pool.pause({.keep_contents = true, .keep_buffer = true});
    pool.resume();
    EXPECT_TRUE(holds_pattern(a.data(), a.size(), 20 + cycle)) << cycle;
  }
  Block b = pool.allocate(kChunk);
  fill_pattern(a.data(), a.size(), 30);
  fill_pattern(b.data(), b.size(), 31);
  pool.pause({.keep_contents = true, .keep_buffer = true});
  pool.resume();
  EXPECT_TRUE(holds_pattern(a.data(), a.size(), 30));
  EXPECT_TRUE(holds_pattern(b.data(), b.size(), 31));
  fill_pattern(b.data(), b.size(), 32);
  pool.pause({.keep_contents = true});  // reuses the kept buffer, then resume frees it
  pool.resume();
  EXPECT_TRUE(holds_pattern(a.data(), a.size(), 30));
  EXPECT_TRUE(holds_pattern(b.data(), b.size(), 32));
  pool.pause({.keep_buffer = true});  // without keep_contents: nothing is saved, whatever keep_buffer says
  pool.resume();
  EXPECT_TRUE(zeros(a.data(), a.size()));
  a = Block();
  b = Block();
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolPauseHost, AReaderIsToldAndKeepsItsPointerAfterResumeAndRefresh) {
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  Block a = pool.allocate(64000);
  fill_pattern(a.data(), a.size(), 5);
  Shared<BlockRef> ref;
  ref[0] = a.ref();
  const pid_t me = ::getpid();
  SyncPipe mapped, paused, told, resumed;
  const pid_t reader = start_child([&] {
    auto p = Pool::open(name);
    p.hold(ref[0]);
    void* const ptr = p.resolve(ref[0]);
    GPUIPC_CHILD_CHECK(holds_pattern(ptr, ref[0].size, 5));
    mapped.notify();
    GPUIPC_CHILD_CHECK(paused.wait(10s));
    const std::string by = "paused by pid " + std::to_string(me);
    GPUIPC_CHILD_CHECK(p.paused());
    GPUIPC_CHILD_CHECK(fails_with([&] { p.resolve(ref[0]); }, ErrorCode::InvalidState, by));
    GPUIPC_CHILD_CHECK(fails_with([&] { p.hold(ref[0]); }, ErrorCode::InvalidState, by));
    GPUIPC_CHILD_CHECK(fails_with([&] { p.allocate(16); }, ErrorCode::InvalidState, by));
    GPUIPC_CHILD_CHECK(fails_with([&] { p.resume(); }, ErrorCode::InvalidState, "another handle"));
    GPUIPC_CHILD_CHECK(zeros(ptr, ref[0].size));  // released pages read as zeros: no crash
    p.refresh();                                  // while paused: drops what it can, changes no address
    told.notify();
    GPUIPC_CHILD_CHECK(resumed.wait(10s));
    GPUIPC_CHILD_CHECK(!p.paused());
    GPUIPC_CHILD_CHECK(p.resolve(ref[0]) == ptr);  // refreshed while paused: valid again at once
    GPUIPC_CHILD_CHECK(holds_pattern(ptr, ref[0].size, 5));
    p.release(ref[0]);
    return 0;
  });
  ASSERT_TRUE(mapped.wait(10s));
  pool.pause({.keep_contents = true});
  paused.notify();
  ASSERT_TRUE(told.wait(10s));
  pool.resume();
  resumed.notify();
  EXPECT_EQ(wait_child(reader), 0);
  a = Block();
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolPauseHost, AReaderThatMappedBeforeThePauseMustRefreshAfterResume) {
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  Block a = pool.allocate(4096);
  fill_pattern(a.data(), a.size(), 6);
  Shared<BlockRef> ref;
  ref[0] = a.ref();
  SyncPipe mapped, cycled;
  const pid_t reader = start_child([&] {
    auto p = Pool::open(name);
    void* const ptr = p.resolve(ref[0]);
    mapped.notify();
    GPUIPC_CHILD_CHECK(cycled.wait(10s));
    GPUIPC_CHILD_CHECK(!p.paused());
    GPUIPC_CHILD_CHECK(p.stats().epoch == 1);
    GPUIPC_CHILD_CHECK(fails_with([&] { p.resolve(ref[0]); }, ErrorCode::InvalidState, "refresh()"));
    GPUIPC_CHILD_CHECK(fails_with([&] { p.allocate(16); }, ErrorCode::InvalidState, "refresh()"));
    p.refresh();
    GPUIPC_CHILD_CHECK(p.resolve(ref[0]) == ptr);
    GPUIPC_CHILD_CHECK(holds_pattern(ptr, ref[0].size, 6));
    Block own = p.allocate(16);
    GPUIPC_CHILD_CHECK(own);
    return 0;
  });
  ASSERT_TRUE(mapped.wait(10s));
  pool.pause({.keep_contents = true});
  pool.resume();
  cycled.notify();
  EXPECT_EQ(wait_child(reader), 0);
  a = Block();
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolPauseHost, OnlyAWriterMayPause) {
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  EXPECT_EQ(run_child([&] {
              auto p = Pool::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(fails_with([&] { p.pause(); }, ErrorCode::PermissionDenied, "write access"));
              GPUIPC_CHILD_CHECK(!p.paused());
              return 0;
            }),
            0);
  EXPECT_FALSE(pool.paused());
  pool = Pool();
  Pool::unlink(name);
}

TEST(PoolPauseHost, APauserSigkilledWhilePausedLeavesItForAnyWriterToResume) {
  const auto name = unique_name("pause");
  auto pool = make_pool(name);
  Block a = pool.allocate(8192);
  fill_pattern(a.data(), a.size(), 7);
  void* const pa = a.data();
  SyncPipe paused;
  const pid_t pauser = start_child([&] {
    auto p = Pool::open(name);
    p.pause({.keep_contents = true});
    paused.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(paused.wait(10s));
  EXPECT_EQ(pool.stats().paused_by_pid, static_cast<std::uint32_t>(pauser));
  EXPECT_TRUE(fails_with([&] { pool.resume(); }, ErrorCode::InvalidState, "another handle"));
  ::kill(pauser, SIGKILL);
  EXPECT_EQ(wait_child(pauser), 128 + SIGKILL);
  // The repair clears the pause before it frees the dead member's entry: wait for both.
  ASSERT_TRUE(wait_until([&] { return pool.stats().pauser_gone && pool.stats().members == 1; }, 5s))
      << "the broker did not repair the pause";
  EXPECT_EQ(pool.stats().state, PoolState::Paused);
  EXPECT_TRUE(fails_with([&] { pool.resolve(a.ref()); }, ErrorCode::InvalidState, "is gone"));
  pool.resume();  // by a process that did not pause it: the saved contents died with the pauser
  EXPECT_FALSE(pool.paused());
  EXPECT_EQ(pool.resolve(a.ref()), pa);
  EXPECT_TRUE(zeros(pa, a.size()));
  // The broker keeps working: a pause cycle again, and other objects.
  pool.pause();
  pool.resume();
  auto seg = Segment::create(unique_name("after"), 4096);
  EXPECT_EQ(seg.size(), 4096U);
  Segment::unlink(seg.name());
  a = Block();
  pool = Pool();
  Pool::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
