// gpuipc mps: a private MPS control daemon for this user. Without MPS, kernels of different processes take turns on
// a GPU (time slices), so a pipeline of processes keeps a fraction of one process's rate; under MPS they run side by
// side (docs/mps.md). `start` runs nvidia-cuda-mps-control -d with its pipe and log folders under the runtime
// directory, and prints the two variables that put a process under it (eval "$(gpuipc mps start)").
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "commands.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/mps.hpp"

namespace gpuipc::cli {
namespace {

using namespace std::chrono_literals;

constexpr const char* kControl = "nvidia-cuda-mps-control";

bool running(const std::string& program, const MpsDirs& d) {
  return mps_ask(program, d, "get_server_list").has_value();
}

std::string shell_quote(const std::string& s) {
  if (s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+:,=@") ==
      std::string::npos) {
    return s;
  }
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

void print_env(const MpsDirs& d) {
  std::cout << "export CUDA_MPS_PIPE_DIRECTORY=" << shell_quote(d.pipe) << "\n"
            << "export CUDA_MPS_LOG_DIRECTORY=" << shell_quote(d.log) << "\n";
}

/// Polls `done` every 50 ms for at most `limit`.
bool wait_for(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(50ms);
  }
  return true;
}

int mps_start(const MpsDirs& d) {
  const std::string program = mps_control_program();
  if (running(program, d)) {
    std::cerr << fmt::format("gpuipc mps: an MPS control daemon already runs with its pipe in {}\n", d.pipe);
    print_env(d);
    return kExitOk;
  }
  const MpsStart r = mps_start_daemon(program, d);
  if (r.exit_code != 0 || !wait_for([&] { return running(program, d); }, 10s)) {
    std::cerr << fmt::format("gpuipc mps: {} -d did not start a control daemon (exit {}){}{}; its log is in {}\n",
                             kControl, r.exit_code, r.output.empty() ? "" : ": ", r.output, d.log);
    return kExitFailure;
  }
  std::cerr << fmt::format(
      "gpuipc mps: started an MPS control daemon (pipe {}); processes with the two variables below run under it; "
      "`gpuipc mps stop` ends it\n",
      d.pipe);
  print_env(d);
  return kExitOk;
}

int mps_stop(const MpsDirs& d) {
  const std::string program = mps_control_program();
  if (!mps_ask(program, d, "quit")) {
    std::cout << fmt::format("no MPS control daemon runs with its pipe in {}\n", d.pipe);
    return kExitOk;
  }
  // quit returns at once; the daemon then ends its servers (after their clients leave) and exits.
  if (!wait_for([&] { return !running(program, d); }, 30s)) {
    std::cerr << fmt::format(
        "gpuipc mps: the control daemon with its pipe in {} still answers 30 s after quit; processes still running "
        "under it keep it (find them with nvidia-smi)\n",
        d.pipe);
    return kExitFailure;
  }
  std::cout << fmt::format("stopped the MPS control daemon with its pipe in {}\n", d.pipe);
  return kExitOk;
}

int mps_status(const MpsDirs& d, bool json) {
  const std::string program = mps_control_program();
  const auto servers = mps_ask(program, d, "get_server_list");
  if (json) {
    nlohmann::json j{{"running", servers.has_value()}, {"pipe_directory", d.pipe}, {"log_directory", d.log}};
    if (servers) {
      nlohmann::json pids = nlohmann::json::array();
      std::size_t at = 0;
      while (at < servers->size()) {
        const std::size_t end = servers->find('\n', at);
        const std::string line = servers->substr(at, end == std::string::npos ? std::string::npos : end - at);
        if (!line.empty()) pids.push_back(line);
        at = end == std::string::npos ? servers->size() : end + 1;
      }
      j["servers"] = pids;
    }
    std::cout << json_text(j) << "\n";
  } else if (servers) {
    std::cout << fmt::format("an MPS control daemon runs with its pipe in {} (log {})\nservers: {}\n", d.pipe, d.log,
                             servers->empty() ? "none yet (one starts with the first client)" : *servers);
  } else {
    std::cout << fmt::format("no MPS control daemon runs with its pipe in {}\n", d.pipe);
  }
  return servers ? kExitOk : kExitNotFound;
}

}  // namespace

void register_mps(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("mps", "start, stop or look at a private MPS control daemon (docs/mps.md)");
  cmd->require_subcommand(1);
  static std::string dir;
  static bool json = false;
  auto add_dir = [](CLI::App* sub) {
    sub->add_option("--dir", dir, "the daemon's folder (pipe/ and log/ in it); default: <runtime dir>/mps");
  };
  auto* start = cmd->add_subcommand("start", "start it (if it is not running) and print the variables to export");
  auto* stop = cmd->add_subcommand("stop", "ask it to quit and wait until it has");
  auto* status = cmd->add_subcommand("status", "whether it runs, and its servers");
  auto* env = cmd->add_subcommand("env", "print the variables that put a process under it");
  for (CLI::App* sub : {start, stop, status, env}) add_dir(sub);
  status->add_flag("--json", json, "one JSON object instead of text");
  start->callback([&exit_code] { exit_code = mps_start(mps_dirs(dir)); });
  stop->callback([&exit_code] { exit_code = mps_stop(mps_dirs(dir)); });
  status->callback([&exit_code] { exit_code = mps_status(mps_dirs(dir), json); });
  env->callback([&exit_code] {
    print_env(mps_dirs(dir));
    exit_code = kExitOk;
  });
}

}  // namespace gpuipc::cli
