// Bad numbers on the command lines of gpuipc, gpuipcd and gpuipc demo are refused as usage errors (exit 2) before
// anything runs: CLI11 reads unsigned options with strtoull(s, 0), which took "-1" as 2^64 - 1 (`top -n -1` ran
// for ever, `--quota-bytes -1` meant no quota), "010" as octal 8, and NaN passed every range check. And the exit
// statuses of a broker that cannot be started and of a runtime "directory" that is a file, a process name that is
// not UTF-8 in `top --json`; an unknown command named as such. Runs the built binaries.
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "gpuipc/channel.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

using namespace std::chrono_literals;

TEST(CliArguments, CountsAreDecimalDigitsThatFit) {
  const TempDir dir("gpuipc-args");
  const std::vector<std::string> env{"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_NO_AUTOSTART=1"};
  const std::vector<std::vector<std::string>> bad{
      {"top", "-n", "-1", "--json"},
      {"top", "-n", "0x10", "--json"},
      {"top", "-n", "99999999999999999999", "--json"},
      {"watch", "x", "--count", "-3"},
      {"daemon", "--foreground", "--quota-bytes", "-1"},
      {"daemon", "--foreground", "--quota-segments", "99999999999999999999"},
      {"daemon", "--foreground", "--quota-opens", "0x10"},
      {"daemon", "--foreground", "--quota-opens-total", "-1"},
      {"daemon", "--foreground", "--idle-timeout-ms", "+5"},
  };
  for (const auto& args : bad) {
    const auto o = run_built("gpuipc", args, env);
    EXPECT_EQ(o.exit_code, 2) << args[0] << " " << args[1] << " " << args[2] << ": " << o.out << o.err;
    EXPECT_NE(o.err.find("whole number"), std::string::npos) << o.err;
  }
  // gpuipcd exits with CLI11's codes (100-127). Its opens quotas took -1 (no limit), 0x10 and 010 (8) before.
  for (const auto& [option, value] :
       std::vector<std::pair<std::string, std::string>>{{"--quota-bytes", "-1"},
                                                        {"--quota-bytes", "18446744073709551616"},
                                                        {"--quota-opens", "-1"},
                                                        {"--quota-opens", "0x10"},
                                                        {"--quota-opens-total", "-1"}}) {
    const auto o = run_built("gpuipcd", {"--runtime-dir", dir.file("d"), option, value}, env);
    EXPECT_TRUE(o.exit_code >= 100 && o.exit_code <= 127)
        << option << " " << value << ": " << o.exit_code << o.out << o.err;
    EXPECT_NE(o.err.find("whole number"), std::string::npos) << o.err;
  }
}

TEST(CliArguments, AnUnknownCommandIsNamedWithTheCommandsThere) {
  const auto top = run_built("gpuipc", {"-v", "bogus"});
  EXPECT_EQ(top.exit_code, 2) << top.err;
  EXPECT_NE(top.err.find("unknown command 'bogus' for 'gpuipc'"), std::string::npos) << top.err;
  EXPECT_NE(top.err.find("ls, stat, rm"), std::string::npos) << top.err;
  const auto mps = run_built("gpuipc", {"mps", "strat"});
  EXPECT_EQ(mps.exit_code, 2) << mps.err;
  EXPECT_NE(mps.err.find("unknown command 'strat' for 'gpuipc mps'; the commands are start, stop, status, env"),
            std::string::npos)
      << mps.err;
  // An unknown option where a command was wanted is named too: CLI11 said only that a subcommand is required.
  const auto option = run_built("gpuipc", {"--json"});
  EXPECT_EQ(option.exit_code, 2) << option.err;
  EXPECT_NE(option.err.find("unknown option '--json' for 'gpuipc'"), std::string::npos) << option.err;
  EXPECT_NE(option.err.find("ls, stat, rm"), std::string::npos) << option.err;
  EXPECT_EQ(option.err.find("A subcommand is required"), std::string::npos) << option.err;
  const auto mps_option = run_built("gpuipc", {"mps", "--bogus"});
  EXPECT_EQ(mps_option.exit_code, 2) << mps_option.err;
  EXPECT_NE(mps_option.err.find("unknown option '--bogus' for 'gpuipc mps'"), std::string::npos) << mps_option.err;
  EXPECT_NE(mps_option.err.find("start, stop, status, env"), std::string::npos) << mps_option.err;
  const auto before = run_built("gpuipc", {"--bogus", "ls"});  // (CLI11 named it already)
  EXPECT_EQ(before.exit_code, 2) << before.err;
  EXPECT_NE(before.err.find("--bogus"), std::string::npos) << before.err;
  // The word as typed may hold escape sequences for the terminal, or be very long: shown escaped and cut short.
  const auto raw = run_built("gpuipc", {"\x1b[2Jbogus\n" + std::string(1000, 'x')});
  EXPECT_EQ(raw.exit_code, 2) << raw.err;
  EXPECT_NE(raw.err.find("unknown command '\\x1b[2Jbogus\\x0axxx"), std::string::npos) << raw.err;
  EXPECT_EQ(raw.err.find('\x1b'), std::string::npos) << raw.err;
  EXPECT_EQ(std::count(raw.err.begin(), raw.err.end(), '\n'), 1) << raw.err;
  EXPECT_LT(raw.err.size(), 400U) << raw.err;
  const auto none = run_built("gpuipc", {});  // no word left over: CLI11's own message
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_NE(none.err.find("A subcommand is required"), std::string::npos) << none.err;
}

