// gpuipc::share on a real GPU, across real processes: cudaMalloc-style (cuMemAlloc) and VMM (cuMemCreate) memory
// adopted by one process and opened by another with its content checked, the lifetime of each kind, and every
// refused pointer. All CUDA work happens in forked children (the test process never initialises CUDA).
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "core/gpu_memory.hpp"
#include "core/segment_internal.hpp"
#include "cuda/driver.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/share.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/gpu_worker.hpp"
#include "support/support.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/kernels/kernels.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

constexpr std::size_t kBytes = 8ULL << 20;
constexpr std::size_t kWords = kBytes / 4;
constexpr std::size_t kOffset = 1ULL << 20;  // shared ranges start inside their allocation

/// VMM memory mapped in this process, exportable as a POSIX fd unless `handle_types` says otherwise.
struct VmmBuffer {
  VmmBuffer(std::size_t size, CUmemAllocationHandleType handle_types) {
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = handle_types;
    CUmemGenericAllocationHandle h = 0;
    cuda::check(cuda::driver().cuMemCreate(&h, size, &prop, 0), "cuMemCreate", "test VMM buffer");
    handle = cuda::AllocationHandle(h);
    range = cuda::reserve_va(size, 0);
    mapping = cuda::map(range.base(), size, handle);
    const int devices[] = {0};
    cuda::set_access(mapping.ptr(), size, devices, false);
  }
  CUdeviceptr ptr() const { return mapping.ptr(); }
  cuda::AllocationHandle handle;
  cuda::VaRange range;
  cuda::MemMapping mapping;
};

/// Shares [base + kOffset, + kBytes) of memory filled with pattern 1 as `name`, lets another child open it (which
/// checks pattern 1 and writes pattern 2), then checks pattern 2. `vmm`: cuMemCreate memory, else cuMemAlloc.
void exporter_and_opener(bool vmm) {
  const auto name = unique_name();
  SyncPipe shared, opened;
  const pid_t a = start_child([&] {
    Gpu g;
    const std::size_t size = 4 * kOffset + kBytes;
    const std::size_t gran = cuda::allocation_granularity(0, false);
    std::optional<VmmBuffer> v;
    cuda::DeviceBuffer plain;
    if (vmm) {
      v.emplace(cuda::round_up(size, gran), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    } else {
      plain = cuda::DeviceBuffer::allocate(size);
    }
    const CUdeviceptr base = vmm ? v->ptr() : plain.get();
    g.k.fill_pattern(g.stream.get(), base + kOffset, kWords, 1);
    g.stream.synchronize();
    auto seg = share(name, reinterpret_cast<void*>(base + kOffset), kBytes, {.device = 0});  // NOLINT
    GPUIPC_CHILD_CHECK(seg.kind() == (vmm ? SegmentKind::Device : SegmentKind::DeviceIpc));
    GPUIPC_CHILD_CHECK(seg.device_pointer() == base + kOffset && seg.size() == kBytes && seg.alive());
    // A second name in the same allocation: openers map the allocation once (legacy) or import it again (VMM).
    auto head = share(name + "-head", reinterpret_cast<void*>(base), 4096);  // NOLINT
    GPUIPC_CHILD_CHECK(Segment::open(name).device_pointer() == seg.device_pointer());  // own share: cache hit
    shared.notify();
    GPUIPC_CHILD_CHECK(opened.wait(60s));
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), base + kOffset, kWords, 2) == 0);
    return 0;
  });
  ASSERT_TRUE(shared.wait(60s));
  const auto info = Segment::stat(name);
  EXPECT_EQ(info.kind, vmm ? SegmentKind::Device : SegmentKind::DeviceIpc);
  EXPECT_EQ(info.size, kBytes);
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto seg = Segment::open(name);
              GPUIPC_CHILD_CHECK(seg.kind() == (vmm ? SegmentKind::Device : SegmentKind::DeviceIpc));
              GPUIPC_CHILD_CHECK(seg.size() == kBytes && seg.alive());
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 1) == 0);
              auto head = Segment::open(name + "-head", {.access = Access::ReadOnly});
              if (!vmm) {
                GPUIPC_CHILD_CHECK(core::legacy_open_count() == 1);  // two names, one cuIpcOpenMemHandle
                GPUIPC_CHILD_CHECK(head.device_pointer() + kOffset == seg.device_pointer());
              }
              g.k.fill_pattern(g.stream.get(), seg.device_pointer(), kWords, 2);
              g.stream.synchronize();
              return 0;
            }),
            0);
  opened.notify();
  EXPECT_EQ(wait_child(a), 0);
  if (vmm) {  // the broker keeps VMM memory: the names outlive the exporter until unlinked
    Segment::unlink(name);
    Segment::unlink(name + "-head");
  }
}

