#include "base/log.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>

#include "base/config.hpp"

namespace gpuipc::log {
namespace {

constexpr int kUnset = -1;
std::atomic<int> g_level{kUnset};

constexpr std::string_view kNames[] = {"off", "error", "warn", "info", "debug", "trace"};

int load_from_env() noexcept {
  Level lvl = Level::Warn;
  bool bad = false;
  std::string value;
  try {
    if (auto raw = config::env_raw("GPUIPC_LOG")) {
      value = *raw;
      bad = !parse_level(value, lvl);
    }
  } catch (...) {
    bad = true;
  }
  g_level.store(static_cast<int>(bad ? Level::Warn : lvl), std::memory_order_relaxed);
  if (bad) write(Level::Warn, "GPUIPC_LOG='" + value + "' is not one of off, error, warn, info, debug, trace; using warn");
  return static_cast<int>(bad ? Level::Warn : lvl);
}

// At most kLinesPerSecond lines a second, so that no client can grow the broker's log without bound by
// provoking warnings; what is dropped is counted and said in the next line that gets through.
constexpr std::uint64_t kLinesPerSecond = 100;

struct RateLimit {
  std::mutex mutex;
  std::int64_t window = -1;
  std::uint64_t lines = 0;
  std::uint64_t dropped = 0;
};

RateLimit& rate_limit() noexcept {
  static RateLimit r;
  return r;
}

/// Whether a line may be written now; `dropped` gets the lines dropped before it (to be reported with it).
bool admit(std::uint64_t& dropped) noexcept {
  auto& r = rate_limit();
  const std::int64_t second = std::chrono::duration_cast<std::chrono::seconds>(
                                  std::chrono::steady_clock::now().time_since_epoch())
                                  .count();
  std::lock_guard lock(r.mutex);
  if (second != r.window) {
    r.window = second;
    r.lines = 0;
  }
  if (r.lines >= kLinesPerSecond) {
    ++r.dropped;
    return false;
  }
  ++r.lines;
  dropped = r.dropped;
  r.dropped = 0;
  return true;
}

}  // namespace

bool parse_level(std::string_view text, Level& out) noexcept {
  for (int i = 0; i < static_cast<int>(std::size(kNames)); ++i) {
    if (text == kNames[i]) {
      out = static_cast<Level>(i);
      return true;
    }
  }
  if (text == "warning") {
    out = Level::Warn;
    return true;
  }
  return false;
}

Level level() noexcept {
  int v = g_level.load(std::memory_order_relaxed);
  if (v == kUnset) v = load_from_env();
  return static_cast<Level>(v);
}

void set_level(Level lvl) noexcept { g_level.store(static_cast<int>(lvl), std::memory_order_relaxed); }

void write(Level lvl, std::string_view message) noexcept {
  try {
    std::uint64_t dropped = 0;
    if (!admit(dropped)) return;
    std::string line = fmt::format("gpuipc[{}] {}: {}\n", ::getpid(), kNames[static_cast<int>(lvl)], message);
    if (dropped > 0) {
      line = fmt::format("gpuipc[{}] warn: {} log lines dropped (more than {} a second)\n", ::getpid(), dropped,
                         kLinesPerSecond) +
             line;
    }
    // One write(2) per line, so lines of concurrent processes do not interleave.
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, line.data(), line.size());
  } catch (...) {  // NOLINT(bugprone-empty-catch): logging must never throw
  }
}

}  // namespace gpuipc::log

namespace gpuipc {

LogLevel log_level() noexcept { return log::level(); }

void set_log_level(LogLevel level) noexcept { log::set_level(level); }

}  // namespace gpuipc