TEST(CliArguments, RmOfAPoolOrAChannelRemovesItsChunksOrBuffersToo) {
  const auto pool = unique_name("rmpool");
  const auto chan = unique_name("rmchan");
  { auto p = Pool::create(pool, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 16, .max_bytes = 1 << 16}); }
  {
    auto c = Channel::create(chan, {.slots = 2, .slot_bytes = 4096, .kind = SegmentKind::Host}, ChannelRole::Producer);
  }
  const auto o = run_built("gpuipc", {"rm", pool, chan});
  ASSERT_EQ(o.exit_code, 0) << o.err;
  for (const auto& left : {pool, pool + ".chunk.0", chan, chan + ".slots"}) {
    EXPECT_THROW(Segment::stat(left), Error) << left << " was left behind";
  }
  // It stops at the first name it cannot remove, and says which it left.
  const auto keep = unique_name("keep");
  { auto s = Segment::create(keep, 4096, {.kind = SegmentKind::Host}); }
  const auto stopped = run_built("gpuipc", {"rm", pool, keep});
  EXPECT_EQ(stopped.exit_code, 5) << stopped.err;
  EXPECT_NE(stopped.err.find("not removed: '" + keep + "'"), std::string::npos) << stopped.err;
  Segment::unlink(keep);
}

TEST(CliArguments, RmOfAChannelOfAnotherReleaseOrOfAPoolsLeftChunksRemovesThemAll) {
  // A channel whose control block is of another layout version (as another gpuipc release makes it): Channel::stat
  // refuses it, yet it is a channel, and its buffers go with it.
  const auto chan = unique_name("oldchan");
  {
    auto c = Channel::create(chan, {.slots = 2, .slot_bytes = 4096, .kind = SegmentKind::Host}, ChannelRole::Producer);
    auto control = Segment::open(chan);
    const std::uint32_t other_version = 99;
    std::memcpy(static_cast<std::byte*>(control.data()) + sizeof(std::uint32_t), &other_version, sizeof other_version);
    EXPECT_THROW(Channel::stat(chan), Error);
  }
  // A pool whose control block was removed alone (Segment::unlink): its chunks are still a pool's.
  const auto pool = unique_name("halfpool");
  { auto p = Pool::create(pool, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 16, .max_bytes = 1 << 17}); }
  Segment::unlink(pool);
  // A channel's slots without their control block (its creator killed between the two): no name may end in .slots,
  // so `gpuipc rm` of the channel's name is the only way to remove them.
  const auto half = unique_name("halfchan");
  {
    auto c = Channel::create(half, {.slots = 2, .slot_bytes = 4096, .kind = SegmentKind::Host}, ChannelRole::Producer);
  }
  Segment::unlink(half);
  const auto o = run_built("gpuipc", {"rm", chan, pool, half});
  EXPECT_EQ(o.exit_code, 0) << o.err;
  for (const auto& left : {chan, chan + ".slots", pool + ".chunk.0", half + ".slots"}) {
    EXPECT_THROW(Segment::stat(left), Error) << left << " was left behind";
  }
  EXPECT_THROW(Channel::unlink(half), Error);  // nothing left of it: NotFound
}

