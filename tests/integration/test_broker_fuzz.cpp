// A fuzzer for the live broker (issue 16, point 4): several client processes send random sequences of requests
// over the socket — every request type (Hello, Create, Open, Close, Unlink, Stat, List, Join, Announce, Rejoin) and
// the broker's own reply types sent back to it; Create with a host memfd, a memfd of the wrong size, /dev/null, a
// pipe, its own socket, no fd or two; Announce of memory it holds or does not; opens that wait; closes, joins and
// rejoins of ids it holds and of random ones; garbage, mutated and truncated bytes, oversized messages and fds
// where none belong — from several connections each, hang up mid-conversation, and are SIGKILLed and restarted at
// random. Some also make channels, semaphores and pools through the library and scribble random words over their
// shared control blocks, which the broker must repair without trusting them.
//
// Checked all along: every reply decodes, answers a request of that connection with its type (or an error) and
// carries the fds its type says; the broker answers a probe within a few seconds. Afterwards: the broker has the
// same pid, its fds and references are back to the baseline, its RSS grew by at most a small bound, and it exits
// with status 0 on SIGTERM (in the ASan build that exit runs LeakSanitizer over the broker).
//
// GPUIPC_BROKER_FUZZ_SECONDS sets the duration (default 10), GPUIPC_BROKER_FUZZ_SEED the seed (printed).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <unordered_map>
#include <variant>

#include "core/client.hpp"
#include "gpuipc/broker.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

using proto::MessageType;

constexpr int kClients = 4;
constexpr int kNames = 12;
constexpr std::size_t kMaxConnections = 3;  // per client
/// Exit code of a client that got a reply that is wrong (details on its stderr).
constexpr int kBadReply = 1;
/// How long the broker may take to answer the supervisor's probe while the clients hammer it.
constexpr auto kProbeLimit = 5s;
/// How much the broker's RSS may grow over the run (its maps and buffers are warmed up before the baseline).
constexpr std::uint64_t kRssGrowthKiB = 16 * 1024;

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* s = std::getenv(name);
  return s != nullptr && *s != '\0' ? std::strtoull(s, nullptr, 10) : fallback;
}

/// Replies the clients received, by Body index (shared with them).
using Tally = std::atomic<std::uint64_t>;

/// What answers a request of type `t` besides an ErrorReply (Hello: only the first; reply types sent to the broker:
/// nothing but an error).
MessageType answer_to(MessageType t) {
  switch (t) {
    case MessageType::Hello:
      return MessageType::HelloReply;
    case MessageType::Create:
    case MessageType::Open:
    case MessageType::Announce:
      return MessageType::OpenReply;
    case MessageType::Stat:
      return MessageType::StatReply;
    case MessageType::List:
      return MessageType::ListReply;
    case MessageType::Join:
      return MessageType::JoinReply;
    case MessageType::Holders:
      return MessageType::HoldersReply;
    case MessageType::Close:
    case MessageType::Unlink:
    case MessageType::UnlinkId:
    case MessageType::Rejoin:
    case MessageType::Leave:
    case MessageType::Watch:
    case MessageType::Heartbeat:
      return MessageType::Ok;
    default:
      return MessageType::Error;
  }
}

/// One fuzzing client process: up to three raw connections with random requests on them, every reply checked.
class Client {
 public:
  Client(std::uint64_t seed, std::string prefix, Tally* replies)
      : m_rng(seed), m_prefix(std::move(prefix)), m_replies(replies) {}

  /// Runs until `deadline`; returns 0, or kBadReply when the broker answered wrongly.
  int run(std::chrono::steady_clock::time_point deadline) {
    while (std::chrono::steady_clock::now() < deadline) {
      if (m_conns.empty() || (m_conns.size() < kMaxConnections && pick(8) == 0)) connect();
      if (m_conns.empty()) continue;
      const std::size_t c = pick(m_conns.size());
      step(c);
      if (!drain(c, static_cast<int>(pick(3)))) return kBadReply;
    }
    return 0;
  }

