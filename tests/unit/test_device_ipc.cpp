// Adopted legacy memory (Kind::DeviceIpc) without a GPU: the record's checks, and the broker's registry with a host
// memfd holding a fabricated record — validated at Create, handed read-only to openers, and on the exporter's
// leave (last Close, or its process's exit after its connection closed) the name goes and exporter_gone is written.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <memory>
#include <vector>

#include "broker/registry.hpp"
#include "os/fd.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"
#include "proto/shm.hpp"
#include "support/support.hpp"

namespace gpuipc::broker {
namespace {

constexpr std::uint64_t kSize = 3000;

proto::Uuid gpu_uuid() {
  proto::Uuid u{};
  for (std::size_t i = 0; i < u.size(); ++i) u[i] = static_cast<std::uint8_t>(0x10 + i);
  return u;
}

proto::DeviceIpcRecord good_record() {
  proto::DeviceIpcRecord r{};
  r.magic = proto::kDeviceIpcMagic;
  r.version = proto::kDeviceIpcVersion;
  r.exporter_pid = 77;
  r.offset = 512;
  r.size = kSize;
  r.alloc_size = 4096;
  const auto u = gpu_uuid();
  std::memcpy(r.device, u.data(), u.size());
  for (std::size_t i = 0; i < sizeof r.handle; ++i) r.handle[i] = static_cast<std::uint8_t>(i);
  return r;
}

TEST(DeviceIpcRecord, AGoodRecordPasses) {
  EXPECT_EQ(proto::check_device_ipc_record(good_record(), kSize, gpu_uuid()), "");
}

TEST(DeviceIpcRecord, EveryBrokenFieldIsNamed) {
  struct Case {
    const char* what;
    void (*mutate)(proto::DeviceIpcRecord&);
    const char* says;
  };
  const Case cases[] = {
      {"magic", [](proto::DeviceIpcRecord& r) { r.magic = 0; }, "magic"},
      {"version", [](proto::DeviceIpcRecord& r) { r.version = 2; }, "version 2"},
      {"size", [](proto::DeviceIpcRecord& r) { r.size = kSize + 1; }, "shares 3001 bytes but the segment has 3000"},
      {"past the end", [](proto::DeviceIpcRecord& r) { r.offset = 1097; }, "do not lie inside the allocation of 4096"},
      {"offset overflow", [](proto::DeviceIpcRecord& r) { r.offset = ~0ULL; }, "do not lie inside"},
      {"huge allocation", [](proto::DeviceIpcRecord& r) { r.alloc_size = proto::kMaxSegmentSize + 1; }, "inside"},
      {"device", [](proto::DeviceIpcRecord& r) { r.device[3] ^= 1; }, "another GPU"},
  };
  for (const auto& c : cases) {
    auto r = good_record();
    c.mutate(r);
    const std::string why = proto::check_device_ipc_record(r, kSize, gpu_uuid());
    EXPECT_NE(why.find(c.says), std::string::npos) << c.what << ": " << why;
  }
  auto zero = good_record();
  zero.size = 0;
  EXPECT_NE(proto::check_device_ipc_record(zero, 0, gpu_uuid()), "");
}

/// The pid of a process that has exited (and was reaped): a connection's process the broker finds gone.
pid_t exited_pid() {
  const pid_t child = test::start_child([] { return 0; });
  EXPECT_EQ(test::wait_child(child), 0);
  return child;
}

/// A registry with an exporter (connection 1, process `exporter_pid`) and an opener (connection 2) of the same uid;
/// connections 3 and up are the exporter's process again (its library reconnected).
struct Broker {
  Registry registry{Quotas{}};
  os::Credentials exporter;
  os::Credentials opener{200, 1000, 1000, {}};
  std::vector<Outgoing> out;
  std::uint32_t rid = 1;

  explicit Broker(pid_t exporter_pid = exited_pid()) : exporter{exporter_pid, 1000, 1000, {}} {
    registry.add_connection(1, exporter);
    registry.add_connection(2, opener);
  }

  proto::Message ask(ConnId conn, proto::Body body, std::vector<os::UniqueFd> fds = {}) {
    out.clear();
    registry.handle(Caller{conn, conn == 2 ? opener : exporter}, proto::Message{rid++, std::move(body)}, fds, 0, out);
    EXPECT_EQ(out.size(), 1U);
    return out.empty() ? proto::Message{} : std::move(out.back().msg);
  }

