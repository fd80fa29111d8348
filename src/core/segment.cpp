#include "gpuipc/segment.hpp"

#include <fmt/format.h>

#include <cstring>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "base/format.hpp"
#include "base/log.hpp"
#include "core/client.hpp"
#include "core/gpu_memory.hpp"
#include "core/membership.hpp"
#include "core/segment_internal.hpp"
#include "cuda/context.hpp"
#include "cuda/trace.hpp"
#include "os/memfd.hpp"

namespace gpuipc {
namespace detail {

Mapping::~Mapping() {
  // The registrations first, while the host memory they cover is still mapped (host_registration.hpp): a late one
  // (a member, destroyed after this body) was unregistered after the munmap, when another mapping may be there.
  late_gpu.reset();
  gpu.reset();
  host = os::Mapping();
  if (client_generation == 0) return;  // never registered
  // Only on the connection that took the reference: a broker that went away took it along, and a forked child
  // or a new broker must not get a Close for an id it never gave out.
  if (!core::BrokerClient::instance().request_on(client_generation, proto::Close{id})) {
    GPUIPC_LOG_DEBUG("segment '{}' (id {}): its broker connection is gone; nothing to close", name, id);
  }
}

std::string check_name_or_throw(std::string_view name) {
  auto why = proto::check_name(name);
  if (!why.empty()) {
    // The name as printable text: a NUL in it cut what() short, and control bytes reached the terminal.
    const std::string shown = printable(name, 200);
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("invalid segment name '{}': {} (use 1-{} characters of A-Z a-z 0-9 . _ -, not starting "
                            "with '.' or '-')",
                            shown, why, proto::kMaxNameLength),
                "check_name");
  }
  return std::string(name);
}

}  // namespace detail

namespace {

constexpr std::string_view kKindNames[] = {"?", "device", "host", "host_pinned", "device_ipc"};
using detail::check_name_or_throw;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

std::string uuid_string(const proto::Uuid& u) {
  bool zero = true;
  for (auto b : u) zero = zero && b == 0;
  if (zero) return {};
  std::string s = "GPU-";
  for (std::size_t i = 0; i < u.size(); ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
    s += fmt::format("{:02x}", u[i]);
  }
  return s;
}

SegmentInfo to_info(const proto::SegmentInfo& p) {
  SegmentInfo i;
  i.id = p.id;
  i.name = p.name;
  i.kind = static_cast<SegmentKind>(p.kind);
  i.size = p.view_size != 0 ? p.view_size : p.size;  // adopted VMM memory: the bytes shared, not the allocation
  i.device_uuid = uuid_string(p.device);
  i.owner_uid = p.owner_uid;
  i.owner_gid = p.owner_gid;
  i.mode = p.mode;
  i.created_unix_ns = p.created_unix_ns;
  i.references = p.references;
  i.mapper_pids = p.mapper_pids;
  i.mapper_count = p.mapper_count;
  return i;
}

/// This process's mappings by (name, access, requested device). A hit costs a hash lookup and one atomic load
/// of the broker's names generation: an unlink anywhere invalidates every binding made before it, and the next
/// open of such a name asks the broker again (Stat) whether it still names the same segment.
class MappingCache {
 public:
  static MappingCache& instance() {
    static MappingCache* cache = new MappingCache();  // NOLINT: process lifetime, outlives static Segments
    return *cache;
  }

  /// The cached mapping for `key` (nullptr when none or made through an older connection) and whether it is
  /// fresh: bound at the current names generation of the current broker. A stale one must be checked with the broker
  /// before reuse. A broker started after the last one died counts its generations from 1 again, and the names it was
  /// given back are not all the names they were (a control block unlinked while held comes back with none): an entry
  /// bound through an earlier broker is stale, whatever its number.
  std::pair<std::shared_ptr<detail::Mapping>, bool> find(const std::string& key, std::uint64_t names_gen,
                                                         std::uint64_t client_gen) {
    std::lock_guard lock(m_mutex);
    auto it = m_entries.find(key);
    if (it == m_entries.end()) return {nullptr, false};
    auto map = it->second.mapping.lock();
    if (!map || map->client_generation != client_gen) {
      m_entries.erase(it);
      return {nullptr, false};
    }
    return {std::move(map),
            names_gen != 0 && it->second.names_generation == names_gen && it->second.client_generation == client_gen};
  }

