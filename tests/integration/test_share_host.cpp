// Adopted memory against a real gpuipcd, without a GPU: a device_ipc share whose exporter is SIGKILLed loses its
// name and its record says PeerDied; the public API refuses what it must with or without a driver.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "base/config.hpp"
#include "cuda/driver.hpp"
#include "gpuipc/share.hpp"
#include "os/memfd.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

/// One request on a raw connection (after Hello); returns the reply and its fds.
proto::Message ask(int sock, const proto::Message& m, std::span<const int> fds, std::vector<os::UniqueFd>& got) {
  const auto bytes = proto::encode(m, fds.size());
  if (os::send_message(sock, bytes, fds) != os::IoStatus::Ok) return {};
  if (!os::wait_readable(sock, 5000)) return {};
  std::vector<std::byte> buf(proto::kMaxMessageSize);
  std::size_t n = 0;
  got.clear();
  if (os::receive_message(sock, buf, n, got) != os::IoStatus::Ok) return {};
  proto::Message out;
  std::string why;
  if (!proto::decode(std::span<const std::byte>(buf.data(), n), got.size(), out, why)) return {};
  return out;
}

os::UniqueFd hello(const char* who) {
  BrokerEnvironment::broker_pid();
  auto sock = os::connect_seqpacket(config::socket_path());
  std::vector<os::UniqueFd> fds;
  ask(sock.get(), proto::Message{1, proto::Hello{static_cast<std::uint32_t>(::getpid()), who}}, {}, fds);
  return sock;
}

/// A fabricated device_ipc record of 1000 bytes in a memfd.
os::UniqueFd record_memfd() {
  auto fd = os::memfd_create("record", proto::kDeviceIpcRecordBytes);
  auto map = os::Mapping::map(fd.get(), proto::kDeviceIpcRecordBytes, true);
  auto* r = static_cast<proto::DeviceIpcRecord*>(map.data());
  r->magic = proto::kDeviceIpcMagic;
  r->version = proto::kDeviceIpcVersion;
  r->size = 1000;
  r->alloc_size = 4096;
  r->device[0] = 1;
  return fd;
}

/// Creates device_ipc segment `name` over `record` on connection `sock`: true when the broker took it.
bool create_share(int sock, const std::string& name, int record) {
  proto::Create c{name, proto::Kind::DeviceIpc, 0644, 1000, proto::Uuid{1}, 0};
  std::vector<os::UniqueFd> got;
  return std::holds_alternative<proto::OpenReply>(
      ask(sock, proto::Message{2, c}, std::span<const int>(&record, 1), got).body);
}

/// An opener's view of `name`'s record, through the broker (the connection stays open in `sock`).
os::Mapping open_record(const std::string& name, os::UniqueFd& sock) {
  sock = hello("opener");
  std::vector<os::UniqueFd> fds;
  const auto opened = ask(sock.get(), proto::Message{3, proto::Open{name, proto::Access::ReadOnly, 0}}, {}, fds);
  if (!std::holds_alternative<proto::OpenReply>(opened.body) || fds.size() != 1) return {};
  return os::Mapping::map(fds[0].get(), proto::kDeviceIpcRecordBytes, false);
}

/// Announces device_ipc segment `name` with its `record` on connection `sock`, as the exporter's library does on a
/// new connection: true when the broker gave it back.
bool announce_share(int sock, const std::string& name, int record) {
  std::vector<os::UniqueFd> got;
  return std::holds_alternative<proto::OpenReply>(
      ask(sock, proto::Message{2, proto::Announce{name, proto::Access::ReadWrite, 1000}},
          std::span<const int>(&record, 1), got)
          .body);
}

std::uint32_t exporter_gone(const os::Mapping& view) {
  return std::atomic_ref<std::uint32_t>(static_cast<proto::DeviceIpcRecord*>(view.data())->exporter_gone).load();
}

