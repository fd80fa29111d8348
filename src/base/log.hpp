// Levelled logging to stderr, controlled by GPUIPC_LOG (off, error, warn, info, debug, trace; default warn).
#pragma once

#include <fmt/format.h>

#include <string_view>

#include "gpuipc/log.hpp"

namespace gpuipc::log {

/// The public gpuipc::LogLevel (include/gpuipc/log.hpp).
using Level = ::gpuipc::LogLevel;

/// The level in force (read from GPUIPC_LOG once; an unknown value falls back to warn with one warning).
Level level() noexcept;
/// Overrides the level (tools use it for --verbose); thread-safe.
void set_level(Level level) noexcept;
/// Parses "debug" etc.; returns false for an unknown name.
bool parse_level(std::string_view text, Level& out) noexcept;
/// Writes one line "gpuipc[<pid>] <level>: <message>" to stderr with a single write(2). At most 100 lines a
/// second are written; the lines dropped beyond that are counted in the next line written.
void write(Level level, std::string_view message) noexcept;

template <typename... Args>
void emit(Level lvl, fmt::format_string<Args...> format, Args&&... args) noexcept {
  if (static_cast<int>(lvl) > static_cast<int>(level())) return;
  try {
    write(lvl, fmt::format(format, std::forward<Args>(args)...));
  } catch (...) {  // NOLINT(bugprone-empty-catch): logging must never throw
  }
}

}  // namespace gpuipc::log

#define GPUIPC_LOG_ERROR(...) ::gpuipc::log::emit(::gpuipc::log::Level::Error, __VA_ARGS__)
#define GPUIPC_LOG_WARN(...) ::gpuipc::log::emit(::gpuipc::log::Level::Warn, __VA_ARGS__)
#define GPUIPC_LOG_INFO(...) ::gpuipc::log::emit(::gpuipc::log::Level::Info, __VA_ARGS__)
#define GPUIPC_LOG_DEBUG(...) ::gpuipc::log::emit(::gpuipc::log::Level::Debug, __VA_ARGS__)
#define GPUIPC_LOG_TRACE(...) ::gpuipc::log::emit(::gpuipc::log::Level::Trace, __VA_ARGS__)