  void put(const std::string& key, const std::shared_ptr<detail::Mapping>& map, std::uint64_t names_gen) {
    std::lock_guard lock(m_mutex);
    m_entries[key] = Entry{map, names_gen, map->client_generation.load()};
  }

  void erase(const std::string& key) {
    std::lock_guard lock(m_mutex);
    m_entries.erase(key);
  }

 private:
  struct Entry {
    std::weak_ptr<detail::Mapping> mapping;
    std::uint64_t names_generation = 0;
    std::uint64_t client_generation = 0;  // the broker connection it was bound through
  };
  std::mutex m_mutex;
  std::unordered_map<std::string, Entry> m_entries;
};

/// Every mapping this process registered with a broker, so that a broker started after the last one died gets the
/// names back (Announce) and the memberships (Rejoin): the library reconnects (its watcher at once, else the next
/// call) and runs rebind(). The same when a broker that runs on cut the connection (or the library dropped it): the
/// references come back, and a device_ipc share's exporter is its exporter again.
class LiveMappings {
 public:
  static LiveMappings& instance() {
    static LiveMappings* live = new LiveMappings();  // NOLINT: process lifetime, like the cache
    return *live;
  }
  void add(const std::shared_ptr<detail::Mapping>& m) {
    std::lock_guard lock(m_mutex);
    std::erase_if(m_maps, [](const std::weak_ptr<detail::Mapping>& w) { return w.expired(); });
    m_maps.push_back(m);
  }
  std::vector<std::shared_ptr<detail::Mapping>> snapshot() {
    std::lock_guard lock(m_mutex);
    std::vector<std::shared_ptr<detail::Mapping>> out;
    for (auto& w : m_maps) {
      if (auto m = w.lock()) out.push_back(std::move(m));
    }
    return out;
  }

 private:
  std::mutex m_mutex;
  std::vector<std::weak_ptr<detail::Mapping>> m_maps;
};

/// Gives every mapping of the lost connection back to the new broker, then rejoins the memberships.
void rebind(std::uint64_t old_generation, std::uint64_t new_generation, const core::BrokerClient::Exchange& exchange) {
  for (const auto& m : LiveMappings::instance().snapshot()) {
    if (m->client_generation != old_generation || !m->memory) continue;
    proto::Announce a;
    a.name = m->name;
    a.access = m->access == Access::ReadOnly ? proto::Access::ReadOnly : proto::Access::ReadWrite;
    a.size = m->broker_size;
    const int fd = m->memory.get();
    try {
      auto r = exchange(a, std::span<const int>(&fd, 1));
      if (const auto* o = std::get_if<proto::OpenReply>(&r.msg.body)) {
        m->id = o->info.id;
        m->client_generation = new_generation;
      }
    } catch (const Error& e) {
      GPUIPC_LOG_INFO("segment '{}' stays mapped but unnamed after the broker restart: {}", m->name, e.what());
    }
  }
  core::rejoin_members(new_generation, exchange);
}

void remember_for_restart(const std::shared_ptr<detail::Mapping>& m) {
  static std::once_flag hook;
  std::call_once(hook, [] { core::BrokerClient::instance().set_rebind_hook(&rebind); });
  LiveMappings::instance().add(m);
  core::BrokerClient::instance().keep_connected();  // given back at once when the broker dies
}

std::string cache_key(std::string_view name, Access access, int device) {
  return fmt::format("{}\x1f{}\x1f{}", name, static_cast<int>(access), device);
}

void map_host(detail::Mapping& m, int fd, bool writable) {
  m.host = os::Mapping::map(fd, m.size, writable);
}

}  // namespace

std::string_view to_string(SegmentKind kind) noexcept {
  const auto i = static_cast<std::size_t>(kind);
  return i < std::size(kKindNames) ? kKindNames[i] : "?";
}

Segment::Segment() noexcept = default;
Segment::Segment(std::shared_ptr<detail::Mapping> map) noexcept : m_map(std::move(map)) {}
Segment::Segment(Segment&&) noexcept = default;
Segment& Segment::operator=(Segment&&) noexcept = default;
Segment::Segment(const Segment&) noexcept = default;
Segment& Segment::operator=(const Segment&) noexcept = default;
Segment::~Segment() = default;

