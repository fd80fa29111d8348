// The run-time-loaded CUDA driver without a GPU: error formatting, a missing or wrong driver library, and the
// ownership rules of the RAII types. Nothing here loads the driver in the test process itself: the driver table
// loads once per process, so every check that loads it runs in a forked child.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <type_traits>

#include "cuda/context.hpp"
#include "cuda/device.hpp"
#include "cuda/driver.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/legacy_ipc.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/error.hpp"
#include "support/support.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/events.hpp"
#include "testkit/cuda/module.hpp"
#include "testkit/cuda/stream.hpp"
#include "testkit/kernels/pattern.hpp"

namespace gpuipc {
namespace {

template <typename T>
constexpr bool kMoveOnly = !std::is_copy_constructible_v<T> && !std::is_copy_assignable_v<T> &&
                           std::is_nothrow_move_constructible_v<T> && std::is_nothrow_move_assignable_v<T> &&
                           std::is_nothrow_destructible_v<T> && std::is_nothrow_default_constructible_v<T>;

static_assert(kMoveOnly<cuda::PrimaryContext>);
static_assert(kMoveOnly<cuda::AllocationHandle>);
static_assert(kMoveOnly<cuda::VaRange>);
static_assert(kMoveOnly<cuda::MemMapping>);
static_assert(kMoveOnly<cuda::HostRegistration>);
static_assert(kMoveOnly<cuda::Stream>);
static_assert(kMoveOnly<cuda::Event>);
static_assert(kMoveOnly<cuda::DeviceBuffer>);
static_assert(kMoveOnly<cuda::IpcMapping>);
static_assert(kMoveOnly<cuda::Module>);
static_assert(!std::is_copy_constructible_v<cuda::ScopedContext> && !std::is_move_constructible_v<cuda::ScopedContext>);

constexpr const char* kMissingLibrary = "/nonexistent/gpuipc-unit-test/libcuda.so.1";

TEST(CudaDriver, ResultNameOfKnownCodes) {
  EXPECT_EQ(cuda::result_name(CUDA_SUCCESS), "CUDA_SUCCESS");
  EXPECT_EQ(cuda::result_name(CUDA_ERROR_OUT_OF_MEMORY), "CUDA_ERROR_OUT_OF_MEMORY");
  EXPECT_EQ(cuda::result_name(CUDA_ERROR_NOT_SUPPORTED), "CUDA_ERROR_NOT_SUPPORTED");
  EXPECT_EQ(cuda::result_name(CUDA_ERROR_ILLEGAL_ADDRESS), "CUDA_ERROR_ILLEGAL_ADDRESS");
}

TEST(CudaDriver, ResultNameOfUnknownCodeIsTheNumber) {
  EXPECT_EQ(cuda::result_name(static_cast<CUresult>(12345)), "CUresult 12345");
}

TEST(CudaDriver, ErrorNamesCallObjectAndResult) {
  const Error e = cuda::cuda_error(CUDA_ERROR_INVALID_VALUE, "cuMemMap", "segment 'weights'");
  EXPECT_EQ(e.code(), ErrorCode::Cuda);
  EXPECT_EQ(e.call(), "cuMemMap");
  EXPECT_EQ(e.cu_result(), static_cast<int>(CUDA_ERROR_INVALID_VALUE));
  EXPECT_EQ(e.sys_errno(), 0);
  EXPECT_EQ(std::string(e.what()).rfind("segment 'weights': cuMemMap failed: CUDA_ERROR_INVALID_VALUE (1)", 0), 0u)
      << e.what();
}

TEST(CudaDriver, ErrorCodesFollowTheResult) {
  EXPECT_EQ(cuda::cuda_error(CUDA_ERROR_NOT_SUPPORTED, "cuMemCreate", "x").code(), ErrorCode::Unsupported);
  EXPECT_EQ(cuda::cuda_error(CUDA_ERROR_NO_DEVICE, "cuDeviceGet", "x").code(), ErrorCode::NoDevice);
  EXPECT_EQ(cuda::cuda_error(CUDA_ERROR_INVALID_DEVICE, "cuDeviceGet", "x").code(), ErrorCode::NoDevice);
  const Error oom = cuda::cuda_error(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate", "GPU allocation of 1 bytes");
  EXPECT_EQ(oom.code(), ErrorCode::Cuda);
  EXPECT_NE(std::string(oom.what()).find("out of GPU memory"), std::string::npos) << oom.what();
  EXPECT_NE(std::string(oom.what()).find("CUDA_ERROR_OUT_OF_MEMORY (2)"), std::string::npos) << oom.what();
}

TEST(CudaDriver, CheckThrowsOnlyOnFailure) {
  EXPECT_NO_THROW(cuda::check(CUDA_SUCCESS, "cuInit", "x"));
  try {
    cuda::check(CUDA_ERROR_INVALID_HANDLE, "cuStreamSynchronize", "stream");
    FAIL() << "check did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Cuda);
    EXPECT_EQ(e.call(), "cuStreamSynchronize");
  }
}

TEST(CudaDriver, MissingLibraryIsNoDriverNamingIt) {
  const int rc = test::run_child([] {
    ::setenv("GPUIPC_CUDA_LIBRARY", kMissingLibrary, 1);  // before the first use: the table loads once
    GPUIPC_CHILD_CHECK(cuda::loaded_driver() == nullptr);
    std::string first;
    try {
      cuda::driver();
      return 2;
    } catch (const Error& e) {
      first = e.what();
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::NoDriver);
      GPUIPC_CHILD_CHECK(first.find(kMissingLibrary) != std::string::npos);
      GPUIPC_CHILD_CHECK(first.find("host segments work without it") != std::string::npos);
      GPUIPC_CHILD_CHECK(first.find('\n') == std::string::npos);
    }
    // The outcome is kept: the same error again, and driver_available says why.
    try {
      cuda::driver();
      return 3;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::NoDriver);
      GPUIPC_CHILD_CHECK(first == e.what());
    }
    std::string why;
    GPUIPC_CHILD_CHECK(!cuda::driver_available(&why));
    GPUIPC_CHILD_CHECK(why == first);
    GPUIPC_CHILD_CHECK(!cuda::driver_available());
    GPUIPC_CHILD_CHECK(cuda::loaded_driver() == nullptr);
    // Everything built on the driver reports the same, and releasing nothing is fine.
    try {
      (void)cuda::device_count();
      return 4;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::NoDriver);
    }
    try {
      (void)cuda::Stream::create();
      return 5;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::NoDriver);
    }
    GPUIPC_CHILD_CHECK(cuda::stream_write_value64(nullptr, 0, 1) == CUDA_ERROR_NOT_INITIALIZED);
    { cuda::AllocationHandle adopted(42); }  // destructor without a driver: nothing to call, no crash
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

TEST(CudaDriver, ALibraryThatIsNotTheDriverIsNoDriver) {
  const int rc = test::run_child([] {
    ::setenv("GPUIPC_CUDA_LIBRARY", "libm.so.6", 1);
    try {
      cuda::driver();
      return 2;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::NoDriver);
      GPUIPC_CHILD_CHECK(std::string(e.what()).find("cuGetProcAddress") != std::string::npos);
    }
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

TEST(CudaDriver, DriverAvailableNeverThrows) {
  // Whatever this machine has (no driver here, a GPU on the lead's machine): an answer, and a reason with false.
  const int rc = test::run_child([] {
    std::string why;
    const bool ok = cuda::driver_available(&why);
    GPUIPC_CHILD_CHECK(ok || !why.empty());
    GPUIPC_CHILD_CHECK(ok == (cuda::loaded_driver() != nullptr));
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

TEST(CudaDevice, UuidFormatsLikeNvidiaSmi) {
  const std::array<std::uint8_t, 16> uuid{0x3f, 0x1b, 0x9c, 0x02, 0xa4, 0x5e, 0x7d, 0x61,
                                          0x80, 0x0b, 0xfe, 0x12, 0x34, 0x56, 0x78, 0x9a};
  const std::string text = cuda::format_uuid(uuid);
  EXPECT_EQ(text, "GPU-3f1b9c02-a45e-7d61-800b-fe123456789a");
  EXPECT_EQ(cuda::parse_uuid(text), uuid);
  EXPECT_EQ(cuda::parse_uuid("3F1B9C02-A45E-7D61-800B-FE123456789A"), uuid);
  EXPECT_FALSE(cuda::parse_uuid("GPU-3f1b9c02-a45e-7d61-800b-fe123456789"));
  EXPECT_FALSE(cuda::parse_uuid("GPU-3f1b9c02a45e-7d61-800b-fe123456789a0"));
  EXPECT_FALSE(cuda::parse_uuid("GPU-3f1b9c02-a45e-7d61-800b-fe123456789g"));
  EXPECT_FALSE(cuda::parse_uuid(""));
}

TEST(CudaDevice, DriverVersionFormat) {
  EXPECT_EQ(cuda::format_driver_version(13000), "13.0");
  EXPECT_EQ(cuda::format_driver_version(12080), "12.8");
  EXPECT_EQ(cuda::format_driver_version(11040), "11.4");
}

TEST(CudaResources, RoundUp) {
  EXPECT_EQ(cuda::round_up(0, 2 << 20), 0u);
  EXPECT_EQ(cuda::round_up(1, 2 << 20), std::size_t{2} << 20);
  EXPECT_EQ(cuda::round_up(2 << 20, 2 << 20), std::size_t{2} << 20);
  EXPECT_EQ(cuda::round_up(3 << 20, 2 << 20), std::size_t{4} << 20);
  EXPECT_EQ(cuda::round_up(10, 3), 12u);
  EXPECT_THROW(cuda::round_up(SIZE_MAX - 1, 4096), Error);
}

TEST(CudaResources, EmptyOwnersAreInert) {
  cuda::AllocationHandle a;
  cuda::VaRange v;
  cuda::MemMapping m;
  cuda::Stream s;
  EXPECT_FALSE(a);
  EXPECT_FALSE(v);
  EXPECT_FALSE(m);
  EXPECT_FALSE(s);
  cuda::VaRange moved(std::move(v));
  EXPECT_FALSE(moved);
}

TEST(Kernels, PatternIsDeterministicAndSeedDependent) {
  static_assert(kernels::pattern_word(1, 0) == kernels::pattern_word(1, 0));
  int same_index = 0;
  int same_other_seed = 0;
  for (unsigned i = 0; i < 4096; ++i) {
    same_index += kernels::pattern_word(7, i) == i ? 1 : 0;
    same_other_seed += kernels::pattern_word(7, i) == kernels::pattern_word(8, i) ? 1 : 0;
  }
  EXPECT_EQ(same_index, 0);
  EXPECT_EQ(same_other_seed, 0);
  EXPECT_NE(kernels::pattern_word(7, 0), kernels::pattern_word(7, 1));
}

}  // namespace
}  // namespace gpuipc
