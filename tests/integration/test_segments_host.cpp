// Host-kind segments across real processes: sharing, permissions, read-only, crashes, unlink, leaks, quotas.
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include "core/client.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "os/fd.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

TEST(SegmentsHost, CreateInOneProcessModifyInAnotherSeenInFirst) {
  const auto name = unique_name();
  auto seg = Segment::create(name, 1 << 20);
  ASSERT_EQ(seg.kind(), SegmentKind::Host);
  ASSERT_GE(seg.size(), 1U << 20);
  auto* p = static_cast<std::uint32_t*>(seg.data());
  for (std::uint32_t i = 0; i < (1 << 18); ++i) p[i] = i;
  EXPECT_EQ(run_child([&] {
              auto s = Segment::open(name);
              auto* q = static_cast<std::uint32_t*>(s.data());
              for (std::uint32_t i = 0; i < (1 << 18); ++i) GPUIPC_CHILD_CHECK(q[i] == i);
              for (std::uint32_t i = 0; i < (1 << 18); ++i) q[i] = i * 3 + 1;
              return 0;
            }),
            0);
  for (std::uint32_t i = 0; i < (1 << 18); ++i) ASSERT_EQ(p[i], i * 3 + 1) << "at " << i;
  Segment::unlink(name);
}

TEST(SegmentsHost, AHandleKnowsItsOwnerAndModeAsTheBrokerSaid) {
  // As the creator said (Create's answer), and as this process, which never mapped them, opens them (Open's
  // answer). Under root (CI) the creator is uid 65534: a field left at 0 would pass for root's own.
  const auto name = unique_name();
  const bool root = ::getuid() == 0;
  const uid_t uid = root ? 65534 : ::getuid();
  const gid_t gid = root ? 65534 : ::getgid();
  (void)Segment::list();  // the broker started by this process: a child of another uid could not start it
  EXPECT_EQ(run_child([&] {
              if (root && (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0)) return 90;
              const auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0644});
              GPUIPC_CHILD_CHECK(seg.owner_uid() == uid && seg.owner_gid() == gid && seg.mode() == 0644U);
              const auto pool = Pool::create(name + "p", {.kind = SegmentKind::Host, .mode = 0666});
              GPUIPC_CHILD_CHECK(pool.owner_uid() == uid && pool.owner_gid() == gid && pool.mode() == 0666U);
              return 0;
            }),
            0);
  const auto opened = Segment::open(name, {.access = Access::ReadOnly});
  EXPECT_EQ(opened.owner_uid(), uid);
  EXPECT_EQ(opened.owner_gid(), gid);
  EXPECT_EQ(opened.mode(), 0644U);
  const auto pool = Pool::open(name + "p");
  EXPECT_EQ(pool.owner_uid(), uid);
  EXPECT_EQ(pool.owner_gid(), gid);
  EXPECT_EQ(pool.mode(), 0666U);
  EXPECT_EQ(Segment().mode(), 0U);
  Segment::unlink(name);
  Pool::unlink(name + "p");
}

TEST(SegmentsHost, OtherUidIsRefusedWithOwnerAndMode) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to setuid a child to another uid";
  const auto name = unique_name();
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0600});
  const int rc = run_child([&] {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 90;
    try {
      Segment::open(name, {.access = Access::ReadOnly});
      return 2;  // must not succeed
    } catch (const Error& e) {
      std::string msg = e.what();
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::PermissionDenied);
      GPUIPC_CHILD_CHECK(msg.find("mode 0600") != std::string::npos);
      GPUIPC_CHILD_CHECK(msg.find("owned by uid 0") != std::string::npos);
      GPUIPC_CHILD_CHECK(msg.find("you are uid 65534") != std::string::npos);
    }
    try {
      Segment::unlink(name);
      return 3;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::PermissionDenied);
    }
    return 0;
  });
  EXPECT_EQ(rc, 0);
  Segment::unlink(name);
}