/// SIGKILLs `exporter` and checks that the record an opener maps (`view`) then says PeerDied and the name is gone.
void kill_exporter_and_expect_the_share_ended(pid_t exporter, const os::Mapping& view, const std::string& name) {
  ::kill(exporter, SIGKILL);
  EXPECT_EQ(wait_child(exporter), 128 + SIGKILL);
  EXPECT_TRUE(wait_until([&] { return exporter_gone(view) != 0; }, 5s)) << "its death reached no opener";
  EXPECT_EQ(exporter_gone(view), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  try {
    Segment::stat(name);
    ADD_FAILURE() << "the name outlived its exporter";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound) << e.what();
  }
}

TEST(ShareHost, ExporterKilledTakesTheNameAndTheRecordSaysPeerDied) {
  const auto name = unique_name();
  SyncPipe created;
  const pid_t exporter = start_child([&] {
    auto sock = hello("exporter");
    const auto fd = record_memfd();
    GPUIPC_CHILD_CHECK(create_share(sock.get(), name, fd.get()));
    created.notify();
    ::pause();
    return 0;
  });
  ASSERT_TRUE(created.wait(10s));
  const auto info = Segment::stat(name);
  EXPECT_EQ(info.kind, SegmentKind::DeviceIpc);
  EXPECT_EQ(to_string(info.kind), "device_ipc");
  EXPECT_EQ(info.size, 1000U);

  // An opener's view of the record, through the broker.
  os::UniqueFd sock;
  const auto view = open_record(name, sock);
  ASSERT_TRUE(view);
  EXPECT_EQ(exporter_gone(view), 0U);

  kill_exporter_and_expect_the_share_ended(exporter, view, name);
  // Our raw reference keeps the unlinked record until this connection goes.
  EXPECT_GE(BrokerEnvironment::broker_references(), 1U);
}

/// A raw exporter in a child: creates device_ipc segment `name`, says `created`, runs `lose` (which loses its
/// connection one way or another; false fails the child), then connects again, announces the share as its library
/// does, says `announced`, and waits to be killed.
pid_t start_raw_exporter(const std::string& name, SyncPipe& created, SyncPipe& announced,
                         const std::function<bool(int sock)>& lose) {
  return start_child([&] {
    auto sock = hello("exporter");
    const auto fd = record_memfd();
    GPUIPC_CHILD_CHECK(create_share(sock.get(), name, fd.get()));
    created.notify();
    GPUIPC_CHILD_CHECK(lose(sock.get()));
    sock = hello("exporter, again");
    const bool back = announce_share(sock.get(), name, fd.get());
    announced.notify();
    GPUIPC_CHILD_CHECK(back);  // the name is still its share
    ::pause();
    return 0;
  });
}

// A connection can close while its process lives on (the broker cut it, its library dropped it): the exporter's
// memory lives as long as its process, so the share did not end with the connection. The exporter announces it on
// its new connection (its library does, at once) and is its exporter again, past the grace; its death still ends it.
TEST(ShareHost, AnExporterWhoseConnectionClosesWhileItRunsKeepsItsShare) {
  const auto name = unique_name();
  SyncPipe created, opened, reconnected;
  const pid_t exporter = start_raw_exporter(
      name, created, reconnected, [&](int sock) { return opened.wait(10s) && ::shutdown(sock, SHUT_RDWR) == 0; });
  ASSERT_TRUE(created.wait(10s));
  os::UniqueFd sock;
  const auto view = open_record(name, sock);
  ASSERT_TRUE(view);
  opened.notify();
  ASSERT_TRUE(reconnected.wait(10s));
  std::this_thread::sleep_for(BrokerEnvironment::kRejoinGrace + 500ms);
  EXPECT_EQ(exporter_gone(view), 0U) << "the share ended while its exporter ran";
  EXPECT_EQ(Segment::stat(name).kind, SegmentKind::DeviceIpc);

  kill_exporter_and_expect_the_share_ended(exporter, view, name);
}

