// `gpuipc top --once --json` against live host objects: a channel a child publishes to at a known rate (and a
// child consumes), a channel with a known depth, a semaphore with a known value and a pool with known stats. And
// the errors: no broker, and a "broker" that answers garbage. Runs the built binary.
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "gpuipc/channel.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/semaphore.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"


namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

using namespace std::chrono_literals;

constexpr const char* kGpuipc = GPUIPC_BUILD_BIN_DIR "/gpuipc";

using Outcome = ProgramOutcome;

/// Runs kGpuipc with `args` and the extra environment `env` ("NAME=value"), collecting stdout and stderr.
Outcome run_gpuipc(const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  return run_program(kGpuipc, args, env, -1, 60s);
}

const nlohmann::json* find_named(const nlohmann::json& array, const std::string& name) {
  for (const auto& e : array) {
    if (e["name"] == name) return &e;
  }
  return nullptr;
}

bool has_pid(const nlohmann::json& pids, pid_t pid) {
  for (const auto& p : pids) {
    if (p.get<pid_t>() == pid) return true;
  }
  return false;
}

constexpr std::size_t kMessageBytes = 1000;

TEST(CliTop, OnceJsonShowsChannelsSemaphoresPoolsAndTheirProcesses) {
  const std::string flow = unique_name("flow");
  const std::string still = unique_name("still");
  const std::string sem_name = unique_name("sem");
  const std::string pool_name = unique_name("pool");

  // A channel a child publishes to, one message of kMessageBytes every 2 ms, and another child consumes.
  const ChannelOptions options{.slots = 8, .slot_bytes = 4096, .header_bytes = 0, .kind = SegmentKind::Host};
  auto creator = Channel::create(flow, options, ChannelRole::Consumer);
  Shared<std::atomic<int>> stop;
  const pid_t producer = start_child([&] {
    auto ch = Channel::open(flow, ChannelRole::Producer);
    while (stop[0].load() == 0) {
      SlotView slot;
      GPUIPC_CHILD_CHECK(ch.acquire(nullptr, 1s, slot) == Status::Ok);
      std::memset(slot.data, 7, kMessageBytes);
      GPUIPC_CHILD_CHECK(ch.publish(nullptr, {}, kMessageBytes) == Status::Ok);
      std::this_thread::sleep_for(2ms);
    }
    return 0;
  });
  const pid_t consumer = start_child([&] {
    auto ch = Channel::open(flow, ChannelRole::Consumer);
    while (stop[0].load() == 0) {
      MessageView m;
      const Status st = ch.receive(nullptr, 100ms, m);
      if (st == Status::Timeout) continue;
      if (st == Status::Closed) break;  // the producer saw `stop` first and left
      GPUIPC_CHILD_CHECK(st == Status::Ok);
      GPUIPC_CHILD_CHECK(ch.release(nullptr) == Status::Ok);
    }
    return 0;
  });

  // A channel with three messages waiting and nobody to take them.
  auto still_ch = Channel::create(still, options, ChannelRole::Producer);
  for (int i = 0; i < 3; ++i) {
    SlotView slot;
    ASSERT_EQ(still_ch.acquire(nullptr, 1s, slot), Status::Ok);
    ASSERT_EQ(still_ch.publish(nullptr, {}, 100), Status::Ok);
  }
  auto sem = Semaphore::create(sem_name, {.initial = 0, .kind = SegmentKind::Host});
  ASSERT_EQ(sem.signal_host(42), Status::Ok);
  auto pool = Pool::create(pool_name, {.kind = SegmentKind::Host, .chunk_bytes = 1 << 20, .max_bytes = 4 << 20});
  Block b1 = pool.allocate(4096);
  Block b2 = pool.allocate(8192);

  // Let the producer get going before the first sample.
  ASSERT_TRUE(wait_until([&] { return creator.stats().published >= 10; }, 10s));
  const Outcome o = run_gpuipc({"top", "--once", "--json", "--interval", "0.5"});
  stop[0].store(1);
  EXPECT_EQ(wait_child(producer), 0);
  EXPECT_EQ(wait_child(consumer), 0);
  ASSERT_EQ(o.exit_code, 0) << o.out << o.err;
  EXPECT_EQ(std::count(o.out.begin(), o.out.end(), '\n'), 1) << "one document: " << o.out;
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(o.out)) << o.out;
  EXPECT_EQ(j["schema"], 1);
  EXPECT_GT(j["interval_s"].get<double>(), 0.4);
  for (const char* key : {"time", "segments", "channels", "semaphores", "pools", "processes"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }

  const auto* f = find_named(j["channels"], flow);
  ASSERT_NE(f, nullptr) << j.dump(2);
  EXPECT_EQ((*f)["kind"], "host");
  EXPECT_EQ((*f)["slots"], 8);
  EXPECT_EQ((*f)["producers"], 1);
  EXPECT_EQ((*f)["consumers"], 2);  // the creator's handle and the child's
  EXPECT_GE((*f)["published"].get<std::uint64_t>(), 10U);
  EXPECT_EQ((*f)["published_bytes"].get<std::uint64_t>(), (*f)["published"].get<std::uint64_t>() * kMessageBytes);
  ASSERT_TRUE((*f)["messages_per_s"].is_number()) << f->dump();
  const double mps = (*f)["messages_per_s"].get<double>();
  EXPECT_GT(mps, 0.0);
  EXPECT_LT(mps, 600.0) << "at most one message per 2 ms";
  EXPECT_NEAR((*f)["bytes_per_s"].get<double>(), mps * kMessageBytes, 1.0);
  EXPECT_GT((*f)["received_per_s"].get<double>(), 0.0);
  EXPECT_TRUE(has_pid((*f)["pids"], producer)) << f->dump();
  EXPECT_TRUE(has_pid((*f)["pids"], consumer)) << f->dump();
  EXPECT_TRUE(has_pid((*f)["pids"], ::getpid())) << f->dump();

  const auto* s = find_named(j["channels"], still);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ((*s)["depth"], 3);
  EXPECT_EQ((*s)["free_slots"], 5);
  EXPECT_EQ((*s)["published"], 3);
  EXPECT_EQ((*s)["published_bytes"], 300);
  EXPECT_EQ((*s)["messages_per_s"].get<double>(), 0.0);
  EXPECT_EQ((*s)["producers"], 1);
  EXPECT_EQ((*s)["consumers"], 0);

  const auto* m = find_named(j["semaphores"], sem_name);
  ASSERT_NE(m, nullptr) << j.dump(2);
  EXPECT_EQ((*m)["value"], 42);
  EXPECT_EQ((*m)["status"], "ok");
  EXPECT_EQ((*m)["signallers"], 1);
  EXPECT_EQ((*m)["waiters"], 0);
  EXPECT_TRUE(has_pid((*m)["pids"], ::getpid()));

  const auto* p = find_named(j["pools"], pool_name);
  ASSERT_NE(p, nullptr) << j.dump(2);
  EXPECT_EQ((*p)["live_blocks"], 2);
  EXPECT_EQ((*p)["chunks"], 1);
  EXPECT_EQ((*p)["max_chunks"], 4);
  EXPECT_EQ((*p)["members"], 1);
  EXPECT_GE((*p)["used_bytes"].get<std::uint64_t>(), 4096U + 8192U);
  EXPECT_TRUE(has_pid((*p)["pids"], ::getpid()));

  // The segments carry what they are; top itself is never among the processes.
  bool saw_slots = false;
  bool saw_chunk = false;
  for (const auto& seg : j["segments"]) {
    if (seg["name"] == flow + ".slots") saw_slots = seg["role"] == "channel_slots";
    if (seg["name"] == pool_name + ".chunk.0") saw_chunk = seg["role"] == "pool_chunk";
  }
  EXPECT_TRUE(saw_slots);
  EXPECT_TRUE(saw_chunk);
  bool saw_self = false;
  for (const auto& proc : j["processes"]) {
    if (proc["pid"].get<pid_t>() == ::getpid()) {
      saw_self = true;
      const auto objects = proc["objects"].get<std::vector<std::string>>();
      EXPECT_NE(std::find(objects.begin(), objects.end(), sem_name), objects.end());
    }
  }
  EXPECT_TRUE(saw_self);

  pool.free(std::move(b1));
  pool.free(std::move(b2));
  Channel::unlink(flow);
  Channel::unlink(still);
  Semaphore::unlink(sem_name);
  Pool::unlink(pool_name);
}

