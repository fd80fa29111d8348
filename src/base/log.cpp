#include "base/log.hpp"

#include <unistd.h>

#include <atomic>
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
    std::string line = fmt::format("gpuipc[{}] {}: {}\n", ::getpid(), kNames[static_cast<int>(lvl)], message);
    // One write(2) per line, so lines of concurrent processes do not interleave.
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, line.data(), line.size());
  } catch (...) {  // NOLINT(bugprone-empty-catch): logging must never throw
  }
}

}  // namespace gpuipc::log
