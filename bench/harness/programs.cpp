#include "programs.hpp"

#include <fmt/format.h>

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

/// Runs `argv` under coreutils' timeout, which bounds a stuck program (a baseline whose peer died waits on its queue
/// forever) and kills its process group with it; os::run_captured collects stdout and stderr together.
ProgramRun run_limited(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                       std::chrono::seconds limit) {
  ProgramRun run;
  std::vector<std::string> command{"timeout", "-k", "10", std::to_string(limit.count())};
  command.insert(command.end(), argv.begin(), argv.end());
  try {
    // timeout's own -k ends it 10 s after the limit; run_captured's limit is a backstop beyond that.
    const os::CapturedRun done = os::run_captured(command, env, {}, limit + std::chrono::seconds(30));
    run.status = done.exit_code;
    run.output = done.output;
  } catch (const std::exception& e) {
    run.error = e.what();
    return run;
  }
  if (run.status == 124 || run.status == 137 || run.status == -1) {
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
  std::vector<std::string> vars;
  for (const auto& [name, value] : env) vars.push_back(fmt::format("{}={}", name, value));
  return run_limited(argv, vars, limit);
}

std::string python_interpreter() {
  const char* env = std::getenv("GPUIPC_BENCH_PYTHON");  // NOLINT(concurrency-mt-unsafe): read before any thread
  return env != nullptr && *env != '\0' ? std::string(env) : std::string("python3");
}

std::string find_script(const std::string& relative) {
  namespace fs = std::filesystem;
  // The tree this binary was built in first (build/bin/../..: its scripts are of the commit it records), then the
  // current directory (an installed binary).
  std::vector<fs::path> candidates;
  const auto exe = os::self_exe_path();
  if (!exe.empty()) candidates.push_back(fs::path(exe).parent_path() / "../.." / relative);
  candidates.push_back(fs::current_path() / relative);
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
  // `args` are shell words (a path quoted in them): /bin/sh reads them, then becomes the interpreter.
  const ProgramRun run = run_limited(
      {"/bin/sh", "-c", fmt::format("exec {} {} {}", shell_quote(python_interpreter()), shell_quote(script), args)}, {},
      limit);
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
      j["script"] = script;  // which checkout's script ran
      if (j.contains("error")) j["log"] = tail(out, 6000);
      return j;
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): reported below
    }
  }
  return {{"error", fmt::format("no result ({})", why)}, {"log", tail(out, 6000)}};
}

}  // namespace gpuipc::bench
