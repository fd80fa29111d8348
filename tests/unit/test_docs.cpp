// The documentation promises of STYLE.md, checked: every registered GPUIPC_* variable has docs/env/<NAME>.md that
// states its default, every page there names a registered variable, every `gpuipc` subcommand has
// docs/cli/<cmd>.md, every benchmark suite has a row in docs/benchmarks.md, and every relative link in README.md
// and docs/ points at a file (and heading) that exists.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "base/config.hpp"

namespace gpuipc {
namespace {

namespace fs = std::filesystem;

const fs::path kSource{GPUIPC_SOURCE_DIR};

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::set<std::string> registered_names() {
  std::set<std::string> names;
  for (const auto& v : config::env_registry()) names.emplace(v.name);
  return names;
}

/// Runs `command` through the shell; returns its stdout and stores its exit status.
std::string run_command(const std::string& command, int& status) {
  std::string out;
  FILE* pipe = ::popen(command.c_str(), "r");  // NOLINT(cert-env33-c): a test running the CLI it just built
  if (pipe == nullptr) {
    status = -1;
    return out;
  }
  char buffer[4096];
  std::size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) out.append(buffer, n);
  status = ::pclose(pipe);
  return out;
}

/// The subcommand names of CLI11's help: the lines indented by exactly two spaces under "Subcommands:".
std::vector<std::string> subcommands_of(const std::string& help) {
  std::vector<std::string> names;
  std::istringstream in(help);
  std::string line;
  bool in_section = false;
  while (std::getline(in, line)) {
    if (line.rfind("Subcommands:", 0) == 0) {
      in_section = true;
      continue;
    }
    if (!in_section) continue;
    if (line.empty()) break;
    if (line.size() > 2 && line[0] == ' ' && line[1] == ' ' && line[2] != ' ') {
      names.push_back(line.substr(2, line.find(' ', 2) - 2));
    }
  }
  return names;
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'.
std::string anchor_of(const std::string& heading) {
  std::string out;
  for (char c : heading) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isalnum(u) != 0) {
      out.push_back(static_cast<char>(std::tolower(u)));
    } else if (c == ' ' || c == '-') {
      out.push_back('-');
    } else if (c == '_') {
      out.push_back('_');
    }
  }
  return out;
}

/// The anchors of every Markdown heading of `text`.
std::set<std::string> anchors_of(const std::string& text) {
  std::set<std::string> anchors;
  std::istringstream in(text);
  std::string line;
  bool fenced = false;
  while (std::getline(in, line)) {
    if (line.rfind("```", 0) == 0) fenced = !fenced;
    if (fenced || line.empty() || line[0] != '#') continue;
    const auto start = line.find_first_not_of('#');
    if (start == std::string::npos || line[start] != ' ') continue;
    anchors.insert(anchor_of(line.substr(start + 1)));
  }
  return anchors;
}

TEST(Docs, EveryRegisteredVariableHasAPageStatingItsDefault) {
  ASSERT_FALSE(config::env_registry().empty());
  for (const auto& v : config::env_registry()) {
    const fs::path page = kSource / "docs" / "env" / (std::string(v.name) + ".md");
    ASSERT_TRUE(fs::exists(page)) << v.name << " is registered in src/base/config.cpp but " << page
                                  << " does not exist: document it (see docs/env/GPUIPC_LOG.md for the layout)";
    const std::string text = read_file(page);
    EXPECT_NE(text.find(std::string(v.name)), std::string::npos) << page << " does not name " << v.name;
    EXPECT_NE(text.find(std::string(v.default_value)), std::string::npos)
        << page << " does not state the registered default '" << v.default_value
        << "' verbatim: update the page or the registry so that they agree";
  }
}

TEST(Docs, EveryVariablePageNamesARegisteredVariable) {
  const auto names = registered_names();
  const fs::path dir = kSource / "docs" / "env";
  ASSERT_TRUE(fs::is_directory(dir)) << dir;
  int pages = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".md") continue;
    ++pages;
    const std::string stem = entry.path().stem().string();
    EXPECT_EQ(names.count(stem), 1U) << entry.path()
                                     << " documents a variable that src/base/config.cpp does not register: register "
                                        "it there or remove the page";
  }
  EXPECT_EQ(static_cast<std::size_t>(pages), names.size());
}

TEST(Docs, EveryCliSubcommandHasAPage) {
  int status = 0;
  const std::string help = run_command(std::string("'") + GPUIPC_BUILD_BIN_DIR "/gpuipc' --help 2>&1", status);
  ASSERT_EQ(status, 0) << "gpuipc --help failed:\n" << help;
  const auto commands = subcommands_of(help);
  ASSERT_FALSE(commands.empty()) << "no subcommands found in gpuipc --help:\n" << help;
  for (const auto& cmd : commands) {
    const fs::path page = kSource / "docs" / "cli" / (cmd + ".md");
    EXPECT_TRUE(fs::exists(page)) << "gpuipc " << cmd << " has no page " << page;
  }
  EXPECT_TRUE(fs::exists(kSource / "docs" / "cli" / "gpuipc.md"));
  EXPECT_TRUE(fs::exists(kSource / "docs" / "cli" / "gpuipcd.md"));
}

TEST(Docs, EveryBenchSuiteHasARowInBenchmarks) {
  int status = 0;
  const std::string list = run_command(std::string("'") + GPUIPC_BUILD_BIN_DIR "/gpuipc' bench list 2>&1", status);
  if (status != 0) GTEST_SKIP() << "this build has no benchmarks (gpuipc bench list: " << list << ")";
  const std::string page = read_file(kSource / "docs" / "benchmarks.md");
  std::istringstream in(list);
  std::string line;
  int suites = 0;
  while (std::getline(in, line)) {
    const std::string name = line.substr(0, line.find(' '));
    if (name.empty()) continue;
    ++suites;
    EXPECT_NE(page.find("| `" + name + "` |"), std::string::npos)
        << "suite '" << name << "' has no row in docs/benchmarks.md's table of suites";
  }
  EXPECT_GT(suites, 0) << "gpuipc bench list printed no suite:\n" << list;
}

TEST(Docs, RelativeLinksResolve) {
  std::vector<fs::path> files{kSource / "README.md"};
  for (const auto& entry : fs::recursive_directory_iterator(kSource / "docs")) {
    if (entry.path().extension() == ".md") files.push_back(entry.path());
  }
  // [text](target) and [text](target#anchor); external links and pure anchors are not checked.
  const std::regex link(R"(\]\(([^)\s#]+)(#[^)\s]*)?\))");
  for (const auto& file : files) {
    ASSERT_TRUE(fs::exists(file)) << file;
    const std::string text = read_file(file);
    for (auto it = std::sregex_iterator(text.begin(), text.end(), link); it != std::sregex_iterator(); ++it) {
      const std::string target = (*it)[1].str();
      if (target.find("://") != std::string::npos || target.rfind("mailto:", 0) == 0) continue;
      const fs::path resolved = file.parent_path() / target;
      EXPECT_TRUE(fs::exists(resolved)) << file << " links to " << target << ", which does not exist";
      if ((*it)[2].matched && resolved.extension() == ".md" && fs::exists(resolved)) {
        const std::string anchor = (*it)[2].str().substr(1);
        EXPECT_EQ(anchors_of(read_file(resolved)).count(anchor), 1U)
            << file << " links to " << target << "#" << anchor << ", but " << target << " has no such heading";
      }
    }
  }
}

}  // namespace
}  // namespace gpuipc