void* Segment::data() const noexcept {
  if (!m_map) return nullptr;
  if (m_map->kind == SegmentKind::Device || m_map->kind == SegmentKind::DeviceIpc) {
    return reinterpret_cast<void*>(device_pointer());  // NOLINT(performance-no-int-to-ptr): a device address
  }
  return m_map->host.data();
}
std::uint64_t Segment::device_pointer() const noexcept {
  return m_map && m_map->gpu ? m_map->gpu->device_pointer() + m_map->view_offset : 0;
}
std::size_t Segment::size() const noexcept { return m_map ? m_map->size : 0; }
SegmentKind Segment::kind() const noexcept { return m_map ? m_map->kind : SegmentKind::Host; }
Access Segment::access() const noexcept { return m_map ? m_map->access : Access::ReadOnly; }
int Segment::device() const noexcept { return m_map && m_map->gpu ? m_map->gpu->device() : -1; }
const std::string& Segment::name() const noexcept {
  static const std::string kEmpty;
  return m_map ? m_map->name : kEmpty;
}
std::uint64_t Segment::id() const noexcept { return m_map ? m_map->id.load() : 0; }
std::uint32_t Segment::owner_uid() const noexcept { return m_map ? m_map->owner_uid : 0; }
std::uint32_t Segment::owner_gid() const noexcept { return m_map ? m_map->owner_gid : 0; }
unsigned Segment::mode() const noexcept { return m_map ? m_map->mode : 0; }
void Segment::close() noexcept { m_map.reset(); }
bool Segment::alive() const noexcept { return !m_map || m_map->alive(); }
void Segment::check_alive() const {
  if (!alive()) throw detail::exporter_gone_error(m_map->name);
}

namespace {

/// Whether `name` ends as the segments a channel or a pool makes beside its control block do: `X.slots` (a channel's
/// buffers) or `X.chunk.<digits>` (a pool's chunks). Channel::create takes a `X.slots` that nobody holds for the
/// leftover of a killed create and reclaims it, and pools sweep their chunks by name.
bool reserved_name(std::string_view name) { return name.ends_with(".slots") || !proto::pool_of_chunk(name).empty(); }

}  // namespace

Segment Segment::create(std::string_view name, std::size_t bytes, const CreateOptions& options) {
  GPUIPC_TRACE("gpuipc::Segment::create");
  if (reserved_name(name)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("segment '{}': names ending in '.slots' or '.chunk.<n>' are reserved for the buffers "
                            "of channels and the chunks of pools (a channel's create reclaims a '.slots' nobody "
                            "holds); choose another name",
                            name),
                "create");
  }
  return detail::create_segment(name, bytes, options, 0);
}

Segment detail::create_segment(std::string_view name, std::size_t bytes, const CreateOptions& options,
                               std::uint32_t flags, const std::function<void(void*)>& init, std::uint64_t place_at,
                               int also_map_for) {
  std::string n = check_name_or_throw(name);
  if (bytes == 0 || bytes > proto::kMaxSegmentSize) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("segment '{}': size {} is out of range (1 byte to 1 TiB)", name, bytes), "create");
  }
  if ((options.mode & ~0777U) != 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("segment '{}': mode {:o} has bits outside 0777", name, options.mode), "create");
  }
  if (options.kind != SegmentKind::Device && options.kind != SegmentKind::Host &&
      options.kind != SegmentKind::HostPinned && options.kind != SegmentKind::DeviceIpc) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("segment '{}': kind {} is not a segment kind (Device, Host or HostPinned)", name,
                            static_cast<unsigned>(options.kind)),
                "create");
  }
  if (options.kind == SegmentKind::DeviceIpc) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("segment '{}': device_ipc segments adopt memory you already have: use gpuipc::share "
                            "(gpuipc/share.hpp), or create a device segment",
                            name),
                "create");
  }
  auto m = std::make_shared<detail::Mapping>();
  m->name = n;
  m->kind = options.kind;
  m->access = Access::ReadWrite;

  proto::Create req;
  req.name = n;
  req.kind = static_cast<proto::Kind>(options.kind);
  req.mode = static_cast<std::uint16_t>(options.mode);
  req.flags = flags;
  os::UniqueFd fd;
  if (options.kind == SegmentKind::Device) {
    auto created = core::create_device_memory(options.device, bytes, place_at, also_map_for);
    m->size = created.size;
    m->gpu = std::move(created.memory);
    fd = std::move(created.exported);
    req.device = created.uuid;
  } else {
    m->size = round_up(bytes, os::page_size());
    fd = os::memfd_create("gpuipc:" + n, m->size);
    map_host(*m, fd.get(), true);
    if (options.kind == SegmentKind::HostPinned) {
      m->gpu = core::register_host_memory(m->host.data(), m->size, options.device, false);
    }
    if (init) init(m->host.data());
  }
  req.size = m->size;
  return detail::SegmentAccess::register_created(std::move(m), req, std::move(fd), options.device, false,
                                                 place_at == 0);
}

