// What `gpuipc daemon`, `gpuipcd` and `gpuipc rm` say about the broker and the objects it serves must be true, and
// a process with closed standard streams must not lose its broker connection to them:
// - `daemon status` / `--stop` say "no broker is running" only when nothing listens (a malformed variable or a
//   socket the user may not reach said so, exit 0, while a broker ran);
// - gpuipcd reads a GPUIPC_* variable only for an option its command line does not give, and never for --help or
//   --version; --runtime-dir must be absolute;
// - `gpuipc rm` of a part alone of a live channel or pool (NAME.slots, NAME.chunk.<n>) is refused;
// - the library's fds (its broker connection, a segment's memfd) never take fd 0, 1 or 2 (a closed stdout's number
//   went to the connection, and `gpuipc ls --json >&-` wrote its JSON into the broker's socket).
// Runs the built binaries.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

#include "gpuipc/broker.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

using namespace std::chrono_literals;

TEST(CliBrokerFacts, DaemonStatusAndStopReportAnErrorInsteadOfNoBroker) {
  (void)Segment::list();  // a broker runs (started on demand)
  ASSERT_TRUE(broker_listening());
  for (const std::vector<std::string>& args : {std::vector<std::string>{"daemon", "status"}, {"daemon", "--stop"}}) {
    const auto o = run_built("gpuipc", args, {"GPUIPC_CONNECT_TIMEOUT_MS=abc"});
    EXPECT_EQ(o.exit_code, 1) << args[1] << ": " << o.out << o.err;
    EXPECT_EQ(o.out.find("no gpuipc broker"), std::string::npos) << o.out;
    EXPECT_NE(o.err.find("GPUIPC_CONNECT_TIMEOUT_MS"), std::string::npos) << o.err;
  }
  EXPECT_TRUE(broker_listening()) << "the broker was stopped";
  // Nothing listening is still "no broker" (exit 5 for status, 0 for --stop).
  const TempDir dir("gpuipc-facts");
  EXPECT_EQ(run_built("gpuipc", {"daemon", "status"}, {"GPUIPC_RUNTIME_DIR=" + dir.path()}).exit_code, 5);
  EXPECT_EQ(run_built("gpuipc", {"daemon", "--stop"}, {"GPUIPC_RUNTIME_DIR=" + dir.path()}).exit_code, 0);
}

TEST(CliBrokerFacts, GpuipcdReadsAVariableOnlyForAnOptionNotGiven) {
  EXPECT_EQ(run_built("gpuipcd", {"--version"}, {"GPUIPC_QUOTA_BYTES=abc"}).exit_code, 0);
  EXPECT_EQ(run_built("gpuipcd", {"--help"}, {"GPUIPC_HELLO_TIMEOUT_MS=zz"}).exit_code, 0);
  EXPECT_EQ(run_built("gpuipc", {"daemon", "--help"}, {"GPUIPC_RUNTIME_DIR=relative"}).exit_code, 0);
  // A malformed variable whose option is not given still fails, saying which.
  const auto bad = run_built("gpuipcd", {"--idle-timeout-ms", "0"}, {"GPUIPC_QUOTA_BYTES=abc"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("GPUIPC_QUOTA_BYTES"), std::string::npos) << bad.err;
  // Given, the option wins: the broker starts (and is stopped again).
  const TempDir dir("gpuipc-facts");
  const std::string log = dir.path() + "/broker.out";
  const pid_t broker = start_program(
      build_bin_dir() + "/gpuipcd", {"--runtime-dir", dir.path(), "--quota-bytes", "1000000", "--idle-timeout-ms", "0"},
      {"GPUIPC_QUOTA_BYTES=abc", "GPUIPC_RUNTIME_DIR=relative"}, -1, log);
  const std::vector<std::string> here{"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_NO_AUTOSTART=1"};
  EXPECT_TRUE(wait_until(
      [&] {
        return run_built("gpuipc", {"daemon", "status"}, here).exit_code == 0;
      },
      20s, 50ms))
      << read_file(log).value_or("");
  EXPECT_EQ(run_built("gpuipc", {"daemon", "--stop"}, here).exit_code, 0);
  EXPECT_EQ(wait_child(broker, 20s), 0) << read_file(log).value_or("");
  // A relative --runtime-dir is a bad command line (CLI11's 105): clients refuse relative directories, so it would
  // serve nobody.
  const auto rel = run_built("gpuipcd", {"--runtime-dir", "relative-dir"});
  EXPECT_EQ(rel.exit_code, 105) << rel.err;
  EXPECT_NE(rel.err.find("absolute"), std::string::npos) << rel.err;
}

TEST(CliBrokerFacts, RmOfAPartAloneOfALiveChannelOrPoolIsRefused) {
  const auto chan = unique_name("partchan");
  const auto pool = unique_name("partpool");
  auto c = Channel::create(chan, {.slots = 2, .slot_bytes = 4096, .kind = SegmentKind::Host}, ChannelRole::Producer);
  auto p = Pool::create(pool, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 16, .max_bytes = 1 << 16});
  for (const auto& [part, owner] : {std::pair{chan + ".slots", chan}, std::pair{pool + ".chunk.0", pool}}) {
    const auto o = run_built("gpuipc", {"rm", part});
    EXPECT_EQ(o.exit_code, 1) << part << ": " << o.err;
    EXPECT_NE(o.err.find("gpuipc rm " + owner), std::string::npos) << o.err;
    EXPECT_NO_THROW(Segment::stat(part)) << part << " was removed";
  }
  // The channel still works: a consumer opens its buffers.
  EXPECT_NO_THROW(Channel::open(chan, ChannelRole::Consumer));
  // Whole, they go.
  c = Channel();
  p = Pool();
  const auto o = run_built("gpuipc", {"rm", chan, pool});
  EXPECT_EQ(o.exit_code, 0) << o.err;
  // A part left behind without its object may go on its own: the pool's chunk after its control block.
  auto q = Pool::create(pool, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 16, .max_bytes = 1 << 16});
  q = Pool();
  Segment::unlink(pool);  // the control block alone
  EXPECT_EQ(run_built("gpuipc", {"rm", pool + ".chunk.0"}).exit_code, 0);
}

TEST(CliBrokerFacts, ClosedStandardStreamsAreNotTakenByTheLibrarysFds) {
  const auto name = unique_name("stdio");
  EXPECT_EQ(run_child([&] {
              ::close(0);
              ::close(1);
              ::close(2);
              auto seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});  // a memfd, then a connection
              for (int fd = 0; fd < 3; ++fd) {
                GPUIPC_CHILD_CHECK(::fcntl(fd, F_GETFD) == -1 && errno == EBADF);
              }
              // A write meant for stdout goes nowhere, and the connection still answers.
              GPUIPC_CHILD_CHECK(::write(1, "{\"x\": 1}\n", 9) == -1);
              auto again = Segment::open(name);
              GPUIPC_CHILD_CHECK(!Segment::list().empty());
              Segment::unlink(name);
              return 0;
            }),
            0);
}

}  // namespace
}  // namespace gpuipc::test
