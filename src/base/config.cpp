#include "base/config.hpp"

#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>

#include "gpuipc/error.hpp"

namespace gpuipc::config {
namespace {

constexpr std::array kRegistry{
    EnvVar{"GPUIPC_RUNTIME_DIR",
           "$XDG_RUNTIME_DIR/gpuipc, else /tmp/gpuipc-$UID (else ~/.gpuipc if another user owns it)",
           "Directory of the broker's socket and lock file; processes that share it share segments."},
    EnvVar{"GPUIPC_LOG", "warn", "Log level: off, error, warn, info, debug or trace."},
    EnvVar{
        "GPUIPC_RESTORE_GRACE_MS", "30000",
        "After a broker restart, how long names linked before it wait for a process that maps them to announce them."},
    EnvVar{"GPUIPC_REJOIN_GRACE_MS", "5000",
           "How long a member whose broker connection closed while its process lives has to rejoin before it is "
           "repaired as dead."},
    EnvVar{"GPUIPC_DAEMON", "gpuipcd next to the program or library, then $PATH",
           "Path of the gpuipcd executable the library starts on demand."},
    EnvVar{"GPUIPC_NO_AUTOSTART", "0", "When 1, the library never starts a broker; connecting fails if none runs."},
    EnvVar{"GPUIPC_IDLE_TIMEOUT_MS", "30000",
           "A broker started on demand exits after this long with no client and nothing registered."},
    EnvVar{"GPUIPC_QUOTA_BYTES", "unlimited", "Most bytes of segments one uid may have registered at once."},
    EnvVar{"GPUIPC_QUOTA_SEGMENTS", "4096", "Most segments (and semaphores, channels) one uid may have at once."},
    EnvVar{"GPUIPC_QUOTA_OPENS", "65536",
           "Most segments one uid's processes may hold open together, each process's opens counted apart."},
    EnvVar{"GPUIPC_QUOTA_OPENS_TOTAL", "1048576",
           "Most segments every uid's processes may hold open together, each process's opens counted apart."},
    EnvVar{"GPUIPC_CONNECT_TIMEOUT_MS", "5000", "How long a client waits for the broker to start and answer."},
    EnvVar{"GPUIPC_HELLO_TIMEOUT_MS", "10000",
           "The broker closes a connection that has not said Hello this long after it accepted it; 0: never."},
    EnvVar{"GPUIPC_CUDA_LIBRARY", "libcuda.so.1", "The CUDA driver library to load at run time."},
    EnvVar{"GPUIPC_NVTX", "1", "When 0, library calls push no NVTX ranges (for nsys and other NVTX tools)."},
    EnvVar{"GPUIPC_BROKER_POLL_US", "1000",
           "How long the broker, after a request, and a client, waiting for the broker's answer, look for the next "
           "message without sleeping; 0: sleep at once."},
    EnvVar{"GPUIPC_CHANNEL_PACING_US", "200",
           "How long a device channel's acquire or receive watches the peer's progress on the host before it "
           "enqueues a stream wait."},
    EnvVar{"GPUIPC_CHANNEL_PACING_AHEAD", "",
           "How many messages a pacing producer may run ahead of the consumers' streams (default: half of a ring of "
           "8 or more slots, else the whole ring)."},
};

std::string trim_lower(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (!std::isspace(static_cast<unsigned char>(c))) out.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  }
  return out;
}

}  // namespace

std::span<const EnvVar> env_registry() noexcept { return kRegistry; }

