// libFuzzer target for the broker's state (src/broker Registry): the input is a session of requests from five
// connections of three users (two of one uid and this process's pid, one of that uid whose process is gone, one of
// another uid, one of root), with real memfds for the memory, control blocks made the way the library makes them
// (or not), waiting opens, time passing, connections dropping with and without repair, broker restarts over the
// journal (names given back by Announce), as written or cut, overwritten or appended to, any message the wire decoder accepts, and writes of any bytes into the
// control blocks the connections share with the broker. The broker serves every user of the machine, so beyond
// "never crashes, never reads out of bounds, never hangs" (ASan + UBSan, libFuzzer's -timeout) it checks what the
// server relies on: every message the registry hands back encodes (the server sends it as is), and once every
// connection has gone no reference and no waiting open is left.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "broker/registry.hpp"
#include "fuzz_input.hpp"
#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "os/memfd.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"
#include "shm/channel_ring.hpp"
#include "shm/pool_block.hpp"
#include "shm/semaphore_block.hpp"

namespace {

using namespace gpuipc;          // NOLINT(google-build-using-namespace): a test harness
using namespace gpuipc::broker;  // NOLINT(google-build-using-namespace)

[[noreturn]] void die(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_broker: %s: %s\n", what, detail.c_str());
  std::abort();
}

using fuzz::Input;

const bool kTrace = std::getenv("FUZZ_BROKER_TRACE") != nullptr;

/// A pid no process has (above the kernel's largest pid_max): its pidfd_open fails, as for a process gone.
constexpr pid_t kGonePid = (1 << 22) + 7;

/// A memory fd a connection handed over, as that process keeps it: its own descriptor and mapping.
struct Kept {
  os::UniqueFd fd;
  os::Mapping map;
  std::string name;
  std::uint64_t size = 0;
};

/// A member entry a JoinReply gave.
struct Joined {
  std::uint64_t id = 0;
  std::uint32_t member = 0;
  std::uint32_t token = 0;
};

class Session {
 public:
  explicit Session(const std::string& journal) : m_journal(journal) {
    std::remove(m_journal.c_str());
    start_broker();
    const uid_t uid = ::getuid();
    const gid_t gid = ::getgid();
    m_creds = {os::Credentials{::getpid(), uid, gid, {}}, os::Credentials{::getpid(), uid, gid, {}},
               os::Credentials{kGonePid, uid, gid, {}}, os::Credentials{kGonePid, uid + 1, gid + 1, {}},
               os::Credentials{::getpid(), 0, 0, {}}};
    for (std::size_t c = 0; c < m_creds.size(); ++c) connect(c);
  }
  ~Session() {
    m_registry.reset();
    std::remove(m_journal.c_str());
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void run(Input& in) {
    for (int op = 0; op < 128 && !in.empty(); ++op) step(in);
    // Every connection goes: nothing may stay referenced or parked.
    for (std::size_t c = 0; c < m_conn.size(); ++c) drop(c, true);
    if (m_registry->total_references() != 0) die("references left", std::to_string(m_registry->total_references()));
    if (m_registry->pending_count() != 0) die("opens left waiting", std::to_string(m_registry->pending_count()));
  }

 private:
  void start_broker() {
    Quotas q;
    q.bytes = 1 << 22;
    q.segments = 6;
    q.fds = 24;
    q.pending_opens_per_connection = 3;
    q.refs_per_connection = 4;
    m_registry = std::make_unique<Registry>(q);
    m_registry->open_journal(m_journal, m_now, 50'000'000);
  }

  void connect(std::size_t c) {
    if (m_conn.size() <= c) m_conn.resize(c + 1, 0);
    m_conn[c] = m_next_conn++;
    m_registry->add_connection(m_conn[c], m_creds[c]);
  }

  void drop(std::size_t c, bool repair) {
    if (m_conn[c] == 0) return;
    std::vector<Outgoing> out;
    m_registry->drop_connection(m_conn[c], repair, &out);
    check(out);
    m_conn[c] = 0;
  }

  /// What the server would send: each message must encode.
  void check(const std::vector<Outgoing>& out) {
    for (const auto& o : out) {
      try {
        (void)proto::encode(o.msg, o.fd ? 1 : 0);
      } catch (const std::exception& e) {
        die("a reply that does not encode", e.what());
      }
      if (const auto* r = std::get_if<proto::OpenReply>(&o.msg.body)) remember(m_ids, r->info.id);
      if (const auto* j = std::get_if<proto::JoinReply>(&o.msg.body)) {
        if (m_joined.size() < 16) m_joined.push_back(Joined{m_last_join_id, j->member, j->token});
      }
    }
  }

  static void remember(std::vector<std::uint64_t>& ids, std::uint64_t id) {
    if (ids.size() < 16 && std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
  }

  /// Sends `body` from a connection the input picks, as the server would hand it over: only what the wire decoder
  /// accepts (a name it refuses, say, never reaches the registry).
  void ask(Input& in, proto::Body body, std::vector<os::UniqueFd> fds = {}) {
    const std::size_t c = in.byte() % m_conn.size();
    if (m_conn[c] == 0) connect(c);
    proto::Message request;
    std::string error;
    try {
      const auto wire = proto::encode(proto::Message{m_rid++, std::move(body)}, fds.size());
      if (!proto::decode(wire, fds.size(), request, error)) return;
    } catch (const std::exception&) {
      return;  // not a message a client can send (encode refuses it: std::invalid_argument)
    }
    std::vector<Outgoing> out;
    m_registry->handle(Caller{m_conn[c], m_creds[c]}, request, fds, m_now, out);
    if (kTrace) {  // FUZZ_BROKER_TRACE=1: what each request got, to check what a seed does
      std::fprintf(stderr, "connection %zu: request type %d ->", c, static_cast<int>(proto::type_of(request.body)));
      for (const auto& o : out) {
        const auto* e = std::get_if<proto::ErrorReply>(&o.msg.body);
        std::fprintf(stderr, " [type %d%s%s]", static_cast<int>(proto::type_of(o.msg.body)), e ? ": " : "",
                     e ? e->message.c_str() : "");
      }
      std::fprintf(stderr, "\n");
    }
    check(out);
  }

  std::string name(Input& in) {
    static const char* const kNames[] = {"a", "b", "c", "ch", "pool"};
    const std::uint8_t b = in.byte();
    if (b < 224) return kNames[b % std::size(kNames)];
    const auto raw = in.take(b % 24);  // any bytes: the registry must refuse or carry them safely
    return std::string(reinterpret_cast<const char*>(raw.data()), raw.size());
  }

  std::uint64_t id(Input& in) {
    const std::uint8_t b = in.byte();
    if (!m_ids.empty() && b < 240) return m_ids[b % m_ids.size()];
    return in.u64() % 64;
  }

  /// A segment id (id()), with the member and token of an entry some connection joined, or any.
  Joined member_entry(Input& in) {
    Joined j{id(in), in.byte() % 64U, in.u32()};
    if (!m_joined.empty() && (in.byte() & 1) != 0) {
      const Joined& known = m_joined[in.byte() % m_joined.size()];
      j.member = known.member;
      j.token = known.token;
    }
    return j;
  }

  /// A Create the way the library makes one (its memory, made and filled in first), with the input choosing
  /// where it departs from that: the flags, the size, the memfd's size, the fds sent, the mode.
  void create(Input& in) {
    static constexpr std::uint32_t kFlags[] = {0, proto::kFlagSemaphore, proto::kFlagChannel, proto::kFlagPool,
                                               proto::kFlagCounting};
    proto::Create req;
    req.name = name(in);
    const std::uint8_t shape = in.byte();
    req.kind = (shape & 0x80) != 0 ? static_cast<proto::Kind>(1 + in.byte() % 4) : proto::Kind::Host;
    req.flags = shape % 8 < 5 ? kFlags[shape % 8] : in.u32();
    const std::uint32_t slots = 1 + in.byte() % 8;
    const std::uint32_t records = 1 + in.byte() % 8;
    std::uint64_t size = 4096;
    if (req.flags == proto::kFlagSemaphore) size = sizeof(proto::SemaphoreBlock);
    if (req.flags == proto::kFlagChannel) size = proto::channel_control_bytes(slots, 64);
    if (req.flags == proto::kFlagPool) size = shm::pool_control_bytes(records);
    if (req.flags == proto::kFlagCounting) size = sizeof(proto::CountingBlock);
    if ((shape & 0x40) != 0) size = in.u32() % (1 << 20);
    req.size = size;
    static constexpr std::uint16_t kModes[] = {0600, 0644, 0666, 0660, 0400};
    const std::uint8_t m = in.byte();
    req.mode = m < 250 ? kModes[m % std::size(kModes)] : static_cast<std::uint16_t>(in.u32() & 0777);
    const std::size_t memfd_size = (shape & 0x20) != 0 ? in.u32() % (1 << 20) : size;
    std::vector<os::UniqueFd> fds;
    try {
      Kept k;
      k.fd = os::memfd_create("fuzz", memfd_size);
      if (memfd_size > 0) {
        k.map = os::Mapping::map(k.fd.get(), memfd_size, true);
        fill(req.flags, k.map, slots, records, in);
      }
      k.name = req.name;
      k.size = size;
      const std::uint8_t sent = in.byte() % 8;  // 1 fd, as the library sends; or none, or two
      if (sent != 0) fds.push_back(os::dup_fd(k.fd.get()));
      if (sent == 7) fds.push_back(os::memfd_create("extra", 4096));
      if (m_kept.size() < 8) m_kept.push_back(std::move(k));
    } catch (const Error&) {
      return;  // out of fds or memory here: not the broker's doing
    }
    ask(in, std::move(req), std::move(fds));
  }

  /// Fills a new control block as its creator does (`flags` names which), unless the input says to leave it.
  static void fill(std::uint32_t flags, const os::Mapping& map, std::uint32_t slots, std::uint32_t records, Input& in) {
    if ((in.byte() & 7) == 0) return;  // left as zeros (or as the input scribbles it later)
    void* p = map.data();
    if (flags == proto::kFlagSemaphore && map.size() >= sizeof(proto::SemaphoreBlock)) shm::semaphore_init(p, 0);
    if (flags == proto::kFlagChannel && map.size() >= proto::channel_control_bytes(slots, 64)) {
      shm::ring_init(p, slots, 64, 4096, static_cast<std::uint32_t>(proto::Kind::Host));
    }
    if (flags == proto::kFlagPool && map.size() >= shm::pool_control_bytes(records)) {
      shm::PoolGeometry g;
      g.pool_id = 7;
      g.mode = shm::PoolMode::Variable;
      g.kind = static_cast<std::uint32_t>(proto::Kind::Host);
      g.max_chunks = 2;
      g.chunk_bytes = 1 << 20;
      g.max_records = records;
      shm::init_pool(p, g);
    }
    if (flags == proto::kFlagCounting && map.size() >= sizeof(proto::CountingBlock)) {
      auto* b = static_cast<proto::CountingBlock*>(p);
      b->version = proto::kCountingVersion;
      b->max_count = 4;
      b->initial = 4;
      b->state = 4;
      b->magic = proto::kCountingMagic;
    }
  }

  void step(Input& in) {
    const std::uint8_t code = in.byte();
    switch (code % 20) {
      case 0:
      case 1:
        create(in);
        break;
      case 2: {
        static constexpr std::uint32_t kWaits[] = {0, 0, 1, 30};
        const auto access = (in.byte() & 1) != 0 ? proto::Access::ReadWrite : proto::Access::ReadOnly;
        auto n = name(in);
        ask(in, proto::Open{std::move(n), access, kWaits[in.byte() % 4]});
        break;
      }
      case 3:
        ask(in, proto::Close{id(in)});
        break;
      case 4:  // by name, or by id
        if ((in.byte() & 3) == 0) {
          ask(in, proto::UnlinkId{id(in)});
        } else {
          ask(in, proto::Unlink{name(in)});
        }
        break;
      case 5:
        ask(in, proto::Stat{name(in)});
        break;
      case 6:
        ask(in, proto::List{static_cast<std::uint64_t>(in.byte() % 8)});
        break;
      case 7: {
        m_last_join_id = id(in);
        ask(in, proto::Join{m_last_join_id, static_cast<std::uint8_t>(in.byte() % 6)});
        break;
      }
      case 8: {  // Leave of an entry some connection joined, or of anything
        const Joined j = member_entry(in);
        ask(in, proto::Leave{j.id, j.member, j.token});
        break;
      }
      case 9: {  // after a restart: a member entry a connection joined, under the id Announce gave its name
        const Joined j = member_entry(in);
        ask(in, proto::Rejoin{j.id, j.member, j.token, static_cast<std::uint8_t>(in.byte() % 6)});
        break;
      }
      case 10:
        ask(in, proto::Holders{name(in)});
        break;
      case 11:
        ask(in, proto::Watch{name(in)});
        break;
      case 12: {
        static constexpr std::uint32_t kDeadlines[] = {0, 1, 10, proto::kMaxHeartbeatMs};
        auto n = name(in);
        ask(in, proto::Heartbeat{std::move(n), kDeadlines[in.byte() % 4]});
        break;
      }
      case 13: {  // after a restart: a process gives back a name it still holds, with its fd (or another's)
        if (m_kept.empty()) break;
        const Kept& k = m_kept[in.byte() % m_kept.size()];
        std::vector<os::UniqueFd> fds;
        try {
          fds.push_back(os::dup_fd(k.fd.get()));
        } catch (const Error&) {
          break;
        }
        const auto access = (in.byte() & 1) != 0 ? proto::Access::ReadWrite : proto::Access::ReadOnly;
        const std::string n = (in.byte() & 3) != 0 ? k.name : name(in);
        ask(in, proto::Announce{n, access, (in.byte() & 3) != 0 ? k.size : in.u64()}, std::move(fds));
        break;
      }
      case 14: {  // any message the wire decoder accepts, with as many fds as it says arrived
        const std::size_t nfds = in.byte() % 3;
        proto::Message msg;
        std::string error;
        if (!proto::decode(in.take(in.byte() * 2U), nfds, msg, error)) break;
        std::vector<os::UniqueFd> fds;
        try {
          for (std::size_t i = 0; i < nfds; ++i) fds.push_back(os::memfd_create("raw", 4096));
        } catch (const Error&) {
          break;
        }
        ask(in, std::move(msg.body), std::move(fds));
        break;
      }
      case 15: {  // time passes: parked opens, heartbeats, exits and owed writes come due
        m_now += static_cast<std::int64_t>(in.byte()) * ((in.byte() & 1) != 0 ? 1'000'000 : 100'000'000);
        std::vector<Outgoing> out;
        m_registry->expire(m_now, out);
        check(out);
        break;
      }
      case 16:  // a connection closes (its process exited or crashed), or the server drops it without repair
        drop(in.byte() % m_conn.size(), (in.byte() & 7) != 0);
        break;
      case 17: {  // the broker dies and a new one starts over its journal; connections come back
        m_registry.reset();
        damage_journal(code / 20, in);  // 17 (the seeds' code): a journal as written
        start_broker();  // the processes keep their ids and member entries, to give back (Announce, Rejoin)
        for (std::size_t c = 0; c < m_conn.size(); ++c) connect(c);
        break;
      }
      default: {  // 18, 19: a process writes anything anywhere into memory it shares with the broker
        if (m_kept.empty()) break;
        const Kept& k = m_kept[in.byte() % m_kept.size()];
        if (!k.map) break;
        const std::size_t at = in.u32() % k.map.size();
        const std::uint64_t v = in.u64();
        std::memcpy(static_cast<std::byte*>(k.map.data()) + at, &v, std::min<std::size_t>(8, k.map.size() - at));
        break;
      }
    }
  }

  /// What a full disk, a crash of the machine or a bad block leaves of the journal the next broker reads: `how` 1
  /// cuts it anywhere, 2 overwrites up to 32 bytes anywhere with the input's, 3 appends up to 255 of them; else it
  /// is left as written. The next broker must start over whatever it finds, or it would not start at all.
  void damage_journal(unsigned how, Input& in) const {
    if (how < 1 || how > 3) return;
    struct stat st {};
    if (::stat(m_journal.c_str(), &st) != 0) return;
    const auto size = static_cast<std::uint64_t>(st.st_size);
    const os::UniqueFd fd(::open(m_journal.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd) return;
    if (how == 1) {
      (void)::ftruncate(fd.get(), static_cast<off_t>(in.u32() % (size + 1)));
      return;
    }
    const std::uint64_t at = how == 2 ? in.u32() % (size + 1) : size;
    const std::span<const std::byte> bytes = in.take(how == 2 ? in.byte() % 33 : in.byte());
    (void)::pwrite(fd.get(), bytes.data(), bytes.size(), static_cast<off_t>(at));
  }

  std::string m_journal;
  std::int64_t m_now = 1'000'000'000;
  std::unique_ptr<Registry> m_registry;
  std::vector<os::Credentials> m_creds;
  std::vector<ConnId> m_conn;  // 0: closed
  ConnId m_next_conn = 16;
  std::uint32_t m_rid = 1;
  std::vector<Kept> m_kept;
  std::vector<std::uint64_t> m_ids;
  std::vector<Joined> m_joined;
  std::uint64_t m_last_join_id = 0;
};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  ::setenv("GPUIPC_LOG", "off", 0);  // the broker's warnings about bad requests are what the fuzzer makes, by design
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string journal = [] {
    const char* dir = ::access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    return std::string(dir) + "/gpuipc-fuzz-broker-" + std::to_string(::getpid()) + ".journal";
  }();
  Input in(data, size);
  Session(journal).run(in);
  return 0;
}
