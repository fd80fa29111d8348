// gpuipcd SIGKILLed and started again (issue "Nothing lost, nothing hangs": broker death and restart): clients
// keep working through shared memory; the next library call starts a new broker and gives it back the names and
// memberships it still holds, with the owner and mode from the broker's journal; names nobody maps go after the
// grace time.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include "gpuipc/channel.hpp"
#include "gpuipc/segment.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

/// SIGKILLs the broker and waits until it is gone. The next library call starts another.
void kill_broker() {
  const pid_t pid = BrokerEnvironment::broker_pid();
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  ASSERT_TRUE(wait_until([&] { return ::kill(pid, 0) != 0 || task_state(pid) == 'Z'; }, 5s));
}

TEST(BrokerRestart, ANameSomeoneStillMapsComesBackWithItsOwnerAndMode) {
  const auto name = unique_name();
  auto seg = Segment::create(name, 1 << 20, {.kind = SegmentKind::Host, .device = 0, .mode = 0640});
  std::memset(seg.data(), 0x5A, 1 << 20);
  const pid_t before = BrokerEnvironment::broker_pid();
  kill_broker();
  // Shared memory needs no broker: still there.
  EXPECT_EQ(static_cast<unsigned char*>(seg.data())[12345], 0x5A);
  const SegmentInfo info = Segment::stat(name);  // reconnects: a new broker, to which the name is given back
  EXPECT_NE(BrokerEnvironment::broker_pid(), before);
  EXPECT_EQ(info.owner_uid, ::getuid());
  EXPECT_EQ(info.mode, 0640U);
  EXPECT_EQ(info.kind, SegmentKind::Host);
  EXPECT_EQ(info.references, 1U);
  EXPECT_EQ(seg.id(), info.id);
  // Another process opens it by name and reads the same memory.
  EXPECT_EQ(run_child([&] {
              auto other = Segment::open(name, {.access = Access::ReadOnly});
              GPUIPC_CHILD_CHECK(static_cast<const unsigned char*>(other.data())[777] == 0x5A);
              return 0;
            }),
            0);
  Segment::unlink(name);
}

TEST(BrokerRestart, ANameNobodyMapsWaitsItsGraceTimeThenGoes) {
  ::setenv("GPUIPC_RESTORE_GRACE_MS", "1500", 1);  // for the broker the library starts next
  const auto name = unique_name();
  {
    auto seg = Segment::create(name, 4096);
  }  // nobody maps it now: only the broker's reference keeps it
  kill_broker();
  try {
    Segment::open(name);
    ADD_FAILURE() << "opened a name whose memory died with the broker";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_NE(std::string(e.what()).find("previous broker died"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Segment::create(name, 4096), Error);  // held for its holders during the grace time
  EXPECT_TRUE(wait_until(
      [&] {
        try {
          auto again = Segment::create(name, 4096);
          return true;
        } catch (const Error&) {
          return false;
        }
      },
      10s, 100ms));
  Segment::unlink(name);
  ::unsetenv("GPUIPC_RESTORE_GRACE_MS");
}

TEST(BrokerRestart, AChannelKeepsWorkingAndAMemberKilledAfterTheRestartIsRepaired) {
  const auto name = unique_name("chan");
  ChannelOptions o;
  o.kind = SegmentKind::Host;
  o.slots = 2;
  o.slot_bytes = 64;
  auto producer = Channel::create(name, o, ChannelRole::Producer);
  SyncPipe joined, restarted;
  const pid_t consumer = start_child([&] {
    auto ch = Channel::open(name, ChannelRole::Consumer);
    joined.notify();
    const auto until = std::chrono::steady_clock::now() + 60s;  // the test kills it long before
    for (bool rebound = false; std::chrono::steady_clock::now() < until;) {
      MessageView m;
      if (ch.receive(nullptr, std::chrono::milliseconds(20), m) == Status::Ok) (void)ch.release(nullptr);
      if (!rebound && restarted.wait(0ms)) {
        (void)Segment::stat(name);  // its next broker call: reconnects, gives its names back and rejoins
        rebound = true;
        joined.notify();
      }
    }
    return 0;
  });
  ASSERT_TRUE(joined.wait(10s));
  kill_broker();
  // Without a broker, messages still flow.
  for (int i = 0; i < 20; ++i) {
    std::uint64_t seq = 0;
    ASSERT_EQ(producer.send(nullptr, &i, sizeof i, {}, std::chrono::seconds(5), seq), Status::Ok) << i;
  }
  (void)Segment::stat(name);  // the producer gives the name back first
  restarted.notify();
  ASSERT_TRUE(joined.wait(10s));
  // The consumer rejoined the new broker: its death is repaired, and the producer is told.
  ::kill(consumer, SIGKILL);
  EXPECT_EQ(wait_child(consumer), 128 + SIGKILL);
  Status st = Status::Ok;
  EXPECT_TRUE(wait_until(
      [&] {
        int v = 0;
        std::uint64_t seq = 0;
        st = producer.send(nullptr, &v, sizeof v, {}, std::chrono::milliseconds(50), seq);
        return st == Status::PeerDied;
      },
      10s))
      << "last status " << static_cast<int>(st);
  producer = Channel();
  Channel::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
