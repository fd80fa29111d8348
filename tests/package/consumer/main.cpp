// Uses an installed gpuipc from outside its tree: a host segment and a host channel shared with a forked child,
// and an error thrown inside the library caught here. Prints one line and exits 0 when everything held.
//   consumer LABEL
#include <gpuipc/channel.hpp>
#include <gpuipc/error.hpp>
#include <gpuipc/segment.hpp>
#include <gpuipc/version.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

using namespace std::chrono_literals;

int child(const std::string& name) {
  const gpuipc::Segment seg = gpuipc::Segment::open(name, {.access = gpuipc::Access::ReadOnly, .wait = 10s});
  const auto* bytes = static_cast<const unsigned char*>(seg.data());
  for (std::size_t i = 0; i < seg.size(); ++i)
    if (bytes[i] != static_cast<unsigned char>(i * 7)) return 10;
  gpuipc::Channel in = gpuipc::Channel::open(name + ".ch", gpuipc::ChannelRole::Consumer, {.wait = 10s});
  for (std::uint64_t want = 0; want < 100; ++want) {
    gpuipc::MessageView m;
    if (in.receive(nullptr, 10s, m) != gpuipc::Status::Ok) return 11;
    std::uint64_t got = 0;
    std::memcpy(&got, m.data, sizeof got);
    if (got != want) return 12;
    in.release(nullptr);
  }
  return 0;
}

int main(int argc, char** argv) {
  const std::string label = argc > 1 ? argv[1] : "consumer";
  const std::string name = "pkg-consumer-" + std::to_string(::getpid());
  try {
    (void)gpuipc::Segment::open(name + ".missing");
    std::fprintf(stderr, "%s: opening a missing name did not throw\n", label.c_str());
    return 1;
  } catch (const gpuipc::Error& e) {  // thrown inside the library, caught here: its type crosses the boundary
    if (e.code() != gpuipc::ErrorCode::NotFound) return 2;
  }
  gpuipc::Segment seg = gpuipc::Segment::create(name, 4096, {.kind = gpuipc::SegmentKind::Host});
  auto* bytes = static_cast<unsigned char*>(seg.data());
  for (std::size_t i = 0; i < seg.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 7);
  gpuipc::Channel out = gpuipc::Channel::create(
      name + ".ch", {.slots = 4, .slot_bytes = 64, .header_bytes = 0, .kind = gpuipc::SegmentKind::Host},
      gpuipc::ChannelRole::Producer);
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(child(name));
  for (std::uint64_t i = 0; i < 100; ++i) {
    std::uint64_t seq = 0;
    if (out.send(nullptr, &i, sizeof i, {}, 10s, seq) != gpuipc::Status::Ok) return 3;
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  gpuipc::Channel::unlink(name + ".ch");
  gpuipc::Segment::unlink(name);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "%s: the child failed (status %d)\n", label.c_str(), status);
    return 4;
  }
  std::printf("%s: gpuipc %s (headers %s): a segment and 100 messages through a channel to another process: ok\n",
              label.c_str(), gpuipc::version(), GPUIPC_VERSION_STRING);
  return 0;
}