TEST(CliArguments, LeadingZerosAreDecimal) {
  const auto o = run_built("gpuipc", {"top", "--json", "-n", "010", "--interval", "0.01"});
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(std::count(o.out.begin(), o.out.end(), '\n'), 10) << "octal would have made it 8";
}

TEST(CliArguments, NumbersThatAreNotFiniteAreRefused) {
  for (const auto& args : std::vector<std::vector<std::string>>{{"top", "-i", "nan", "-n", "2", "--json"},
                                                                {"top", "-i", "inf", "--once"},
                                                                {"top", "-i", "1e999", "--once"},
                                                                {"watch", "x", "--timeout", "nan"}}) {
    const auto o = run_built("gpuipc", args);
    EXPECT_EQ(o.exit_code, 2) << args[0] << " " << args[2] << ": " << o.out << o.err;
  }
  const auto both = run_built("gpuipc", {"top", "--once", "-n", "3"});
  EXPECT_EQ(both.exit_code, 2) << "--once and -n do not go together: " << both.out << both.err;
}

// Seconds are a plain number in range, and the message says which: CLI11's ranges called "5s" out of range and printed
// --timeout's open upper bound as 309 digits.
TEST(CliArguments, SecondsThatAreNoPlainNumberOrOutOfRangeSaySo) {
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"top", "-i", "5s", "--once"}, "'5s' is not a number of seconds (write a plain number"},
           {{"top", "-i", "0", "--once"}, "'0' is out of range: 0.01 to 3600 seconds"},
           {{"watch", "x", "--timeout", "-1"}, "'-1' is too small: 0 seconds at least"},
           {{"watch", "x", "--timeout", ""}, "'' is not a number of seconds"}}) {
    const auto o = run_built("gpuipc", args);
    EXPECT_EQ(o.exit_code, 2) << args[0] << " " << args[2] << ": " << o.out << o.err;
    EXPECT_NE(o.err.find(says), std::string::npos) << o.err;
    EXPECT_LT(o.err.size(), 300U) << o.err;
  }
}

TEST(CliArguments, DemoChecksItsCountsBeforeStarting) {
  for (const auto& args : std::vector<std::vector<std::string>>{{"demo", "--host", "--slots", "0"},
                                                                {"demo", "--host", "--slots", "4097"},
                                                                {"demo", "--host", "--frames", "-1"},
                                                                {"demo", "--host", "--frame-mib", "-1"},
                                                                {"demo", "--host", "--frame-mib", "100000"}}) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto o = run_built("gpuipc", args);
    EXPECT_EQ(o.exit_code, 2) << args[2] << " " << args[3] << ": " << o.out << o.err;
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s) << "refused before the workers start";
  }
}

TEST(CliArguments, ADemoWhoseProducerFailsStopsItsConsumerAtOnce) {
  // The consumer was collected first, and it waited 30 s for a channel the producer had failed to make.
  const TempDir dir("gpuipc-demo-quota");
  const auto start = std::chrono::steady_clock::now();
  const auto o = run_built("gpuipc", {"demo", "--host", "--frames", "10"},
                           {"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_QUOTA_BYTES=1048576"});
  EXPECT_EQ(o.exit_code, 1) << o.out << o.err;
  EXPECT_NE(o.err.find("quota exceeded"), std::string::npos) << o.err;
  EXPECT_NE(o.err.find("consumer: stopped when the producer failed"), std::string::npos) << o.err;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s) << "the consumer waited for its channel";
  std::ifstream pid_file(dir.file("broker.pid"));
  pid_t broker = 0;
  if (pid_file >> broker && broker > 0) ::kill(broker, SIGTERM);  // the demo's broker, in this directory
}