// A broker killed while an exporter runs: the next broker gives the share back to its exporter (the journal keeps
// it), and ends it when the exporter dies. Before, the name was lost, and the exporter's death reached no opener.
// Openers commonly unlink a share once all of them have opened it, and a name can go while its exporter is away.
// The exporter's Announce looked names up and found none: the share ended when the grace ran out, while it ran.
TEST(ShareHost, AShareUnlinkedWhileItsExporterIsAwayIsItsExportersAgain) {
  const auto name = unique_name();
  SyncPipe created, opened, unlinked, reconnected;
  const pid_t exporter = start_raw_exporter(name, created, reconnected, [&](int sock) {
    return opened.wait(10s) && ::shutdown(sock, SHUT_RDWR) == 0 && unlinked.wait(10s);
  });
  ASSERT_TRUE(created.wait(10s));
  os::UniqueFd sock;
  const auto view = open_record(name, sock);
  ASSERT_TRUE(view);
  opened.notify();
  // The broker has seen the exporter's connection close: only this opener's reference is left.
  ASSERT_TRUE(wait_until([&] { return Segment::stat(name).references == 1; }, 10s));
  Segment::unlink(name);
  unlinked.notify();
  ASSERT_TRUE(reconnected.wait(10s));
  std::this_thread::sleep_for(BrokerEnvironment::kRejoinGrace + 500ms);
  EXPECT_EQ(exporter_gone(view), 0U) << "the share ended while its exporter ran";

  kill_exporter_and_expect_the_share_ended(exporter, view, name);
}

/// A raw exporter's share (unlinked first when `unlink`) through a broker kill: the next broker gives it back to the
/// exporter, and the exporter's death still reaches an opener of the dead broker's time.
void share_outlives_a_broker_kill(bool unlink) {
  const auto name = unique_name();
  SyncPipe created, killed, announced;
  const pid_t exporter = start_raw_exporter(name, created, announced, [&](int) {
    if (!killed.wait(20s)) return false;
    (void)Segment::list();  // the library connects to the next broker (starting it if no watcher did yet)
    return true;
  });
  ASSERT_TRUE(created.wait(10s));
  os::UniqueFd sock;
  const auto view = open_record(name, sock);
  ASSERT_TRUE(view);
  if (unlink) Segment::unlink(name);
  ASSERT_TRUE(BrokerEnvironment::kill_broker());
  killed.notify();
  ASSERT_TRUE(announced.wait(20s));
  if (!unlink) {
    try {
      EXPECT_EQ(Segment::stat(name).kind, SegmentKind::DeviceIpc);
    } catch (const Error& e) {
      ADD_FAILURE() << "the name did not come back: " << e.what();
    }
  }
  EXPECT_EQ(exporter_gone(view), 0U);

  kill_exporter_and_expect_the_share_ended(exporter, view, name);
}

TEST(ShareHost, AShareOutlivesABrokerKillAndEndsWithItsExporter) { share_outlives_a_broker_kill(false); }

// Unlinked, the share was not journaled: its exporter's Announce was refused, and its death reached no opener.
TEST(ShareHost, AnUnlinkedShareOutlivesABrokerKillAndEndsWithItsExporter) { share_outlives_a_broker_kill(true); }

TEST(ShareHost, CreateRefusesDeviceIpcAndShareRefusesHostMemory) {
  EXPECT_EQ(run_child([] {
              try {
                Segment::create(unique_name(), 4096, {.kind = SegmentKind::DeviceIpc});
                return 2;
              } catch (const Error& e) {
                GPUIPC_CHILD_CHECK(e.code() == ErrorCode::InvalidArgument);
                GPUIPC_CHILD_CHECK(std::strstr(e.what(), "gpuipc::share") != nullptr);
              }
              std::vector<char> host(4096);
              try {
                share(unique_name(), host.data(), host.size());
                return 3;
              } catch (const Error& e) {
                // Without a driver nothing can be asked about the pointer; with one, it is host memory.
                const bool ok = cuda::driver_available() ? e.code() == ErrorCode::InvalidArgument &&
                                                               std::strstr(e.what(), "is host memory") != nullptr
                                                         : e.code() == ErrorCode::NoDriver || e.code() == ErrorCode::NoDevice;
                if (!ok) std::fprintf(stderr, "%s\n", e.what());
                GPUIPC_CHILD_CHECK(ok);
              }
              try {
                share("bad/name", host.data(), host.size());
                return 4;
              } catch (const Error& e) {
                GPUIPC_CHILD_CHECK(e.code() == ErrorCode::InvalidArgument);
              }
              return 0;
            }),
            0);
}

}  // namespace
}  // namespace gpuipc::test
