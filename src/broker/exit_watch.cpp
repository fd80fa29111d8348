#include "broker/exit_watch.hpp"

#include <unordered_map>
#include <utility>

#include "base/log.hpp"
#include "gpuipc/error.hpp"
#include "os/process.hpp"

namespace gpuipc::broker {

struct ExitWatch::State {
  std::unordered_map<pid_t, std::weak_ptr<const WatchedProcess>> by_pid;
  std::unordered_map<uid_t, std::size_t> per_uid;
  ExitPasses passes;
  std::uint64_t opened = 0;  ///< passes opened so far
};

bool exited(const ProcessWatch& process) noexcept {
  if (!process || !process->pidfd || process->gone) return true;
  const std::uint64_t pass = process->passes != nullptr ? process->passes->current : 0;
  if (pass != 0 && process->running_in == pass) return false;
  if (process->passes != nullptr) ++process->passes->looks;
  try {
    process->gone = os::pidfd_wait_exit(process->pidfd.get(), 0);
  } catch (const Error&) {  // not a pidfd any more: nothing to wait for
    process->gone = true;
  }
  if (!process->gone) process->running_in = pass;
  return process->gone;
}

ExitWatch::ExitWatch() : m_state(std::make_shared<State>()) {}

ProcessWatch ExitWatch::watch(pid_t pid, std::uint64_t start, uid_t uid, std::size_t allowed) noexcept {
  if (pid <= 0) return {};
  try {
    if (const auto known = m_state->by_pid.find(pid); known != m_state->by_pid.end()) {
      if (ProcessWatch w = known->second.lock(); w && !exited(w)) {
        // The process that has the pid now: the one asked for, unless that one started at another time (gone).
        return start == 0 || w->start == start ? w : ProcessWatch{};
      } else if (w && start != 0 && w->start == start) {
        // The process asked for, seen exited: nothing to wait for (not reaped yet, it would take a second pidfd).
        return {};
      }
    }
    if (const std::size_t count = watched(uid); count >= allowed) {
      GPUIPC_LOG_WARN(
          "uid {} has {} processes the broker waits for the exit of, the most it allows (half its file descriptor "
          "budget, less the uid's segments): pid {} is not waited for",
          uid, count, pid);
      return {};
    }
    // The pidfd before the start: a pid used again after that read is not the process the pidfd names.
    auto fd = os::pidfd_open(pid);
    const std::uint64_t started = os::process_start_ticks(pid);
    if (start != 0 && started != start) return {};
    auto process = std::make_unique<WatchedProcess>(WatchedProcess{std::move(fd), pid, started, &m_state->passes});
    ++m_state->per_uid[uid];  // given back by the deleter, which runs also when the shared_ptr cannot be made
    ProcessWatch w(process.release(), [state = m_state, uid](const WatchedProcess* p) noexcept {
      if (auto c = state->per_uid.find(uid); c != state->per_uid.end() && --c->second == 0) state->per_uid.erase(c);
      // Unless a newer process with its pid is watched by now.
      if (auto k = state->by_pid.find(p->pid); k != state->by_pid.end() && k->second.expired()) {
        state->by_pid.erase(k);
      }
      delete p;  // NOLINT(cppcoreguidelines-owning-memory): the shared_ptr's deleter
    });
    m_state->by_pid[pid] = w;
    return w;
  } catch (const std::exception&) {  // gone (NotFound), no pidfd, or no memory: nothing waits for it
    return {};
  }
}

std::uint64_t ExitWatch::looks() const noexcept { return m_state->passes.looks; }

ExitWatch::Pass::Pass(ExitWatch& watch) noexcept : m_state(watch.m_state), m_outer(m_state->passes.current == 0) {
  if (m_outer) m_state->passes.current = ++m_state->opened;
}

ExitWatch::Pass::~Pass() {
  if (m_outer) m_state->passes.current = 0;
}

std::size_t ExitWatch::watched(uid_t uid) const noexcept {
  const auto c = m_state->per_uid.find(uid);
  return c == m_state->per_uid.end() ? 0 : c->second;
}

}  // namespace gpuipc::broker
