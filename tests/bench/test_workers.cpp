// The forked workers of bench/harness/workers.hpp: a worker that fails makes run_workers throw, and the names the
// measurement made are unlinked on that way out too (UnlinkOnExit), so a failed run leaves nothing registered.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/error.hpp"
#include "support/broker_env.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

const bool kRegistered = test::register_broker_environment();

bool registered(const std::string& name) {
  try {
    (void)CountingSemaphore::stat(name);
    return true;
  } catch (const Error& e) {
    if (e.code() == ErrorCode::NotFound) return false;
    throw;
  }
}

TEST(BenchWorkers, AFailedWorkerLeavesNoName) {
  const std::string name = test::unique_name("bench-unlink");
  EXPECT_THROW(
      {
        const UnlinkOnExit unlink_name([&] { CountingSemaphore::unlink(name); });
        run_workers({[&]() -> nlohmann::json {
          auto s = CountingSemaphore::create(name, {.initial = 0, .max_count = 1});
          throw std::runtime_error("failed after making its name");
        }});
      },
      Error);
  EXPECT_FALSE(registered(name)) << name << " outlived the failed measurement";
}

TEST(BenchWorkers, UnlinkOnExitDropsWhatUnlinkThrows) {
  // A worker that failed before making its name: the unlink's NotFound must not replace the worker's error.
  EXPECT_NO_THROW({ const UnlinkOnExit unlink_name([] { CountingSemaphore::unlink(test::unique_name("never")); }); });
}

}  // namespace
}  // namespace gpuipc::bench