TEST(SegmentsHost, GroupAndOtherBitsAreHonoured) {
  if (::getuid() != 0) GTEST_SKIP() << "needs root to setuid a child to another uid";
  const auto name = unique_name();
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host, .device = 0, .mode = 0644});
  static_cast<char*>(seg.data())[0] = 'x';
  const int rc = run_child([&] {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return 90;
    auto ro = Segment::open(name, {.access = Access::ReadOnly});  // other has r
    GPUIPC_CHILD_CHECK(static_cast<const char*>(ro.data())[0] == 'x');
    try {
      Segment::open(name, {.access = Access::ReadWrite});  // other lacks w
      return 2;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::PermissionDenied);
      GPUIPC_CHILD_CHECK(std::string(e.what()).find("read-only") != std::string::npos);
    }
    return 0;
  });
  EXPECT_EQ(rc, 0);
  Segment::unlink(name);
}

TEST(SegmentsHost, ReadOnlyOpenerCannotWriteAndOnlyItFaults) {
  const auto name = unique_name();
  auto seg = Segment::create(name, 8192);
  static_cast<char*>(seg.data())[0] = 'a';
  const int rc = run_child([&] {
    auto ro = Segment::open(name, {.access = Access::ReadOnly});
    GPUIPC_CHILD_CHECK(ro.access() == Access::ReadOnly);
    GPUIPC_CHILD_CHECK(static_cast<const char*>(ro.data())[0] == 'a');
    std::signal(SIGSEGV, SIG_DFL);  // die of the fault itself, also under sanitizers that catch SIGSEGV
    static_cast<volatile char*>(ro.data())[0] = 'b';  // must fault: PROT_READ
    return 0;
  });
  EXPECT_EQ(rc, 128 + SIGSEGV);
  EXPECT_EQ(static_cast<char*>(seg.data())[0], 'a');
  // The read-only fd cannot be turned into a writable mapping either (the broker reopened it O_RDONLY).
  EXPECT_EQ(run_child([&] {
              auto ro = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(::mprotect(ro.data(), 4096, PROT_READ | PROT_WRITE) != 0);
              return 0;
            }),
            0);
  // The broker keeps serving, and the faulting child's reference is gone.
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::references_of(name) == 1; }, 2s));
  Segment::unlink(name);
}

TEST(SegmentsHost, SigkillOfCreatorKeepsDataAndReturnsReferences) {
  const auto name = unique_name();
  const auto refs0 = BrokerEnvironment::broker_references();
  const int fds0 = BrokerEnvironment::broker_fd_baseline();
  SyncPipe ready;
  const pid_t child = start_child([&] {
    auto s = Segment::create(name, 65536);
    std::memset(s.data(), 0x5a, 65536);
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  ::kill(child, SIGKILL);
  EXPECT_EQ(wait_child(child), 128 + SIGKILL);
  // The name survives its creator (like /dev/shm); its reference went with the connection.
  ASSERT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == refs0; }, 2s));
  auto s = Segment::open(name, {.access = Access::ReadOnly});
  for (int i = 0; i < 65536; ++i) ASSERT_EQ(static_cast<const unsigned char*>(s.data())[i], 0x5a);
  s.close();
  Segment::unlink(name);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds0; }, 2s))
      << BrokerEnvironment::broker_fd_count() << " vs " << fds0;
  EXPECT_EQ(BrokerEnvironment::broker_references(), refs0);
}

TEST(SegmentsHost, SigkillOfOpenerReturnsItsReference) {
  const auto name = unique_name();
  auto seg = Segment::create(name, 4096);
  ASSERT_EQ(BrokerEnvironment::references_of(name), 1U);
  SyncPipe ready;
  const pid_t child = start_child([&] {
    auto a = Segment::open(name);
    auto b = Segment::open(name, {.access = Access::ReadOnly});
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(ready.wait(10s));
  EXPECT_EQ(BrokerEnvironment::references_of(name), 3U);
  ::kill(child, SIGKILL);
  EXPECT_EQ(wait_child(child), 128 + SIGKILL);
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::references_of(name) == 1; }, 2s));
  Segment::unlink(name);
}