TEST(CliTop, TextFrameNamesTheObjects) {
  const std::string name = unique_name("sem");
  auto sem = Semaphore::create(name, {.initial = 7, .kind = SegmentKind::Host});
  const Outcome o = run_gpuipc({"top", "--once", "--interval", "0.05"});
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.out.find("\x1b[2J"), std::string::npos) << "--once does not clear the screen";
  EXPECT_NE(o.out.find("SEMAPHORES"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find(name), std::string::npos) << o.out;
  Semaphore::unlink(name);
}

TEST(CliTop, EveryHolderOfANameIsListedBeyondTheSixteenTheBrokersListNames) {
  // 24 children hold a semaphore (the broker's segment list names 16 pids a segment). Each holds it until told.
  const std::string name = unique_name("many");
  auto sem = Semaphore::create(name, {.initial = 1, .kind = SegmentKind::Host});
  constexpr int kHolders = 24;
  Shared<std::atomic<int>> opened;
  Shared<std::atomic<int>> stop;
  std::vector<pid_t> children;
  for (int k = 0; k < kHolders; ++k) {
    children.push_back(start_child([&] {
      auto s = Semaphore::open(name);
      opened[0].fetch_add(1);
      while (stop[0].load() == 0) std::this_thread::sleep_for(5ms);
      return 0;
    }));
  }
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (opened[0].load() < kHolders && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(opened[0].load(), kHolders);

  const Outcome o = run_gpuipc({"top", "--once", "--json", "--interval", "0.05"});
  const Outcome text = run_gpuipc({"top", "--once", "--interval", "0.05"});
  // Unlinked, it has no name to ask the holders of: the broker's 16 pids, and the rest counted.
  Semaphore::unlink(name);
  const Outcome unlinked = run_gpuipc({"top", "--once", "--interval", "0.05"});
  stop[0].store(1);
  for (const pid_t c : children) EXPECT_EQ(wait_child(c), 0);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto j = nlohmann::json::parse(o.out);
  const auto* s = find_named(j["semaphores"], name);
  ASSERT_NE(s, nullptr) << o.out;
  EXPECT_EQ((*s)["pids"].size(), static_cast<std::size_t>(kHolders + 1)) << (*s)["pids"].dump();
  EXPECT_EQ(s->value("mapper_count", -1), kHolders + 1) << "the children and this process";
  const auto* seg = find_named(j["segments"], name);
  ASSERT_NE(seg, nullptr);
  EXPECT_EQ((*seg)["mapper_pids"].size(), static_cast<std::size_t>(kHolders + 1));
  int listed = 0;
  for (const auto& proc : j["processes"]) {
    const auto objects = proc["objects"].get<std::vector<std::string>>();
    if (std::find(objects.begin(), objects.end(), name) != objects.end()) ++listed;
  }
  EXPECT_EQ(listed, kHolders + 1) << "one PROCESSES entry per holder";
  for (const pid_t c : children) EXPECT_TRUE(has_pid((*s)["pids"], c)) << c;
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find(std::to_string(children.back())), std::string::npos) << text.out;
  ASSERT_EQ(unlinked.exit_code, 0) << unlinked.err;
  EXPECT_NE(unlinked.out.find(fmt::format(",+{}\n", kHolders + 1 - 16)), std::string::npos) << unlinked.out;
}

