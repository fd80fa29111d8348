// gpuipc who / watch: the processes that hold a name open, and their joins, leaves, deaths and missed heartbeats.
#include <fmt/format.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
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

/// Waits until `w` has an event (true) or `deadline` passed (false; time_point::max(): never). Throws output_error
/// when standard output's reader went away first: a pipe's write end polls POLLERR once its read end is closed (a
/// terminal POLLHUP once hung up), so a watch piped into `head -1` ends then, not at the next event's write, however
/// long that is in coming.
bool wait_for_event(const Watcher& w, std::chrono::steady_clock::time_point deadline) {
  using clock = std::chrono::steady_clock;
  for (;;) {
    int wait_ms = -1;
    if (deadline != clock::time_point::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()).count();
      wait_ms = static_cast<int>(std::clamp<std::int64_t>(left, 0, 1'000'000));
    }
    std::array<pollfd, 2> fds{pollfd{w.fd(), POLLIN, 0}, pollfd{STDOUT_FILENO, 0, 0}};  // (stdout: errors only)
    const int n = ::poll(fds.data(), fds.size(), wait_ms);
    if (const int err = errno; n < 0 && err != EINTR) {
      throw Error(ErrorCode::System, fmt::format("poll of the watch connection failed: {}", std::strerror(err)), "poll",
                  err);
    }
    if ((fds[1].revents & (POLLERR | POLLHUP)) != 0) throw output_error(std::strerror(EPIPE));
    if ((fds[1].revents & POLLNVAL) != 0) throw output_error(std::strerror(EBADF));
    if (n > 0 && fds[0].revents != 0) return true;
    if (wait_ms >= 0 && clock::now() >= deadline) return false;
  }
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
    // A line at a time, for pipes; a line that cannot be written ends the watch (exit status 1).
    auto emit = [](const std::string& line) {
      std::cout << line << '\n';
      flush_output();
    };
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
      if (!wait_for_event(w, deadline)) break;  // the timeout passed
      const auto e = w.next(std::chrono::nanoseconds(0));
      if (!e) continue;  // (the connection was readable for something else)
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
