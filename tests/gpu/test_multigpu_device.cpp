// Two GPUs of one node (issue 15): device segments opened on another GPU than their owner's (read-write, and
// read-only with a write that faults only the writer), channels and pools across GPUs, a pool opened without a
// device mapping every chunk for the GPU current at open, a semaphore signalled from GPU 1's stream and waited on by
// GPU 0's, stream 0 of semaphores and pool frees meaning the caller's GPU's legacy stream, processes whose
// CUDA_VISIBLE_DEVICES differ mapping the same physical GPU (devices are named by UUID), and Unsupported where two
// GPUs have no peer access. Every test skips, saying
// why, on a machine with fewer than two GPUs. All CUDA work runs in forked children, which set
// CUDA_VISIBLE_DEVICES themselves before their first CUDA call (the test process never initialises CUDA).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "cuda/context.hpp"
#include "cuda/stream_ops.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/device.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/gpu_worker.hpp"
#include "support/support.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kBytes = 64ULL << 20;
constexpr std::size_t kWords = kBytes / 4;

/// In a child, before its first CUDA call: which of the test process's GPUs it sees, in which order.
void see_gpus(std::initializer_list<int> ordinals) {
  ::setenv("CUDA_VISIBLE_DEVICES", visible_devices(ordinals).c_str(), 1);  // NOLINT(concurrency-mt-unsafe)
}

/// A variable pool of `kind` on GPU `device` (this process's ordinal), mode 0600: 4 MiB chunks, at most four, so
/// that a 3 MiB block fills a chunk and the next one grows the pool.
PoolOptions four_small_chunks(SegmentKind kind, int device) {
  return {.kind = kind,
          .device = device,
          .mode = 0600,
          .pool_mode = PoolMode::Variable,
          .chunk_bytes = 4 << 20,
          .max_bytes = 16 << 20};
}

/// A device segment on GPU `owner` filled with pattern `seed`, kept by a child until `done` is notified; then
/// the child checks that the contents are pattern `expect_after` (the same seed: untouched).
pid_t start_owner(const std::string& name, int owner, std::uint64_t seed, std::uint64_t expect_after,
                  const SyncPipe& created, const SyncPipe& done) {
  return start_child([&, owner, seed, expect_after] {
    Gpu g(owner);
    auto seg = Segment::create(name, kBytes, {.kind = SegmentKind::Device, .device = owner, .mode = 0600});
    GPUIPC_CHILD_CHECK(seg.device() == owner);
    GPUIPC_CHILD_CHECK(Segment::stat(name).device_uuid == device_info(owner, false).uuid_string);
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, seed);
    g.stream.synchronize();
    created.notify();
    GPUIPC_CHILD_CHECK(done.wait(120s));
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, expect_after) == 0);
    return 0;
  });
}

TEST(MultiGpu, SegmentOfGpu1OpenedReadWriteFromGpu0) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("peer-rw");
  SyncPipe created, done;
  const pid_t owner = start_owner(name, 1, 1, 2, created, done);
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              Gpu g(0);
              auto seg = Segment::open(name, {.access = Access::ReadWrite, .wait = {}, .device = 0});
              GPUIPC_CHILD_CHECK(seg.device() == 0);  // mapped by GPU 0's context: a peer mapping
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 1) == 0);
              g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 2);  // GPU 0 writes GPU 1's memory
              g.stream.synchronize();
              // With GPU 0's context current and no device asked for, the current context maps it too.
              auto current = Segment::open(name);
              GPUIPC_CHILD_CHECK(current.device() == 0);
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), current.device_pointer(), kWords, 2) == 0);
              return 0;
            }),
            0);
  done.notify();
  EXPECT_EQ(wait_child(owner), 0);  // GPU 1 sees what GPU 0 wrote
  Segment::unlink(name);
}

