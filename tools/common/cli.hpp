// What the gpuipc programs share (tools/gpuipc, tools/gpuipc-demo, tools/gpuipc-bench; gpuipcd its argument
// checks): the exit codes of docs/cli/gpuipc.md, argument checks, and one main loop that turns CLI11's and the
// library's errors into them. Header-only, over
// the public API (include/gpuipc), CLI11 and fmt; nothing else may include it.
#pragma once

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>

#include "gpuipc/error.hpp"
#include "gpuipc/format.hpp"

namespace gpuipc::cli {

/// Exit codes shared by every subcommand (docs/cli/gpuipc.md lists them).
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      ///< the command ran and found a problem (doctor: something gpuipc needs is missing)
  kExitUsage = 2,        ///< bad command line
  kExitNoDriver = 3,     ///< no CUDA driver could be loaded
  kExitNoDevice = 4,     ///< the driver loaded but reports no GPU
  kExitNotFound = 5,     ///< the named object does not exist
  kExitPermission = 6,   ///< the caller may not do this
  kExitBroker = 7,       ///< the broker could not be reached or started
  kExitNeedsGpu = 8,     ///< the command needs a GPU and there is none (bench)
};

/// A count on the command line, added with ->transform (it drops leading zeros): decimal digits that fit 64 bits.
/// CLI11 (2.1) reads unsigned options with strtoull(s, 0), which takes "-1" as 2^64 - 1, "010" as octal 8 and an
/// overflow as the largest value.
inline const CLI::Validator kWholeNumber(
    [](std::string& s) -> std::string {
      const bool digits = !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
      if (digits) s.erase(0, std::min(s.find_first_not_of('0'), s.size() - 1));
      if (digits && (s.size() < 20 || (s.size() == 20 && s <= "18446744073709551615"))) return {};
      return "'" + s + "' is not a whole number (decimal digits, at most 18446744073709551615)";
    },
    "UINT", "WholeNumber");

/// A number of seconds from `lo` to `hi`, added with ->check: a plain decimal number, finite, in range. CLI::Range let
/// NaN through (every comparison is false), refused "5s" as "not in range" (it is no number), and printed an open
/// upper bound as its 309 digits.
inline CLI::Validator seconds_between(double lo, double hi = std::numeric_limits<double>::infinity()) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        std::size_t used = 0;
        double v = 0;
        try {
          v = std::stod(s, &used);
        } catch (const std::out_of_range&) {
          return "'" + s + "' is out of range";
        } catch (const std::exception&) {
          used = 0;
        }
        if (s.empty() || used != s.size()) {
          return "'" + s + "' is not a number of seconds (write a plain number: 5, 0.5, 2e-3)";
        }
        if (!std::isfinite(v)) return "'" + s + "' is not a finite number";
        if (v < lo || v > hi) {
          return std::isinf(hi) ? fmt::format("'{}' is too small: {} seconds at least", s, lo)
                                : fmt::format("'{}' is out of range: {} to {} seconds", s, lo, hi);
        }
        return {};
      },
      "SECONDS", "Seconds");
}

/// When the command line ended without the subcommand that `app` (or the subcommand given) needs but left a word
/// over (`gpuipc bogus`, `gpuipc mps strat`, `gpuipc --json`), prints "unknown command" or "unknown option" naming it
/// and the commands there, and returns true. CLI11 would say only that a subcommand is required.
inline bool unknown_command(CLI::App& app) {
  CLI::App* at = &app;
  for (auto subs = at->get_subcommands(); !subs.empty(); subs = at->get_subcommands()) at = subs.front();
  const auto rest = at->remaining();
  if (at->get_require_subcommand_min() == 0 || rest.empty() || rest.front().empty()) return false;
  std::string names;
  for (const CLI::App* sub : at->get_subcommands({})) {
    if (sub->get_name().empty() || sub->get_group().empty()) continue;  // (a hidden one)
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  std::string path = at->get_name();
  for (const CLI::App* up = at->get_parent(); up != nullptr; up = up->get_parent()) path = up->get_name() + " " + path;
  const bool option = rest.front()[0] == '-';
  std::cerr << "gpuipc: unknown " << (option ? "option" : "command") << " '" << printable(rest.front(), 64) << "' for '"
            << path << "'" << (option ? " (a command's options go after the command)" : "") << "; the commands are "
            << names << " (" << path << " --help)\n";
  return true;
}

/// Flushes std::cout (and the C stdout under it) and returns why what was printed did not all reach standard output
/// (the failed write's strerror: a full disk, a closed pipe), or empty when it did.
inline std::string output_failure() {
  errno = 0;
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && std::cout.good() && std::ferror(stdout) == 0) return {};
  return err != 0 ? std::strerror(err) : "the write failed";
}

/// The error of a failed write to standard output: "could not write to standard output: WHY".
inline Error output_error(const std::string& why) {
  return Error(ErrorCode::System,
               fmt::format("could not write to standard output: {}; what it printed is incomplete", why), "write");
}

/// Flushes standard output; throws output_error() when it could not be written (run() prints it, exit status 1).
/// For a command that prints until stopped (top, watch): it stops at the first output that fails.
inline void flush_output() {
  if (auto why = output_failure(); !why.empty()) throw output_error(why);
}

/// Parses `argv` into `app` (whose callbacks run the command and store its code in `exit_code`) and returns the
/// process exit code: `exit_code`, or the code of the error that ended the command, printed as "gpuipc: ...". What
/// the command printed on stdout is flushed: a write that failed there is an error too, said on stderr, and turns
/// exit status 0 into 1 (a command's own failure keeps its code).
inline int run(CLI::App& app, int argc, char** argv, const int& exit_code) {
  // `rc`, or kExitFailure in place of 0 when the output (a command's, or the help) could not be written.
  auto written = [](int rc) {
    const auto why = output_failure();
    if (why.empty()) return rc;
    std::cerr << "gpuipc: " << output_error(why).what() << "\n";
    return rc == kExitOk ? kExitFailure : rc;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::RequiredError& e) {
    if (unknown_command(app)) return kExitUsage;
    const int rc = app.exit(e);
    return rc == 0 ? written(0) : kExitUsage;
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? written(0) : kExitUsage;
  } catch (const Error& e) {
    std::cerr << "gpuipc: " << e.what() << "\n";
    // The broker could not be reached or started (connect, hello, or a dead connection); a broker or socket the
    // caller may not use (another user's) is a permission matter.
    if (e.code() != ErrorCode::PermissionDenied &&
        (e.call() == "connect" || e.call() == "hello" || e.call() == "send" || e.call() == "recv")) {
      return kExitBroker;
    }
    switch (e.code()) {
      case ErrorCode::NoDriver: return kExitNoDriver;
      case ErrorCode::NoDevice: return kExitNoDevice;
      case ErrorCode::NotFound: return kExitNotFound;
      case ErrorCode::PermissionDenied: return kExitPermission;
      default: return kExitFailure;
    }
  } catch (const std::exception& e) {
    std::cerr << "gpuipc: " << e.what() << "\n";
    return kExitFailure;
  }
  return written(exit_code);
}

}  // namespace gpuipc::cli
