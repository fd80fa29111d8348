// gpuipc ls / stat / rm.
#include <fmt/chrono.h>
#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "commands.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "gpuipc/format.hpp"
#include "gpuipc/pool.hpp"
#include "gpuipc/segment.hpp"

namespace gpuipc::cli {
namespace {


std::string created_string(std::uint64_t unix_ns) {
  const auto tp = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::nanoseconds(unix_ns)));
  return fmt::format("{:%Y-%m-%dT%H:%M:%S}Z", fmt::gmtime(std::chrono::system_clock::to_time_t(tp)));
}

nlohmann::json to_json(const SegmentInfo& i) {
  return nlohmann::json{{"id", i.id},
                        {"name", i.name},
                        {"unlinked", i.name.empty()},
                        {"kind", std::string(to_string(i.kind))},
                        {"size", i.size},
                        {"device", i.device_uuid},
                        {"owner_uid", i.owner_uid},
                        {"owner_gid", i.owner_gid},
                        {"mode", fmt::format("{:04o}", i.mode)},
                        {"created", created_string(i.created_unix_ns)},
                        {"references", i.references},
                        {"mapper_count", i.mapper_count},
                        {"mapper_pids", i.mapper_pids}};
}

/// The statistics of pool `name`, read from its control block, or nothing when it is not a pool (or unreadable).
std::optional<PoolStats> pool_stats(const SegmentInfo& i) {
  if (i.name.empty() || i.kind == SegmentKind::Device) return std::nullopt;
  try {
    return Pool::stat(i.name);
  } catch (const Error&) {
    return std::nullopt;
  }
}

nlohmann::json to_json(const PoolStats& s) {
  return nlohmann::json{{"used_bytes", s.used_bytes},
                        {"free_bytes", s.free_bytes},
                        {"capacity_bytes", s.capacity_bytes},
                        {"max_bytes", s.max_bytes},
                        {"largest_free_block", s.largest_free_block},
                        {"chunks", s.chunks},
                        {"max_chunks", s.max_chunks},
                        {"live_blocks", s.live_blocks},
                        {"draining_blocks", s.draining_blocks},
                        {"members", s.members},
                        {"state", std::string(to_string(s.state))},
                        {"paused_by_pid", s.paused_by_pid}};
}

std::string pool_line(const PoolStats& s) {
  std::string paused;
  if (s.state != PoolState::Active) {
    paused = fmt::format(", {} by pid {}{}", to_string(s.state), s.paused_by_pid, s.pauser_gone ? " (gone)" : "");
  }
  return fmt::format("used {}, free {}, {} of {} chunks, largest free block {}, {} blocks live, {} members{}",
                     human_bytes(s.used_bytes), human_bytes(s.free_bytes), s.chunks, s.max_chunks,
                     human_bytes(s.largest_free_block), s.live_blocks, s.members, paused);
}

/// A counting semaphore's counts, read from its block, or nothing when `i` is not one. The list does not say what
/// a segment is: a counting semaphore is a small host segment whose block reads as one.
std::optional<CountingSemaphoreStats> counting_stats(const SegmentInfo& i) {
  constexpr std::size_t kMaxProbeBytes = 64 * 1024;
  if (i.name.empty() || i.kind != SegmentKind::Host || i.size > kMaxProbeBytes) return std::nullopt;
  try {
    return CountingSemaphore::stat(i.name);
  } catch (const Error&) {
    return std::nullopt;
  }
}

nlohmann::json to_json(const CountingSemaphoreStats& s) {
  return nlohmann::json{{"available", s.available},
                        {"max_count", s.max_count},
                        {"held", s.held},
                        {"holders", s.holders},
                        {"waiting", s.waiting}};
}

std::string counting_line(const CountingSemaphoreStats& s) {
  return fmt::format("{} of {} permits available, {} held by {} holder{}, {} waiting", s.available, s.max_count, s.held,
                     s.holders, s.holders == 1 ? "" : "s", s.waiting);
}

std::string pids_string(const SegmentInfo& i) {
  std::string s = fmt::format("{}", fmt::join(i.mapper_pids, ","));
  if (i.mapper_count > i.mapper_pids.size()) s += fmt::format(",+{}", i.mapper_count - i.mapper_pids.size());
  return s.empty() ? "-" : s;
}

}  // namespace

