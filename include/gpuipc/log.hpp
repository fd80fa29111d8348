// The library's log level: what gpuipc writes to stderr (GPUIPC_LOG: off, error, warn, info, debug, trace; default
// warn; docs/env/GPUIPC_LOG.md). Front ends set it for --verbose.
#pragma once

namespace gpuipc {

/// How much the library logs, from nothing to everything.
enum class LogLevel : int { Off = 0, Error = 1, Warn = 2, Info = 3, Debug = 4, Trace = 5 };

/// The level in force (read from GPUIPC_LOG once; an unknown value falls back to warn with one warning).
LogLevel log_level() noexcept;

/// Overrides the level for this process; thread-safe.
void set_log_level(LogLevel level) noexcept;

}  // namespace gpuipc