TEST(CliArguments, AnInterruptedDemoLeavesNoNameBehind) {
  // Ctrl-C ended the demo with its channel still registered (32 MiB of GPU memory a run, until `gpuipc rm`).
  (void)BrokerEnvironment::broker_pid();
  TempDir dir("gpuipc-demo-int");
  const pid_t demo = start_program(build_bin_dir() + "/gpuipc", {"demo", "--host", "--frames", "100000000"}, {}, -1,
                                   dir.file("demo.log"));
  const std::string name = "gpuipc-demo-" + std::to_string(demo);  // (gpuipc hands over to gpuipc-demo: one pid)
  const bool made = wait_until(
      [&] {
        try {
          (void)Segment::stat(name + ".slots");
          return true;
        } catch (const Error&) {
          return false;
        }
      },
      30s);
  ASSERT_TRUE(made) << "the demo made no channel";
  ::kill(demo, SIGINT);
  EXPECT_EQ(wait_child(demo, 30s), 128 + SIGINT);
  for (const auto& left : {name, name + ".slots"}) {
    EXPECT_THROW((void)Segment::stat(left), Error) << left << " was left behind";
  }
}

// `--out-dir ''` wrote <suite>-quick-cpu-<date>.json into the filesystem root, and `--json ''` was ignored (the
// default file was written): an empty path is a usage error. And `list` names the suites to list.
TEST(CliArguments, BenchRefusesAnEmptyResultPathAndListsTheSuitesNamed) {
  if (::access((build_bin_dir() + "/gpuipc-bench").c_str(), X_OK) != 0) {
    GTEST_SKIP() << "this build has no gpuipc-bench (built without nvcc)";
  }
  // (with `list`, which runs no suite: before, these printed the listing and exited 0)
  for (const auto& [option, says] :
       std::vector<std::pair<std::string, std::string>>{{"--out-dir", "--out-dir: an empty path; give a directory"},
                                                        {"--json", "--json: an empty path; give a file"}}) {
    const auto o = run_built("gpuipc", {"bench", "--quick", option, "", "list"});
    EXPECT_EQ(o.exit_code, 2) << option << ": " << o.out << o.err;
    EXPECT_NE(o.err.find(says), std::string::npos) << o.err;
    EXPECT_TRUE(o.out.empty()) << o.out;
  }
  const auto listed = run_built("gpuipc", {"bench", "list", "counting"});
  EXPECT_EQ(listed.exit_code, 0) << listed.out << listed.err;
  EXPECT_EQ(listed.out.rfind("counting ", 0), 0U) << listed.out;
  EXPECT_EQ(std::count(listed.out.begin(), listed.out.end(), '\n'), 1) << listed.out;
  const auto all = run_built("gpuipc", {"bench", "list"});
  EXPECT_EQ(all.exit_code, 0) << all.err;
  EXPECT_GT(std::count(all.out.begin(), all.out.end(), '\n'), 1) << all.out;
  const auto unknown = run_built("gpuipc", {"bench", "list", "nosuchsuite"});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.out << unknown.err;
  EXPECT_NE(unknown.err.find("no suite 'nosuchsuite'"), std::string::npos) << unknown.err;
}