/// "Any device" means the calling thread's current context's GPU: two threads of one process, current on GPU 0 and
/// on GPU 1, each get a mapping its GPU can use. The process's cache gave the second thread the first one's mapping
/// (accessible from GPU 0 only), and its first kernel on it faulted.
TEST(MultiGpu, ThreadsCurrentOnTwoGpusEachGetAMappingTheirGpuCanUse) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("any-dev");
  SyncPipe created, done;
  const pid_t owner = start_owner(name, 0, 3, 3, created, done);
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              Gpu g0(0);
              auto first = Segment::open(name);
              GPUIPC_CHILD_CHECK(first.device() == 0);
              int second_device = -2;
              std::uint64_t wrong = 1;
              std::thread other([&] {
                Gpu g1(1);
                auto second = Segment::open(name);
                second_device = second.device();
                if (second_device == 1)
                  wrong = g1.k.count_mismatches(g1.stream.get(), second.device_pointer(), kWords, 3);
                auto again = Segment::open(name);  // cached now: the same mapping
                if (again.device_pointer() != second.device_pointer()) second_device = -3;
              });
              other.join();
              GPUIPC_CHILD_CHECK(second_device == 1);
              GPUIPC_CHILD_CHECK(wrong == 0);
              auto back = Segment::open(name);  // GPU 0's thread again
              GPUIPC_CHILD_CHECK(back.device() == 0);
              GPUIPC_CHILD_CHECK(g0.k.count_mismatches(g0.stream.get(), back.device_pointer(), kWords, 3) == 0);
              return 0;
            }),
            0);
  done.notify();
  EXPECT_EQ(wait_child(owner), 0);
  Segment::unlink(name);
}

TEST(MultiGpu, WriteThroughReadOnlyPeerMappingFaultsOnlyTheWriter) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("peer-ro");
  SyncPipe created, done;
  const pid_t owner = start_owner(name, 1, 3, 3, created, done);
  ASSERT_TRUE(created.wait(60s));
  const pid_t broker = BrokerEnvironment::broker_pid();
  const int writer = run_child([&] {
    Gpu g(0);
    auto seg = Segment::open(name, {.access = Access::ReadOnly, .wait = {}, .device = 0});
    GPUIPC_CHILD_CHECK(seg.device() == 0 && seg.access() == Access::ReadOnly);
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 3) == 0);  // reads work
    g.k.write_one(g.stream.get(), seg.device_pointer() + 4096, 0xdeadbeef);
    try {
      g.stream.synchronize();
    } catch (const Error& e) {
      std::fprintf(stderr, "GPU 0 faulted writing GPU 1's read-only mapping, as expected: %s\n", e.what());
      return e.code() == ErrorCode::Cuda ? 42 : 2;  // the GPU's fault, confined to this process; not another error
    }
    return 1;
  });
  EXPECT_EQ(writer, 42);
  // The broker and this process are unharmed; the faulting process's reference is gone; another process still
  // reads the segment from GPU 0; the owner (on GPU 1) sees its data unchanged and keeps working.
  EXPECT_GT(broker, 0);
  EXPECT_EQ(::kill(broker, 0), 0) << "the broker died with the faulting process";
  EXPECT_EQ(BrokerEnvironment::broker_pid(), broker);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::references_of(name) == 1; }, 10s, 50ms))
      << "references of " << name << ": " << BrokerEnvironment::references_of(name);
  EXPECT_EQ(run_child([&] {
              Gpu g(0);
              auto seg = Segment::open(name, {.access = Access::ReadOnly, .wait = {}, .device = 0});
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 3) == 0);
              return 0;
            }),
            0);
  done.notify();
  EXPECT_EQ(wait_child(owner), 0);
  Segment::unlink(name);
}

struct Header {
  std::uint32_t index;
  std::uint32_t pad;
  std::uint64_t seed;
};
constexpr std::size_t kSlotBytes = 4 << 20;
constexpr std::size_t kSlotWords = kSlotBytes / 4;
constexpr std::uint32_t kMessages = 64;

/// Creates channel `name` on GPU `slots_on` (this process's ordinal) and publishes kMessages checked patterns from
/// a stream of GPU `producer_gpu`, once the consumer has joined; returns when the consumer is done.
int produce_across(const std::string& name, int slots_on, int producer_gpu, const SyncPipe& created,
                   const SyncPipe& joined, const SyncPipe& consumed) {
  Gpu g(producer_gpu);
  auto ch = Channel::create(name, {.slots = 4, .slot_bytes = kSlotBytes, .header_bytes = sizeof(Header),
                                   .kind = SegmentKind::Device, .device = slots_on, .mode = 0600},
                            ChannelRole::Producer);
  created.notify();
  GPUIPC_CHILD_CHECK(joined.wait(60s));
  for (std::uint32_t i = 0; i < kMessages; ++i) {
    SlotView slot;
    GPUIPC_CHILD_CHECK(ch.acquire(g.stream.get(), 30s, slot) == Status::Ok);
    const Header h{i, 0, 1000 + i};
    g.k.fill_pattern(g.stream.get(), slot.device_pointer, kSlotWords, h.seed);
    GPUIPC_CHILD_CHECK(ch.publish(g.stream.get(), std::as_bytes(std::span(&h, 1)), kSlotBytes) == Status::Ok);
  }
  g.stream.synchronize();
  GPUIPC_CHILD_CHECK(consumed.wait(120s));
  return 0;
}