  /// Announces "t" from `conn` with the record's memfd, as a library does on its new connection: the exporter's
  /// own description, or an opener's read-only one.
  proto::Message announce(ConnId conn, proto::Access access) {
    std::vector<os::UniqueFd> fds;
    fds.push_back(access == proto::Access::ReadOnly ? os::reopen_readonly(record_fd.get())
                                                    : os::dup_fd(record_fd.get()));
    return ask(conn, proto::Announce{"t", access, kSize}, std::move(fds));
  }

  /// The broker started after this one died: a registry over the same journal, with the same record.
  std::unique_ptr<Broker> restarted(const std::string& journal) {
    auto next = std::make_unique<Broker>(exporter.pid);
    next->registry.open_journal(journal, os::monotonic_ns(), 10'000'000'000);
    next->record_fd = os::dup_fd(record_fd.get());
    next->record_map = os::Mapping::map(record_fd.get(), proto::kDeviceIpcRecordBytes, true);
    return next;
  }

  /// Creates "t" from connection 1 with `record` in a memfd of `bytes` (its inode of mode `mode`, when not 0);
  /// returns the reply and keeps the memfd.
  proto::Message create(const proto::DeviceIpcRecord& record, std::size_t bytes = proto::kDeviceIpcRecordBytes,
                        unsigned mode = 0) {
    auto fd = os::memfd_create("test-record", bytes);
    if (mode != 0) {
      EXPECT_EQ(::fchmod(fd.get(), mode), 0);
    }
    auto map = os::Mapping::map(fd.get(), bytes, true);
    std::memcpy(map.data(), &record, std::min(bytes, sizeof record));
    record_map = std::move(map);
    record_fd = os::UniqueFd(::dup(fd.get()));
    proto::Create req{"t", proto::Kind::DeviceIpc, 0640, kSize, gpu_uuid(), 0};
    std::vector<os::UniqueFd> fds;
    fds.push_back(std::move(fd));
    return ask(1, req, std::move(fds));
  }

  std::uint32_t exporter_gone() {
    auto* r = static_cast<proto::DeviceIpcRecord*>(record_map.data());
    return std::atomic_ref<std::uint32_t>(r->exporter_gone).load();
  }

  bool named() { return std::holds_alternative<proto::StatReply>(ask(2, proto::Stat{"t"}).body); }

  os::Mapping record_map;  // the exporter's view of the record
  os::UniqueFd record_fd;  // the exporter's record memfd
};

std::string error_of(const proto::Message& m) {
  const auto* e = std::get_if<proto::ErrorReply>(&m.body);
  return e == nullptr ? "" : e->message;
}

TEST(RegistryDeviceIpc, CreateChecksTheRecordAndOpenersGetItReadOnly) {
  Broker b;
  const auto created = b.create(good_record());
  const auto* r = std::get_if<proto::OpenReply>(&created.body);
  ASSERT_NE(r, nullptr) << error_of(created);
  EXPECT_EQ(r->info.kind, proto::Kind::DeviceIpc);
  EXPECT_EQ(r->info.size, kSize);
  EXPECT_EQ(r->info.device, gpu_uuid());

  // Even a read-write opener gets a read-only file description: the record is the exporter's to write.
  b.out.clear();
  std::vector<os::UniqueFd> none;
  b.registry.handle(Caller{2, b.opener}, proto::Message{9, proto::Open{"t", proto::Access::ReadWrite, 0}}, none, 0,
                    b.out);
  ASSERT_EQ(b.out.size(), 1U);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.out[0].msg.body)) << error_of(b.out[0].msg);
  ASSERT_TRUE(b.out[0].fd);
  EXPECT_THROW(os::Mapping::map(b.out[0].fd.get(), proto::kDeviceIpcRecordBytes, true), Error);
  auto ro = os::Mapping::map(b.out[0].fd.get(), proto::kDeviceIpcRecordBytes, false);
  EXPECT_EQ(static_cast<const proto::DeviceIpcRecord*>(ro.data())->offset, 512U);
}

// Openers get the record read-only, but a description is not the inode: one of another uid could reopen a 0666
// memfd writable through /proc/self/fd and rewrite the handle every other opener opens, or clear exporter_gone
// under them. The broker keeps it to its owner, as it does host segments' memfds.
TEST(RegistryDeviceIpc, TheRecordIsKeptToItsOwnerSoNoOpenerCanReopenItWritable) {
  Broker b;
  ASSERT_TRUE(
      std::holds_alternative<proto::OpenReply>(b.create(good_record(), proto::kDeviceIpcRecordBytes, 0666).body));
  struct stat st {};
  ASSERT_EQ(::fstat(b.record_fd.get(), &st), 0);
  EXPECT_EQ(st.st_mode & 077, 0U) << "mode " << std::oct << (st.st_mode & 07777);
}

TEST(RegistryDeviceIpc, BadRecordsAreRefusedWithTheReason) {
  {
    Broker b;
    auto r = good_record();
    r.magic = 1;
    EXPECT_NE(error_of(b.create(r)).find("device_ipc): magic"), std::string::npos);
  }
  {
    Broker b;
    EXPECT_NE(error_of(b.create(good_record(), 8192)).find("record memfd is 8192 bytes, not 4096"), std::string::npos);
  }
  {
    Broker b;
    auto r = good_record();
    r.exporter_gone = 1;
    EXPECT_NE(error_of(b.create(r)).find("already gone"), std::string::npos);
  }
  {
    Broker b;
    auto r = good_record();
    r.size = kSize - 1;
    EXPECT_NE(error_of(b.create(r)).find("shares 2999 bytes"), std::string::npos);
  }
}

// An exporter whose process has exited by its connection's close (Broker's default) ends the share at once.
TEST(RegistryDeviceIpc, ExporterConnectionDropUnlinksAndSaysPeerDied) {
  Broker b;
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(good_record()).body));
  std::vector<os::UniqueFd> none;
  b.out.clear();
  b.registry.handle(Caller{2, b.opener}, proto::Message{5, proto::Open{"t", proto::Access::ReadOnly, 0}}, none, 0,
                    b.out);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.out.at(0).msg.body));
  EXPECT_EQ(b.exporter_gone(), 0U);

  b.registry.drop_connection(1);
  EXPECT_EQ(b.exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  EXPECT_FALSE(b.named());
  // The opener's reference keeps the (unlinked) record until it closes.
  EXPECT_EQ(b.registry.segment_count(), 1U);
  b.registry.drop_connection(2);
  EXPECT_EQ(b.registry.segment_count(), 0U);
}