 private:
  struct Held {  // memory an OpenReply brought: what Announce gives back
    std::string name;
    std::uint64_t size;
    os::UniqueFd fd;
  };
  struct Conn {
    os::UniqueFd sock;
    bool tainted = false;  // mutated bytes went out: a reply may carry a request id that was never sent
    std::unordered_map<std::uint32_t, proto::Body> pending;  // requests not answered yet
    std::vector<std::uint64_t> ids;      // one per reference this connection holds (as far as it knows)
    std::vector<std::uint64_t> lib_ids;  // those of them that name the library's objects: Join works
    std::vector<Held> held;
    bool watching = false;  // it sent Watch: Events may come
  };

  std::uint64_t pick(std::uint64_t n) { return m_rng() % n; }

  std::string name() {
    const auto k = pick(kNames + 1);
    if (k == kNames) return "fz-shared";                                     // every client's
    if (k < 4 && pick(2) == 0) return m_prefix + "lib" + std::to_string(k);  // the library's objects: Join works
    return m_prefix + std::to_string(k);
  }

  void connect() {
    try {
      Conn c;
      c.sock = os::connect_seqpacket(std::getenv("GPUIPC_RUNTIME_DIR") + std::string("/broker.sock"), 500ms);
      m_conns.push_back(std::move(c));
      if (pick(10) != 0) send(m_conns.back(), proto::Hello{pick(3) == 0 ? 0U : 42U, "fuzz"});
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): refused (too many connections): use the others
    }
  }

  /// Sends `body` well-formed (with `fds`) and remembers what should answer it.
  void send(Conn& c, const proto::Body& body, const std::vector<int>& fds = {}) {
    const std::uint32_t rid = m_rid++;
    std::vector<std::byte> bytes;
    try {
      bytes = proto::encode(proto::Message{rid, body}, fds.size());
    } catch (const std::exception&) {
      return;  // a field the encoder refuses: malformed bytes are the hostile step's job
    }
    c.pending.emplace(rid, body);
    send_raw(c, bytes, fds);
  }

  void send_raw(Conn& c, std::vector<std::byte> bytes, const std::vector<int>& fds) {
    if (bytes.empty()) bytes.push_back(std::byte{0});  // an empty datagram reads as end-of-stream
    try {
      (void)os::send_message(c.sock.get(), bytes, fds, 65536);
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): the broker closed it; drain() notices
    }
  }

  std::uint64_t some_id(const Conn& c) {
    if (!c.lib_ids.empty() && pick(3) == 0) return c.lib_ids[pick(c.lib_ids.size())];
    if (!c.ids.empty() && pick(4) != 0) return c.ids[pick(c.ids.size())];
    if (!m_known_ids.empty() && pick(2) == 0) return m_known_ids[pick(m_known_ids.size())];
    return pick(300);
  }

  /// An fd for Create or Announce: a memfd of `size` bytes most often, else something that is not one.
  os::UniqueFd memory_fd(const Conn& c, std::uint64_t size) {
    try {
      switch (pick(8)) {
        case 0:
          return os::UniqueFd(::open("/dev/null", O_RDWR | O_CLOEXEC));
        case 1: {
          int p[2];
          if (::pipe2(p, O_CLOEXEC) != 0) return {};
          ::close(p[1]);
          return os::UniqueFd(p[0]);
        }
        case 2:
          return os::memfd_create("fz", size + 4096);  // a liar's size
        case 3:
          return os::UniqueFd(::fcntl(c.sock.get(), F_DUPFD_CLOEXEC, 0));  // its own connection
        case 4:                                                            // memory of another segment, sealed already
          if (!c.held.empty()) return os::UniqueFd(::fcntl(c.held[pick(c.held.size())].fd.get(), F_DUPFD_CLOEXEC, 0));
          [[fallthrough]];
        default:
          return os::memfd_create("fz", size);
      }
    } catch (const Error&) {
      return {};
    }
  }

  void step(std::size_t index) {
    Conn& c = m_conns[index];
    const auto r = pick(100);
    if (r < 17) {  // Create
      proto::Create req;
      req.name = name();
      req.kind = static_cast<proto::Kind>(pick(10) == 0 ? 1 + pick(4) : 2);
      req.mode = static_cast<std::uint16_t>(pick(2) == 0 ? 0600 : pick(01000));
      req.size = 4096 * (1 + pick(16));
      const std::uint32_t flags[] = {
          0, 0, 0, proto::kFlagSemaphore, proto::kFlagChannel, proto::kFlagPool, proto::kFlagCounting};
      req.flags = flags[pick(7)];
      auto fd = memory_fd(c, req.size);
      if (fd) send(c, req, {fd.get()});
    } else if (r < 33) {  // Open, maybe waiting for the name
      const std::uint32_t waits[] = {0, 0, 5, 50, 300};
      send(c, proto::Open{name(), pick(3) == 0 ? proto::Access::ReadOnly : proto::Access::ReadWrite, waits[pick(5)]});
    } else if (r < 42) {
      const std::uint64_t id = some_id(c);
      if (auto at = std::find(c.ids.begin(), c.ids.end(), id); at != c.ids.end()) c.ids.erase(at);
      send(c, proto::Close{id});
    } else if (r < 47) {  // by name, or by id (a segment of any name, or none)
      if (pick(3) == 0) {
        send(c, proto::UnlinkId{some_id(c)});
      } else {
        send(c, proto::Unlink{name()});
      }
    } else if (r < 49) {
      send(c, proto::Stat{name()});
    } else if (r < 51) {  // liveness: who holds a name, watch it (events follow), heartbeats that expire or not
      switch (pick(3)) {
        case 0:
          send(c, proto::Holders{name()});
          break;
        case 1:
          c.watching = true;
          send(c, proto::Watch{name()});
          break;
        default:
          send(c, proto::Heartbeat{name(), static_cast<std::uint32_t>(pick(4) == 0 ? 0 : 1 + pick(50))});
          break;
      }
    } else if (r < 54) {
      send(c, proto::List{pick(2) == 0 ? 0 : some_id(c)});
    } else if (r < 65) {  // Join with a role each object has, or not
      const std::uint64_t id = !c.lib_ids.empty() && pick(4) != 0 ? c.lib_ids[pick(c.lib_ids.size())] : some_id(c);
      send(c, proto::Join{id, static_cast<std::uint8_t>(pick(8) != 0 ? 1 + pick(4) : pick(256))});
    } else if (r < 71) {  // Announce memory this connection holds (its name is live: one more reference), or not
      proto::Announce req{name(), pick(2) == 0 ? proto::Access::ReadOnly : proto::Access::ReadWrite, 4096};
      os::UniqueFd fd;
      if (!c.held.empty() && pick(3) != 0) {
        const Held& h = c.held[pick(c.held.size())];
        req.name = h.name;
        req.size = h.size;
        fd = os::UniqueFd(::fcntl(h.fd.get(), F_DUPFD_CLOEXEC, 0));
      } else {
        fd = memory_fd(c, req.size);
      }
      if (fd) send(c, req, {fd.get()});
    } else if (r < 73) {  // Leave an entry this process joined (on any of its connections), or a made-up one
      proto::Leave req{some_id(c), static_cast<std::uint32_t>(pick(70)), static_cast<std::uint32_t>(m_rng())};
      if (!m_joined.empty() && pick(4) != 0) {
        const auto& j = m_joined[pick(m_joined.size())];
        req = proto::Leave{j.id, pick(4) == 0 ? static_cast<std::uint32_t>(pick(70)) : j.member, j.token};
      }
      send(c, req);
    } else if (r < 78) {  // Rejoin an entry this process joined (on any of its connections), or a made-up one
      proto::Rejoin req{some_id(c), static_cast<std::uint32_t>(pick(70)), static_cast<std::uint32_t>(m_rng()),
                        static_cast<std::uint8_t>(pick(6))};
      if (!m_joined.empty() && pick(4) != 0) {
        req = m_joined[pick(m_joined.size())];
        if (pick(4) == 0) req.member = static_cast<std::uint32_t>(pick(70));
      }
      send(c, req);
    } else if (r < 80) {  // a reply type, or Hello again: each refused
      const proto::Body bodies[] = {proto::Hello{1, "again"}, proto::OkReply{}, proto::JoinReply{1, 2},
                                    proto::StatReply{}, proto::ErrorReply{1, 0, "x"}};
      send(c, bodies[pick(5)]);
    } else if (r < 90) {
      library_objects();
    } else if (r < 96) {
      hostile(c);
    } else {  // hang up mid-conversation, replies unread
      m_conns.erase(m_conns.begin() + static_cast<std::ptrdiff_t>(index));
    }
  }

  /// Bytes the broker must refuse (it answers with an error and closes) or that it may serve when a mutation left
  /// them valid.
  void hostile(Conn& c) {
    const std::uint32_t rid = m_rid++;
    std::vector<std::byte> bytes;
    std::vector<int> fds;
    os::UniqueFd memory;
    switch (pick(6)) {
      case 0:  // garbage
        bytes.resize(pick(200));
        for (auto& b : bytes) b = static_cast<std::byte>(m_rng());
        break;
      case 1:  // a valid request with bytes changed, or cut short
        bytes = proto::encode(proto::Message{rid, proto::Open{name(), proto::Access::ReadWrite, 0}});
        if (pick(2) == 0) {
          for (int i = 0, n = 1 + static_cast<int>(pick(3)); i < n; ++i) {
            bytes[pick(bytes.size())] = static_cast<std::byte>(m_rng());
          }
        } else {
          bytes.resize(pick(bytes.size()));
        }
        break;
      case 2:  // fds (up to os::kMaxFds) on a request that carries none
        bytes = proto::encode(proto::Message{rid, proto::Stat{name()}});
        for (std::size_t i = 0, n = 1 + pick(os::kMaxFds); i < n; ++i) fds.push_back(c.sock.get());
        break;
      case 3:  // Create announcing an fd it does not send, or sending one it did not announce
        memory = os::memfd_create("fz", 4096);
        bytes = proto::encode(proto::Message{rid, proto::Create{.name = name(), .size = 4096}}, 1);
        if (pick(2) == 0) {
          bytes[proto::kHeaderSize - 2] = std::byte{0};
          fds.push_back(memory.get());
        }
        break;
      case 4:  // larger than any message
        bytes.assign(proto::kMaxMessageSize + 1 + pick(4096), std::byte{0x47});
        break;
      default:  // a request before Hello is the no-Hello connect's case; this is a header with a huge body length
        bytes = proto::encode(proto::Message{rid, proto::List{0}});
        bytes[12] = std::byte{0xff};
        bytes[13] = std::byte{0xff};
        break;
    }
    c.tainted = true;
    send_raw(c, bytes, fds);
  }

  /// Channels, semaphores and pools through the library, with random words written over their shared control
  /// blocks: the broker repairs them when this process leaves or dies and must not trust a word of them.
  void library_objects() {
    const std::string lib = m_prefix + "lib" + std::to_string(pick(4));
    try {
      switch (pick(4)) {
        case 0:
          m_channels.push_back(
              pick(2) == 0
                  ? Channel::create(lib, {.slots = 4, .slot_bytes = 256, .header_bytes = 16, .kind = SegmentKind::Host},
                                    ChannelRole::Producer)
                  : Channel::open(lib, pick(2) == 0 ? ChannelRole::Producer : ChannelRole::Consumer));
          break;
        case 1:
          m_semaphores.push_back(pick(2) == 0 ? Semaphore::create(lib, {.kind = SegmentKind::Host})
                                              : Semaphore::open(lib, {.role = SemaphoreRole::Signaller}));
          break;
        case 2:
          m_counting.push_back(pick(2) == 0 ? CountingSemaphore::create(lib, {.initial = 1, .max_count = 3})
                                            : CountingSemaphore::open(lib));
          if (pick(2) == 0) (void)m_counting.back().try_acquire(1 + static_cast<std::uint32_t>(pick(2)));
          break;
        default:
          m_pools.push_back(
              pick(2) == 0 ? Pool::create(lib, {.pool_mode = PoolMode::Fixed, .block_bytes = 256, .block_count = 8})
                           : Pool::open(lib));
          break;
      }
      auto control = Segment::open(lib);
      auto* words = static_cast<std::uint32_t*>(control.data());
      const std::size_t n = control.size() / 4;
      for (int i = 0, count = static_cast<int>(pick(8)); i < count; ++i) {
        proto::atomic(words[pick(n)]).store(static_cast<std::uint32_t>(m_rng()));
      }
      if (pick(4) == 0) Segment::unlink(lib);
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): a scribbled object may refuse to open
    }
    if (pick(3) == 0) m_channels.clear();
    if (pick(3) == 0) m_semaphores.clear();
    if (pick(3) == 0) m_pools.clear();
    if (pick(3) == 0) m_counting.clear();
  }

  /// Whether reply `msg` (with `nfds` fds) fits what connection `c` asked; says why not on stderr.
  bool check_reply(Conn& c, const proto::Message& msg, std::size_t nfds) {
    const MessageType type = proto::type_of(msg.body);
    auto it = c.pending.find(msg.request_id);
    const bool error = type == MessageType::Error;
    if (it == c.pending.end()) {
      // Protocol errors that end a connection answer request 0; a mutated request id gets its answer too.
      if ((error && msg.request_id == 0) || c.tainted) return true;
      // A watcher's events come unasked, as request 0.
      if (type == MessageType::Event && msg.request_id == 0 && c.watching) return nfds == 0;
      std::fprintf(stderr, "broker fuzz: reply type %d to request %u, which this connection never sent\n",
                   static_cast<int>(type), msg.request_id);
      return false;
    }
    const MessageType asked = proto::type_of(it->second);
    if (const auto* j = std::get_if<proto::Join>(&it->second); j != nullptr && type == MessageType::JoinReply) {
      const auto& r = std::get<proto::JoinReply>(msg.body);
      m_joined.push_back(proto::Rejoin{j->id, r.member, r.token, j->role});
    }
    c.pending.erase(it);
    if (!error && type != answer_to(asked)) {
      std::fprintf(stderr, "broker fuzz: request %u of type %d answered with type %d\n", msg.request_id,
                   static_cast<int>(asked), static_cast<int>(type));
      return false;
    }
    // HelloReply: the status page (or none); OpenReply to Open: the memory; nothing else carries an fd.
    const bool open_reply = type == MessageType::OpenReply && asked == MessageType::Open;
    const std::size_t want = type == MessageType::HelloReply || open_reply ? 1 : 0;
    if (nfds > want || (type == MessageType::OpenReply && nfds != want)) {
      std::fprintf(stderr, "broker fuzz: reply type %d to request type %d came with %zu fds\n", static_cast<int>(type),
                   static_cast<int>(asked), nfds);
      return false;
    }
    return true;
  }

  /// Reads what connection `index` has within `timeout_ms`; false when a reply is wrong.
  bool drain(std::size_t index, int timeout_ms) {
    if (index >= m_conns.size()) return true;
    Conn& c = m_conns[index];
    std::vector<std::byte> buf(proto::kMaxMessageSize);
    while (os::wait_readable(c.sock.get(), timeout_ms)) {
      timeout_ms = 0;
      std::size_t n = 0;
      std::vector<os::UniqueFd> fds;
      os::IoStatus st = os::IoStatus::Closed;
      try {
        st = os::receive_message(c.sock.get(), buf, n, fds);
      } catch (const Error&) {  // NOLINT(bugprone-empty-catch): reset by the broker: as closed
      }
      if (st != os::IoStatus::Ok) {
        m_conns.erase(m_conns.begin() + static_cast<std::ptrdiff_t>(index));
        return true;
      }
      proto::Message msg;
      std::string why;
      if (!proto::decode(std::span<const std::byte>(buf.data(), n), fds.size(), msg, why)) {
        std::fprintf(stderr, "broker fuzz: the broker sent an undecodable message: %s\n", why.c_str());
        return false;
      }
      if (!check_reply(c, msg, fds.size())) return false;
      m_replies[msg.body.index()].fetch_add(1);
      if (const auto* r = std::get_if<proto::OpenReply>(&msg.body)) {
        c.ids.push_back(r->info.id);
        if (r->info.name.find("lib") != std::string::npos) c.lib_ids.push_back(r->info.id);
        m_known_ids.push_back(r->info.id);
        if (!fds.empty() && !r->info.name.empty() && c.held.size() < 4) {
          c.held.push_back(Held{r->info.name, r->info.size, std::move(fds[0])});
        }
      }
      if (c.ids.size() > 32) c.ids.erase(c.ids.begin());
      if (c.lib_ids.size() > 8) c.lib_ids.erase(c.lib_ids.begin());
      if (m_known_ids.size() > 64) m_known_ids.erase(m_known_ids.begin());
      if (m_joined.size() > 16) m_joined.erase(m_joined.begin());
    }
    return true;
  }

  std::mt19937_64 m_rng;
  std::string m_prefix;
  Tally* m_replies;
  std::uint32_t m_rid = 1;
  std::vector<Conn> m_conns;
  std::vector<std::uint64_t> m_known_ids;  // from every connection of this process
  std::vector<proto::Rejoin> m_joined;
  std::vector<Channel> m_channels;
  std::vector<Semaphore> m_semaphores;
  std::vector<Pool> m_pools;
  std::vector<CountingSemaphore> m_counting;
};