TEST(ShareDevice, CuMemAllocMemoryIsOpenedByAnotherProcessOncePerAllocation) {
  GPUIPC_REQUIRE_GPU();
  exporter_and_opener(false);
}

TEST(ShareDevice, VmmMemoryIsOpenedByAnotherProcess) {
  GPUIPC_REQUIRE_GPU();
  exporter_and_opener(true);
}

TEST(ShareDevice, VmmShareOutlivesItsExporter) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  EXPECT_EQ(run_child([&] {
              Gpu g;
              VmmBuffer v(cuda::allocation_granularity(0, false) * 2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
              g.k.fill_pattern(g.stream.get(), v.ptr() + 4096, 1024, 9);
              g.stream.synchronize();
              share(name, reinterpret_cast<void*>(v.ptr() + 4096), 4096);  // NOLINT: handle dropped at once
              return 0;  // frees its own mapping and handle; the broker holds the exported fd
            }),
            0);
  EXPECT_EQ(run_child([&] {
              Gpu g;
              auto seg = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(seg.size() == 4096);
              GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), 1024, 9) == 0);
              return 0;
            }),
            0);
  Segment::unlink(name);
}

TEST(ShareDevice, LegacyShareDiesWithItsExporterAndOpenersGetPeerDied) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe shared, opened, exporter_gone;
  const pid_t a = start_child([&] {
    Gpu g;
    auto buf = cuda::DeviceBuffer::allocate(kBytes);
    auto seg = share(name, reinterpret_cast<void*>(buf.get()), kBytes);  // NOLINT
    shared.notify();
    GPUIPC_CHILD_CHECK(opened.wait(60s));
    return 0;
  });
  ASSERT_TRUE(shared.wait(60s));
  const pid_t b = start_child([&] {
    Gpu g;
    auto seg = Segment::open(name);
    GPUIPC_CHILD_CHECK(seg.alive());
    opened.notify();
    GPUIPC_CHILD_CHECK(exporter_gone.wait(60s));
    GPUIPC_CHILD_CHECK(wait_until([&] { return !seg.alive(); }, 5s));
    try {
      seg.check_alive();
      return 2;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::PeerDied);
    }
    try {
      Segment::open(name);  // a cache hit on a dead share
      return 3;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::PeerDied);
    }
    return 0;
  });
  EXPECT_EQ(wait_child(a), 0);
  exporter_gone.notify();
  EXPECT_EQ(wait_child(b), 0);
  // The name went with the exporter.
  try {
    Segment::stat(name);
    ADD_FAILURE() << "the name outlived its exporter";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
  }
}

/// A child that shares kBytes of cuMemAlloc memory filled with `pattern` as `name`, says `shared`, runs
/// `meanwhile` (its failure, non-zero, is the child's), and once `done` says so checks that the share is still alive
/// (then exits, closing it).
pid_t start_legacy_exporter(const std::string& name, std::uint32_t pattern, SyncPipe& shared, SyncPipe& done,
                            const std::function<int()>& meanwhile = {}) {
  return start_child([&, pattern] {
    Gpu g;
    auto buf = cuda::DeviceBuffer::allocate(kBytes);
    g.k.fill_pattern(g.stream.get(), buf.get(), kWords, pattern);
    g.stream.synchronize();
    auto seg = share(name, reinterpret_cast<void*>(buf.get()), kBytes);  // NOLINT
    GPUIPC_CHILD_CHECK(seg.kind() == SegmentKind::DeviceIpc);
    shared.notify();
    if (meanwhile && meanwhile() != 0) return 1;
    GPUIPC_CHILD_CHECK(done.wait(60s));
    GPUIPC_CHILD_CHECK(seg.alive());
    return 0;
  });
}

/// In a fresh child: opens `name` and checks it is alive and holds `pattern`. The child's exit status.
int open_and_check(const std::string& name, std::uint32_t pattern) {
  return run_child([&] {
    Gpu g;
    auto seg = Segment::open(name, {.access = Access::ReadOnly});
    GPUIPC_CHILD_CHECK(seg.alive());
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, pattern) == 0);
    return 0;
  });
}

