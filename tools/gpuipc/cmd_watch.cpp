// gpuipc who / watch: the processes that hold a name open, and their joins, leaves, deaths and missed heartbeats.
#include <fmt/format.h>

#include <chrono>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "gpuipc/liveness.hpp"

namespace gpuipc::cli {
namespace {

nlohmann::json to_json(const Holder& h) {
  return nlohmann::json{{"pid", h.pid},
                        {"uid", h.uid},
                        {"role", h.role},
                        {"references", h.references},
                        {"read_write", h.read_write},
                        {"creator", h.creator},
                        {"heartbeat", std::string(to_string(h.heartbeat))},
                        {"heartbeat_deadline_ms", h.heartbeat_deadline.count()}};
}

std::string holder_line(const Holder& h) {
  std::string s = fmt::format("pid {} uid {} {} ({} reference{})", h.pid, h.uid, h.role, h.references,
                              h.references == 1 ? "" : "s");
  if (h.heartbeat != HeartbeatState::None) {
    s += fmt::format(", heartbeat {} within {} ms", to_string(h.heartbeat), h.heartbeat_deadline.count());
  }
  return s;
}

std::string clock_string(std::uint64_t unix_ns) {
  const auto s = static_cast<std::time_t>(unix_ns / 1'000'000'000);
  std::tm tm{};
  ::gmtime_r(&s, &tm);
  return fmt::format("{:02}:{:02}:{:02}.{:03}Z", tm.tm_hour, tm.tm_min, tm.tm_sec, (unix_ns / 1'000'000) % 1000);
}

}  // namespace

void register_watch(CLI::App& app, int& exit_code) {
  auto* who = app.add_subcommand("who", "list the processes that hold a name open: pid, uid, role, heartbeat");
  static std::string who_name;
  static bool who_json = false;
  who->add_option("NAME", who_name, "segment, semaphore, channel, pool or counting semaphore name")->required();
  who->add_flag("--json", who_json, "print a JSON array (keys: docs/cli/who.md)");
  who->callback([&exit_code] {
    const auto hs = holders(who_name);
    if (who_json) {
      nlohmann::json arr = nlohmann::json::array();
      for (const auto& h : hs) arr.push_back(to_json(h));
      std::cout << json_text(arr, 2) << "\n";
    } else {
      std::cout << fmt::format("{:>8} {:>6} {:<28} {:>4} {}\n", "PID", "UID", "ROLE", "REFS", "HEARTBEAT");
      for (const auto& h : hs) {
        std::cout << fmt::format("{:>8} {:>6} {:<28} {:>4} {}\n", h.pid, h.uid, h.role, h.references,
                                 h.heartbeat == HeartbeatState::None
                                     ? std::string("-")
                                     : fmt::format("{} ({} ms)", to_string(h.heartbeat), h.heartbeat_deadline.count()));
      }
    }
    exit_code = kExitOk;
  });

  auto* watch = app.add_subcommand("watch", "follow who holds a name: joins, leaves, deaths, missed heartbeats");
  static std::string watch_name;
  static bool watch_json = false;
  static std::size_t watch_count = 0;
  static double watch_timeout = -1;
  watch->add_option("NAME", watch_name, "the name to watch")->required();
  watch->add_flag("--json", watch_json, "one JSON object per line (keys: docs/cli/watch.md)");
  watch->add_option("--count", watch_count, "exit after this many events (default: never)")->transform(kWholeNumber);
  watch->add_option("--timeout", watch_timeout, "exit after this many seconds (default: never)")
      ->check(seconds_between(0));
  watch->callback([&exit_code] {
    auto w = Watcher::watch(watch_name);
    // The holders at the start, then a line saying the watch is on: events after it are live.
    const auto hs = holders(watch_name);
    auto emit = [](const std::string& line) { std::cout << line << std::endl; };  // a line at a time, for pipes
    for (const auto& h : hs) {
      if (watch_json) {
        auto j = to_json(h);
        j["event"] = "holder";
        j["name"] = watch_name;
        emit(json_text(j));
      } else {
        emit(fmt::format("holder  {}: {}", watch_name, holder_line(h)));
      }
    }
    if (watch_json) {
      emit(json_text(nlohmann::json{{"event", "watching"}, {"name", watch_name}, {"holders", hs.size()}}));
    } else {
      emit(fmt::format("watching {} ({} holder{})", watch_name, hs.size(), hs.size() == 1 ? "" : "s"));
    }
    using clock = std::chrono::steady_clock;
    const bool forever = watch_timeout < 0;
    const auto deadline =
        forever
            ? clock::time_point::max()
            : clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(watch_timeout));
    std::size_t seen = 0;
    while (watch_count == 0 || seen < watch_count) {
      const auto left = forever
                            ? std::chrono::nanoseconds(-1)
                            : std::max(std::chrono::nanoseconds(0), std::chrono::nanoseconds(deadline - clock::now()));
      const auto e = w.next(left);
      if (!e) break;  // the timeout passed
      ++seen;
      if (e->event == LivenessEvent::Lost) {  // about no process: this watch fell behind and missed events
        if (watch_json) {
          emit(json_text(nlohmann::json{{"event", "lost"}, {"name", e->name}, {"unix_ns", e->unix_ns}}));
        } else {
          emit(
              fmt::format("{} {:<7} {}: events were dropped while this watch fell behind; `gpuipc who {}` shows the "
                          "holders now",
                          clock_string(e->unix_ns), to_string(e->event), e->name, e->name));
        }
        continue;
      }
      if (watch_json) {
        auto j = to_json(e->holder);
        j["event"] = std::string(to_string(e->event));
        j["name"] = e->name;
        j["unix_ns"] = e->unix_ns;
        emit(json_text(j));
      } else {
        emit(fmt::format("{} {:<7} {}: {}", clock_string(e->unix_ns), to_string(e->event), e->name,
                         holder_line(e->holder)));
      }
    }
    exit_code = kExitOk;
  });
}

}  // namespace gpuipc::cli
