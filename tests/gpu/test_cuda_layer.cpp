// The cuda layer on a real GPU: device probing, the VMM export/import/map round trip in one process and across
// processes, host registration observed through stream memory operations, and the embedded kernels.
// Every test skips, saying why, where there is no driver or no GPU.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/legacy_ipc.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/error.hpp"
#include "os/memfd.hpp"
#include "os/socket.hpp"
#include "support/support.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/events.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/kernels.hpp"

extern char** environ;

namespace gpuipc {
namespace {

using namespace std::chrono_literals;

#define GPUIPC_REQUIRE_GPU()                                                                 \
  do {                                                                                       \
    std::string why;                                                                         \
    if (!gpuipc::cuda::driver_available(&why)) GTEST_SKIP() << "no CUDA driver: " << why;    \
    if (gpuipc::cuda::device_count() == 0) GTEST_SKIP() << "the CUDA driver reports no GPU"; \
  } while (0)

// The fd number the socket has in a re-executed child, and the variable that tells the child it is one.
constexpr int kChildSocketFd = 200;
constexpr const char* kChildEnv = "CUDA_LAYER_TEST_CHILD_FD";

std::vector<std::uint32_t> pattern(std::size_t words, std::uint64_t seed) {
  std::vector<std::uint32_t> out(words);
  for (std::size_t i = 0; i < words; ++i) out[i] = kernels::pattern_word(seed, i);
  return out;
}

std::size_t count_mismatches(const std::vector<std::uint32_t>& words, std::uint64_t seed) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < words.size(); ++i) bad += words[i] != kernels::pattern_word(seed, i) ? 1 : 0;
  return bad;
}