namespace {

/// The GPU whose context registers a host_pinned open's mapping: `requested`, or for "any device" (-1) the calling
/// thread's current context's GPU, else GPU 0. (The registration is portable: every context of the process may use
/// it, and the GPU chosen is only whose context the open makes or keeps. -1 meant GPU 0 whatever was current, so
/// a process working on another GPU made GPU 0's context too: hundreds of MiB there, or an error when GPU 0 is
/// exclusive to another process.)
int pinned_registration_device(int requested) {
  if (requested >= 0) return requested;
  if (cuda::current_context() == nullptr) return 0;  // (loads the driver: NoDriver as the registration would say)
  return cuda::current_ordinal();
}

/// What a Create's or an Open's answer says of the segment that the mapping keeps: its size as registered (for
/// Announce), its owner and mode.
void note_broker_info(detail::Mapping& m, const proto::SegmentInfo& info) noexcept {
  m.broker_size = info.size;
  m.owner_uid = info.owner_uid;
  m.owner_gid = info.owner_gid;
  m.mode = info.mode;
  m.created_unix_ns = info.created_unix_ns;
}

}  // namespace

Segment detail::SegmentAccess::register_created(std::shared_ptr<Mapping> m, const proto::Create& req, os::UniqueFd fd,
                                                int device, bool read_only_too, bool cached) {
  auto& client = core::BrokerClient::instance();
  const int raw = fd.get();
  auto reply = client.request(req, std::span<const int>(&raw, 1));
  const auto* r = std::get_if<proto::OpenReply>(&reply.msg.body);
  if (r == nullptr) throw Error(ErrorCode::Protocol, "the broker answered Create with something else", "create");
  m->id = r->info.id;
  m->client_generation = reply.generation;
  note_broker_info(*m, r->info);
  m->memory = std::move(fd);
  remember_for_restart(m);
  // Cached under the device it was made with and under "any device" (-1, OpenOptions' default), so that the
  // creator opening its own segment is a cache hit either way.
  const std::uint64_t names_gen = client.names_generation();
  for (const Access access : {Access::ReadWrite, Access::ReadOnly}) {
    if (!cached || (access == Access::ReadOnly && !read_only_too)) break;
    MappingCache::instance().put(cache_key(req.name, access, -1), m, names_gen);
    if (m->kind != SegmentKind::Host) MappingCache::instance().put(cache_key(req.name, access, device), m, names_gen);
  }
  return Segment(std::move(m));
}

Segment Segment::open(std::string_view name, const OpenOptions& options) {
  GPUIPC_TRACE("gpuipc::Segment::open");
  return detail::open_segment(name, options, true);
}

namespace {

/// What the broker is asked to wait for the name: `options.wait` clamped to 0..UINT32_MAX ms (about 49 days).
std::chrono::milliseconds broker_wait(const OpenOptions& options) {
  return std::chrono::milliseconds(std::clamp<std::int64_t>(options.wait.count(), 0, UINT32_MAX));
}

/// The device part of a mapping's cache key: the device asked for; -3 for an unregistered host_pinned mapping; -4
/// for a look (the broker counts it as no holder: it must not serve an open that holds the segment).
int cache_device(const OpenOptions& options, bool register_pinned, bool look) {
  return look ? -4 : register_pinned ? options.device : -3;
}

proto::Open open_request(const std::string& name, const OpenOptions& options, bool look = false) {
  if (options.access != Access::ReadOnly && options.access != Access::ReadWrite) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("open of '{}': access {} is neither ReadOnly nor ReadWrite", name,
                            static_cast<unsigned>(options.access)),
                "open");
  }
  proto::Open req;
  req.name = name;
  req.access = static_cast<proto::Access>(options.access);
  if (look && options.access == Access::ReadOnly &&
      core::BrokerClient::instance().broker_has_connecting(proto::kFeatureLook)) {
    req.access = proto::Access::Look;
  }
  req.wait_ms = static_cast<std::uint32_t>(broker_wait(options).count());
  return req;
}