TEST(CliArguments, ABrokerThatCannotBeStartedExits7NamingGpuipcDaemon) {
  const TempDir dir("gpuipc-args");
  const auto o =
      run_built("gpuipc", {"ls"}, {"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_DAEMON=/nonexistent/gpuipcd"});
  EXPECT_EQ(o.exit_code, 7) << o.out << o.err;
  EXPECT_NE(o.err.find("GPUIPC_DAEMON"), std::string::npos) << o.err;
  // A GPUIPC_DAEMON that is no program this user may run (execv's EACCES) is that, not a directory this user
  // cannot start a broker in (exit 6, "set GPUIPC_RUNTIME_DIR to a directory of your own").
  write_file(dir.file("not-executable"), "#!/bin/sh\n");
  ASSERT_EQ(::chmod(dir.file("not-executable").c_str(), 0644), 0);
  const auto denied = run_built(
      "gpuipc", {"ls"}, {"GPUIPC_RUNTIME_DIR=" + dir.file("run"), "GPUIPC_DAEMON=" + dir.file("not-executable")});
  EXPECT_EQ(denied.exit_code, 7) << denied.out << denied.err;
  EXPECT_NE(denied.err.find("GPUIPC_DAEMON"), std::string::npos) << denied.err;
  EXPECT_NE(denied.err.find("Permission denied"), std::string::npos) << denied.err;
  EXPECT_EQ(denied.err.find("GPUIPC_RUNTIME_DIR"), std::string::npos) << denied.err;
  // `daemon --foreground` runs it in place: why it cannot, and which variable named it.
  const auto foreground = run_built("gpuipc", {"daemon", "--foreground"},
                                    {"GPUIPC_RUNTIME_DIR=" + dir.file("run"), "GPUIPC_DAEMON=/nonexistent/gpuipcd"});
  EXPECT_EQ(foreground.exit_code, 1) << foreground.out << foreground.err;
  EXPECT_NE(foreground.err.find("No such file or directory"), std::string::npos) << foreground.err;
  EXPECT_NE(foreground.err.find("GPUIPC_DAEMON"), std::string::npos) << foreground.err;
}

TEST(CliArguments, AnUnlimitedConnectTimeoutWaitsForTheBrokerItStarts) {
  // "unlimited" was INT64_MAX ms: the connect's deadline wrapped into the past, and a command that had to start the
  // broker gave up at once ("did not start listening ... within 9223372036854775807 ms", exit 7).
  const TempDir dir("gpuipc-args");
  const std::vector<std::string> env{"GPUIPC_RUNTIME_DIR=" + dir.file("run"), "GPUIPC_CONNECT_TIMEOUT_MS=unlimited",
                                     "GPUIPC_DAEMON=" + build_bin_dir() + "/gpuipcd"};
  const auto o = run_built("gpuipc", {"ls"}, env);
  EXPECT_EQ(o.exit_code, 0) << o.out << o.err;
  EXPECT_EQ(run_built("gpuipc", {"daemon", "--stop"}, env).exit_code, 0);
}

TEST(CliArguments, TheBrokerLogIsNeitherASymlinkFollowedNorAFifoWaitedOn) {
  // The library opened broker.log to start a broker with O_CREAT|O_APPEND only: a symlink put there (in a sticky
  // directory another user can write) had it append to any file, and a FIFO held the command for good.
  const TempDir dir("gpuipc-args");
  const std::string run = dir.file("run"), victim = dir.file("victim");
  ASSERT_EQ(::mkdir(run.c_str(), 0755), 0);
  write_file(victim, "keep\n");
  ASSERT_EQ(::symlink(victim.c_str(), (run + "/broker.log").c_str()), 0);
  const std::vector<std::string> env{"GPUIPC_RUNTIME_DIR=" + run, "GPUIPC_DAEMON=" + build_bin_dir() + "/gpuipcd",
                                     "GPUIPC_LOG=info"};
  auto o = run_program(build_bin_dir() + "/gpuipc", {"ls"}, env, -1, 20s);
  EXPECT_NE(o.exit_code, 0) << o.out << o.err;
  EXPECT_NE(o.err.find("broker.log"), std::string::npos) << o.err;
  EXPECT_EQ(read_file(victim).value_or(""), "keep\n");
  ASSERT_EQ(::unlink((run + "/broker.log").c_str()), 0);
  ASSERT_EQ(::mkfifo((run + "/broker.log").c_str(), 0600), 0);
  o = run_program(build_bin_dir() + "/gpuipc", {"ls"}, env, -1, 20s);
  EXPECT_NE(o.exit_code, kChildTimedOut) << "waited on the FIFO";
  EXPECT_NE(o.exit_code, 0) << o.out << o.err;
  EXPECT_NE(o.err.find("broker.log"), std::string::npos) << o.err;
  run_program(build_bin_dir() + "/gpuipc", {"daemon", "--stop"}, env);
}

