// gpuipc top: a live view of segments, channels, semaphores, pools and their processes, from the broker's List
// reply and the counters in the objects' control blocks (read-only, CUDA-free). Rates come from two samples
// --interval apart. Keys and exit codes: docs/cli/top.md.
#include <fmt/chrono.h>
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "commands.hpp"
#include "gpuipc/broker.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/format.hpp"
#include "gpuipc/liveness.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/semaphore.hpp"

namespace gpuipc::cli {
namespace {

// Version of the JSON layout: bumped when a key changes meaning or goes; new keys do not bump it.
constexpr int kJsonSchema = 1;
// A semaphore is one page; larger host segments are not probed for one.
constexpr std::size_t kMaxSemaphoreProbeBytes = 64 * 1024;

/// What a listed segment is, as far as top can tell.
enum class Role { Segment, Channel, ChannelSlots, Semaphore, Pool, PoolChunk };

const char* role_name(Role r) {
  switch (r) {
    case Role::Channel:
      return "channel";
    case Role::ChannelSlots:
      return "channel_slots";
    case Role::Semaphore:
      return "semaphore";
    case Role::Pool:
      return "pool";
    case Role::PoolChunk:
      return "pool_chunk";
    case Role::Segment:
      break;
  }
  return "segment";
}

/// One look at everything: the broker's list, then each object's control block.
struct Sample {
  std::chrono::steady_clock::time_point at;
  std::chrono::system_clock::time_point wall;
  std::vector<SegmentInfo> segments;
  std::vector<Role> roles;  // parallel to segments
  std::map<std::string, ChannelStats> channels;
  std::map<std::string, SemaphoreStats> semaphores;
  std::map<std::string, PoolStats> pools;
};

bool host_kind(SegmentKind k) { return k == SegmentKind::Host || k == SegmentKind::HostPinned; }

/// Reads `read(name)`, or nothing when the object went away, may not be read, or is not what its name suggested:
/// between the list and this read anything may have changed, and a member may have scribbled over the block.
template <typename Read>
auto try_read(Read&& read) -> std::optional<decltype(read())> {
  try {
    return read();
  } catch (const Error& e) {
    // The broker itself failing is not a per-object matter: let the command fail with its exit code.
    if (e.call() == "connect" || e.call() == "hello" || e.call() == "send" || e.call() == "recv") throw;
    return std::nullopt;
  }
}

Sample take_sample() {
  Sample s;
  s.segments = Segment::list();
  s.at = std::chrono::steady_clock::now();
  s.wall = std::chrono::system_clock::now();
  std::set<std::string> names;
  for (const auto& i : s.segments) {
    if (!i.name.empty()) names.insert(i.name);
  }
  auto ends_with = [](const std::string& a, std::string_view b) {
    return a.size() > b.size() && a.compare(a.size() - b.size(), b.size(), b) == 0;
  };
  auto chunk_of_pool = [&](const std::string& n) {
    const auto at = n.rfind(".chunk.");
    return at != std::string::npos && at > 0 && names.count(n.substr(0, at) + ".chunk.0") != 0 &&
           names.count(n.substr(0, at)) != 0;
  };
  s.roles.assign(s.segments.size(), Role::Segment);
  for (std::size_t k = 0; k < s.segments.size(); ++k) {
    const auto& i = s.segments[k];
    if (i.name.empty()) continue;
    if (host_kind(i.kind) && names.count(i.name + ".slots") != 0) {
      if (auto st = try_read([&] { return Channel::stat(i.name); })) {
        s.channels[i.name] = *st;
        s.roles[k] = Role::Channel;
      }
    } else if (host_kind(i.kind) && names.count(i.name + ".chunk.0") != 0) {
      if (auto st = try_read([&] { return Pool::stat(i.name); })) {
        s.pools[i.name] = *st;
        s.roles[k] = Role::Pool;
      }
    }
  }
  for (std::size_t k = 0; k < s.segments.size(); ++k) {
    const auto& i = s.segments[k];
    if (i.name.empty() || s.roles[k] != Role::Segment) continue;
    if (ends_with(i.name, ".slots") && s.channels.count(i.name.substr(0, i.name.size() - 6)) != 0) {
      s.roles[k] = Role::ChannelSlots;
    } else if (chunk_of_pool(i.name) && s.pools.count(i.name.substr(0, i.name.rfind(".chunk."))) != 0) {
      s.roles[k] = Role::PoolChunk;
    } else if (host_kind(i.kind) && i.size <= kMaxSemaphoreProbeBytes) {
      // The list does not say what a segment is: a semaphore is a page that reads as one.
      if (auto st = try_read([&] { return Semaphore::stat(i.name); })) {
        s.semaphores[i.name] = *st;
        s.roles[k] = Role::Semaphore;
      }
    }
  }
  // The list names at most 16 pids a segment; the broker's holders of a name are all of them (up to 256).
  for (auto& i : s.segments) {
    if (i.name.empty() || i.mapper_count <= i.mapper_pids.size()) continue;
    if (auto all = try_read([&] { return holders(i.name); })) {
      i.mapper_pids.clear();
      for (const auto& h : *all) i.mapper_pids.push_back(h.pid);
    }
  }
  return s;
}

/// The pids holding references, without this process (top's own read-only looks).
std::vector<std::uint32_t> pids_of(const SegmentInfo& i) {
  const auto self = client_pid();
  std::vector<std::uint32_t> out;
  for (auto p : i.mapper_pids) {
    if (p != self) out.push_back(p);
  }
  return out;
}

/// Mapper processes other than this one: the broker's count, less this process when it is listed.
std::uint32_t mapper_count_of(const SegmentInfo& i) {
  const auto self = client_pid();
  const bool listed = std::find(i.mapper_pids.begin(), i.mapper_pids.end(), self) != i.mapper_pids.end();
  return listed && i.mapper_count > 0 ? i.mapper_count - 1 : i.mapper_count;
}

/// (now - before) / seconds, or nothing when there is no earlier value or the counter went back (a new object of
/// that name, or a block rewritten by a member).
std::optional<double> rate(std::optional<std::uint64_t> before, std::uint64_t now, double seconds) {
  if (!before || now < *before || seconds <= 0) return std::nullopt;
  return static_cast<double>(now - *before) / seconds;
}

nlohmann::json opt(const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); }

std::string status_name(Status s) {
  switch (s) {
    case Status::Ok:
      return "ok";
    case Status::Closed:
      return "closed";
    case Status::PeerDied:
      return "peer_died";
    default:
      return "unknown";
  }
}

std::string command_of(std::uint32_t pid) {
  // Empty when the process is gone or in another PID namespace: no command to show.
  std::ifstream in(fmt::format("/proc/{}/comm", pid));
  std::string c;
  std::getline(in, c);
  while (!c.empty() && c.back() == '\r') c.pop_back();
  // Any process may name itself anything (prctl PR_SET_NAME): bytes that are not printable ASCII would make the
  // JSON dump throw (invalid UTF-8) or the terminal misbehave.
  for (char& ch : c) {
    if (ch < 0x20 || ch > 0x7e) ch = '?';
  }
  return c;
}

/// The frame from two samples: everything in `now`, rates against `before`.
nlohmann::json frame(const Sample& before, const Sample& now) {
  const double dt = std::chrono::duration<double>(now.at - before.at).count();
  nlohmann::json j;
  j["schema"] = kJsonSchema;
  j["time"] = fmt::format("{:%Y-%m-%dT%H:%M:%S}Z", fmt::gmtime(std::chrono::system_clock::to_time_t(now.wall)));
  j["interval_s"] = dt;
  std::map<std::string, const SegmentInfo*> by_name;
  std::map<std::uint32_t, std::vector<std::string>> objects_of_pid;
  nlohmann::json segs = nlohmann::json::array();
  for (std::size_t k = 0; k < now.segments.size(); ++k) {
    const auto& i = now.segments[k];
    if (!i.name.empty()) by_name[i.name] = &i;
    const auto pids = pids_of(i);
    segs.push_back({{"id", i.id},
                    {"name", i.name},
                    {"role", role_name(now.roles[k])},
                    {"kind", std::string(to_string(i.kind))},
                    {"size", i.size},
                    {"owner_uid", i.owner_uid},
                    {"mode", fmt::format("{:04o}", i.mode)},
                    {"references", i.references},
                    {"mapper_count", mapper_count_of(i)},
                    {"mapper_pids", pids}});
    const auto r = now.roles[k];
    if (r == Role::ChannelSlots || r == Role::PoolChunk) continue;  // shown under their channel or pool
    for (auto p : pids) {
      objects_of_pid[p].push_back(i.name.empty() ? fmt::format("(unlinked #{})", i.id) : i.name);
    }
  }
  j["segments"] = std::move(segs);

  nlohmann::json chans = nlohmann::json::array();
  for (const auto& [name, c] : now.channels) {
    const auto* info = by_name.at(name);
    const auto prev = before.channels.find(name);
    const bool had = prev != before.channels.end();
    const auto* slots_info = by_name.count(name + ".slots") != 0 ? by_name.at(name + ".slots") : nullptr;
    chans.push_back(
        {{"name", name},
         {"kind", slots_info != nullptr ? std::string(to_string(slots_info->kind)) : ""},
         {"slots", c.slots},
         {"slot_bytes", c.slot_bytes},
         {"depth", c.queued},
         {"free_slots", c.free_slots},
         {"producers", c.producers},
         {"consumers", c.consumers},
         {"published", c.published},
         {"published_bytes", c.published_bytes},
         {"received", c.tail},
         {"redelivered", c.redelivered},
         {"abandoned", c.abandoned},
         {"messages_per_s", opt(rate(had ? std::optional(prev->second.published) : std::nullopt, c.published, dt))},
         {"bytes_per_s",
          opt(rate(had ? std::optional(prev->second.published_bytes) : std::nullopt, c.published_bytes, dt))},
         {"received_per_s", opt(rate(had ? std::optional(prev->second.tail) : std::nullopt, c.tail, dt))},
         {"mapper_count", mapper_count_of(*info)},
         {"pids", pids_of(*info)}});
  }
  j["channels"] = std::move(chans);

  nlohmann::json sems = nlohmann::json::array();
  for (const auto& [name, s] : now.semaphores) {
    const auto* info = by_name.at(name);
    const auto prev = before.semaphores.find(name);
    const std::uint32_t mappers = mapper_count_of(*info);
    sems.push_back(
        {{"name", name},
         {"kind", std::string(to_string(info->kind))},
         {"value", s.value},
         {"status", status_name(s.status)},
         {"signallers", s.signallers},
         {"waiters", mappers > s.signallers ? mappers - s.signallers : 0},
         {"value_per_s",
          opt(rate(prev != before.semaphores.end() ? std::optional(prev->second.value) : std::nullopt, s.value, dt))},
         {"mapper_count", mappers},
         {"pids", pids_of(*info)}});
  }
  j["semaphores"] = std::move(sems);

  nlohmann::json pools = nlohmann::json::array();
  for (const auto& [name, p] : now.pools) {
    pools.push_back({{"name", name},
                     {"kind", std::string(to_string(by_name.at(name)->kind))},
                     {"used_bytes", p.used_bytes},
                     {"free_bytes", p.free_bytes},
                     {"capacity_bytes", p.capacity_bytes},
                     {"max_bytes", p.max_bytes},
                     {"largest_free_block", p.largest_free_block},
                     {"chunks", p.chunks},
                     {"max_chunks", p.max_chunks},
                     {"live_blocks", p.live_blocks},
                     {"draining_blocks", p.draining_blocks},
                     {"members", p.members},
                     {"mapper_count", mapper_count_of(*by_name.at(name))},
                     {"pids", pids_of(*by_name.at(name))}});
  }
  j["pools"] = std::move(pools);

  nlohmann::json procs = nlohmann::json::array();
  for (const auto& [pid, objects] : objects_of_pid) {
    procs.push_back({{"pid", pid}, {"command", command_of(pid)}, {"objects", objects}});
  }
  j["processes"] = std::move(procs);
  return j;
}

std::string rate_text(const nlohmann::json& v, bool bytes) {
  if (v.is_null()) return "-";
  const double r = v.get<double>();
  if (bytes) return human_bytes(static_cast<std::uint64_t>(std::llround(r))) + "/s";
  return fmt::format("{:.1f}", r);
}

/// The pids listed, then ",+N" for holders the broker counted and did not name (more than it lists).
std::string pids_text(const nlohmann::json& pids, const nlohmann::json& count) {
  std::vector<std::uint32_t> v = pids.get<std::vector<std::uint32_t>>();
  const auto n = count.get<std::uint32_t>();
  std::string s = v.empty() ? (n == 0 ? "-" : "") : fmt::format("{}", fmt::join(v, ","));
  if (n > v.size()) s += fmt::format("{}+{}", v.empty() ? "" : ",", n - v.size());
  return s;
}

/// The frame as text tables (the same values as the JSON).
std::string render(const nlohmann::json& j) {
  std::string o = fmt::format("gpuipc top  {}  (rates over {:.2f} s)\n\n", j["time"].get<std::string>(),
                              j["interval_s"].get<double>());
  o += fmt::format("CHANNELS {}\n{:<28} {:<6} {:>9} {:>5} {:>4} {:>4} {:>12} {:>11} {:>12}  {}\n", j["channels"].size(),
                   "NAME", "KIND", "DEPTH", "PROD", "CONS", "FREE", "PUBLISHED", "MSG/S", "BYTES/S", "PIDS");
  for (const auto& c : j["channels"]) {
    o += fmt::format("{:<28} {:<6} {:>4}/{:<4} {:>5} {:>4} {:>4} {:>12} {:>11} {:>12}  {}\n",
                     c["name"].get<std::string>(), c["kind"].get<std::string>(), c["depth"].get<std::uint32_t>(),
                     c["slots"].get<std::uint32_t>(), c["producers"].get<std::uint32_t>(),
                     c["consumers"].get<std::uint32_t>(), c["free_slots"].get<std::uint32_t>(),
                     c["published"].get<std::uint64_t>(), rate_text(c["messages_per_s"], false),
                     rate_text(c["bytes_per_s"], true), pids_text(c["pids"], c["mapper_count"]));
  }
  o += fmt::format("\nSEMAPHORES {}\n{:<28} {:<12} {:>20} {:<9} {:>5} {:>5} {:>11}  {}\n", j["semaphores"].size(),
                   "NAME", "KIND", "VALUE", "STATUS", "SIGN", "WAIT", "VALUE/S", "PIDS");
  for (const auto& s : j["semaphores"]) {
    o += fmt::format("{:<28} {:<12} {:>20} {:<9} {:>5} {:>5} {:>11}  {}\n", s["name"].get<std::string>(),
                     s["kind"].get<std::string>(), s["value"].get<std::uint64_t>(), s["status"].get<std::string>(),
                     s["signallers"].get<std::uint32_t>(), s["waiters"].get<std::uint32_t>(),
                     rate_text(s["value_per_s"], false), pids_text(s["pids"], s["mapper_count"]));
  }
  o += fmt::format("\nPOOLS {}\n{:<28} {:<12} {:>10} {:>10} {:>7} {:>10} {:>6} {:>4}  {}\n", j["pools"].size(), "NAME",
                   "KIND", "USED", "FREE", "CHUNKS", "LARGEST", "BLOCKS", "MEMB", "PIDS");
  for (const auto& p : j["pools"]) {
    o += fmt::format("{:<28} {:<12} {:>10} {:>10} {:>3}/{:<3} {:>10} {:>6} {:>4}  {}\n", p["name"].get<std::string>(),
                     p["kind"].get<std::string>(), human_bytes(p["used_bytes"].get<std::uint64_t>()),
                     human_bytes(p["free_bytes"].get<std::uint64_t>()), p["chunks"].get<std::uint32_t>(),
                     p["max_chunks"].get<std::uint32_t>(), human_bytes(p["largest_free_block"].get<std::uint64_t>()),
                     p["live_blocks"].get<std::uint64_t>(), p["members"].get<std::uint32_t>(),
                     pids_text(p["pids"], p["mapper_count"]));
  }
  std::size_t plain = 0;
  for (const auto& s : j["segments"]) plain += s["role"] == "segment" ? 1 : 0;
  o += fmt::format("\nSEGMENTS {}\n{:<28} {:<12} {:>10} {:>6} {:>5} {:>4}  {}\n", plain, "NAME", "KIND", "SIZE",
                   "OWNER", "MODE", "REFS", "PIDS");
  for (const auto& s : j["segments"]) {
    if (s["role"] != "segment") continue;
    const std::string name = s["name"].get<std::string>();
    o += fmt::format("{:<28} {:<12} {:>10} {:>6} {:>5} {:>4}  {}\n",
                     name.empty() ? fmt::format("(unlinked #{})", s["id"].get<std::uint64_t>()) : name,
                     s["kind"].get<std::string>(), human_bytes(s["size"].get<std::uint64_t>()),
                     s["owner_uid"].get<std::uint32_t>(), s["mode"].get<std::string>(),
                     s["references"].get<std::uint32_t>(), pids_text(s["mapper_pids"], s["mapper_count"]));
  }
  o += fmt::format("\nPROCESSES {}\n{:>8} {:<16} {}\n", j["processes"].size(), "PID", "COMMAND", "OBJECTS");
  for (const auto& p : j["processes"]) {
    o += fmt::format("{:>8} {:<16} {}\n", p["pid"].get<std::uint32_t>(), p["command"].get<std::string>(),
                     fmt::join(p["objects"].get<std::vector<std::string>>(), ","));
  }
  return o;
}

}  // namespace