std::optional<std::string> env_raw(std::string_view name) {
  const bool known = std::any_of(kRegistry.begin(), kRegistry.end(), [&](const EnvVar& v) { return v.name == name; });
  if (!known) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("environment variable {} is not registered in src/base/config.cpp", name),
                "env_raw");
  }
  const std::string key(name);
  const char* v = std::getenv(key.c_str());  // NOLINT(concurrency-mt-unsafe): nothing in gpuipc calls setenv
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::uint64_t env_u64(std::string_view name, std::uint64_t fallback) {
  auto raw = env_raw(name);
  if (!raw) return fallback;
  const std::string s = trim_lower(*raw);
  if (s == "unlimited" || s == "inf") return UINT64_MAX;
  std::size_t pos = 0;
  unsigned long long value = 0;
  // stoull skips blanks and takes a sign: "-1" would read as 2^64 - 1. A value starts with a digit.
  if (!s.empty() && std::isdigit(static_cast<unsigned char>(s[0])) != 0) {
    try {
      value = std::stoull(s, &pos, 10);
    } catch (const std::exception&) {
      pos = 0;
    }
  }
  std::uint64_t mult = 1;
  if (pos > 0 && pos + 1 == s.size()) {
    switch (s[pos]) {
      case 'k': mult = 1ULL << 10; break;
      case 'm': mult = 1ULL << 20; break;
      case 'g': mult = 1ULL << 30; break;
      case 't': mult = 1ULL << 40; break;
      default: pos = 0;
    }
    if (pos != 0) pos = s.size();
  }
  if (pos == 0 || pos != s.size() || (mult > 1 && value > UINT64_MAX / mult)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{}='{}' is not a non-negative integer (examples: 1000, 64M, 2G, unlimited)", name, *raw),
                "env_u64");
  }
  return value * mult;
}

std::chrono::milliseconds env_ms(std::string_view name, std::chrono::milliseconds fallback) {
  const auto v = env_u64(name, static_cast<std::uint64_t>(fallback.count()));
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::min<std::uint64_t>(v, kMostEnvMs.count())));
}

bool env_bool(std::string_view name, bool fallback) {
  auto raw = env_raw(name);
  if (!raw) return fallback;
  const std::string s = trim_lower(*raw);
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  throw Error(ErrorCode::InvalidArgument, fmt::format("{}='{}' is not a boolean (use 1 or 0)", name, *raw), "env_bool");
}

std::string runtime_dir() {
  if (auto dir = env_raw("GPUIPC_RUNTIME_DIR")) {
    // Relative, it named another directory after a chdir: the process's next connect (after a broker restart) went
    // to another broker, or started one there, and the names it held were given back to none.
    if (dir->front() != '/') {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("GPUIPC_RUNTIME_DIR='{}' is a relative path, which would name another directory after "
                              "a change of directory; give an absolute one (e.g. \"$PWD/{}\")",
                              *dir, *dir),
                  "runtime_dir");
    }
    return *dir;
  }
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");  // NOLINT(concurrency-mt-unsafe): see env_raw
  if (xdg != nullptr && *xdg == '/') return std::string(xdg) + "/gpuipc";
  // /tmp is everyone's: another user can make /tmp/gpuipc-$UID first (the broker then refuses it as unsafe, and
  // this user would have no broker at all). Fall back to a directory in this user's home, which nobody else can
  // create; every process of the user makes the same choice, so they still meet.
  const uid_t uid = ::getuid();
  std::string tmp = fmt::format("/tmp/gpuipc-{}", uid);
  struct stat st {};
  if (::lstat(tmp.c_str(), &st) != 0 || (S_ISDIR(st.st_mode) && st.st_uid == uid)) return tmp;
  const char* home = std::getenv("HOME");  // NOLINT(concurrency-mt-unsafe): see env_raw
  std::string fallback = home != nullptr && *home == '/' ? std::string(home) + "/.gpuipc" : std::string();
  // Without a usable home nothing else is shared by every process of this user: keep /tmp's path, whose
  // refusal says what is wrong and to set GPUIPC_RUNTIME_DIR.
  if (fallback.empty() || fallback.size() + sizeof("/broker.sock") > 108) return tmp;
  return fallback;
}

std::string socket_path() { return runtime_dir() + "/broker.sock"; }

}  // namespace gpuipc::config