TEST(SegmentsHost, SigkillInTheMiddleOfRequestsLeavesNothingBehind) {
  const int fds0 = BrokerEnvironment::broker_fd_baseline();
  const auto refs0 = BrokerEnvironment::broker_references();
  for (int round = 0; round < 5; ++round) {
    const auto name = unique_name("churn" + std::to_string(round));
    SyncPipe started;
    const pid_t child = start_child([&] {
      started.notify();
      for (int i = 0;; ++i) {
        auto s = Segment::create(name, 4096);
        auto o = Segment::open(name, {.access = Access::ReadOnly});
        Segment::unlink(name);
      }
      return 0;
    });
    ASSERT_TRUE(started.wait(10s));
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + 15 * round));
    ::kill(child, SIGKILL);
    EXPECT_EQ(wait_child(child), 128 + SIGKILL);
    // Whatever it was doing, the name may remain (killed between create and unlink), but no reference does.
    EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == refs0; }, 2s));
    try {
      Segment::unlink(name);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::NotFound);
    }
  }
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds0; }, 2s))
      << BrokerEnvironment::broker_fd_count() << " vs " << fds0;
  // Still serving.
  auto s = Segment::create(unique_name("after"), 4096);
  Segment::unlink(unique_name("after"));
}

TEST(SegmentsHost, UnlinkWhileMappedKeepsMappingsAndFreesTheNameAtOnce) {
  const auto name = unique_name();
  auto a = Segment::create(name, 4096);
  std::strcpy(static_cast<char*>(a.data()), "first");
  SyncPipe opened, unlinked, done;
  const pid_t child = start_child([&] {
    auto b = Segment::open(name);
    opened.notify();
    GPUIPC_CHILD_CHECK(unlinked.wait(10s));
    GPUIPC_CHILD_CHECK(std::strcmp(static_cast<const char*>(b.data()), "first") == 0);
    std::strcpy(static_cast<char*>(b.data()), "still shared");
    try {
      Segment::open(name);
      return 2;  // the name is gone: a second open must not find the unlinked segment
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::NotFound);
    }
    done.notify();
    return 0;
  });
  ASSERT_TRUE(opened.wait(10s));
  const auto old_id = a.id();
  Segment::unlink(name);
  unlinked.notify();
  ASSERT_TRUE(done.wait(10s));
  EXPECT_STREQ(static_cast<const char*>(a.data()), "still shared");
  // The name can be taken again at once, by a new segment.
  auto c = Segment::create(name, 4096);
  EXPECT_NE(c.id(), old_id);
  EXPECT_STREQ(static_cast<const char*>(c.data()), "");
  EXPECT_EQ(wait_child(child), 0);
  // The old one is freed when its last mapper goes.
  a.close();
  EXPECT_TRUE(wait_until(
      [&] {
        for (const auto& s : Segment::list()) {
          if (s.id == old_id) return false;
        }
        return true;
      },
      2s));
  Segment::unlink(name);
}

TEST(SegmentsHost, CachedOpenSharesTheMappingAndNoticesUnlinkAndRecreate) {
  const auto name = unique_name();
  auto a = Segment::create(name, 4096);
  auto b = Segment::open(name);
  EXPECT_EQ(a.data(), b.data());  // one mapping per process
  EXPECT_EQ(BrokerEnvironment::references_of(name), 1U);
  const auto old_id = a.id();
  // Another process replaces the segment under the same name.
  EXPECT_EQ(run_child([&] {
              Segment::unlink(name);
              auto n = Segment::create(name, 8192);
              std::strcpy(static_cast<char*>(n.data()), "new");
              // Keep the name: the child's exit drops its reference, the name stays.
              return 0;
            }),
            0);
  auto c = Segment::open(name);
  EXPECT_NE(c.id(), old_id);
  EXPECT_STREQ(static_cast<const char*>(c.data()), "new");
  Segment::unlink(name);
}

TEST(SegmentsHost, ThousandCyclesKeepFdCountsFlat) {
  // Warm up: the connection, the status page.
  Segment::create(unique_name("warm"), 4096);
  Segment::unlink(unique_name("warm"));
  const int mine0 = os::count_open_fds();
  const int broker0 = BrokerEnvironment::broker_fd_baseline();
  const auto name = unique_name();
  for (int i = 0; i < 1000; ++i) {
    auto s = Segment::create(name, 4096);
    static_cast<int*>(s.data())[0] = i;
    {
      auto o = Segment::open(name, {.access = Access::ReadOnly});
      ASSERT_EQ(static_cast<const int*>(o.data())[0], i);
    }
    Segment::unlink(name);
  }
  EXPECT_EQ(os::count_open_fds(), mine0) << describe_open_fds();
  // Not more than before (fewer is fine: the baseline may have caught a reply's fd in flight).
  EXPECT_LE(BrokerEnvironment::broker_fd_count(), broker0);
  EXPECT_EQ(BrokerEnvironment::broker_references(), 0U);
}