/// Opens channel `name` for GPU `consumer_gpu` and checks every message on that GPU.
int consume_across(const std::string& name, int consumer_gpu, const SyncPipe& joined, const SyncPipe& consumed) {
  Gpu g(consumer_gpu);
  auto ch = Channel::open(name, ChannelRole::Consumer, {.wait = 10s, .device = consumer_gpu});
  GPUIPC_CHILD_CHECK(ch.device() == consumer_gpu);
  joined.notify();
  for (std::uint32_t i = 0; i < kMessages; ++i) {
    MessageView m;
    GPUIPC_CHILD_CHECK(ch.receive(g.stream.get(), 30s, m) == Status::Ok);
    Header h{};
    std::memcpy(&h, m.header.data(), sizeof h);
    GPUIPC_CHILD_CHECK(h.index == i && m.size == kSlotBytes);
    // The consumer's stream waited for the producer's (another GPU's) stream: the slot is complete.
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), m.device_pointer, kSlotWords, h.seed) == 0);
    GPUIPC_CHILD_CHECK(ch.release(g.stream.get()) == Status::Ok);
  }
  g.stream.synchronize();
  consumed.notify();
  return 0;
}

TEST(MultiGpu, ChannelFromAProducerOnGpu1ToAConsumerOnGpu0) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("xgpu-ch");
  SyncPipe created, joined, consumed;
  const pid_t producer = start_child([&] { return produce_across(name, 1, 1, created, joined, consumed); });
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] { return consume_across(name, 0, joined, consumed); }), 0);
  EXPECT_EQ(wait_child(producer), 0);
  Channel::unlink(name);
}

TEST(MultiGpu, PoolOnGpu1UsedFromGpu0AndItsNewChunksStayOnGpu1) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("xgpu-pool");
  const std::string gpu1 = gpu_uuids().at(1);
  Shared<BlockRef> refs(2);
  SyncPipe created, b_done, a_done;
  constexpr std::size_t kBlock = 3 << 20;  // two blocks do not fit one 4 MiB chunk: the second adds a chunk
  const pid_t a = start_child([&] {
    Gpu g(1);
    auto pool = Pool::create(name, four_small_chunks(SegmentKind::Device, 1));
    Block b = pool.allocate(kBlock);
    g.k.fill_pattern(g.stream.get(), reinterpret_cast<CUdeviceptr>(b.data()), kBlock / 4, 31);
    g.stream.synchronize();
    refs[0] = b.ref();
    created.notify();
    GPUIPC_CHILD_CHECK(b_done.wait(120s));
    // The block GPU 0's process allocated (in the chunk it added) resolves here and holds its pattern.
    const auto* other = pool.resolve(refs[1]);
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), reinterpret_cast<CUdeviceptr>(other), kBlock / 4, 32) == 0);
    a_done.notify();
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              Gpu g(0);
              auto pool = Pool::open(name, {.access = Access::ReadWrite, .wait = {}, .device = 0});
              const auto* mine = pool.resolve(refs[0]);
              GPUIPC_CHILD_CHECK(
                  g.k.count_mismatches(g.stream.get(), reinterpret_cast<CUdeviceptr>(mine), kBlock / 4, 31) == 0);
              Block b = pool.allocate(kBlock);  // made by this process, mapped for GPU 0, living on GPU 1
              GPUIPC_CHILD_CHECK(b.ref().chunk == 1);
              GPUIPC_CHILD_CHECK(Segment::stat(name + ".chunk.1").device_uuid == gpu1);
              g.k.fill_pattern(g.stream.get(), reinterpret_cast<CUdeviceptr>(b.data()), kBlock / 4, 32);
              g.stream.synchronize();
              refs[1] = b.ref();
              b_done.notify();
              GPUIPC_CHILD_CHECK(a_done.wait(120s));
              return 0;
            }),
            0);
  EXPECT_EQ(wait_child(a), 0);
  Pool::unlink(name);
}