/// A live exporter: a child that waits to be killed.
struct LiveExporter {
  LiveExporter()
      : pid(test::start_child([] {
          ::pause();
          return 0;
        })) {}
  ~LiveExporter() { end(); }
  void end() {
    if (pid <= 0) return;
    ::kill(pid, SIGKILL);
    EXPECT_EQ(test::wait_child(pid), 128 + SIGKILL);
    pid = 0;
  }
  pid_t pid;
};

/// Closes the exporter's connection `conn` (the share stays: its process runs), then kills the exporter and runs the
/// broker's timers until the share has ended; false if it ended before the kill or never did.
bool ends_with_its_exporter(Broker& b, ConnId conn, LiveExporter& live) {
  b.registry.drop_connection(conn);
  if (b.exporter_gone() != 0) return false;
  live.end();
  return test::wait_until(
      [&] {
        b.out.clear();
        b.registry.expire(os::monotonic_ns(), b.out);
        return b.exporter_gone() != 0;
      },
      std::chrono::seconds(10));
}

/// A broker with a journal, and share "t" of a live exporter created through it (`b`).
struct JournaledShare {
  JournaledShare() {
    b.registry.open_journal(journal, os::monotonic_ns(), 10'000'000'000);
    EXPECT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(good_record()).body));
  }
  test::TempDir dir;
  const std::string journal = dir.file("names.journal");
  LiveExporter live;
  Broker b{live.pid};
};

