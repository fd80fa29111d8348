#include "support/support.hpp"

extern char** environ;

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "os/child.hpp"
#include "os/process.hpp"
#include "os/socket.hpp"

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

pid_t start_child(const std::function<int()>& body) { return os::fork_child(body, kChildThrew); }

int wait_child(pid_t pid, std::chrono::milliseconds timeout) {
  const os::ChildExit e = os::wait_child(pid, timeout);
  if (!e.finished) {
    std::fprintf(stderr, "child %d outlived its %lld ms timeout: killed it\n", static_cast<int>(pid),
                 static_cast<long long>(timeout.count()));
    return kChildTimedOut;
  }
  const int code = os::exit_code(e.wait_status);
  return code < 0 ? kChildTimedOut : code;
}

int run_child(const std::function<int()>& body, std::chrono::milliseconds timeout) {
  return wait_child(start_child(body), timeout);
}

rlimit use_up_fds() {
  rlimit before{};
  (void)::getrlimit(RLIMIT_NOFILE, &before);
  int top = 0;
  for (int fd = 0; fd < 65536 && static_cast<rlim_t>(fd) < before.rlim_cur; ++fd) {
    if (::fcntl(fd, F_GETFD) >= 0) top = fd;
  }
  rlimit low = before;
  low.rlim_cur = static_cast<rlim_t>(top) + 1;
  (void)::setrlimit(RLIMIT_NOFILE, &low);
  while (::dup(0) >= 0) {  // the free numbers below
  }
  return before;
}

::testing::AssertionResult fails_with(const std::function<void()>& call, ErrorCode code, std::string_view text) {
  const std::string expected = std::string(to_string(code)) + " with \"" + std::string(text) + "\"";
  std::string instead;
  try {
    call();
    instead = "did not throw";
  } catch (const Error& e) {
    if (e.code() == code && std::string_view(e.what()).find(text) != std::string_view::npos) {
      return ::testing::AssertionSuccess();
    }
    instead = "threw " + std::string(to_string(e.code())) + ": " + e.what();
  }
  std::fprintf(stderr, "%s; expected %s\n", instead.c_str(), expected.c_str());
  return ::testing::AssertionFailure() << instead << "; expected " << expected;
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

KillStorm kill_storm(const std::function<pid_t(std::uint32_t)>& start, const std::function<bool(std::uint32_t)>& ready,
                     unsigned kills, unsigned seed) {
  KillStorm r;
  std::mt19937 rng(seed);
  std::vector<std::pair<pid_t, std::uint32_t>> victims{{start(0), 0}, {start(1), 1}};
  for (std::uint32_t next = 2; r.kills < kills; ++next) {
    auto& [pid, id] = victims[rng() % victims.size()];
    if (!wait_until([&, id = id] { return ready(id); }, 60s)) {
      r.not_ready = id;
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 1500));
    ::kill(pid, SIGKILL);
    if (wait_child(pid) != 128 + SIGKILL) ++r.other_exits;
    ++r.kills;
    pid = start(next);
    id = next;
  }
  for (const auto& v : victims) r.running.push_back(v.first);
  return r;
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

namespace {

// argv and envp for exec_program, built before fork: the child of a threaded test may not allocate.
struct ExecPlan {
  std::string program;
  std::vector<std::string> args;
  std::vector<std::string> env;
  std::vector<char*> argv;
  std::vector<char*> envp;
  char* listen_pid = nullptr;  // the digits of "LISTEN_PID=<pid>", written by the child
  int keep_fd = -1;
};

void plan_exec(ExecPlan& plan, const std::string& program, const std::vector<std::string>& args,
               const std::vector<std::string>& env, int keep_fd) {
  plan.program = program;
  plan.keep_fd = keep_fd;
  plan.args = args;
  plan.args.insert(plan.args.begin(), program);
  plan.env = env;
  const auto has = [&](const char* name) {
    return std::any_of(plan.env.begin(), plan.env.end(), [&](const std::string& e) { return e.rfind(name, 0) == 0; });
  };
  bool own_pid = false;
  if (keep_fd >= 0 && !has("LISTEN_PID=")) {
    plan.env.emplace_back("LISTEN_PID=" + std::string(20, '\0'));
    own_pid = true;
  }
  if (keep_fd >= 0 && !has("LISTEN_FDS=")) plan.env.emplace_back("LISTEN_FDS=1");
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const bool overridden = std::any_of(plan.env.begin(), plan.env.end(), [&](const std::string& mine) {
      return entry.substr(0, entry.find('=') + 1) == std::string_view(mine).substr(0, mine.find('=') + 1);
    });
    if (!overridden) plan.envp.push_back(*e);
  }
  for (auto& e : plan.env) plan.envp.push_back(e.data());
  plan.envp.push_back(nullptr);
  if (own_pid) {
    for (auto& e : plan.env) {
      if (e.rfind("LISTEN_PID=", 0) == 0) plan.listen_pid = e.data() + std::strlen("LISTEN_PID=");
    }
  }
  for (auto& a : plan.args) plan.argv.push_back(a.data());
  plan.argv.push_back(nullptr);
}

// In the forked child: async-signal-safe calls only.
[[noreturn]] void exec_program(ExecPlan& plan, int out_fd, int err_fd) {
  if (plan.listen_pid != nullptr) {
    char digits[20];
    int n = 0;
    for (auto v = static_cast<unsigned long>(::getpid()); v != 0 || n == 0; v /= 10)
      digits[n++] = static_cast<char>('0' + v % 10);
    for (int i = 0; i < n; ++i) plan.listen_pid[i] = digits[n - 1 - i];
    plan.listen_pid[n] = '\0';
  }
  if (out_fd >= 0) ::dup2(out_fd, 1);
  if (err_fd >= 0) ::dup2(err_fd, 2);
  if (plan.keep_fd >= 0) {
    // dup2 clears FD_CLOEXEC on the copy; when the fd already is 3, clear it by hand.
    if (plan.keep_fd == 3) {
      ::fcntl(3, F_SETFD, 0);
    } else {
      ::dup2(plan.keep_fd, 3);
    }
  }
  ::execve(plan.program.c_str(), plan.argv.data(), plan.envp.data());
  ::_exit(127);
}

}  // namespace

