#include "programs.hpp"

#include <fmt/format.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "os/process.hpp"

namespace gpuipc::bench {
namespace {

/// `s` as one word for /bin/sh.
std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// Runs the shell words `command` under coreutils' timeout, which bounds a stuck program (a baseline whose peer died
/// waits on its queue forever) and kills its process group with it.
ProgramRun run_shell(const std::string& command, std::chrono::seconds limit) {
  ProgramRun run;
  const std::string cmd = fmt::format("timeout -k 10 {} {} 2>&1", limit.count(), command);
  FILE* f = ::popen(cmd.c_str(), "r");  // NOLINT(cert-env33-c): a command line of ours
  if (f == nullptr) {
    run.error = "popen failed";
    return run;
  }
  char buf[4096];
  while (std::fgets(buf, sizeof buf, f) != nullptr) run.output += buf;
  const int status = ::pclose(f);
  run.status = status == -1 ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (run.status == 124 || run.status == 137) {
    run.error = fmt::format("timed out after {} s", limit.count());
  } else if (run.status != 0) {
    run.error = fmt::format("exit status {}", run.status);
  }
  return run;
}

}  // namespace

std::string tail(const std::string& s, std::size_t n) { return s.size() <= n ? s : s.substr(s.size() - n); }

ProgramRun run_program(const std::vector<std::string>& argv,
                       const std::vector<std::pair<std::string, std::string>>& env, std::chrono::seconds limit) {
  std::string command = "env";  // coreutils' env adds the variables and then runs argv
  for (const auto& [name, value] : env) command.append(" ").append(shell_quote(fmt::format("{}={}", name, value)));
  for (const auto& a : argv) command.append(" ").append(shell_quote(a));
  return run_shell(command, limit);
}

std::string python_interpreter() {
  const char* env = std::getenv("GPUIPC_BENCH_PYTHON");  // NOLINT(concurrency-mt-unsafe): read before any thread
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("python3");
}

std::string find_script(const std::string& relative) {
  namespace fs = std::filesystem;
  std::vector<fs::path> candidates{fs::current_path() / relative};
  const auto exe = os::self_exe_path();
  if (!exe.empty()) candidates.push_back(fs::path(exe).parent_path() / "../.." / relative);
  for (const auto& c : candidates) {
    std::error_code ec;
    if (fs::exists(c, ec)) return fs::weakly_canonical(c, ec).string();
  }
  return {};
}

nlohmann::json run_python_json(const std::string& relative_script, const std::string& args,
                               std::chrono::seconds limit) {
  using json = nlohmann::json;
  const std::string script = find_script(relative_script);
  if (script.empty()) return {{"error", fmt::format("{} not found (run from the repository root)", relative_script)}};
  const ProgramRun run =
      run_shell(fmt::format("{} {} {}", shell_quote(python_interpreter()), shell_quote(script), args), limit);
  const std::string& out = run.output;
  const std::string why =
      run.status == 127 ? fmt::format("exit status 127 (is '{}' installed?)", python_interpreter()) : run.error;
  // The result is the last line that starts with {"impl"; anything else is the script's (or its children's) log.
  std::size_t pos = out.rfind("{\"impl\"");
  while (pos != std::string::npos && pos != 0 && out[pos - 1] != '\n') pos = out.rfind("{\"impl\"", pos - 1);
  if (pos != std::string::npos) {
    try {
      const auto end = out.find('\n', pos);
      auto j = json::parse(out.substr(pos, end == std::string::npos ? std::string::npos : end - pos));
      if (run.status != 0 && !j.contains("error")) j["error"] = why;
      if (j.contains("error")) j["log"] = tail(out, 6000);
      return j;
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): reported below
    }
  }
  return {{"error", fmt::format("no result ({})", why)}, {"log", tail(out, 6000)}};
}

}  // namespace gpuipc::bench