// A connection can close while its process lives on (the broker cuts one whose replies go unread, the library drops
// one to a broker that leaves its requests unanswered). The exporter's memory lives as long as its process: the
// share used to end at once (openers told PeerDied, the name removed) while the memory was still there.
TEST(RegistryDeviceIpc, AnExporterWhoseConnectionClosesWhileItRunsKeepsItsShareUntilItExits) {
  LiveExporter live;
  Broker b(live.pid);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(good_record()).body));
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.ask(2, proto::Open{"t", proto::Access::ReadOnly, 0}).body));
  b.registry.drop_connection(1);
  EXPECT_EQ(b.exporter_gone(), 0U) << "the share ended while its exporter ran";
  EXPECT_TRUE(b.named());
  // Its library reconnects and announces the share: the exporter again, past the grace.
  b.registry.add_connection(3, b.exporter);
  const auto back = b.announce(3, proto::Access::ReadWrite);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(back.body)) << error_of(back);
  b.out.clear();
  b.registry.expire(os::monotonic_ns() + 60'000'000'000, b.out);
  EXPECT_EQ(b.exporter_gone(), 0U) << "the share ended though its exporter announced it again";
  EXPECT_TRUE(b.named());
  // Its process's death still ends the share, after a second connection loss too.
  EXPECT_TRUE(ends_with_its_exporter(b, 3, live));
  EXPECT_EQ(b.exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  EXPECT_FALSE(b.named());
  EXPECT_EQ(b.registry.segment_count(), 1U);  // the opener's reference
  b.registry.drop_connection(2);
  EXPECT_EQ(b.registry.segment_count(), 0U);
}

// A process that exec'd keeps its pid and never announces the share: it ends when the grace runs out. Another
// process's Announce of the record gives it a reference, not the share.
TEST(RegistryDeviceIpc, AnExporterThatDoesNotComeBackWithinTheGraceLosesItsShare) {
  LiveExporter live;
  Broker b(live.pid);
  b.registry.set_rejoin_grace(50'000'000);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(good_record()).body));
  b.registry.drop_connection(1);
  const auto other = b.announce(2, proto::Access::ReadOnly);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(other.body)) << error_of(other);
  b.out.clear();
  b.registry.expire(os::monotonic_ns(), b.out);
  EXPECT_EQ(b.exporter_gone(), 0U);
  b.registry.expire(os::monotonic_ns() + 100'000'000, b.out);
  EXPECT_EQ(b.exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  EXPECT_FALSE(b.named());
  // Too late: the exporter's own Announce finds no name.
  b.registry.add_connection(3, b.exporter);
  EXPECT_TRUE(std::holds_alternative<proto::ErrorReply>(b.announce(3, proto::Access::ReadWrite).body));
}

// A broker can die while an exporter runs: the share used to be lost (not journaled). Its name then went with the
// broker, and worse, when its exporter died later no broker told the openers, whose alive() stayed true over freed
// memory. The journal keeps the share with its exporter's process: the exporter's Announce makes it its own again
// (an opener's first: the share waits for the exporter), and the exporter's death still ends it.
TEST(RegistryDeviceIpc, AShareComesBackAfterABrokerRestartAndEndsWithItsExporter) {
  for (const bool exporter_first : {true, false}) {
    SCOPED_TRACE(exporter_first ? "the exporter announces first" : "an opener announces first");
    JournaledShare s;
    const auto next = s.b.restarted(s.journal);  // `b` is never asked again: it died
    auto announced =
        next->announce(exporter_first ? 1 : 2, exporter_first ? proto::Access::ReadWrite : proto::Access::ReadOnly);
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(announced.body)) << error_of(announced);
    announced =
        next->announce(exporter_first ? 2 : 1, exporter_first ? proto::Access::ReadOnly : proto::Access::ReadWrite);
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(announced.body)) << error_of(announced);
    next->out.clear();
    next->registry.expire(os::monotonic_ns() + 60'000'000'000, next->out);  // past every grace
    EXPECT_EQ(next->exporter_gone(), 0U) << "the share ended though its exporter gave it back";
    EXPECT_TRUE(next->named());
    EXPECT_TRUE(ends_with_its_exporter(*next, 1, s.live));  // its death: the connection first, then the exit
    EXPECT_EQ(next->exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
    EXPECT_FALSE(next->named());
  }
}

// The exporter died while no broker ran: the first opener to give the share back learns it at once.
TEST(RegistryDeviceIpc, AnExporterThatDiedWhileNoBrokerRanEndsTheShareWhenAnOpenerGivesItBack) {
  JournaledShare s;
  s.live.end();
  const auto next = s.b.restarted(s.journal);
  const auto announced = next->announce(2, proto::Access::ReadOnly);
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(announced.body)) << error_of(announced);
  EXPECT_EQ(next->exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  EXPECT_FALSE(next->named());
}