/// open_segment after the broker's answer: maps the segment it sent (the reply's fd) and caches the mapping unless
/// it is placed. `names_gen`: the names generation read before the Open was sent.
Segment map_opened(const std::string& n, const OpenOptions& options, bool register_pinned, std::uint64_t place_at,
                   core::Reply&& reply, std::uint64_t names_gen, bool look = false) {
  const auto* r = std::get_if<proto::OpenReply>(&reply.msg.body);
  if (r == nullptr) throw Error(ErrorCode::Protocol, "the broker answered Open with something else", "open");
  auto m = std::make_shared<detail::Mapping>();
  m->name = n;
  m->id = r->info.id;
  m->kind = static_cast<SegmentKind>(r->info.kind);
  m->access = options.access;
  m->size = r->info.view_size != 0 ? r->info.view_size : r->info.size;
  m->view_offset = r->info.view_offset;
  // From here on the broker counts a reference for us: the Mapping's destructor returns it, also when a step
  // below throws (a reply without the fd included).
  m->client_generation = reply.generation;  // the connection that holds it, whatever reconnected since
  if (reply.fds.size() != 1) {
    throw Error(ErrorCode::Protocol, "the broker answered Open without the segment's fd", "open");
  }
  const bool read_only = options.access == Access::ReadOnly;
  if (m->kind == SegmentKind::Device) {
    // Adopted VMM memory (a view) maps its whole allocation: cuMemMap maps allocations from their start.
    m->gpu = core::import_device_memory(reply.fds[0].get(), r->info.size, r->info.device, options.device, read_only,
                                        place_at);
  } else if (m->kind == SegmentKind::DeviceIpc) {
    detail::open_device_ipc(*m, reply.fds[0].get(), r->info, options.device);
  } else {
    map_host(*m, reply.fds[0].get(), !read_only);
    if (m->kind == SegmentKind::HostPinned && register_pinned) {
      m->gpu =
          core::register_host_memory(m->host.data(), m->size, pinned_registration_device(options.device), read_only);
    }
  }
  note_broker_info(*m, r->info);
  m->memory = std::move(reply.fds[0]);
  remember_for_restart(m);
  if (place_at == 0) {
    MappingCache::instance().put(cache_key(n, options.access, cache_device(options, register_pinned, look)), m,
                                 names_gen);
    // Device memory opened for "any device" is mapped on one GPU: cached under it too, where an open for "any
    // device" from a thread current on that GPU finds it (cached_open) when the "any" entry maps on another.
    if (options.device < 0 && !look && m->gpu && (m->kind == SegmentKind::Device || m->kind == SegmentKind::DeviceIpc))
      MappingCache::instance().put(cache_key(n, options.access, m->gpu->device()), m, names_gen);
  }
  return detail::SegmentAccess::make(std::move(m));
}

}  // namespace