ProgramOutcome run_built(const char* program, const std::vector<std::string>& args,
                         const std::vector<std::string>& env) {
  return run_program(build_bin_dir() + "/" + program, args, env, -1, std::chrono::seconds(60));
}

ProgramOutcome run_program(const std::string& program, const std::vector<std::string>& args,
                           const std::vector<std::string>& env, int keep_fd, std::chrono::milliseconds timeout) {
  int out_pipe[2];
  int err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    throw std::runtime_error("pipe2");
  }
  ExecPlan plan;
  plan_exec(plan, program, args, env, keep_fd);
  const pid_t pid = ::fork();
  if (pid == 0) exec_program(plan, out_pipe[1], err_pipe[1]);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  ProgramOutcome o;
  std::array<pollfd, 2> fds{pollfd{out_pipe[0], POLLIN, 0}, pollfd{err_pipe[0], POLLIN, 0}};
  int open_count = 2;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (open_count > 0 && std::chrono::steady_clock::now() < deadline) {
    if (::poll(fds.data(), fds.size(), 100) < 0 && errno != EINTR) break;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[4096];
      const ssize_t n = ::read(fds[i].fd, buf, sizeof(buf));
      if (n > 0) {
        (i == 0 ? o.out : o.err).append(buf, static_cast<std::size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_count;
      }
    }
  }
  for (auto& p : fds) {
    if (p.fd >= 0) ::close(p.fd);
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  o.exit_code = wait_child(pid, std::max(left, std::chrono::milliseconds(1)));
  return o;
}

pid_t start_program(const std::string& program, const std::vector<std::string>& args,
                    const std::vector<std::string>& env, int keep_fd, const std::string& log_path) {
  const int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (log < 0) throw std::runtime_error("open " + log_path);
  ExecPlan plan;
  plan_exec(plan, program, args, env, keep_fd);
  const pid_t pid = ::fork();
  if (pid == 0) exec_program(plan, log, log);
  ::close(log);
  if (pid < 0) throw std::runtime_error("fork");
  return pid;
}

std::string build_bin_dir() {
  return (std::filesystem::path(os::self_exe_path()).parent_path().parent_path() / "bin").string();
}

std::uint8_t pattern_byte(std::uint64_t seed, std::size_t i) { return static_cast<std::uint8_t>(seed * 131 + i * 7 + 1); }

void fill_pattern(void* p, std::size_t n, std::uint64_t seed) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = pattern_byte(seed, i);
}

bool holds_pattern(const void* p, std::size_t n, std::uint64_t seed) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  for (std::size_t i = 0; i < n; ++i) {
    if (b[i] != pattern_byte(seed, i)) return false;
  }
  return true;
}

os::UniqueFd lingering_socket(int seconds, os::UniqueFd& peer) {
  const os::UniqueFd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  EXPECT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), len), 0);
  EXPECT_EQ(::listen(listener.get(), 1), 0);
  EXPECT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  os::UniqueFd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int small = 4096;
  (void)::setsockopt(sock.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  EXPECT_EQ(::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), len), 0);
  peer.reset(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  (void)::setsockopt(peer.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  os::set_nonblocking(sock.get(), true);
  const std::vector<char> chunk(65536, 'x');
  while (::send(sock.get(), chunk.data(), chunk.size(), MSG_NOSIGNAL) > 0) {
  }
  const linger l{1, seconds};
  EXPECT_EQ(::setsockopt(sock.get(), SOL_SOCKET, SO_LINGER, &l, sizeof l), 0);
  return sock;
}

}  // namespace gpuipc::test