// A process at its RLIMIT_NOFILE opens a segment: the broker's answer carries an fd the kernel cannot give it. It took
// that for the broker closing the connection (PeerDied) and dropped it (the broker then repaired its semaphores and
// channels as if it had died), and the reference the Open counted stayed. The open fails saying why; the connection
// and the reference count are as they were.
TEST(SegmentsHost, AnOpenInAProcessOutOfFdsSaysSoAndKeepsItsConnection) {
  const auto name = unique_name();
  auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
  EXPECT_EQ(run_child([&] {
              auto mine = Segment::create(unique_name("mine"), 4096, {.kind = SegmentKind::Host});
              const std::uint64_t connection = core::BrokerClient::instance().generation();
              const rlimit before = use_up_fds();
              GPUIPC_CHILD_CHECK(fails_with([&] { (void)Segment::open(name); }, ErrorCode::QuotaExceeded,
                                            "this process is out of file descriptors"));
              GPUIPC_CHILD_CHECK(::setrlimit(RLIMIT_NOFILE, &before) == 0);
              GPUIPC_CHILD_CHECK(core::BrokerClient::instance().generation() == connection);
              const auto opened = Segment::open(name);
              GPUIPC_CHILD_CHECK(Segment::stat(name).references == 2);  // the failed open's was given back
              return 0;
            }),
            0);
}

TEST(SegmentsHost, QuotaExceededIsAClearError) {
  const auto a = unique_name("a");
  const auto b = unique_name("b");
  // Sparse memfds: no memory is touched.
  auto first = Segment::create(a, BrokerEnvironment::kQuotaBytes / 2 + 4096);
  try {
    Segment::create(b, BrokerEnvironment::kQuotaBytes / 2 + 4096);
    FAIL() << "the second create should exceed the quota";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::QuotaExceeded);
    EXPECT_NE(std::string(e.what()).find("GPUIPC_QUOTA_BYTES"), std::string::npos) << e.what();
  }
  Segment::unlink(a);
  first.close();
  auto again = Segment::create(b, BrokerEnvironment::kQuotaBytes / 2 + 4096);  // room again
  Segment::unlink(b);
}

TEST(SegmentsHost, OpenWaitsForTheCreator) {
  const auto name = unique_name();
  const pid_t child = start_child([&] {
    auto s = Segment::open(name, {.access = Access::ReadOnly, .wait = std::chrono::milliseconds(10000)});
    // The reply comes when the name appears; the creator writes right after that.
    GPUIPC_CHILD_CHECK(wait_until([&] { return std::strcmp(static_cast<const char*>(s.data()), "hello") == 0; }, 5s));
    return 0;
  });
  ASSERT_TRUE(wait_until([&] { return task_state(child) == 'S'; }, 5s));
  std::this_thread::sleep_for(50ms);
  auto s = Segment::create(name, 4096);
  std::strcpy(static_cast<char*>(s.data()), "hello");
  EXPECT_EQ(wait_child(child), 0);
  Segment::unlink(name);
}

TEST(SegmentsHost, OpenWaitTimesOut) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    Segment::open(unique_name("never"), {.access = Access::ReadOnly, .wait = std::chrono::milliseconds(200)});
    FAIL() << "open of a name nobody creates must time out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout);
  }
  const auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(dt, 190ms);
  EXPECT_LT(dt, 5s);
}

TEST(SegmentsHost, BadNamesAndSizesAreRefusedBeforeTheBroker) {
  for (const char* bad : {"", "a/b", "..", "-x", ".hidden", "sp ace"}) {
    try {
      Segment::create(bad, 4096);
      ADD_FAILURE() << "accepted name '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::InvalidArgument) << bad;
    }
  }
  EXPECT_THROW(Segment::create(unique_name(), 0), Error);
  try {
    Segment::open(unique_name("missing"));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_NE(std::string(e.what()).find("gpuipc ls"), std::string::npos);
  }
  const auto name = unique_name();
  auto s = Segment::create(name, 10);
  EXPECT_EQ(s.size(), 4096U);  // rounded to a page
  try {
    Segment::create(name, 10);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::AlreadyExists);
  }
  Segment::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