// A child that must be able to use CUDA although this process already initialised it: fork, then exec this
// test binary again (a fresh process) running only `test_name`, with `sock` (unless -1) as fd kChildSocketFd.
// Everything the child needs is prepared before fork.
class ReexecChild {
 public:
  ReexecChild(const std::string& test_name, int sock) {
    const std::string filter = "--gtest_filter=" + test_name;
    const std::string env = std::string(kChildEnv) + "=" + std::to_string(kChildSocketFd);
    std::vector<std::string> args = {"/proc/self/exe", filter, "--gtest_also_run_disabled_tests"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::string env_copy = env;
    std::vector<char*> envp;
    for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
    envp.push_back(env_copy.data());
    envp.push_back(nullptr);
    m_pid = ::fork();
    if (m_pid == 0) {
      // dup2 clears close-on-exec on the new fd, so the socket survives exec.
      if (sock >= 0 && ::dup2(sock, kChildSocketFd) < 0) ::_exit(126);
      ::execve("/proc/self/exe", argv.data(), envp.data());
      ::_exit(127);
    }
  }
  ReexecChild(const ReexecChild&) = delete;
  ReexecChild& operator=(const ReexecChild&) = delete;
  ~ReexecChild() {
    if (m_pid > 0) {
      ::kill(m_pid, SIGKILL);
      test::wait_child(m_pid, 5s);
    }
  }
  pid_t pid() const noexcept { return m_pid; }
  /// Waits for the child's exit code (kChildTimedOut after killing it).
  int wait(std::chrono::milliseconds timeout) {
    const int rc = test::wait_child(m_pid, timeout);
    m_pid = -1;
    return rc;
  }

 private:
  pid_t m_pid = -1;
};

// What the exporter sends with the fd.
struct ImportRequest {
  std::uint64_t size;
  std::uint64_t seed;
  std::array<std::uint8_t, 16> uuid;
};

TEST(CudaLayer, QueryDeviceIsSane) {
  GPUIPC_REQUIRE_GPU();
  EXPECT_GE(cuda::driver_version(), 12000);
  const int count = cuda::device_count();
  for (int i = 0; i < count; ++i) {
    const cuda::DeviceInfo info = cuda::query_device(i);
    SCOPED_TRACE(info.name);
    EXPECT_EQ(info.ordinal, i);
    EXPECT_FALSE(info.name.empty());
    EXPECT_GT(info.total_memory, 0u);
    EXPECT_GT(info.free_memory, 0u);
    EXPECT_LE(info.free_memory, info.total_memory);
    EXPECT_GE(info.cc_major, 7);
    EXPECT_GT(info.sm_count, 0);
    EXPECT_EQ(info.uuid_string.size(), 40u);
    EXPECT_EQ(info.uuid_string.rfind("GPU-", 0), 0u);
    EXPECT_EQ(cuda::parse_uuid(info.uuid_string), info.uuid);
    EXPECT_EQ(cuda::find_device(info.uuid), i);
    EXPECT_FALSE(info.pci_bus_id.empty());
    EXPECT_TRUE(info.unified_addressing);
    if (info.vmm) {
      EXPECT_GT(info.granularity_min, 0u);
      EXPECT_GE(info.granularity_recommended, info.granularity_min);
    }
    const cuda::MemoryInfo mem = cuda::memory_info(i);
    EXPECT_EQ(mem.total, info.total_memory);
  }
  const auto matrix = cuda::peer_access_matrix();
  ASSERT_EQ(matrix.size(), static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    ASSERT_EQ(matrix[i].size(), static_cast<std::size_t>(count));
    EXPECT_TRUE(matrix[i][i]);
  }
  EXPECT_FALSE(cuda::find_device(std::array<std::uint8_t, 16>{}).has_value());
}

TEST(CudaLayer, VmmRoundTripInOneProcess) {
  GPUIPC_REQUIRE_GPU();
  const cuda::DeviceInfo info = cuda::query_device(0, false);
  if (!info.vmm || !info.posix_fd_handles) GTEST_SKIP() << info.name << " lacks VMM or POSIX fd handles";
  const cuda::PrimaryContext context(0);
  context.make_current();

  const std::size_t granularity = cuda::allocation_granularity(0, false);
  const std::size_t size = cuda::round_up(3 << 20, granularity);
  EXPECT_THROW(cuda::create_exportable(0, granularity + 1), Error) << "unrounded sizes are refused";

  cuda::AllocationHandle created = cuda::create_exportable(0, size);
  const os::UniqueFd fd = cuda::export_fd(created);
  ASSERT_TRUE(fd.valid());
  const cuda::AllocationHandle imported = cuda::import_fd(fd.get());

  // Two views of one allocation: read-write through the creator's handle, read-only through the imported one.
  const cuda::VaRange va = cuda::reserve_va(2 * size, granularity);
  const cuda::MemMapping writer = cuda::map(va.base(), size, created);
  const cuda::MemMapping reader = cuda::map(va.base() + size, size, imported);
  const int devices[] = {0};
  cuda::set_access(writer.ptr(), size, devices, false);
  cuda::set_access(reader.ptr(), size, devices, true);
  // The mappings and the imported handle keep the memory: the creator's handle may go first.
  created = cuda::AllocationHandle();

  // Asking for fabric handles too works wherever the driver refuses them (no IMEX channel): it falls back.
  const cuda::AllocationHandle with_fabric = cuda::create_exportable(0, granularity, true);
  EXPECT_TRUE(cuda::export_fd(with_fabric).valid());
  EXPECT_EQ(::fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC) << "the driver's exported fd leaks into exec";

  const std::size_t words = size / sizeof(std::uint32_t);
  const auto sent = pattern(words, 11);
  cuda::copy_to_device(writer.ptr(), sent.data(), size);
  std::vector<std::uint32_t> received(words);
  cuda::copy_to_host(received.data(), reader.ptr(), size);
  EXPECT_EQ(count_mismatches(received, 11), 0u);
}

// The importer side of VmmAcrossProcesses; runs only as that test's re-executed child.
TEST(CudaLayerChild, DISABLED_ImportVerifyAndWriteBack) {
  const char* env = std::getenv(kChildEnv);
  if (env == nullptr) GTEST_SKIP() << "helper of CudaLayer.VmmAcrossProcesses; runs only as its child";
  const int sock = std::atoi(env);
  ASSERT_TRUE(os::wait_readable(sock, 60'000)) << "no request from the exporter";
  std::array<std::byte, 256> buffer{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(sock, buffer, size, fds), os::IoStatus::Ok);
  ASSERT_EQ(size, sizeof(ImportRequest));
  ASSERT_EQ(fds.size(), 1u);
  ImportRequest request{};
  std::memcpy(&request, buffer.data(), sizeof(request));

  const std::optional<int> ordinal = cuda::find_device(request.uuid);
  ASSERT_TRUE(ordinal.has_value()) << "the exporter's GPU is not visible here";
  const cuda::PrimaryContext context(*ordinal);
  context.make_current();
  const cuda::AllocationHandle handle = cuda::import_fd(fds[0].get());
  fds.clear();  // the imported handle keeps the memory on its own
  const cuda::VaRange va = cuda::reserve_va(request.size, 0);
  const cuda::MemMapping mapping = cuda::map(va.base(), request.size, handle);
  const int devices[] = {*ordinal};
  cuda::set_access(mapping.ptr(), request.size, devices, false);

  std::vector<std::uint32_t> words(request.size / sizeof(std::uint32_t));
  cuda::copy_to_host(words.data(), mapping.ptr(), request.size);
  const std::size_t bad = count_mismatches(words, request.seed);
  EXPECT_EQ(bad, 0u);
  const auto reply_words = pattern(words.size(), request.seed + 1);
  cuda::copy_to_device(mapping.ptr(), reply_words.data(), request.size);

  const std::uint8_t ok = bad == 0 ? 1 : 0;
  EXPECT_EQ(os::send_message(sock, std::as_bytes(std::span(&ok, 1))), os::IoStatus::Ok);
}

TEST(CudaLayer, VmmAcrossProcesses) {
  GPUIPC_REQUIRE_GPU();
  const cuda::DeviceInfo info = cuda::query_device(0, false);
  if (!info.vmm || !info.posix_fd_handles) GTEST_SKIP() << info.name << " lacks VMM or POSIX fd handles";

  auto [mine, theirs] = os::seqpacket_pair();
  ReexecChild child("CudaLayerChild.DISABLED_ImportVerifyAndWriteBack", theirs.get());
  ASSERT_GT(child.pid(), 0);
  theirs.reset();

  const cuda::PrimaryContext context(0);
  context.make_current();
  const std::size_t granularity = cuda::allocation_granularity(0, false);
  const std::size_t size = cuda::round_up(5 << 20, granularity);
  const cuda::AllocationHandle handle = cuda::create_exportable(0, size);
  const cuda::VaRange va = cuda::reserve_va(size, granularity);
  const cuda::MemMapping mapping = cuda::map(va.base(), size, handle);
  const int devices[] = {0};
  cuda::set_access(mapping.ptr(), size, devices, false);
  const std::size_t words = size / sizeof(std::uint32_t);
  const auto sent = pattern(words, 21);
  cuda::copy_to_device(mapping.ptr(), sent.data(), size);

  {
    const os::UniqueFd fd = cuda::export_fd(handle);
    const ImportRequest request{size, 21, info.uuid};
    const int fds[] = {fd.get()};
    ASSERT_EQ(os::send_message(mine.get(), std::as_bytes(std::span(&request, 1)), fds), os::IoStatus::Ok);
  }  // our copy of the fd goes: the child's import holds the memory from its side

  ASSERT_TRUE(os::wait_readable(mine.get(), 120'000)) << "the importer did not answer";
  std::array<std::byte, 16> reply{};
  std::size_t reply_size = 0;
  std::vector<os::UniqueFd> no_fds;
  ASSERT_EQ(os::receive_message(mine.get(), reply, reply_size, no_fds), os::IoStatus::Ok);
  ASSERT_EQ(reply_size, 1u);
  EXPECT_EQ(static_cast<int>(reply[0]), 1) << "the importer read a different pattern";
  EXPECT_EQ(child.wait(60s), 0) << "the importer's test failed";

  // What the child wrote through its own mapping is here, after the child is gone.
  std::vector<std::uint32_t> received(words);
  cuda::copy_to_host(received.data(), mapping.ptr(), size);
  EXPECT_EQ(count_mismatches(received, 22), 0u);
}

// Runs only as the child of WriteThroughReadOnlyMappingFaults: the fault ruins this process's context for good.
TEST(CudaLayerChild, DISABLED_WriteThroughReadOnlyMappingFaults) {
  if (std::getenv(kChildEnv) == nullptr) GTEST_SKIP() << "helper of CudaLayer.WriteThroughReadOnlyMappingFaults";
  const cuda::PrimaryContext context(0);
  context.make_current();
  const std::size_t granularity = cuda::allocation_granularity(0, false);
  const cuda::AllocationHandle handle = cuda::create_exportable(0, granularity);
  const cuda::VaRange va = cuda::reserve_va(2 * granularity, granularity);
  const cuda::MemMapping writable = cuda::map(va.base(), granularity, handle);
  const cuda::MemMapping read_only = cuda::map(va.base() + granularity, granularity, handle);
  const int devices[] = {0};
  cuda::set_access(writable.ptr(), granularity, devices, false);
  cuda::set_access(read_only.ptr(), granularity, devices, true);
  const kernels::Kernels k;
  const cuda::Stream stream = cuda::Stream::create();
  k.write_one(stream.get(), writable.ptr(), 1);  // allowed
  stream.synchronize();
  k.write_one(stream.get(), read_only.ptr() + 4, 2);
  try {
    stream.synchronize();
    ADD_FAILURE() << "a write through a PROT_READ mapping did not fault";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Cuda) << e.what();
    std::cerr << "fault as expected: " << e.what() << "\n";
  }
  // The owners are released in a faulted context now: their destructors log, never throw or crash.
}

TEST(CudaLayer, WriteThroughReadOnlyMappingFaults) {
  GPUIPC_REQUIRE_GPU();
  const cuda::DeviceInfo info = cuda::query_device(0, false);
  if (!info.vmm || !info.posix_fd_handles) GTEST_SKIP() << info.name << " lacks VMM or POSIX fd handles";
  ReexecChild child("CudaLayerChild.DISABLED_WriteThroughReadOnlyMappingFaults", -1);
  ASSERT_GT(child.pid(), 0);
  EXPECT_EQ(child.wait(120s), 0);
}

// The importer side of LegacyIpcAcrossProcesses; runs only as that test's re-executed child.
TEST(CudaLayerChild, DISABLED_LegacyIpcOpenAndVerify) {
  const char* env = std::getenv(kChildEnv);
  if (env == nullptr) GTEST_SKIP() << "helper of CudaLayer.LegacyIpcAcrossProcesses; runs only as its child";
  const int sock = std::atoi(env);
  ASSERT_TRUE(os::wait_readable(sock, 60'000)) << "no handle from the exporter";
  struct Request {
    CUipcMemHandle handle;
    std::uint64_t size;
    std::uint64_t seed;
  } request{};
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(os::receive_message(sock, std::as_writable_bytes(std::span(&request, 1)), size, fds), os::IoStatus::Ok);
  ASSERT_EQ(size, sizeof(request));
  const cuda::PrimaryContext context(0);
  context.make_current();
  const cuda::IpcMapping mapping = cuda::IpcMapping::open(request.handle);
  ASSERT_TRUE(mapping);
  std::vector<std::uint32_t> words(request.size / sizeof(std::uint32_t));
  cuda::copy_to_host(words.data(), mapping.get(), request.size);
  const std::uint8_t ok = count_mismatches(words, request.seed) == 0 ? 1 : 0;
  EXPECT_EQ(ok, 1);
  EXPECT_EQ(os::send_message(sock, std::as_bytes(std::span(&ok, 1))), os::IoStatus::Ok);
}

TEST(CudaLayer, LegacyIpcAcrossProcesses) {
  GPUIPC_REQUIRE_GPU();
  if (!cuda::query_device(0, false).legacy_ipc) GTEST_SKIP() << "no legacy IPC on GPU 0";
  auto [mine, theirs] = os::seqpacket_pair();
  ReexecChild child("CudaLayerChild.DISABLED_LegacyIpcOpenAndVerify", theirs.get());
  ASSERT_GT(child.pid(), 0);
  theirs.reset();
  const cuda::PrimaryContext context(0);
  context.make_current();
  const std::size_t bytes = std::size_t{3} << 20;
  const cuda::DeviceBuffer buffer = cuda::DeviceBuffer::allocate(bytes);
  const auto sent = pattern(bytes / sizeof(std::uint32_t), 31);
  cuda::copy_to_device(buffer.get(), sent.data(), bytes);
  struct Request {
    CUipcMemHandle handle;
    std::uint64_t size;
    std::uint64_t seed;
  } request{cuda::ipc_get_mem_handle(buffer.get()), bytes, 31};
  ASSERT_EQ(os::send_message(mine.get(), std::as_bytes(std::span(&request, 1))), os::IoStatus::Ok);
  ASSERT_TRUE(os::wait_readable(mine.get(), 120'000)) << "the importer did not answer";
  std::array<std::byte, 16> reply{};
  std::size_t reply_size = 0;
  std::vector<os::UniqueFd> no_fds;
  ASSERT_EQ(os::receive_message(mine.get(), reply, reply_size, no_fds), os::IoStatus::Ok);
  EXPECT_EQ(static_cast<int>(reply[0]), 1) << "the importer read a different pattern";
  EXPECT_EQ(child.wait(60s), 0);
}

TEST(CudaLayer, ForkedChildOfAnInitialisedParentIsTold) {
  GPUIPC_REQUIRE_GPU();
  const int rc = test::run_child([] {
    try {
      cuda::driver();
      return 2;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::Unsupported);
    }
    GPUIPC_CHILD_CHECK(cuda::loaded_driver() == nullptr);
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

/// A page of a memfd with two CPU views: the GPU writes through the registered one, a test reads the other, as
/// another process would.
struct RegisteredPage {
  explicit RegisteredPage(const char* name)
      : memfd(os::memfd_create(name, os::page_size())),
        registered_view(os::Mapping::map(memfd.get(), os::page_size(), true)),
        other_view(os::Mapping::map(memfd.get(), os::page_size(), true)),
        registration(cuda::HostRegistration::register_memory(registered_view.data(), os::page_size())) {}
  std::uint64_t* words() const { return static_cast<std::uint64_t*>(other_view.data()); }
  CUdeviceptr device_words() const { return registration.device_pointer(); }

  os::UniqueFd memfd;
  os::Mapping registered_view, other_view;
  cuda::HostRegistration registration;
};

/// Skips unless GPU 0 can register host memory and run 64-bit stream memory operations; then makes its primary
/// context current.
#define GPUIPC_REQUIRE_STREAM_MEMOPS(context)                                                         \
  GPUIPC_REQUIRE_GPU();                                                                               \
  const cuda::DeviceInfo info = cuda::query_device(0, false);                                         \
  if (!info.host_register) GTEST_SKIP() << info.name << " cannot register host memory";               \
  if (!info.stream_mem_ops_64) GTEST_SKIP() << info.name << " lacks 64-bit stream memory operations"; \
  const cuda::PrimaryContext context(0);                                                              \
  context.make_current()

TEST(CudaLayer, HostRegistrationSeesStreamMemoryOperations) {
  GPUIPC_REQUIRE_STREAM_MEMOPS(context);
  const RegisteredPage page("gpuipc-test-semaphore");
  auto* words = page.words();
  std::atomic_ref<std::uint64_t> counter(words[0]);
  std::atomic_ref<std::uint64_t> echo(words[1]);
  const CUdeviceptr device_words = page.device_words();
  const cuda::Stream stream = cuda::Stream::create();

  // GPU -> CPU.
  ASSERT_EQ(cuda::stream_write_value64(stream.get(), device_words, 42), CUDA_SUCCESS);
  EXPECT_TRUE(test::wait_until([&] { return counter.load() == 42; }, 10s));

  // CPU -> GPU: the stream blocks on the counter until the CPU releases it, then echoes.
  ASSERT_EQ(cuda::stream_wait_value64(stream.get(), device_words, 100), CUDA_SUCCESS);
  ASSERT_EQ(cuda::stream_write_value64(stream.get(), device_words + 8, 7), CUDA_SUCCESS);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(echo.load(), 0u) << "the stream did not wait";
  EXPECT_FALSE(stream.query());
  counter.store(100);  // released even when the check above failed, so the stream never stays blocked
  EXPECT_TRUE(test::wait_until([&] { return echo.load() == 7; }, 10s));
  stream.synchronize();
}

TEST(CudaLayer, StreamReachedNowCountsWhatAWriteWouldWaitFor) {
  GPUIPC_REQUIRE_STREAM_MEMOPS(context);
  const RegisteredPage page("gpuipc-test-reached");
  auto* words = page.words();
  const CUdeviceptr device_words = page.device_words();
  const cuda::Stream non_blocking = cuda::Stream::create(true);
  const cuda::Stream blocking = cuda::Stream::create(false);
  struct Probe {
    CUevent event = cuda::create_probe_event();
    ~Probe() { cuda::destroy_event(event); }
  } owned;
  const CUevent probe = owned.event;
  ASSERT_NE(probe, nullptr);
  auto all_reached = [&] {
    return cuda::stream_reached_now(non_blocking.get()) && cuda::stream_reached_now(blocking.get()) &&
           cuda::legacy_stream_reached_now(probe, 1ms);
  };
  EXPECT_TRUE(test::wait_until(all_reached, 10s));
  // The legacy default stream is never answered by a stream query: what a write there waits for cannot be listed.
  EXPECT_FALSE(cuda::stream_reached_now(nullptr));
  EXPECT_FALSE(cuda::stream_reached_now(CU_STREAM_LEGACY));

  // The legacy stream blocked on a host word: a write on the blocking stream would wait for it, one on the
  // non-blocking stream would not.
  // From here no ASSERT: the words are released below whatever fails, so no stream stays blocked.
  EXPECT_EQ(cuda::stream_wait_value64(CU_STREAM_LEGACY, device_words, 1), CUDA_SUCCESS);
  std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(cuda::stream_reached_now(non_blocking.get()));
  EXPECT_FALSE(cuda::stream_reached_now(blocking.get()));
  EXPECT_FALSE(cuda::legacy_stream_reached_now(probe, 1ms));
  // The non-blocking stream with its own work queued.
  EXPECT_EQ(cuda::stream_wait_value64(non_blocking.get(), device_words + 8, 1), CUDA_SUCCESS);
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(cuda::stream_reached_now(non_blocking.get()));
  std::atomic_ref<std::uint64_t>(words[0]).store(1);  // released even when a check above failed
  std::atomic_ref<std::uint64_t>(words[1]).store(1);
  non_blocking.synchronize();
  cuda::synchronize(CU_STREAM_LEGACY, "the legacy stream");
  EXPECT_TRUE(test::wait_until(all_reached, 10s));
  cuda::synchronize_context("the probe's last record");
}

TEST(CudaLayer, KernelsFillVerifyAndBandwidthKernels) {
  GPUIPC_REQUIRE_GPU();
  const cuda::PrimaryContext context(0);
  context.make_current();
  const kernels::Kernels k;
  EXPECT_GT(k.sm_count(), 0);
  const cuda::Stream stream = cuda::Stream::create();

  const std::size_t bytes = std::size_t{16} << 20;
  const std::size_t words = bytes / sizeof(std::uint32_t);
  const cuda::DeviceBuffer buffer = cuda::DeviceBuffer::allocate(bytes);
  k.fill_pattern(stream.get(), buffer.get(), words, 5);
  EXPECT_EQ(k.count_mismatches(stream.get(), buffer.get(), words, 5), 0u);
  EXPECT_GT(k.count_mismatches(stream.get(), buffer.get(), words, 6), words - 16) << "another seed must not verify";

  // The host and the kernels agree on the pattern.
  std::vector<std::uint32_t> head(4096);
  cuda::copy_to_host(head.data(), buffer.get(), head.size() * sizeof(std::uint32_t));
  EXPECT_EQ(count_mismatches(head, 5), 0u);
  const auto from_host = pattern(words, 9);
  cuda::copy_to_device(buffer.get(), from_host.data(), bytes);
  EXPECT_EQ(k.count_mismatches(stream.get(), buffer.get(), words, 9), 0u);

  // write_fill then read_sum: every u32 lane is 3.
  const std::size_t vectors = bytes / 16;
  const cuda::DeviceBuffer sum = cuda::DeviceBuffer::allocate(sizeof(std::uint64_t));
  k.write_fill(stream.get(), buffer.get(), vectors, 3);
  cuda::memset_d8_async(sum.get(), 0, sizeof(std::uint64_t), stream.get());
  k.read_sum(stream.get(), buffer.get(), vectors, sum.get());
  stream.synchronize();
  std::uint64_t total = 0;
  cuda::copy_to_host(&total, sum.get(), sizeof(total));
  EXPECT_EQ(total, static_cast<std::uint64_t>(vectors) * 4 * 3);

  // write_flag then spin_until in stream order: the spin ends at once, without timing out.
  const cuda::DeviceBuffer flag = cuda::DeviceBuffer::allocate(16);
  cuda::memset_d8(flag.get(), 0, 16);
  k.write_flag(stream.get(), flag.get(), 5);
  k.spin_until(stream.get(), flag.get(), 5, 1'000'000'000ULL, flag.get() + 8);
  k.write_one(stream.get(), flag.get() + 12, 0xabcdU);
  stream.synchronize();
  std::array<std::uint32_t, 4> flag_words{};
  cuda::copy_to_host(flag_words.data(), flag.get(), 16);
  EXPECT_EQ(flag_words[0], 5u);
  EXPECT_EQ(flag_words[2], 0u) << "spin_until timed out";
  EXPECT_EQ(flag_words[3], 0xabcdU);
}

TEST(CudaLayer, EventsTimeAStream) {
  GPUIPC_REQUIRE_GPU();
  const cuda::PrimaryContext context(0);
  context.make_current();
  const cuda::Stream stream = cuda::Stream::create();
  const cuda::Event start = cuda::Event::create();
  const cuda::Event end = cuda::Event::create();
  const cuda::DeviceBuffer buffer = cuda::DeviceBuffer::allocate(std::size_t{64} << 20);
  start.record(stream.get());
  cuda::memset_d8_async(buffer.get(), 1, buffer.size(), stream.get());
  end.record(stream.get());
  end.synchronize();
  EXPECT_TRUE(end.query());
  EXPECT_GE(cuda::Event::elapsed_ms(start, end), 0.0F);
}

}  // namespace
}  // namespace gpuipc