TEST(ShareDevice, ARecordClaimingMoreThanTheAllocationIsRefused) {
  // An opener checked the exporter's record against the record's own alloc_size only: an exporter that wrote a
  // larger one (and an offset past its memory) had the opener's device_pointer() point outside the mapping, and its
  // first kernel fault there. The opener now checks the range against what the handle opened.
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe shared, done;
  const pid_t a = start_child([&] {
    Gpu g;
    auto buf = cuda::DeviceBuffer::allocate(kBytes);
    auto seg = share(name, reinterpret_cast<void*>(buf.get()), kOffset);  // NOLINT
    proto::DeviceIpcRecord* r = detail::SegmentAccess::mapping(seg)->record();
    GPUIPC_CHILD_CHECK(r != nullptr && r->alloc_size >= kBytes);
    r->alloc_size = 1ULL << 30;  // the record still agrees with itself, and with the broker's check at Create
    r->offset = (1ULL << 30) - kOffset;
    shared.notify();
    GPUIPC_CHILD_CHECK(done.wait(60s));
    return 0;
  });
  ASSERT_TRUE(shared.wait(60s));
  EXPECT_EQ(run_child([&] {
              Gpu g;
              GPUIPC_CHILD_CHECK(fails_with([&] { (void)Segment::open(name, {.access = Access::ReadOnly}); },
                                            ErrorCode::Protocol, "do not lie inside the allocation the handle opens"));
              return 0;
            }),
            0);
  done.notify();
  EXPECT_EQ(wait_child(a), 0);
}

// A connection can close while its process lives on (the broker cuts one whose replies go unread, the library drops
// one to a broker that leaves its requests unanswered). cudaMalloc memory lives as long as its exporter's process:
// the share used to end with the connection (openers told PeerDied, the name removed). The exporter's library
// reconnects and announces the share again: an opener from before keeps it and a new one opens it, past the
// broker's grace; the exporter's own close ends it.
TEST(ShareDevice, ALegacyShareOutlivesItsExportersLostConnection) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe shared, opened, cut, past, done;
  const pid_t a = start_legacy_exporter(name, 5, shared, done, [&] {
    GPUIPC_CHILD_CHECK(opened.wait(60s));
    GPUIPC_CHILD_CHECK(shut_broker_connections() > 0);
    cut.notify();
    return 0;
  });
  ASSERT_TRUE(shared.wait(60s));
  const pid_t b = start_child([&] {
    Gpu g;
    auto seg = Segment::open(name, {.access = Access::ReadOnly});
    opened.notify();
    GPUIPC_CHILD_CHECK(past.wait(60s));
    GPUIPC_CHILD_CHECK(seg.alive());
    GPUIPC_CHILD_CHECK(g.k.count_mismatches(g.stream.get(), seg.device_pointer(), kWords, 5) == 0);
    return 0;
  });
  ASSERT_TRUE(cut.wait(60s));
  std::this_thread::sleep_for(BrokerEnvironment::kRejoinGrace + 500ms);
  past.notify();
  EXPECT_EQ(wait_child(b), 0) << "an opener from before the cut lost the share";
  EXPECT_EQ(open_and_check(name, 5), 0) << "the name did not stay with its exporter";
  done.notify();
  EXPECT_EQ(wait_child(a), 0);
  try {
    Segment::stat(name);  // the exporter's close, on its new connection, ended the share
    ADD_FAILURE() << "the name outlived its exporter";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
  }
}

// A broker killed while an exporter runs: its watcher gives the share back to the next broker (the journal keeps
// it). The name used to be lost, and the exporter's death then reached no opener (alive() stayed true over freed
// memory). An opener from before the kill hears of the exporter's end through the next broker.
TEST(ShareDevice, ALegacyShareOutlivesABrokerKill) {
  GPUIPC_REQUIRE_GPU();
  const auto name = unique_name();
  SyncPipe shared, opened, done, ended;
  const pid_t a = start_legacy_exporter(name, 6, shared, done);
  ASSERT_TRUE(shared.wait(60s));
  const pid_t b = start_child([&] {
    Gpu g;
    auto seg = Segment::open(name, {.access = Access::ReadOnly});
    opened.notify();
    GPUIPC_CHILD_CHECK(ended.wait(60s));
    GPUIPC_CHILD_CHECK(wait_until([&] { return !seg.alive(); }, 5s));
    return 0;
  });
  ASSERT_TRUE(opened.wait(60s));
  ASSERT_TRUE(BrokerEnvironment::kill_broker());
  EXPECT_TRUE(wait_until(
      [&] {
        try {
          return Segment::stat(name).kind == SegmentKind::DeviceIpc;
        } catch (const Error&) {
          return false;
        }
      },
      10s))
      << "the name did not come back";
  EXPECT_EQ(open_and_check(name, 6), 0);
  done.notify();
  EXPECT_EQ(wait_child(a), 0);
  ended.notify();
  EXPECT_EQ(wait_child(b), 0) << "an opener from before the kill did not hear of the exporter's end";
}

