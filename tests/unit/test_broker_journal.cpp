// The broker's journal (src/broker/journal.hpp): the names, member entries and owed stream writes a broker started
// after another one died replays, and the compaction that keeps it from growing without bound.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "broker/journal.hpp"
#include "gpuipc/error.hpp"
#include "proto/shm.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using broker::Journal;
using broker::JournalEntry;
using broker::JournalMember;
using broker::JournalOwed;
using broker::JournalState;

JournalEntry entry(const std::string& name) {
  JournalEntry e;
  e.name = name;
  e.kind = proto::Kind::Host;
  e.mode = 0600;
  e.size = 4096;
  e.flags = proto::kFlagChannel;
  e.file_dev = 7;
  e.file_ino = 42;
  return e;
}

TEST(BrokerJournal, AJournalOthersCouldHaveWrittenIsNotReplayed) {
  // Its lines say who owns a name and which memory it is: a file another user planted (or could write) in a runtime
  // directory they may write (sticky, such as /tmp) was replayed, and its forged owners given out.
  TempDir dir;
  const std::string path = dir.file("names.journal");
  {
    JournalState state;
    Journal j = Journal::open(path, state);
    j.linked(entry("kept"));
  }
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  JournalState state;
  try {
    (void)Journal::open(path, state);
    ADD_FAILURE() << "a journal writable by others was replayed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::PermissionDenied);
    EXPECT_NE(std::string(e.what()).find("mode 0666, writable by group or others"), std::string::npos) << e.what();
  }
  ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
  const Journal again = Journal::open(path, state);
  EXPECT_EQ(state.linked.size(), 1U);
}

TEST(BrokerJournal, ALineTheDiskCutShortDoesNotSwallowTheNext) {
  // A short write (a full disk) left part of a line, and the next line was glued onto it: replay skips a torn line
  // only when it is the last, so the glued one was lost, and an unlink lost so brought its name back.
  TempDir dir;
  const std::string path = dir.file("names.journal");
  EXPECT_EQ(run_child([&] {
              JournalState state;
              Journal j = Journal::open(path, state);
              j.linked(entry("gone"));
              // RLIMIT_FSIZE cuts the next write a few bytes past the end, as a full disk does (and SIGXFSZ, ignored,
              // makes writes past it fail with EFBIG).
              ::signal(SIGXFSZ, SIG_IGN);
              struct stat st {};
              GPUIPC_CHILD_CHECK(::stat(path.c_str(), &st) == 0);
              rlimit lim{static_cast<rlim_t>(st.st_size) + 5, RLIM_INFINITY};
              GPUIPC_CHILD_CHECK(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
              j.linked(entry("torn"));
              lim.rlim_cur = RLIM_INFINITY;
              GPUIPC_CHILD_CHECK(::setrlimit(RLIMIT_FSIZE, &lim) == 0);
              j.unlinked("gone");
              j.linked(entry("after"));
              return 0;
            }),
            0);
  JournalState state;
  const Journal again = Journal::open(path, state);
  std::vector<std::string> names;
  for (const JournalEntry& e : state.linked) names.push_back(e.name);
  EXPECT_EQ(names, std::vector<std::string>{"after"});
}

TEST(BrokerJournal, MemberEntriesOfNamesStillLinkedAreReplayed) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  JournalState st;
  {
    Journal j = Journal::open(path, st);
    EXPECT_TRUE(st.linked.empty());
    EXPECT_TRUE(st.members.empty());
    j.linked(entry("chan-a"));
    j.linked(entry("chan-b"));
    j.joined(JournalMember{"chan-a", 0, 5, 3, 1234, 99});
    j.joined(JournalMember{"chan-a", 1, 6, 4, 1235, 100});
    j.joined(JournalMember{"chan-b", 0, 7, 3, 1236, 101});
    j.left("chan-a", 1, 6);
    j.left("chan-a", 0, 9);  // another token: not the entry that is there
    j.unlinked("chan-b");    // its members go with it
  }
  Journal again = Journal::open(path, st);
  const auto& linked = st.linked;
  const auto& members = st.members;
  ASSERT_EQ(linked.size(), 1U);
  EXPECT_EQ(linked[0].name, "chan-a");
  EXPECT_EQ(linked[0].file_ino, 42U);
  ASSERT_EQ(members.size(), 1U);
  EXPECT_EQ(members[0].name, "chan-a");
  EXPECT_EQ(members[0].member, 0U);
  EXPECT_EQ(members[0].token, 5U);
  EXPECT_EQ(members[0].role, 3U);
  EXPECT_EQ(members[0].pid, 1234);
  EXPECT_EQ(members[0].start, 99U);
  // Compacted on open: exactly what is left, one line each.
  EXPECT_EQ(read_file(path).value_or(""),
            broker::journal_line(linked[0]) + "\n" + broker::journal_member_line(members[0]) + "\n");
}