TEST(MultiGpu, SemaphoreSignalledFromGpu1StreamReleasesGpu0Stream) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto data = unique_name("xgpu-data");
  const auto sem = unique_name("xgpu-sem");
  SyncPipe ready, waiting, done;
  const pid_t signaller = start_child([&] {
    Gpu g(1);
    auto seg = Segment::create(data, kBytes, {.kind = SegmentKind::Device, .device = 1, .mode = 0600});
    auto s = Semaphore::create(sem, {.initial = 0, .kind = SegmentKind::HostPinned, .device = 1, .mode = 0600});
    ready.notify();
    GPUIPC_CHILD_CHECK(waiting.wait(60s));
    // GPU 0's stream is blocked on the semaphore now. GPU 1 writes the data, then signals in stream order.
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 41);
    GPUIPC_CHILD_CHECK(s.signal(g.stream.get(), 1) == Status::Ok);
    g.stream.synchronize();
    GPUIPC_CHILD_CHECK(done.wait(60s));
    return 0;
  });
  ASSERT_TRUE(ready.wait(60s));
  EXPECT_EQ(run_child([&] {
              Gpu g(0);
              auto seg = Segment::open(data, {.access = Access::ReadOnly, .wait = {}, .device = 0});
              auto s = Semaphore::open(sem, {.role = SemaphoreRole::Waiter, .wait = {}, .device = 0});
              GPUIPC_CHILD_CHECK(s.wait(g.stream.get(), 1) == Status::Ok);
              // Nothing has signalled: GPU 0's stream must still be waiting.
              std::this_thread::sleep_for(200ms);
              GPUIPC_CHILD_CHECK(!g.stream.query());
              waiting.notify();
              // Enqueued behind the wait: reads GPU 1's memory only after GPU 1's stream signalled.
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 41) == 0);
              GPUIPC_CHILD_CHECK(s.value() == 1);
              done.notify();
              return 0;
            }),
            0);
  EXPECT_EQ(wait_child(signaller), 0);
  Semaphore::unlink(sem);
  Segment::unlink(data);
}

// A host_pinned open for any device (-1) registers the page in the current context's GPU, else GPU 0. It was GPU 0
// whatever was current: a versioned reader working on GPU 1 (its counter is such a semaphore) made GPU 0's context.
TEST(MultiGpu, AHostPinnedOpenForAnyDeviceRegistersInTheCurrentContextsGpu) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto sem = unique_name("any-pinned");
  SyncPipe created, done;
  const pid_t creator = start_child([&] {
    auto s = Semaphore::create(sem, {.initial = 0, .kind = SegmentKind::HostPinned, .device = 0, .mode = 0600});
    created.notify();
    GPUIPC_CHILD_CHECK(done.wait(120s));
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              Gpu g(1);
              auto seg = Segment::open(sem, {.access = Access::ReadOnly, .wait = {}, .device = -1});
              GPUIPC_CHILD_CHECK(seg.device() == 1);
              // The semaphore's page, opened the same way, serves GPU 1's stream.
              auto w = Semaphore::open(sem, {.role = SemaphoreRole::Waiter, .wait = {}, .device = -1});
              GPUIPC_CHILD_CHECK(w.wait(g.stream.get(), 0) == Status::Ok);
              g.stream.synchronize();
              return 0;
            }),
            0);
  EXPECT_EQ(run_child([&] {
              // No context current: GPU 0, as before.
              auto seg = Segment::open(sem, {.access = Access::ReadOnly, .wait = {}, .device = -1});
              GPUIPC_CHILD_CHECK(seg.device() == 0);
              return 0;
            }),
            0);
  done.notify();
  EXPECT_EQ(wait_child(creator), 0);
  Semaphore::unlink(sem);
}

