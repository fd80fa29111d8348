// The broker's journal (src/broker/journal.hpp): the names and member entries a broker started after another one
// died replays, and the compaction that keeps it from growing without bound.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "broker/journal.hpp"
#include "proto/shm.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using broker::Journal;
using broker::JournalEntry;
using broker::JournalMember;

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

TEST(BrokerJournal, MemberEntriesOfNamesStillLinkedAreReplayed) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  std::vector<JournalEntry> linked;
  std::vector<JournalMember> members;
  {
    Journal j = Journal::open(path, linked, members);
    EXPECT_TRUE(linked.empty());
    EXPECT_TRUE(members.empty());
    j.linked(entry("chan-a"));
    j.linked(entry("chan-b"));
    j.joined(JournalMember{"chan-a", 0, 5, 3, 1234, 99});
    j.joined(JournalMember{"chan-a", 1, 6, 4, 1235, 100});
    j.joined(JournalMember{"chan-b", 0, 7, 3, 1236, 101});
    j.left("chan-a", 1, 6);
    j.left("chan-a", 0, 9);  // another token: not the entry that is there
    j.unlinked("chan-b");    // its members go with it
  }
  Journal again = Journal::open(path, linked, members);
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
  std::vector<JournalEntry> linked;
  std::vector<JournalMember> members;
  Journal j = Journal::open(path, linked, members);
  ASSERT_EQ(members.size(), 1U);
  EXPECT_EQ(members[0].member, 1U);
  EXPECT_EQ(members[0].token, 2U);
}

TEST(BrokerJournal, AskedToCompactOnceItHasGrownWellPastWhatItHolds) {
  TempDir dir;
  const std::string path = dir.file("names.journal");
  std::vector<JournalEntry> linked;
  std::vector<JournalMember> members;
  Journal j = Journal::open(path, linked, members);
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
  Journal reopened = Journal::open(path, linked, members);
  EXPECT_TRUE(linked.empty());
}

}  // namespace
}  // namespace gpuipc::test