// Openers, or the exporter itself, commonly unlink a share once everyone has opened it, and a name can go while the
// exporter is away (its connection closed while it ran). Its Announce, which looked names up, found none: the share
// ended when the grace ran out, its openers told PeerDied while the exporter ran. Unlinked while the exporter was
// away and nobody held it, the record was freed at once. Unlinked before, the share ended at the connection's close.
TEST(RegistryDeviceIpc, AnUnlinkedShareIsItsExportersAgainOnItsAnnounce) {
  for (const bool unlink_first : {true, false}) {
    for (const bool opener_holds : {true, false}) {
      SCOPED_TRACE(fmt::format("unlinked {} the exporter's connection closed; {}", unlink_first ? "before" : "after",
                               opener_holds ? "an opener holds it" : "no opener"));
      LiveExporter live;
      Broker b(live.pid);
      ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(good_record()).body));
      if (opener_holds) {
        ASSERT_TRUE(
            std::holds_alternative<proto::OpenReply>(b.ask(2, proto::Open{"t", proto::Access::ReadOnly, 0}).body));
      }
      if (unlink_first) {
        ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(1, proto::Unlink{"t"}).body));
      }
      b.registry.drop_connection(1);
      EXPECT_EQ(b.exporter_gone(), 0U) << "the share ended while its exporter ran";
      // Another process of the owner's uid (here the opener's connection) unlinks it while the exporter is away.
      if (!unlink_first) {
        ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(2, proto::Unlink{"t"}).body));
      }
      b.registry.add_connection(3, b.exporter);
      const auto back = b.announce(3, proto::Access::ReadWrite);
      ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(back.body)) << error_of(back);
      b.out.clear();
      b.registry.expire(os::monotonic_ns() + 60'000'000'000, b.out);  // past the grace
      EXPECT_EQ(b.exporter_gone(), 0U) << "the share ended though its exporter announced it again";
      EXPECT_FALSE(b.named());
      EXPECT_TRUE(ends_with_its_exporter(b, 3, live));
      EXPECT_EQ(b.exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
      b.registry.drop_connection(2);
      EXPECT_EQ(b.registry.segment_count(), 0U);
    }
  }
}

// The same across a broker restart: the share was not journaled once unlinked, so an opener could not give it back,
// and the exporter's later death reached no opener (alive() stayed true over freed memory). Unlinked after the restart
// before anyone gave it back, the journal forgot it.
TEST(RegistryDeviceIpc, AnUnlinkedShareComesBackAfterABrokerRestartAndEndsWithItsExporter) {
  for (const bool before : {true, false}) {
    SCOPED_TRACE(before ? "unlinked before the broker died" : "unlinked after the restart, before any Announce");
    JournaledShare s;
    ASSERT_TRUE(
        std::holds_alternative<proto::OpenReply>(s.b.ask(2, proto::Open{"t", proto::Access::ReadOnly, 0}).body));
    if (before) {
      ASSERT_TRUE(std::holds_alternative<proto::OkReply>(s.b.ask(1, proto::Unlink{"t"}).body));
    }
    const auto next = s.b.restarted(s.journal);
    if (!before) {
      ASSERT_TRUE(std::holds_alternative<proto::OkReply>(next->ask(2, proto::Unlink{"t"}).body));
    }
    auto announced = next->announce(2, proto::Access::ReadOnly);  // the opener first: the share waits for the exporter
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(announced.body)) << error_of(announced);
    EXPECT_EQ(next->exporter_gone(), 0U) << "the share ended while its exporter ran";
    announced = next->announce(1, proto::Access::ReadWrite);
    ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(announced.body)) << error_of(announced);
    next->out.clear();
    next->registry.expire(os::monotonic_ns() + 60'000'000'000, next->out);
    EXPECT_EQ(next->exporter_gone(), 0U) << "the share ended though its exporter gave it back";
    EXPECT_FALSE(next->named());
    EXPECT_TRUE(ends_with_its_exporter(*next, 1, s.live));
    EXPECT_EQ(next->exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::PeerDied));
  }
}