TEST(MultiGpu, PoolOpenedWithoutADeviceMapsEveryChunkForTheGpuCurrentAtOpen) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("cur-pool");
  Shared<BlockRef> refs(2);
  SyncPipe created, written;
  constexpr std::size_t kBlock = 3 << 20;  // one block per 4 MiB chunk
  const pid_t owner = start_child([&] {
    Gpu g(0);
    auto pool = Pool::create(name, four_small_chunks(SegmentKind::Device, 0));
    Block a = pool.allocate(kBlock);
    Block b = pool.allocate(kBlock);
    GPUIPC_CHILD_CHECK(a.ref().chunk == 0 && b.ref().chunk == 1);
    const auto pa = reinterpret_cast<CUdeviceptr>(a.data());
    const auto pb = reinterpret_cast<CUdeviceptr>(b.data());
    g.k.fill_pattern(g.stream.get(), pa, kBlock / 4, 91);
    g.k.fill_pattern(g.stream.get(), pb, kBlock / 4, 92);
    g.stream.synchronize();
    refs[0] = a.ref();
    refs[1] = b.ref();
    created.notify();
    GPUIPC_CHILD_CHECK(written.wait(120s));
    // What the other process wrote from GPU 1 through its peer mappings.
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), pa, kBlock / 4, 93) == 0);
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), pb, kBlock / 4, 94) == 0);
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              // GPU 1's context current (as torch.cuda.set_device(1) makes it), and no device asked for.
              Gpu g1(1);
              auto pool = Pool::open(name);
              GPUIPC_CHILD_CHECK(pool.mapping_device() == 1);
              const auto a = reinterpret_cast<CUdeviceptr>(pool.resolve(refs[0]));
              GPUIPC_CHILD_CHECK(g1.k.count_mismatches(g1.stream.get(), a, kBlock / 4, 91) == 0);
              g1.k.fill_pattern(g1.stream.get(), a, kBlock / 4, 93);
              g1.stream.synchronize();
              // GPU 0's context current now: the chunk this handle maps next, and the one it adds, are mapped for
              // GPU 1 all the same, the GPU mapping_device() names.
              const cuda::PrimaryContext gpu0(0);
              gpu0.make_current();
              const auto b = reinterpret_cast<CUdeviceptr>(pool.resolve(refs[1]));
              Block c = pool.allocate(kBlock);
              GPUIPC_CHILD_CHECK(c.ref().chunk == 2);
              GPUIPC_CHILD_CHECK(pool.mapping_device() == 1);
              g1.ctx.make_current();
              GPUIPC_CHILD_CHECK(g1.k.count_mismatches(g1.stream.get(), b, kBlock / 4, 92) == 0);
              g1.k.fill_pattern(g1.stream.get(), b, kBlock / 4, 94);
              const auto cp = reinterpret_cast<CUdeviceptr>(c.data());
              g1.k.fill_pattern(g1.stream.get(), cp, kBlock / 4, 95);
              GPUIPC_CHILD_CHECK(g1.k.count_mismatches(g1.stream.get(), cp, kBlock / 4, 95) == 0);
              // A synchronous copy in GPU 1's context reads the block too.
              g1.stream.synchronize();
              std::uint32_t first = 0;
              cuda::copy_to_host(&first, b, sizeof first);
              GPUIPC_CHILD_CHECK(first == kernels::pattern_word(94, 0));
              written.notify();
              return 0;
            }),
            0);
  EXPECT_EQ(wait_child(owner), 0);
  Pool::unlink(name);
}

/// A word of pinned host memory (a host_pinned segment) that a kernel spins on until the test opens the gate, with
/// the kernel's timed-out word beside it. Opened on destruction too, so that no stream stays blocked whatever
/// check fails first.
struct HostGate {
  explicit HostGate(const std::string& name)
      : seg(Segment::create(name, 4096, {.kind = SegmentKind::HostPinned, .device = 1, .mode = 0600})) {}
  HostGate(const HostGate&) = delete;
  HostGate& operator=(const HostGate&) = delete;
  ~HostGate() {
    open();
    try {
      Segment::unlink(seg.name());
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the broker drops the name with the process
    }
  }
  /// Word `i` (u64) on the host and on the GPU: 0 the gate, 1 the kernel's timed-out word, from 2 free for tests.
  std::atomic_ref<std::uint64_t> word(std::size_t i) const {
    return std::atomic_ref(static_cast<std::uint64_t*>(seg.data())[i]);
  }
  CUdeviceptr device_word(std::size_t i) const { return seg.device_pointer() + 8 * i; }
  CUdeviceptr flag() const { return device_word(0); }
  CUdeviceptr timed_out() const { return device_word(1); }
  void open() const { word(0).store(1); }
  bool kernel_timed_out() const { return word(1).load() != 0; }
  Segment seg;
};

/// How long a gate kernel spins at most (it ends by itself if a test never opens its gate).
constexpr std::uint64_t kGateLimitNs = 30'000'000'000ULL;

