// The environment registry's number parser (src/base/config.cpp): what GPUIPC_ quotas and timeouts accept.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "base/config.hpp"
#include "gpuipc/error.hpp"

namespace gpuipc {
namespace {

/// Sets GPUIPC_QUOTA_SEGMENTS for one check (a registered variable nothing else in this test process reads).
std::uint64_t parse(const char* value) {
  ::setenv("GPUIPC_QUOTA_SEGMENTS", value, 1);  // NOLINT(concurrency-mt-unsafe): single-threaded test
  const auto v = config::env_u64("GPUIPC_QUOTA_SEGMENTS", 7);
  ::unsetenv("GPUIPC_QUOTA_SEGMENTS");  // NOLINT(concurrency-mt-unsafe)
  return v;
}

TEST(ConfigEnv, NumbersSuffixesAndUnlimited) {
  EXPECT_EQ(parse("1000"), 1000U);
  EXPECT_EQ(parse("64M"), 64ULL << 20);
  EXPECT_EQ(parse("2g"), 2ULL << 30);
  EXPECT_EQ(parse("unlimited"), UINT64_MAX);
  EXPECT_EQ(parse(""), 7U);      // empty: the default
  EXPECT_EQ(parse("010"), 10U);  // decimal, not octal
}

TEST(ConfigEnv, AnUnlimitedDurationMakesDeadlinesInTheFuture) {
  // INT64_MAX ms: now() + it wrapped into the past (a connect that gave up at once, a restore grace of -1 ms).
  for (const char* value : {"unlimited", "100000000000000", "18446744073709551615"}) {
    ::setenv("GPUIPC_CONNECT_TIMEOUT_MS", value, 1);  // NOLINT(concurrency-mt-unsafe): single-threaded test
    const auto ms = config::env_ms("GPUIPC_CONNECT_TIMEOUT_MS", std::chrono::milliseconds(5));
    ::unsetenv("GPUIPC_CONNECT_TIMEOUT_MS");  // NOLINT(concurrency-mt-unsafe)
    EXPECT_EQ(ms, config::kMostEnvMs) << value;
    const auto now = std::chrono::steady_clock::now();
    EXPECT_GT(now + ms, now) << value;
    EXPECT_GT(std::chrono::system_clock::now() + ms, std::chrono::system_clock::now()) << value;
  }
}

TEST(ConfigEnv, ARelativeRuntimeDirectoryIsRefused) {
  // It named another directory after a chdir: a process that held names went, at its next connect (a broker
  // restart), to another broker or started one there, and its names were given back to none.
  ::setenv("GPUIPC_RUNTIME_DIR", "rel/run", 1);  // NOLINT(concurrency-mt-unsafe): single-threaded test
  try {
    (void)config::runtime_dir();
    ADD_FAILURE() << "a relative GPUIPC_RUNTIME_DIR was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("is a relative path"), std::string::npos) << e.what();
  }
  ::setenv("GPUIPC_RUNTIME_DIR", "/abs/run", 1);  // NOLINT(concurrency-mt-unsafe)
  EXPECT_EQ(config::runtime_dir(), "/abs/run");
  ::unsetenv("GPUIPC_RUNTIME_DIR");  // NOLINT(concurrency-mt-unsafe)
}

// stoull takes a sign and leading blanks: "-1" read as 2^64 - 1, no limit at all, where the docs promise an error.
TEST(ConfigEnv, ASignOrAnythingButDigitsFirstIsRefused) {
  for (const char* bad : {"-1", "+5", "-0", "abc", "5x", "0x10", "99999999999999999999", "16E"}) {
    try {
      parse(bad);
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << bad;
      EXPECT_NE(std::string(e.what()).find("GPUIPC_QUOTA_SEGMENTS"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace gpuipc