// A pool member that left owing stream frees is recorded again with an eighth field: the later line wins, and a
// line without the field (a broker before it) reads as joined.
TEST(BrokerJournal, AMemberThatLeftOwingFreesIsReplayedAsLeft) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  JournalState st;
  {
    Journal j = Journal::open(path, st);
    j.linked(entry("pool-a"));
    j.joined(JournalMember{"pool-a", 0, 5, 2, 1234, 99});
    j.joined(JournalMember{"pool-a", 0, 5, 2, 1234, 99, true});
    j.joined(JournalMember{"pool-a", 1, 6, 2, 1235, 100});
  }
  EXPECT_EQ(broker::journal_member_line(JournalMember{"pool-a", 0, 5, 2, 1234, 99, true}), "M pool-a 0 5 2 1234 99 1");
  EXPECT_EQ(broker::journal_member_line(JournalMember{"pool-a", 1, 6, 2, 1235, 100}), "M pool-a 1 6 2 1235 100");
  for (int pass = 0; pass < 2; ++pass) {  // as appended, then as compacted by the first open
    Journal again = Journal::open(path, st);
    ASSERT_EQ(st.members.size(), 2U);
    EXPECT_TRUE(st.members[0].left);
    EXPECT_FALSE(st.members[1].left);
  }
}

TEST(BrokerJournal, MalformedMemberLinesAreSkipped) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  write_file(path, broker::journal_line(entry("chan-a")) +
                       "\n"
                       "M chan-a 64 1 3 10 10\n"  // no such entry (kMaxMembers)
                       "M chan-a 0 0 3 10 10\n"   // token 0 marks a free entry
                       "M chan-a 0 1 3 -5 10\n"   // a negative pid
                       "M chan-a 2 3\n"           // torn
                       "M ../x 0 1 3 10 10\n"     // not a name
                       "M chan-a 1 2 3 10 10\n");
  JournalState st;
  Journal j = Journal::open(path, st);
  ASSERT_EQ(st.members.size(), 1U);
  EXPECT_EQ(st.members[0].member, 1U);
  EXPECT_EQ(st.members[0].token, 2U);
}

// A line whose attributes no Create could have given (the journal is the broker's own file, but a full disk, a crash
// of the machine or a bad block can leave anything in it) is skipped: the segment it would restore could not be
// described to a client (its OpenReply does not encode: fuzz_broker found a host segment given a view).
TEST(BrokerJournal, ALineOfAttributesNoCreateCouldGiveIsSkipped) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  int lines = 0;
  const auto line = [&](const std::function<void(JournalEntry&)>& change) {
    JournalEntry e = entry("seg-" + std::to_string(lines++));
    e.flags = 0;
    change(e);
    return broker::journal_line(e) + "\n";
  };
  write_file(path, line([](JournalEntry& e) { e.view_size = 4096; }) +  // a host segment with a view
                       line([](JournalEntry& e) { e.size = 0; }) +
                       line([](JournalEntry& e) { e.size = proto::kMaxSegmentSize + 1; }) +
                       line([](JournalEntry& e) { e.mode = 01777; }) + line([](JournalEntry& e) { e.flags = 0x40; }) +
                       line([](JournalEntry& e) { e.device[0] = 1; }) +  // a GPU's uuid on host memory
                       line([](JournalEntry& e) {
                         e.kind = proto::Kind::Device;
                         e.view_offset = 1;  // an offset without a view
                       }));
  JournalState st;
  Journal j = Journal::open(path, st);
  EXPECT_TRUE(st.linked.empty()) << st.linked.size() << " of " << lines << " restored, the first "
                                 << (st.linked.empty() ? "" : st.linked.front().name);
  write_file(path, line([](JournalEntry&) {}));
  Journal again = Journal::open(path, st);
  EXPECT_EQ(st.linked.size(), 1U);
}