void register_segments(CLI::App& app, int& exit_code) {
  auto* ls = app.add_subcommand("ls", "list segments: name, kind, size, device, owner, mode, mappers and their pids");
  static bool ls_json = false;
  ls->add_flag("--json", ls_json, "print a JSON array (keys: docs/cli/ls.md)");
  ls->callback([&exit_code] {
    const auto all = Segment::list();
    // Pools: control segments whose first chunk is listed too (nothing else is opened).
    std::set<std::string> names;
    for (const auto& i : all) names.insert(i.name);
    auto pool_of = [&](const SegmentInfo& i) {
      return names.count(i.name + ".chunk.0") != 0 ? pool_stats(i) : std::nullopt;
    };
    if (ls_json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& i : all) {
        arr.push_back(to_json(i));
        if (auto p = pool_of(i)) arr.back()["pool"] = to_json(*p);
        if (auto c = counting_stats(i)) arr.back()["counting_semaphore"] = to_json(*c);
      }
      std::cout << json_text(arr, 2) << "\n";
    } else {
      std::cout << fmt::format("{:<32} {:<12} {:>10} {:<40} {:>6} {:>4} {:>4} {}\n", "NAME", "KIND", "SIZE", "DEVICE",
                               "OWNER", "MODE", "REFS", "PIDS");  // (MODE: 4 digits)
      for (const auto& i : all) {
        std::cout << fmt::format("{:<32} {:<12} {:>10} {:<40} {:>6} {:04o} {:>4} {}\n",
                                 i.name.empty() ? fmt::format("(unlinked #{})", i.id) : i.name, to_string(i.kind),
                                 human_bytes(i.size), i.device_uuid.empty() ? "-" : i.device_uuid, i.owner_uid, i.mode,
                                 i.references, pids_string(i));
        if (auto p = pool_of(i)) std::cout << "  pool: " << pool_line(*p) << "\n";
        if (auto c = counting_stats(i)) std::cout << "  counting semaphore: " << counting_line(*c) << "\n";
      }
    }
    exit_code = kExitOk;
  });

  auto* st = app.add_subcommand("stat", "show one segment (and a pool's statistics)");
  static std::string stat_name;
  static bool stat_json = false;
  st->add_option("NAME", stat_name, "segment name")->required();
  st->add_flag("--json", stat_json, "print JSON (keys: docs/cli/stat.md)");
  st->callback([&exit_code] {
    const auto i = Segment::stat(stat_name);
    const auto pool = pool_stats(i);
    const auto counting = counting_stats(i);
    if (stat_json) {
      auto j = to_json(i);
      if (pool) j["pool"] = to_json(*pool);
      if (counting) j["counting_semaphore"] = to_json(*counting);
      std::cout << json_text(j, 2) << "\n";
    } else {
      std::cout << fmt::format(
          "name:       {}\nid:         {}\nkind:       {}\nsize:       {} ({} bytes)\ndevice:     {}\nowner:      "
          "uid {} gid {}\nmode:       {:04o}\ncreated:    {}\nreferences: {}\nmappers:    {} (pids {})\n",
          i.name, i.id, to_string(i.kind), human_bytes(i.size), i.size, i.device_uuid.empty() ? "-" : i.device_uuid,
          i.owner_uid, i.owner_gid, i.mode, created_string(i.created_unix_ns), i.references, i.mapper_count,
          pids_string(i));
      if (pool) std::cout << "pool:       " << pool_line(*pool) << "\n";
      if (counting) std::cout << "counting:   " << counting_line(*counting) << "\n";
    }
    exit_code = kExitOk;
  });

  auto* rm = app.add_subcommand("rm",
                                "unlink segments: the names go now, the memory when the last mapper closes (a pool's "
                                "chunks and a channel's buffers go with it)");
  static std::vector<std::string> rm_names;
  rm->add_option("NAME", rm_names, "segment names")->required();
  rm->callback([&exit_code] {
    for (std::size_t k = 0; k < rm_names.size(); ++k) {
      const std::string& n = rm_names[k];
      try {
        // A pool or a channel is more than its name: its chunks or its buffers (NAME.chunk.<n>, NAME.slots) go with it.
        unlink_any(n);
      } catch (const Error&) {
        // The error is printed by the caller; say which names it left alone.
        if (k + 1 < rm_names.size()) {
          std::string rest;
          for (std::size_t r = k + 1; r < rm_names.size(); ++r)
            rest += (rest.empty() ? "'" : ", '") + rm_names[r] + "'";
          std::cerr << "gpuipc rm: stopped at '" << n << "'; not removed: " << rest << "\n";
        }
        throw;
      }
    }
    exit_code = kExitOk;
  });
}

}  // namespace gpuipc::cli