namespace {

/// A device kind's mapping for "any device" (-1) is made on the calling thread's current context's GPU, else on the
/// owner's, and only that GPU may access it. A cached one serves such an open only when it maps on the GPU the
/// open would choose: nullopt when it does (or the open asked for a device, or no context is current), else the
/// current context's ordinal. (A thread current on another GPU was given the other GPU's mapping, and its first
/// kernel on it faulted.)
std::optional<int> other_mapping_device(const detail::Mapping& m, const OpenOptions& options, bool look) noexcept {
  if (look || options.device >= 0 || !m.gpu || (m.kind != SegmentKind::Device && m.kind != SegmentKind::DeviceIpc))
    return std::nullopt;
  if (cuda::current_context_or_null() == nullptr) return std::nullopt;
  try {
    const int here = cuda::current_ordinal();
    return here == m.gpu->device() ? std::nullopt : std::optional<int>(here);
  } catch (const Error&) {
    return std::nullopt;  // (the driver could not say: as before)
  }
}

/// open_segment's cache lookup: the process's mapping of `n` when it has one that still names the segment (a stale
/// entry, made before an unlink somewhere, is checked with a Stat), else nullopt. Throws PeerDied for an adopted
/// segment whose exporter is gone.
std::optional<Segment> cached_open(const std::string& n, const OpenOptions& options, bool register_pinned,
                                   bool look = false) {
  auto& client = core::BrokerClient::instance();
  auto& cache = MappingCache::instance();
  // An unregistered host_pinned mapping is cached apart (device -3 is no device anyone asks for).
  const std::string key = cache_key(n, options.access, cache_device(options, register_pinned, look));
  auto [hit, fresh] = cache.find(key, client.names_generation(), client.generation());
  if (!hit) return std::nullopt;
  if (!hit->alive()) {
    cache.erase(key);
    throw detail::exporter_gone_error(n);
  }
  if (const auto other = other_mapping_device(*hit, options, look)) {
    OpenOptions there = options;  // this process's mapping on the current GPU, if it made one; else a new open
    there.device = *other;
    return cached_open(n, there, register_pinned, look);
  }
  if (fresh) return detail::SegmentAccess::make(std::move(hit));
  // An unlink happened somewhere since this binding was made: is the name still this segment?
  try {
    auto st = client.request(proto::Stat{n});
    const auto* sr = std::get_if<proto::StatReply>(&st.msg.body);
    if (sr != nullptr && sr->info.id == hit->id) {
      cache.put(key, hit, client.names_generation());
      return detail::SegmentAccess::make(std::move(hit));
    }
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
  }
  cache.erase(key);
  return std::nullopt;
}

}  // namespace

std::uint32_t detail::control_magic(const Segment& s) noexcept {
  if (s.size() < sizeof(std::uint32_t) || !host_readable(s.kind())) return 0;
  std::uint32_t magic = 0;
  std::memcpy(&magic, s.data(), sizeof magic);
  return magic;
}

std::uint32_t detail::control_magic(std::string_view name) { return control_magic(look_at_segment(name)); }

std::optional<Error> detail::unlink_control(std::string_view name, std::uint32_t magic, std::string_view what) {
  try {
    // By name alone it removed whatever `name` was (a semaphore, another object's control block).
    if (control_magic(name) != magic) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("'{}' is not a {}: remove another kind of object with its own unlink, or a plain "
                              "segment with Segment::unlink (`gpuipc rm`)",
                              name, what),
                  "unlink");
    }
    Segment::unlink(name);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
    return e;
  }
  return std::nullopt;
}

Segment detail::look_at_segment(std::string_view name) {
  return open_segment(name, {.access = Access::ReadOnly, .wait = {}, .device = -1}, false, 0, true);
}

Segment detail::open_segment(std::string_view name, const OpenOptions& options, bool register_pinned,
                             std::uint64_t place_at, bool look) {
  std::string n = check_name_or_throw(name);
  // A placed mapping is this caller's alone: no cache lookup, and it is not cached (map_opened).
  if (place_at == 0) {
    if (auto hit = cached_open(n, options, register_pinned, look)) return std::move(*hit);
  }
  auto& client = core::BrokerClient::instance();
  const std::uint64_t names_gen = client.names_generation();
  // The broker's wait (clamped as it is asked for: wait + 1 s overflowed for milliseconds::max()) and a second. An
  // open that waits does not hold the connection meanwhile: the process's other threads' calls go on.
  const proto::Open req = open_request(n, options, look);
  const auto limit = broker_wait(options) + std::chrono::milliseconds(1000);
  auto reply = req.wait_ms > 0 ? client.request_waiting(req, limit) : client.request(req, {}, limit);
  return map_opened(n, options, register_pinned, place_at, std::move(reply), names_gen, look);
}