TEST(MultiGpu, SemaphoreSignalOnStream0FollowsTheCurrentGpusLegacyStream) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("s0-sig");
  const auto gate_name = unique_name("s0-sgate");
  EXPECT_EQ(run_child([&] {
              Gpu g(1);
              // Registered by GPU 0's context; the caller works on GPU 1.
              auto sem =
                  Semaphore::create(name, {.initial = 0, .kind = SegmentKind::HostPinned, .device = 0, .mode = 0600});
              const HostGate gate(gate_name);
              // GPU 1's legacy default stream is busy with a kernel until the gate opens.
              g.k.spin_until(nullptr, gate.flag(), 1, kGateLimitNs, gate.timed_out());
              const Status plain = sem.signal(nullptr, 1);
              const Status woken = sem.signal(nullptr, 2, true);  // its event probe must ask GPU 1's legacy stream
              std::this_thread::sleep_for(300ms);
              const std::uint64_t seen = sem.value();
              const bool still_gpu1 = cuda::current_context() == g.ctx.get();
              gate.open();
              GPUIPC_CHILD_CHECK(plain == Status::Ok && woken == Status::Ok);
              GPUIPC_CHILD_CHECK(seen == 0);  // both writes wait behind GPU 1's kernel
              GPUIPC_CHILD_CHECK(still_gpu1);
              GPUIPC_CHILD_CHECK(sem.wait_host(2, 10s).status == Status::Ok);
              cuda::synchronize(nullptr, "GPU 1's legacy stream");
              GPUIPC_CHILD_CHECK(!gate.kernel_timed_out());
              return 0;
            }),
            0);
  Semaphore::unlink(name);
}

TEST(MultiGpu, SemaphoreWaitOnStream0HoldsTheCurrentGpusLegacyStream) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("s0-wait");
  const auto flag_name = unique_name("s0-wflag");
  EXPECT_EQ(run_child([&] {
              Gpu g(1);
              auto sem =
                  Semaphore::create(name, {.initial = 0, .kind = SegmentKind::HostPinned, .device = 0, .mode = 0600});
              const HostGate page(flag_name);  // its word 2: written by GPU 1's kernel
              const Status waited = sem.wait(nullptr, 1);
              g.k.write_flag(nullptr, page.device_word(2), 7);  // enqueued behind the wait on GPU 1's legacy stream
              std::this_thread::sleep_for(300ms);
              const std::uint64_t early = page.word(2).load();
              GPUIPC_CHILD_CHECK(sem.signal_host(1) == Status::Ok);  // released whatever the checks say
              GPUIPC_CHILD_CHECK(waited == Status::Ok);
              GPUIPC_CHILD_CHECK(early == 0);  // GPU 1's stream waited for the semaphore
              GPUIPC_CHILD_CHECK(wait_until([&] { return page.word(2).load() == 7; }, 10s));
              cuda::synchronize(nullptr, "GPU 1's legacy stream");
              return 0;
            }),
            0);
  Semaphore::unlink(name);
}

TEST(MultiGpu, PoolFreeOnStream0WaitsForTheCurrentGpusLegacyStream) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("s0-pool");
  const auto gate_name = unique_name("s0-pgate");
  EXPECT_EQ(run_child([&] {
              Gpu g(1);
              // One block; the control block registered by GPU 0's context (the pool's), the caller on GPU 1.
              auto pool = Pool::create(name, {.kind = SegmentKind::HostPinned,
                                              .device = 0,
                                              .mode = 0600,
                                              .pool_mode = PoolMode::Fixed,
                                              .block_bytes = 4096,
                                              .block_count = 1});
              const HostGate gate(gate_name);
              Block b = pool.allocate(4096);
              // GPU 1's legacy stream still uses the block (a kernel that runs until the gate opens).
              g.k.spin_until(nullptr, gate.flag(), 1, kGateLimitNs, gate.timed_out());
              pool.free(std::move(b), nullptr);
              std::this_thread::sleep_for(300ms);
              Block again;
              const Status early = pool.try_allocate(4096, 256, again);
              const std::uint32_t draining = pool.stats().draining_blocks;
              gate.open();
              GPUIPC_CHILD_CHECK(early == Status::WouldBlock);  // not reused while the kernel runs
              GPUIPC_CHILD_CHECK(draining == 1);
              GPUIPC_CHILD_CHECK(wait_until([&] { return pool.try_allocate(4096, 256, again) == Status::Ok; }, 10s));
              cuda::synchronize(nullptr, "GPU 1's legacy stream");
              GPUIPC_CHILD_CHECK(!gate.kernel_timed_out());
              return 0;
            }),
            0);
  Pool::unlink(name);
}