// The stream writes a killed broker was still to make for dead channel members: the next broker makes them. A write
// or process journaled twice (each death journals all that is still owed) counts once; an unlinked name's go.
TEST(BrokerJournal, OwedStreamWritesOfNamesStillLinkedAreReplayed) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  JournalState st;
  {
    Journal j = Journal::open(path, st);
    j.linked(entry("chan-a"));
    j.linked(entry("chan-b"));
    j.owed(JournalOwed{"chan-a", {{2, 1}}, {{4321, 77}}});
    j.owed(JournalOwed{"chan-a", {{2, 1}, {5 | proto::kOwedFreed, 0}}, {{4321, 77}, {4322, 78}}});
    j.owed(JournalOwed{"chan-b", {{9, 0}}, {}});
    j.unlinked("chan-b");
  }
  Journal again = Journal::open(path, st);
  ASSERT_EQ(st.owed.size(), 1U);
  const JournalOwed& o = st.owed[0];
  EXPECT_EQ(o.name, "chan-a");
  ASSERT_EQ(o.writes.size(), 2U);
  EXPECT_EQ(o.writes[0].code, 2U);
  EXPECT_EQ(o.writes[0].after, 1U);
  EXPECT_EQ(o.writes[1].code, 5 | proto::kOwedFreed);
  using Process = std::pair<std::int64_t, std::uint64_t>;
  EXPECT_EQ(o.processes, (std::vector<Process>{{4321, 77}, {4322, 78}}));
  // Compacted on open to one "O" line and an "X" line per process; replayed again, the same.
  const std::string text = read_file(path).value_or("");
  EXPECT_EQ(text, broker::journal_line(st.linked[0]) + "\n" + broker::journal_owed_lines(o));
  Journal third = Journal::open(path, st);
  ASSERT_EQ(st.owed.size(), 1U);
  EXPECT_EQ(st.owed[0].writes.size(), 2U);
  EXPECT_EQ(read_file(path).value_or(""), text);
}

// A control block unlinked while held is journaled under its memory's identity (unlinked_key): its lines replay as a
// name's do, and the removal of its name does not take them. A key is one file's only, and only a host control block
// has one: a line with any other is skipped.
TEST(BrokerJournal, AnUnlinkedControlBlockReplaysUnderItsMemorysKey) {
  const std::string key = broker::unlinked_key(7, 42);
  EXPECT_EQ(key, "#7:42");
  EXPECT_TRUE(broker::is_unlinked_key(key));
  for (const char* bad : {"#07:42", "#7:042", "#7:", "#:42", "#7:42x", "7:42", "#-7:42", "#+7:42", "#7;42", "#7:4:2",
                          "#99999999999999999999:1"}) {
    EXPECT_FALSE(broker::is_unlinked_key(bad)) << bad;
  }
  TempDir dir;
  const std::string path = dir.file("names.journal");
  JournalState st;
  {
    Journal j = Journal::open(path, st);
    j.linked(entry("chan-a"));  // file 7:42
    j.joined(JournalMember{"chan-a", 0, 5, 3, 1234, 99});
    JournalEntry unlinked = entry(key);
    j.record(broker::journal_line(unlinked) + "\n" +
             broker::journal_member_line(JournalMember{key, 0, 5, 3, 1234, 99}) + "\n" +
             broker::journal_owed_lines(JournalOwed{key, {{2, 1}}, {{1234, 99}}}));
    j.unlinked("chan-a");
    JournalEntry device = entry(broker::unlinked_key(7, 43));
    device.file_ino = 43;
    device.kind = proto::Kind::Device;
    j.linked(device);
    j.linked(entry(broker::unlinked_key(8, 42)));  // its line records file 7:42
    JournalEntry plain = entry(broker::unlinked_key(7, 44));
    plain.file_ino = 44;
    plain.flags = 0;
    j.linked(plain);
  }
  Journal again = Journal::open(path, st);
  ASSERT_EQ(st.linked.size(), 1U);
  EXPECT_EQ(st.linked[0].name, key);
  EXPECT_EQ(st.linked[0].flags, proto::kFlagChannel);
  ASSERT_EQ(st.members.size(), 1U);
  EXPECT_EQ(st.members[0].name, key);
  EXPECT_EQ(st.members[0].token, 5U);
  ASSERT_EQ(st.owed.size(), 1U);
  EXPECT_EQ(st.owed[0].name, key);
  ASSERT_EQ(st.owed[0].writes.size(), 1U);
  EXPECT_EQ(st.owed[0].writes[0].code, 2U);
}