TEST(CliTop, IterationsPrintOneDocumentPerFrame) {
  const Outcome o = run_gpuipc({"top", "--json", "-n", "2", "--interval", "0.05"});
  ASSERT_EQ(o.exit_code, 0) << o.err;
  ASSERT_EQ(std::count(o.out.begin(), o.out.end(), '\n'), 2) << o.out;
  const auto nl = o.out.find('\n');
  EXPECT_TRUE(nlohmann::json::accept(o.out.substr(0, nl))) << o.out;
  EXPECT_TRUE(nlohmann::json::accept(o.out.substr(nl + 1))) << o.out;
}

TEST(CliTop, NoBrokerExits7WithAMessage) {
  const TempDir dir("gpuipc-top");
  const Outcome o =
      run_gpuipc({"top", "--once", "--json"},
                 {"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_NO_AUTOSTART=1", "GPUIPC_CONNECT_TIMEOUT_MS=2000"});
  EXPECT_EQ(o.exit_code, 7) << o.out << o.err;
  EXPECT_TRUE(o.out.empty()) << o.out;
  EXPECT_EQ(o.err.rfind("gpuipc: ", 0), 0U) << o.err;
}

TEST(CliTop, GarbageBrokerExits7WithAMessage) {
  // A listener on the broker's socket path that answers every connection with bytes that are no message.
  const TempDir dir("gpuipc-top");
  const std::string path = dir.path() + "/broker.sock";
  const int listener = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  ASSERT_GE(listener, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof(addr.sun_path));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  ASSERT_EQ(::listen(listener, 8), 0);
  std::atomic<bool> done{false};
  std::thread server([&] {
    while (!done.load()) {
      pollfd p{listener, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int c = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      char buf[512];
      (void)::recv(c, buf, sizeof(buf), MSG_DONTWAIT);
      const char garbage[] = "\xde\xad\xbe\xef not a gpuipc message \xff\xff\xff\xff";
      (void)::send(c, garbage, sizeof(garbage), MSG_NOSIGNAL);
      std::this_thread::sleep_for(50ms);
      ::close(c);
    }
  });
  const Outcome o =
      run_gpuipc({"top", "--once", "--json"},
                 {"GPUIPC_RUNTIME_DIR=" + dir.path(), "GPUIPC_NO_AUTOSTART=1", "GPUIPC_CONNECT_TIMEOUT_MS=2000"});
  done.store(true);
  server.join();
  ::close(listener);
  EXPECT_EQ(o.exit_code, 7) << o.out << o.err;
  EXPECT_TRUE(o.out.empty()) << o.out;
  EXPECT_EQ(o.err.rfind("gpuipc: ", 0), 0U) << o.err;
}

}  // namespace
}  // namespace gpuipc::test
