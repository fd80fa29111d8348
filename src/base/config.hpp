// The one registry of GPUIPC_* environment variables. Every variable the library and its programs read is listed
// in config.cpp with its default and a one-line description, and documented in docs/env/<NAME>.md (a unit test
// checks both directions). Read them only through these functions. The one exception: the benchmark harness's
// own knobs (GPUIPC_BENCH_*), which bench/ reads with getenv and docs/benchmarks.md#environment-variables-of-the-
// benchmarks documents.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace gpuipc::config {

/// One registered environment variable.
struct EnvVar {
  std::string_view name;           ///< "GPUIPC_RUNTIME_DIR"
  std::string_view default_value;  ///< human-readable default ("" when unset means "derived", see description)
  std::string_view description;    ///< one line
};

/// Every registered variable, in documentation order.
std::span<const EnvVar> env_registry() noexcept;

/// The raw value of a registered variable, or nullopt when unset or empty. Throws Error(InvalidArgument) for a
/// name that is not registered: reading an undocumented variable is a bug.
std::optional<std::string> env_raw(std::string_view name);

/// The variable as a non-negative integer (decimal; suffixes K, M, G, T for powers of 1024 allowed), else
/// `fallback`. A malformed value throws Error(InvalidArgument) naming the variable and the value.
std::uint64_t env_u64(std::string_view name, std::uint64_t fallback);

/// The longest duration env_ms gives: 100 years ("unlimited", and anything longer). Any clock's now() plus it still
/// fits a 64-bit count of nanoseconds (INT64_MAX ms, as it was, made every deadline computed from it wrap into the
/// past: a connect that gave up at once, a restore grace of -1 ms that dropped every journaled name).
inline constexpr std::chrono::milliseconds kMostEnvMs{std::int64_t{100} * 365 * 24 * 3600 * 1000};

/// The variable as a duration in milliseconds, at most kMostEnvMs, else `fallback`.
std::chrono::milliseconds env_ms(std::string_view name, std::chrono::milliseconds fallback);

/// The variable as a boolean (1/0, true/false, yes/no, on/off), else `fallback`.
bool env_bool(std::string_view name, bool fallback);

/// The broker's runtime directory: $GPUIPC_RUNTIME_DIR, else $XDG_RUNTIME_DIR/gpuipc, else /tmp/gpuipc-$UID
/// unless another user made that first, then $HOME/.gpuipc. Throws Error(InvalidArgument) for a relative
/// GPUIPC_RUNTIME_DIR.
std::string runtime_dir();

/// The broker's socket path inside runtime_dir().
std::string socket_path();

}  // namespace gpuipc::config
