#include "support/support.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace gpuipc::test {
namespace {

[[noreturn]] void fail(const std::string& what) { throw std::runtime_error(what + ": " + std::strerror(errno)); }

std::string temp_root() {
  // Socket paths must fit in 107 bytes: a long $TMPDIR would make every socket test fail for the wrong reason.
  const char* env = std::getenv("TMPDIR");
  if (env != nullptr && env[0] == '/' && std::strlen(env) <= 48) return env;
  return "/tmp";
}

}  // namespace

TempDir::TempDir(std::string_view prefix) : m_owner(::getpid()) {
  std::string pattern = temp_root() + "/" + std::string(prefix) + "-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) fail("mkdtemp " + pattern);
  m_path = std::move(pattern);
}

TempDir::~TempDir() {
  if (::getpid() != m_owner) return;
  std::error_code ec;
  std::filesystem::remove_all(m_path, ec);
}

std::string TempDir::file(std::string_view name) const { return m_path + "/" + std::string(name); }

pid_t start_child(const std::function<int()>& body) {
  std::fflush(nullptr);  // so that buffered output is not written twice
  const pid_t pid = ::fork();
  if (pid < 0) fail("fork");
  if (pid != 0) return pid;
  int code = kChildThrew;
  try {
    code = body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child %d: uncaught exception: %s\n", static_cast<int>(::getpid()), e.what());
  } catch (...) {
    std::fprintf(stderr, "child %d: uncaught non-standard exception\n", static_cast<int>(::getpid()));
  }
  std::fflush(stderr);
  ::_exit(code);
}

int wait_child(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t rc = ::waitpid(pid, &status, WNOHANG);
    if (rc == pid) break;
    if (rc < 0 && errno != EINTR) fail("waitpid " + std::to_string(pid));
    if (std::chrono::steady_clock::now() >= deadline) {
      std::fprintf(stderr, "child %d outlived its %lld ms timeout: killing it\n", static_cast<int>(pid),
                   static_cast<long long>(timeout.count()));
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      return kChildTimedOut;
    }
    std::this_thread::sleep_for(1ms);
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kChildTimedOut;
}

int run_child(const std::function<int()>& body, std::chrono::milliseconds timeout) {
  return wait_child(start_child(body), timeout);
}

void report_child_failure(const char* file, int line, const char* expr) noexcept {
  std::fprintf(stderr, "%s:%d: child check failed: %s\n", file, line, expr);
  std::fflush(stderr);
}

SyncPipe::SyncPipe() {
  int fds[2] = {-1, -1};
  if (::pipe2(fds, O_CLOEXEC) != 0) fail("pipe2");
  m_read.reset(fds[0]);
  m_write.reset(fds[1]);
}

void SyncPipe::notify() const {
  const char byte = 'x';
  ssize_t n;
  while ((n = ::write(m_write.get(), &byte, 1)) < 0 && errno == EINTR) {
  }
  if (n != 1) fail("SyncPipe write");
}

bool SyncPipe::wait(std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd pfd{m_read.get(), POLLIN, 0};
    const int rc = ::poll(&pfd, 1, static_cast<int>(std::max<long long>(left.count(), 0)));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return false;
    char byte = 0;
    const ssize_t n = ::read(m_read.get(), &byte, 1);
    if (n < 0 && errno == EINTR) continue;
    return n == 1;
  }
}

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout,
                std::chrono::milliseconds interval) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(interval);
  }
  return pred();
}

std::string describe_open_fds() {
  std::ostringstream out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    std::error_code link_ec;
    const auto target = std::filesystem::read_symlink(entry.path(), link_ec);
    out << entry.path().filename().string() << " -> " << (link_ec ? "?" : target.string()) << "\n";
  }
  return out.str();
}

char task_state(pid_t id) {
  const auto stat = read_file("/proc/" + std::to_string(id) + "/stat");
  if (!stat) return '\0';
  // "pid (comm) S ...": comm may contain spaces and parentheses, so look after the last ')'.
  const auto close = stat->rfind(')');
  if (close == std::string::npos || close + 2 >= stat->size()) return '\0';
  return (*stat)[close + 2];
}

bool wait_until_sleeping(pid_t id, std::chrono::milliseconds timeout) {
  return wait_until(
      [id] {
        const char state = task_state(id);
        return state == 'S' || state == 'D';
      },
      timeout, 1ms);
}

namespace {
std::array<std::atomic<int>, NSIG> g_signal_counts{};
extern "C" void count_signal(int sig) {
  if (sig > 0 && sig < NSIG) g_signal_counts[static_cast<std::size_t>(sig)].fetch_add(1);
}
}  // namespace

struct ScopedSignalCounter::Saved {
  struct sigaction action;
};

ScopedSignalCounter::ScopedSignalCounter(int sig) : m_sig(sig), m_saved(new Saved{}) {
  g_signal_counts.at(static_cast<std::size_t>(sig)).store(0);
  struct sigaction sa {};
  sa.sa_handler = count_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: interrupted calls fail with EINTR
  if (::sigaction(sig, &sa, &m_saved->action) != 0) {
    delete m_saved;
    fail("sigaction " + std::to_string(sig));
  }
}

ScopedSignalCounter::~ScopedSignalCounter() {
  ::sigaction(m_sig, &m_saved->action, nullptr);
  delete m_saved;
}

int ScopedSignalCounter::count() const noexcept { return g_signal_counts[static_cast<std::size_t>(m_sig)].load(); }

SignalPulser::SignalPulser(pthread_t target, int sig, std::chrono::milliseconds delay, std::chrono::milliseconds period,
                           int max_signals) {
  m_thread = std::thread([this, target, sig, delay, period, max_signals] {
    std::unique_lock lock(m_mutex);
    auto next = std::chrono::steady_clock::now() + delay;
    while (m_sent.load() < max_signals && !m_cv.wait_until(lock, next, [this] { return m_stop; })) {
      ::pthread_kill(target, sig);
      m_sent.fetch_add(1);
      next += period;
    }
  });
}

SignalPulser::~SignalPulser() {
  {
    std::lock_guard lock(m_mutex);
    m_stop = true;
  }
  m_cv.notify_all();
  m_thread.join();
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void write_file(const std::string& path, std::string_view content) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(content.data(), static_cast<std::streamsize>(content.size()));
  if (!out) fail("write " + path);
}

}  // namespace gpuipc::test