/// share() of `ptr` fails with `code` and a message containing `says`.
bool refused(const void* ptr, std::size_t bytes, const ShareOptions& o, ErrorCode code, const char* says) {
  try {
    share(unique_name("refused"), ptr, bytes, o);
  } catch (const Error& e) {
    if (e.code() == code && std::strstr(e.what(), says) != nullptr) return true;
    std::fprintf(stderr, "share refused with %s: %s (wanted '%s')\n", std::string(to_string(e.code())).c_str(),
                 e.what(), says);
    return false;
  }
  std::fprintf(stderr, "share accepted what it should refuse ('%s')\n", says);
  return false;
}

TEST(ShareDevice, EveryRefusedPointerSaysWhatToDo) {
  GPUIPC_REQUIRE_GPU();
  EXPECT_EQ(run_child([&] {
              Gpu g;
              const auto& api = cuda::driver();
              const auto ptr = [](CUdeviceptr p) { return reinterpret_cast<const void*>(p); };  // NOLINT
              // Host memory: pageable, and pinned.
              std::vector<char> host(1 << 20);
              GPUIPC_CHILD_CHECK(refused(host.data(), 4096, {}, ErrorCode::InvalidArgument, "is host memory"));
              void* pinned = nullptr;
              GPUIPC_CHILD_CHECK(api.cuMemHostAlloc(&pinned, 1 << 20, 0) == CUDA_SUCCESS);
              GPUIPC_CHILD_CHECK(refused(pinned, 4096, {}, ErrorCode::InvalidArgument, "use a host segment"));
              api.cuMemFreeHost(pinned);
              // Managed memory.
              GPUIPC_CHILD_CHECK(api.cuMemAllocManaged != nullptr);
              CUdeviceptr managed = 0;
              GPUIPC_CHILD_CHECK(api.cuMemAllocManaged(&managed, 1 << 20, CU_MEM_ATTACH_GLOBAL) == CUDA_SUCCESS);
              GPUIPC_CHILD_CHECK(refused(ptr(managed), 4096, {}, ErrorCode::InvalidArgument, "managed memory"));
              api.cuMemFree(managed);
              // A freed pointer.
              auto gone = cuda::DeviceBuffer::allocate(1 << 20);
              const CUdeviceptr freed = gone.get();
              gone = cuda::DeviceBuffer();
              GPUIPC_CHILD_CHECK(
                  refused(ptr(freed), 4096, {}, ErrorCode::InvalidArgument, "is not allocated GPU memory"));
              // Another device than the one named (GPU 0's memory, said to be on GPU 1).
              auto buf = cuda::DeviceBuffer::allocate(1 << 20);
              GPUIPC_CHILD_CHECK(
                  refused(ptr(buf.get()), 4096, {.device = 1}, ErrorCode::InvalidArgument, "lives on GPU 0, not on GPU 1"));
              // Past the end of the allocation: both sizes named.
              GPUIPC_CHILD_CHECK(refused(ptr(buf.get() + (1 << 20) - 100), 200, {}, ErrorCode::InvalidArgument,
                                         "run 100 bytes past the end of its allocation (1048576 bytes"));
              // A VMM allocation without the POSIX-fd handle type.
              const std::size_t gran = cuda::allocation_granularity(0, false);
              VmmBuffer closed(gran, CU_MEM_HANDLE_TYPE_NONE);
              GPUIPC_CHILD_CHECK(refused(ptr(closed.ptr()), 4096, {}, ErrorCode::Unsupported,
                                         "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"));
              // A VMM range past the end of its (one) allocation.
              VmmBuffer open(gran, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
              GPUIPC_CHILD_CHECK(
                  refused(ptr(open.ptr()), gran + 1, {}, ErrorCode::InvalidArgument, "one allocation at a time"));
              // Nothing above left a name behind.
              for (const auto& s : Segment::list()) GPUIPC_CHILD_CHECK(s.name.find("refused") == std::string::npos);
              return 0;
            }),
            0);
}

}  // namespace
}  // namespace gpuipc::test
