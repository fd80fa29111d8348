// A private broker for one test process: its own runtime directory (mode 0755, so a setuid child can reach the
// socket), the gpuipcd of this build, small quotas; stopped with SIGTERM when the tests end.
#pragma once

#include <gtest/gtest.h>
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "support/support.hpp"

namespace gpuipc::test {

class BrokerEnvironment : public ::testing::Environment {
 public:
  /// Quota of bytes for the test broker (GPUIPC_QUOTA_BYTES): large, since host memfds are sparse.
  static constexpr std::uint64_t kQuotaBytes = 64ULL << 30;
  /// How long a member whose connection closed while its process lives has to rejoin (GPUIPC_REJOIN_GRACE_MS).
  static constexpr std::chrono::milliseconds kRejoinGrace{2000};

  void SetUp() override;
  void TearDown() override;

  /// The runtime directory of this process's broker.
  static const std::string& runtime_dir();
  /// The broker's pid (connects, starting it, if needed).
  static pid_t broker_pid();
  /// SIGKILLs the broker and waits until it is gone: true, or false when it still runs after 5 s. The clients'
  /// watchers (or their next library call) start another.
  static bool kill_broker();
  /// Open fds of the broker process (/proc/<pid>/fd).
  static int broker_fd_count();
  /// The broker's settled fd count: the least of several reads over ~20 ms, so a reply's fd caught in flight
  /// (dup'ed for sendmsg, closed right after) does not inflate a baseline.
  static int broker_fd_baseline();
  /// Sum of the broker's references over all segments.
  static std::uint64_t broker_references();
  /// References the broker counts for segment `name` (0 when it does not exist).
  static std::uint64_t references_of(const std::string& name);

 private:
  static std::unique_ptr<TempDir> s_dir;
};

/// Registers the environment once per test binary (call from a static initializer).
bool register_broker_environment();

/// Shuts down this process's connections to the broker (the library's, and its watcher's copy): the broker sees
/// them close while the process lives on, as when it cuts a connection (replies not read, a request that failed) or
/// the library drops one. Returns how many.
int shut_broker_connections();

/// A name unique to this test and process: "<test-name>-<pid>-<suffix>".
std::string unique_name(const std::string& suffix = "seg");

}  // namespace gpuipc::test