std::vector<std::variant<Segment, Error>> detail::open_segments(std::span<const SegmentOpen> opens) {
  auto& client = core::BrokerClient::instance();
  std::vector<std::optional<std::variant<Segment, Error>>> got(opens.size());
  std::vector<std::size_t> asked;  // the opens the process's cache did not answer
  std::vector<proto::Body> bodies;
  std::chrono::milliseconds wait{0};
  for (std::size_t i = 0; i < opens.size(); ++i) {
    const auto& o = opens[i];
    std::string n = check_name_or_throw(o.name);
    try {
      if (o.place_at == 0) {
        if (auto hit = cached_open(n, o.options, o.register_pinned)) {
          got[i].emplace(std::move(*hit));
          continue;
        }
      }
    } catch (const Error& e) {
      got[i].emplace(e);
      continue;
    }
    try {
      bodies.emplace_back(open_request(n, o.options));
    } catch (const Error& e) {  // (an access out of range: this open's error, not the batch's)
      got[i].emplace(e);
      continue;
    }
    asked.push_back(i);
    wait = std::max(wait, broker_wait(o.options));
  }
  if (!bodies.empty()) {
    const std::uint64_t names_gen = client.names_generation();
    auto answers = client.request_batch(bodies, wait + std::chrono::milliseconds(1000));
    for (std::size_t k = 0; k < asked.size(); ++k) {
      const auto& o = opens[asked[k]];
      if (answers[k].error) {
        got[asked[k]].emplace(std::move(*answers[k].error));
        continue;
      }
      try {
        got[asked[k]].emplace(
            map_opened(o.name, o.options, o.register_pinned, o.place_at, std::move(*answers[k].reply), names_gen));
      } catch (const Error& e) {
        got[asked[k]].emplace(e);
      }
    }
  }
  std::vector<std::variant<Segment, Error>> out;
  out.reserve(opens.size());
  for (auto& g : got) out.push_back(std::move(*g));
  return out;
}

std::uint64_t detail::register_pinned_later(const Segment& segment, int ordinal) {
  const auto& m = SegmentAccess::mapping(segment);
  if (!m || m->kind != SegmentKind::HostPinned) {
    throw Error(ErrorCode::InvalidArgument, "not a host_pinned segment", "register_pinned_later");
  }
  if (m->gpu) return m->gpu->device_pointer() + m->view_offset;  // registered before it was shared
  // The mapping may be cached and shared by other handles: registered once (a throw lets the next call try again),
  // into late_gpu, never into `gpu`, which other threads read without a lock.
  std::call_once(m->late_once, [&] {
    m->late_gpu = core::register_host_memory(m->host.data(), m->size, ordinal < 0 ? 0 : ordinal,
                                             m->access == Access::ReadOnly);
  });
  return m->late_gpu->device_pointer() + m->view_offset;
}

void Segment::unlink(std::string_view name) {
  std::string n = check_name_or_throw(name);
  core::BrokerClient::instance().request(proto::Unlink{n});
}

bool detail::unlink_if_still_named(const Segment& s) {
  const auto& map = SegmentAccess::mapping(s);
  if (!map) return false;
  auto& client = core::BrokerClient::instance();
  try {
    if (!client.broker_has_connecting(proto::kFeatureUnlinkId)) {
      if (Segment::stat(map->name).id != map->id.load()) return false;
      Segment::unlink(map->name);
      return true;
    }
    client.request_built([&](std::uint64_t generation) -> proto::Body {
      // Ids are one broker's: a mapping not given back to this one has no id here (another segment may have it).
      if (map->client_generation.load() != generation) {
        throw Error(ErrorCode::NotFound, fmt::format("segment '{}' is not registered with this broker", map->name),
                    "unlink");
      }
      return proto::UnlinkId{map->id.load()};
    });
    return true;
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound) throw;
    return false;
  }
}

SegmentInfo Segment::stat(std::string_view name) {
  std::string n = check_name_or_throw(name);
  auto reply = core::BrokerClient::instance().request(proto::Stat{n});
  const auto* r = std::get_if<proto::StatReply>(&reply.msg.body);
  if (r == nullptr) throw Error(ErrorCode::Protocol, "the broker answered Stat with something else", "stat");
  return to_info(r->info);
}

std::vector<SegmentInfo> Segment::list() {
  std::vector<SegmentInfo> out;
  std::uint64_t after = 0;
  for (;;) {
    auto reply = core::BrokerClient::instance().request(proto::List{after});
    const auto* r = std::get_if<proto::ListReply>(&reply.msg.body);
    if (r == nullptr) throw Error(ErrorCode::Protocol, "the broker answered List with something else", "list");
    // Pages come in id order, each past `after`: a broker that answered the same page again (more = true) kept this
    // loop asking for ever, and `out` growing.
    for (const auto& e : r->entries) {
      if (e.id <= after) {
        throw Error(ErrorCode::Protocol,
                    fmt::format("the broker's list went back (segment id {} after {})", e.id, after), "list");
      }
      out.push_back(to_info(e));
      after = e.id;
    }
    if (!r->more || r->entries.empty()) break;
  }
  return out;
}

}  // namespace gpuipc
