// NVTX ranges (src/cuda/trace.hpp): library calls push a named range of the "gpuipc" domain and pop it, as a
// profiler such as nsys sees them, and GPUIPC_NVTX=0 turns them off. The profiler is tests/nvtx/nvtx_recorder.cpp,
// loaded by NVTX through NVTX_INJECTION64_PATH the way nsys injects itself. Each check runs in a fresh child:
// NVTX looks for its injection once per process, at its first call.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "gpuipc/channel.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

constexpr std::size_t kLogBytes = 1 << 16;

/// In a child with the recorder injected (and GPUIPC_NVTX=`nvtx` when given): a host segment created, opened and
/// unlinked, a semaphore signalled and waited on, a message through a host channel. Returns what the recorder saw.
std::string record(const char* nvtx) {
  Shared<char> log(kLogBytes);
  const int rc = run_child([&] {
    ::setenv("NVTX_INJECTION64_PATH", GPUIPC_NVTX_RECORDER, 1);
    if (nvtx != nullptr) ::setenv("GPUIPC_NVTX", nvtx, 1);
    const std::string name = "trace." + std::to_string(::getpid());
    {
      Segment seg = Segment::create(name, 4096, {.kind = SegmentKind::Host});
      Segment again = Segment::open(name);
      Segment::unlink(name);
      Semaphore sem = Semaphore::create(name + ".sem", {.kind = SegmentKind::Host});
      GPUIPC_CHILD_CHECK(sem.signal_host(1) == Status::Ok);
      GPUIPC_CHILD_CHECK(sem.wait_host(1, std::chrono::seconds(5)).status == Status::Ok);
      Semaphore::unlink(name + ".sem");
      Channel in = Channel::create(name + ".ch", {.slots = 2, .slot_bytes = 64, .header_bytes = 0,
                                                  .kind = SegmentKind::Host},
                                   ChannelRole::Consumer);
      Channel out = Channel::open(name + ".ch", ChannelRole::Producer);
      std::uint64_t seq = 0;
      const int value = 7;
      GPUIPC_CHILD_CHECK(out.send(nullptr, &value, sizeof value, {}, std::chrono::seconds(5), seq) == Status::Ok);
      MessageView m;
      GPUIPC_CHILD_CHECK(in.receive(nullptr, std::chrono::seconds(5), m) == Status::Ok);
      GPUIPC_CHILD_CHECK(in.release(nullptr) == Status::Ok);
      Channel::unlink(name + ".ch");
    }
    void* recorder = ::dlopen(GPUIPC_NVTX_RECORDER, RTLD_LAZY | RTLD_NOLOAD);
    if (recorder == nullptr) return 0;  // NVTX never loaded it: nothing recorded
    auto* recorded = reinterpret_cast<const char* (*)()>(::dlsym(recorder, "gpuipc_nvtx_recorded"));
    GPUIPC_CHILD_CHECK(recorded != nullptr);
    std::strncpy(log.get(), recorded(), kLogBytes - 1);
    return 0;
  });
  EXPECT_EQ(rc, 0);
  return std::string(log.get());
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

TEST(Trace, LibraryCallsAreNvtxRangesOfTheGpuipcDomainThatAProfilerSees) {
  const std::string log = record(nullptr);
  EXPECT_EQ(count(log, "domain gpuipc\n"), 1) << log;
  for (const char* call : {"gpuipc::Segment::open", "gpuipc::Semaphore::create", "gpuipc::Semaphore::signal_host",
                           "gpuipc::Semaphore::wait_host", "gpuipc::Channel::create", "gpuipc::Channel::send",
                           "gpuipc::Channel::receive", "gpuipc::Channel::release"}) {
    EXPECT_GE(count(log, std::string("push ") + call + "\n"), 1) << call << " in:\n" << log;  // (channels open segments)
  }
  EXPECT_GE(count(log, "push gpuipc::Segment::create\n"), 1) << log;  // the semaphore's block is one too
  EXPECT_EQ(count(log, "push "), count(log, "pop\n")) << "every range is closed:\n" << log;
}

TEST(Trace, GpuipcNvtxZeroTurnsThemOff) {
  const std::string log = record("0");
  EXPECT_EQ(count(log, "push "), 0) << log;
}

}  // namespace
}  // namespace gpuipc::test