void register_top(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "top", "live view of channels (depth, messages/s, bytes/s), semaphores, pools, segments and their processes");
  static double interval = 1.0;
  static bool once = false;
  static bool json = false;
  static std::uint64_t iterations = 0;
  cmd->add_option("-i,--interval", interval, "seconds between the two samples of a frame (rates), and between frames")
      ->check(seconds_between(0.01, 3600.0));
  auto* once_flag = cmd->add_flag("--once", once, "print one frame and exit");
  cmd->add_flag("--json", json, "print one JSON document per frame (keys: docs/cli/top.md)");
  cmd->add_option("-n,--iterations", iterations, "print this many frames and exit (0: until Ctrl-C)")
      ->transform(kWholeNumber)
      ->excludes(once_flag);
  cmd->callback([&exit_code] {
    const auto pause =
        std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(interval));
    const std::uint64_t frames = once ? 1 : iterations;
    Sample before = take_sample();
    for (std::uint64_t n = 0; frames == 0 || n < frames; ++n) {
      std::this_thread::sleep_for(pause);
      Sample now = take_sample();
      const nlohmann::json j = frame(before, now);
      if (json) {
        std::cout << json_text(j) << "\n";
      } else {
        // Plain ANSI: clear the screen and home the cursor, then the frame (no curses).
        if (!once && ::isatty(STDOUT_FILENO) != 0) std::cout << "\x1b[2J\x1b[H";  // not into files and pipes
        std::cout << render(j);
      }
      // A frame that could not be written ends top (a full disk; a pipe whose reader went, SIGPIPE ignored).
      flush_output();
      before = std::move(now);
    }
    exit_code = kExitOk;
  });
}

}  // namespace gpuipc::cli