TEST(CliArguments, ARuntimeDirectoryThatIsAFileIsRefusedAsUnsafe) {
  // `daemon status` and `daemon --stop` connected without the check (status then reported a broker, or said none
  // runs; --stop signalled whatever listened there).
  const TempDir dir("gpuipc-args");
  write_file(dir.file("afile"), "not a directory");
  ASSERT_EQ(::mkdir(dir.file("open").c_str(), 0777), 0);
  ASSERT_EQ(::chmod(dir.file("open").c_str(), 0777), 0);  // (past the umask)
  for (const auto& [where, says] : std::vector<std::pair<std::string, std::string>>{
           {"afile", "is unsafe: it exists but is not a directory"}, {"open", "writable by group or others"}}) {
    for (const auto& args : std::vector<std::vector<std::string>>{{"ls"}, {"daemon", "status"}, {"daemon", "--stop"}}) {
      const auto o = run_built("gpuipc", args, {"GPUIPC_RUNTIME_DIR=" + dir.file(where)});
      EXPECT_EQ(o.exit_code, 6) << where << " " << args.back() << ": " << o.out << o.err;
      EXPECT_NE(o.err.find(says), std::string::npos) << o.err;
    }
    // With GPUIPC_NO_AUTOSTART=1 too: it said only "start one with gpuipc daemon --foreground" (exit 7), which then
    // fails, the directory being unsafe.
    const auto o = run_built("gpuipc", {"ls"}, {"GPUIPC_RUNTIME_DIR=" + dir.file(where), "GPUIPC_NO_AUTOSTART=1"});
    EXPECT_EQ(o.exit_code, 6) << where << ": " << o.out << o.err;
    EXPECT_NE(o.err.find(says), std::string::npos) << o.err;
  }
}

TEST(CliArguments, JsonOutputStaysJsonWhenAPathOrAVariableIsNotUtf8) {
  // nlohmann's dump threw on such a string: no JSON at all, exit 1 ("[json.exception.type_error.316] invalid UTF-8
  // byte"), and doctor lost its own exit code.
  const TempDir dir("gpuipc-utf8");
  const auto status = run_built("gpuipc", {"daemon", "status", "--json"},
                                {"GPUIPC_RUNTIME_DIR=" + dir.path() + "/r\xe9", "GPUIPC_NO_AUTOSTART=1"});
  EXPECT_EQ(status.exit_code, 5) << status.out << status.err;  // no broker there
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(status.out)) << status.out << status.err;
  EXPECT_EQ(j["running"], false);
  const auto doctor = run_built("gpuipc", {"doctor", "--json"},
                                {"CUDA_VISIBLE_DEVICES=\xff", "GPUIPC_CUDA_LIBRARY=/nonexistent/libcuda.so.1"});
  ASSERT_NO_THROW(j = nlohmann::json::parse(doctor.out)) << doctor.out << doctor.err;
  EXPECT_EQ(doctor.exit_code, j["exit_code"].get<int>()) << doctor.err;
}

// Any process may call itself anything: a name that is not UTF-8 made `top --json` fail (nlohmann's dump throws).
TEST(CliArguments, TopJsonShowsAProcessNameThatIsNotUtf8) {
  const std::string name = unique_name("seg");
  SyncPipe ready;
  SyncPipe done;
  const pid_t child = start_child([&] {
    ::prctl(PR_SET_NAME, "bad\xff\xfename", 0, 0, 0);
    auto seg = Segment::create(name, 4096);
    ready.notify();
    return done.wait(60s) ? 0 : 1;
  });
  ASSERT_TRUE(ready.wait(30s));
  const auto o = run_built("gpuipc", {"top", "--once", "--json", "--interval", "0.01"});
  done.notify();
  EXPECT_EQ(wait_child(child), 0);
  Segment::unlink(name);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(o.out)) << o.out;
  bool seen = false;
  for (const auto& p : j["processes"]) seen = seen || p["command"] == "bad??name";
  EXPECT_TRUE(seen) << j["processes"].dump();
}

}  // namespace
}  // namespace gpuipc::test