/// Exit codes of the child that sees only GPU 0 while the memory lives on GPU 1 (a driver-dependent outcome).
constexpr int kHiddenOwnerMapped = 0;
constexpr int kHiddenOwnerRefused = 10;

TEST(MultiGpu, ProcessesWithOtherCudaVisibleDevicesMapTheSamePhysicalGpu) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("cvd-seg");
  const std::string gpu0 = gpu_uuids().at(0);
  const std::string gpu1 = gpu_uuids().at(1);
  SyncPipe created, done;
  const pid_t owner = start_child([&] {
    see_gpus({0, 1});
    Gpu g(1);
    auto seg = Segment::create(name, kBytes, {.kind = SegmentKind::Device, .device = 1, .mode = 0600});
    GPUIPC_CHILD_CHECK(Segment::stat(name).device_uuid == gpu1);
    g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 51);
    g.stream.synchronize();
    created.notify();
    GPUIPC_CHILD_CHECK(done.wait(120s));
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  // "1,0": its GPU 0 is the owner's GPU 1. With no context and no device asked for, the owner's GPU maps it.
  EXPECT_EQ(run_child([&] {
              see_gpus({1, 0});
              GPUIPC_CHILD_CHECK(device_info(0, false).uuid_string == gpu1);
              GPUIPC_CHILD_CHECK(device_ordinal(gpu1) == 0 && device_ordinal(gpu0) == 1);
              auto seg = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(seg.device() == 0);
              Gpu g(0);
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 51) == 0);
              // Its GPU 1 (the physical GPU 0) maps it as a peer.
              auto peer = Segment::open(name, {.access = Access::ReadOnly, .wait = {}, .device = 1});
              GPUIPC_CHILD_CHECK(peer.device() == 1);
              Gpu g1(1);
              GPUIPC_CHILD_CHECK(g1.k.count_mismatches(g1.stream.get(), peer.device_pointer(), kWords, 51) == 0);
              return 0;
            }),
            0);
  // "1": the only GPU it sees is the owner's.
  EXPECT_EQ(run_child([&] {
              see_gpus({1});
              GPUIPC_CHILD_CHECK(device_count() == 1 && device_ordinal(gpu1) == 0 && device_ordinal(gpu0) == -1);
              auto seg = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(seg.device() == 0);
              Gpu g(0);
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 51) == 0);
              return 0;
            }),
            0);
  // "0": the owner's GPU is hidden. Without a device it is NoDevice naming the UUID; from its GPU 0 the driver
  // decides (it may map memory of a GPU this process does not see); a refusal must name the UUID.
  const int hidden = run_child([&] {
    see_gpus({0});
    try {
      (void)Segment::open(name, {.access = Access::ReadOnly});
      return 1;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::NoDevice);
      GPUIPC_CHILD_CHECK(std::string(e.what()).find(gpu1) != std::string::npos);
    }
    Gpu g(0);
    try {
      auto seg = Segment::open(name, {.access = Access::ReadOnly, .wait = {}, .device = 0});
      GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 51) == 0);
      std::fprintf(stderr, "hidden owner: GPU 0 mapped memory of %s, which it does not see\n", gpu1.c_str());
      return kHiddenOwnerMapped;
    } catch (const Error& e) {
      std::fprintf(stderr, "hidden owner: refused: %s\n", e.what());
      GPUIPC_CHILD_CHECK(std::string(e.what()).find(gpu1) != std::string::npos);
      return kHiddenOwnerRefused;
    }
  });
  EXPECT_TRUE(hidden == kHiddenOwnerMapped || hidden == kHiddenOwnerRefused) << "exit " << hidden;
  done.notify();
  EXPECT_EQ(wait_child(owner), 0);
  Segment::unlink(name);
}