std::uint64_t rss_kib(pid_t pid) {
  const auto status = read_file("/proc/" + std::to_string(pid) + "/status");
  if (!status) return 0;
  const auto at = status->find("VmRSS:");
  return at == std::string::npos ? 0 : std::strtoull(status->c_str() + at + 6, nullptr, 10);
}

/// Unlinks every name the clients left (their references went with their connections).
void unlink_all() {
  for (const auto& s : Segment::list()) {
    if (s.name.rfind("fz-", 0) != 0) continue;
    try {
      Segment::unlink(s.name);
    } catch (const Error&) {  // NOLINT(bugprone-empty-catch): a pool's unlink took its chunks along
    }
  }
}

TEST(BrokerFuzz, RandomRequestsFromDyingClientsLeaveTheBrokerAsItWas) {
  const std::uint64_t seed = env_number("GPUIPC_BROKER_FUZZ_SEED", std::random_device{}());
  const auto duration = std::chrono::seconds(env_number("GPUIPC_BROKER_FUZZ_SECONDS", 10));
  SCOPED_TRACE("GPUIPC_BROKER_FUZZ_SEED=" + std::to_string(seed));
  std::cout << "broker fuzz: seed " << seed << ", " << duration.count() << " s\n";
  std::mt19937_64 rng(seed);

  // A private broker, a child of this process so that its exit status is ours to check: this build's gpuipcd (the
  // ASan one in the ASan build), its stderr kept for the failure messages. The library must not start another.
  TempDir dir("gpuipc-fuzz");
  const std::string daemon = GPUIPC_BUILD_BIN_DIR "/gpuipcd";
  const pid_t broker = start_child([&] {
    const int log = ::open(dir.file("broker.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (log < 0 || ::dup2(log, 2) < 0) return 90;
    // A small ASan quarantine, so that freed memory it holds back does not read as growth.
    const char* asan = std::getenv("ASAN_OPTIONS");
    const std::string opts = std::string(asan != nullptr ? asan : "") + ":quarantine_size_mb=4";
    ::setenv("ASAN_OPTIONS", opts.c_str(), 1);
    const std::string arg = "--runtime-dir=" + dir.path();
    ::execl(daemon.c_str(), daemon.c_str(), arg.c_str(), static_cast<char*>(nullptr));
    return 91;
  });
  auto broker_log = [&] { return "broker log:\n" + read_file(dir.file("broker.log")).value_or("(none)"); };
  struct StopBroker {  // on a failed assertion: the broker does not outlive the test
    pid_t pid;
    ~StopBroker() {
      if (pid > 0 && ::kill(pid, SIGKILL) == 0) wait_child(pid, 10s);
    }
  } stop_broker{broker};
  ::setenv("GPUIPC_RUNTIME_DIR", dir.path().c_str(), 1);
  ::setenv("GPUIPC_NO_AUTOSTART", "1", 1);
  // Listening, not only bound: broker.sock exists from bind(2), a moment before listen(2).
  ASSERT_TRUE(wait_until([] { return gpuipc::broker_listening(); }, 10s)) << broker_log();
  ASSERT_EQ(BrokerEnvironment::broker_pid(), broker);

  Shared<Tally> replies(std::variant_size_v<proto::Body>);
  // Warm up every path once, so that what the broker allocates for good (its maps, buffers) is in the baseline.
  EXPECT_EQ(run_child([&] {
              return Client(seed ^ 0x5eed, "fz-warm-", replies.get()).run(std::chrono::steady_clock::now() + 1s);
            }),
            0);
  unlink_all();
  ASSERT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == 0; }, 5s))
      << BrokerEnvironment::broker_references() << " references after the warm-up";
  const int fds_before = BrokerEnvironment::broker_fd_baseline();
  const std::uint64_t rss_before = rss_kib(broker);

  const auto deadline = std::chrono::steady_clock::now() + duration;
  std::array<pid_t, kClients> kids{};
  struct KillLeftovers {  // on a failed assertion: no client outlives the test
    std::array<pid_t, kClients>& kids;
    ~KillLeftovers() {
      for (pid_t& p : kids) {
        if (p > 0 && ::kill(p, SIGKILL) == 0) wait_child(p, 10s);
      }
    }
  } leftovers{kids};
  std::uint64_t generation = 0, kills = 0;
  auto spawn = [&](std::size_t k) {
    const std::uint64_t s = seed + 1000003 * ++generation + k;
    const std::string prefix = "fz-" + std::to_string(k % 2) + "-";  // two clients share each set of names
    kids[k] = start_child([&, s, prefix] { return Client(s, prefix, replies.get()).run(deadline); });
  };
  for (std::size_t k = 0; k < kids.size(); ++k) spawn(k);
  auto slowest = std::chrono::steady_clock::duration::zero();
  while (std::chrono::steady_clock::now() + 500ms < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 300));
    const std::size_t k = rng() % kids.size();
    ::kill(kids[k], SIGKILL);
    const int rc = wait_child(kids[k], 10s);
    kids[k] = 0;
    ASSERT_TRUE(rc == 128 + SIGKILL || rc == 0) << "client " << k << " ended with " << rc;
    ++kills;
    spawn(k);
    // The broker keeps answering (a stat of a name nobody makes), however the clients treat it.
    const auto asked = std::chrono::steady_clock::now();
    EXPECT_THROW(Segment::stat("fz-probe"), Error);
    slowest = std::max(slowest, std::chrono::steady_clock::now() - asked);
    ASSERT_LT(slowest, kProbeLimit) << "the broker took that long to answer a Stat" << broker_log();
  }
  for (pid_t& kid : kids) {
    EXPECT_EQ(wait_child(kid, 30s), 0);
    kid = 0;
  }
  ASSERT_TRUE(os::process_alive(broker)) << broker_log();
  ASSERT_EQ(BrokerEnvironment::broker_pid(), broker) << broker_log();

  // Everything the clients held went with their connections: once their names are unlinked, nothing is left.
  unlink_all();
  std::vector<SegmentInfo> left;
  EXPECT_TRUE(wait_until([&] { return (left = Segment::list()).empty(); }, 5s))
      << left.size() << " segments left, the first '" << left.front().name << "'";
  EXPECT_TRUE(wait_until([] { return BrokerEnvironment::broker_references() == 0; }, 5s))
      << BrokerEnvironment::broker_references() << " references left";
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_fd_count() <= fds_before; }, 5s))
      << BrokerEnvironment::broker_fd_count() << " broker fds, " << fds_before << " before";
  const std::uint64_t rss_after = rss_kib(broker);
  EXPECT_LE(rss_after, rss_before + kRssGrowthKiB) << "broker RSS grew from " << rss_before << " KiB to " << rss_after;
  auto n = [&](MessageType t) { return replies[static_cast<std::size_t>(t) - 1].load(); };
  std::cout << "broker fuzz: " << kills << " clients killed, slowest probe "
            << std::chrono::duration_cast<std::chrono::milliseconds>(slowest).count()
            << " ms; replies: " << n(MessageType::HelloReply) << " HelloReply, " << n(MessageType::OpenReply)
            << " OpenReply, " << n(MessageType::StatReply) << " StatReply, " << n(MessageType::ListReply)
            << " ListReply, " << n(MessageType::Ok) << " Ok, " << n(MessageType::JoinReply) << " JoinReply, "
            << n(MessageType::Error) << " Error; broker fds " << BrokerEnvironment::broker_fd_count() << " ("
            << fds_before << " before), RSS " << rss_after << " KiB (" << rss_before << " before)\n";
  EXPECT_GT(n(MessageType::OpenReply), 0U) << "the fuzzer never got a segment made or opened";

  ASSERT_EQ(::kill(broker, SIGTERM), 0);
  EXPECT_EQ(wait_child(broker, 30s), 0) << broker_log();
  stop_broker.pid = 0;
}

}  // namespace
}  // namespace gpuipc::test