// The journal names a share's exporter by its pid and start time. A start the broker could not read (0) matched any
// process given that pid: one of another uid, holding the record read-only, took the share as its exporter whatever
// the mode said (and could end it for every opener by closing it).
TEST(RegistryDeviceIpc, AnExporterOfUnknownStartMustBeOfItsOwnersUid) {
  JournaledShare s;
  {  // the start as a broker that could not read it journals it
    std::string text = test::read_file(s.journal).value_or("");
    const auto line = text.find("L t ");
    ASSERT_NE(line, std::string::npos) << text;
    const auto end = text.find('\n', line);
    const auto last = text.rfind(' ', end);
    text.replace(last + 1, end - last - 1, "0");
    test::write_file(s.journal, text);
  }
  const auto next = s.b.restarted(s.journal);
  const os::Credentials other{s.live.pid, 2000, 2000, {}};  // the exporter's pid, another uid
  next->registry.add_connection(4, other);
  next->out.clear();
  std::vector<os::UniqueFd> fds;
  fds.push_back(os::reopen_readonly(next->record_fd.get()));
  next->registry.handle(Caller{4, other}, proto::Message{1, proto::Announce{"t", proto::Access::ReadWrite, kSize}}, fds,
                        0, next->out);
  ASSERT_EQ(next->out.size(), 1U);
  const auto* refused = std::get_if<proto::ErrorReply>(&next->out[0].msg.body);
  ASSERT_NE(refused, nullptr) << "another uid's process took the share as its exporter";
  EXPECT_EQ(refused->code, static_cast<std::uint8_t>(ErrorCode::PermissionDenied)) << refused->message;
  const auto announced = next->announce(1, proto::Access::ReadWrite);  // the exporter itself
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(announced.body)) << error_of(announced);
}

TEST(RegistryDeviceIpc, ABrokerStoppingDoesNotSayTheExporterDied) {
  // A clean stop (SIGTERM, `gpuipc daemon --stop`, a service restart) drops every connection without repair: the
  // exporter lives, and its openers' memory with it. It was told PeerDied (alive() false, check_alive() threw).
  Broker b;
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(b.create(good_record()).body));
  b.registry.mark_stopping();
  b.registry.drop_connection(1, /*repair=*/false);
  EXPECT_EQ(b.exporter_gone(), 0U);
}

TEST(RegistryDeviceIpc, ExportersLastCloseEndsTheShareButAnOpenersCloseDoesNot) {
  Broker b;
  const auto created = b.create(good_record());
  const std::uint64_t id = std::get<proto::OpenReply>(created.body).info.id;
  std::vector<os::UniqueFd> none;
  b.out.clear();
  b.registry.handle(Caller{2, b.opener}, proto::Message{5, proto::Open{"t", proto::Access::ReadOnly, 0}}, none, 0,
                    b.out);
  b.out.clear();
  b.registry.handle(Caller{1, b.exporter}, proto::Message{6, proto::Open{"t", proto::Access::ReadWrite, 0}}, none,
                    0, b.out);  // the exporter holds 2 references now
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(2, proto::Close{id}).body));
  EXPECT_TRUE(b.named());
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(1, proto::Close{id}).body));
  EXPECT_TRUE(b.named());
  EXPECT_EQ(b.exporter_gone(), 0U);
  ASSERT_TRUE(std::holds_alternative<proto::OkReply>(b.ask(1, proto::Close{id}).body));
  EXPECT_EQ(b.exporter_gone(), static_cast<std::uint32_t>(proto::PoisonReason::Closed));
  EXPECT_FALSE(b.named());
  EXPECT_EQ(b.registry.segment_count(), 0U);
}

TEST(RegistryDeviceIpc, OtherKindsAreUntouchedByTheirCreatorsLeaving) {
  Broker b;
  auto fd = os::memfd_create("host", 4096);
  std::vector<os::UniqueFd> fds;
  fds.push_back(std::move(fd));
  ASSERT_TRUE(std::holds_alternative<proto::OpenReply>(
      b.ask(1, proto::Create{"t", proto::Kind::Host, 0600, 4096, proto::Uuid{}, 0}, std::move(fds)).body));
  b.registry.drop_connection(1);
  EXPECT_TRUE(b.named());
}

}  // namespace
}  // namespace gpuipc::broker