TEST(MultiGpu, PoolChunksGoToThePoolsGpuWhateverTheOrderAMemberSees) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("cvd-pool");
  const std::string gpu1 = gpu_uuids().at(1);
  Shared<BlockRef> refs(1);
  SyncPipe created, done, checked;
  constexpr std::size_t kBlock = 3 << 20;
  const pid_t a = start_child([&] {
    see_gpus({0, 1});
    Gpu g(1);
    auto pool = Pool::create(name, four_small_chunks(SegmentKind::Device, 1));
    Block b = pool.allocate(kBlock);
    created.notify();
    GPUIPC_CHILD_CHECK(done.wait(120s));
    const auto* other = pool.resolve(refs[0]);
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), reinterpret_cast<CUdeviceptr>(other), kBlock / 4, 61) == 0);
    checked.notify();
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  // Sees the GPUs the other way round: the pool creator's GPU 1 is its GPU 0. Its new chunk must go to that
  // physical GPU, not to its own ordinal 1.
  EXPECT_EQ(run_child([&] {
              see_gpus({1, 0});
              auto pool = Pool::open(name);
              Block b = pool.allocate(kBlock);
              GPUIPC_CHILD_CHECK(b.ref().chunk == 1);
              GPUIPC_CHILD_CHECK(Segment::stat(name + ".chunk.1").device_uuid == gpu1);
              Gpu g(0);
              g.k.fill_pattern(g.stream.get(), reinterpret_cast<CUdeviceptr>(b.data()), kBlock / 4, 61);
              g.stream.synchronize();
              refs[0] = b.ref();
              done.notify();
              GPUIPC_CHILD_CHECK(checked.wait(120s));  // the block stays allocated until A has read it
              return 0;
            }),
            0);
  EXPECT_EQ(wait_child(a), 0);
  Pool::unlink(name);
}

TEST(MultiGpu, AHostPinnedPoolGrowsInAMemberThatSeesOnlyAnotherGpu) {
  // A host_pinned chunk is registered (portable) in the context of the member that makes it. It was registered
  // with the creator's ordinal: a member that sees one GPU (its 0, the creator's 1) got NoDevice growing the pool.
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("cvd-pinned");
  Shared<BlockRef> refs(1);
  SyncPipe created, done, checked;
  constexpr std::size_t kBlock = 3 << 20;
  const pid_t a = start_child([&] {
    see_gpus({0, 1});
    Gpu g(1);
    auto pool = Pool::create(name, four_small_chunks(SegmentKind::HostPinned, 1));
    Block b = pool.allocate(kBlock);
    created.notify();
    GPUIPC_CHILD_CHECK(done.wait(120s));
    const auto* other = static_cast<const unsigned char*>(pool.resolve(refs[0]));
    GPUIPC_CHILD_CHECK(other[0] == 0x5a && other[kBlock - 1] == 0x5a);
    checked.notify();
    return 0;
  });
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              see_gpus({1});
              auto pool = Pool::open(name);
              Block b = pool.allocate(kBlock);  // a new chunk, made here
              GPUIPC_CHILD_CHECK(b.ref().chunk == 1);
              std::memset(b.data(), 0x5a, kBlock);
              refs[0] = b.ref();
              done.notify();
              GPUIPC_CHILD_CHECK(checked.wait(120s));
              return 0;
            }),
            0);
  EXPECT_EQ(wait_child(a), 0);
  Pool::unlink(name);
}

TEST(MultiGpu, ChannelBetweenAProcessSeeingOneGpuAndOneSeeingBoth) {
  GPUIPC_REQUIRE_TWO_GPUS();
  const auto name = unique_name("cvd-ch");
  SyncPipe created, joined, consumed;
  // The producer sees only GPU 1 (its GPU 0); the consumer sees both and reads from GPU 0, a peer of the slots.
  const pid_t producer = start_child([&] {
    see_gpus({1});
    return produce_across(name, 0, 0, created, joined, consumed);
  });
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              see_gpus({0, 1});
              return consume_across(name, 0, joined, consumed);
            }),
            0);
  EXPECT_EQ(wait_child(producer), 0);
  Channel::unlink(name);
}

TEST(MultiGpu, NoPeerAccessIsUnsupportedWithAMessage) {
  GPUIPC_REQUIRE_GPU();
  if (!two_gpus_without_peer_access()) {
    GTEST_SKIP() << "needs two GPUs without peer access between them (tests/unit/test_device_choice.cpp checks the "
                    "decision without a GPU)";
  }
  const auto name = unique_name("no-peer");
  SyncPipe created, done;
  const pid_t owner = start_owner(name, 1, 71, 71, created, done);
  ASSERT_TRUE(created.wait(60s));
  EXPECT_EQ(run_child([&] {
              try {
                (void)Segment::open(name, {.access = Access::ReadOnly, .wait = {}, .device = 0});
              } catch (const Error& e) {
                GPUIPC_CHILD_CHECK(e.code() == ErrorCode::Unsupported);
                GPUIPC_CHILD_CHECK(std::string(e.what()).find("no peer access") != std::string::npos);
                return 0;
              }
              return 1;
            }),
            0);
  done.notify();
  EXPECT_EQ(wait_child(owner), 0);
  Segment::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