// A device_ipc share (cudaMalloc memory adopted with gpuipc::share) is journaled with its record's memfd and its
// exporter's process, whose exit ends it; a line without the process is not replayed.
TEST(BrokerJournal, ADeviceIpcShareReplaysWithItsExportersProcess) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  JournalState st;
  {
    Journal j = Journal::open(path, st);
    JournalEntry share = entry("share");
    share.kind = proto::Kind::DeviceIpc;
    share.flags = 0;
    share.exporter_pid = 1234;
    share.exporter_start = 99;
    j.linked(share);
    JournalEntry bare = share;
    bare.name = "bare";
    std::string line = broker::journal_line(bare);
    line.resize(line.rfind(" 1234 99"));
    j.record(line + "\n");
    JournalEntry channel = share;
    channel.name = "flagged";
    channel.flags = proto::kFlagChannel;
    j.linked(channel);
  }
  Journal again = Journal::open(path, st);
  ASSERT_EQ(st.linked.size(), 1U);
  EXPECT_EQ(st.linked[0].name, "share");
  EXPECT_EQ(st.linked[0].kind, proto::Kind::DeviceIpc);
  EXPECT_EQ(st.linked[0].file_ino, 42U);
  EXPECT_EQ(st.linked[0].exporter_pid, 1234);
  EXPECT_EQ(st.linked[0].exporter_start, 99U);
}

TEST(BrokerJournal, MalformedOwedLinesAndATornLastLineAreSkipped) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  write_file(path, broker::journal_line(entry("chan-a")) +
                       "\n"
                       "O chan-a\n"        // no writes
                       "O chan-a 3\n"      // a code without its `after`
                       "O chan-a 3 1 x\n"  // not a number
                       "O ../x 3 1\n"      // not a name
                       "X chan-a 0 5\n"    // no process
                       "X chan-a -3 5\n"   // a negative pid
                       "O chan-a 4 2\n"
                       "X chan-a 10 11\n"
                       "O chan-a 6 3");  // torn: no newline (it could have lost digits)
  JournalState st;
  Journal j = Journal::open(path, st);
  ASSERT_EQ(st.owed.size(), 1U);
  ASSERT_EQ(st.owed[0].writes.size(), 1U);
  EXPECT_EQ(st.owed[0].writes[0].code, 4U);
  EXPECT_EQ(st.owed[0].writes[0].after, 2U);
  ASSERT_EQ(st.owed[0].processes.size(), 1U);
  EXPECT_EQ(st.owed[0].processes[0].first, 10);
}

TEST(BrokerJournal, AskedToCompactOnceItHasGrownWellPastWhatItHolds) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  JournalState st;
  Journal j = Journal::open(path, st);
  j.linked(entry("kept"));
  int churn = 0;
  while (!j.wants_compaction()) {
    ASSERT_LT(++churn, 100000) << "never asked to compact";
    const std::string name = "churn-" + std::to_string(churn);
    j.linked(entry(name));
    j.unlinked(name);
  }
  EXPECT_GT(read_file(path).value_or("").size(), 1U << 20);
  const std::string live = broker::journal_line(entry("kept")) + "\n";
  j.rewrite(live);
  EXPECT_FALSE(j.wants_compaction());
  EXPECT_EQ(read_file(path).value_or(""), live);
  j.unlinked("kept");  // appends go to the new file
  EXPECT_EQ(read_file(path).value_or(""), live + "U kept\n");
  Journal reopened = Journal::open(path, st);
  EXPECT_TRUE(st.linked.empty());
}

}  // namespace
}  // namespace gpuipc::test
