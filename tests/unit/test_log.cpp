// The log's rate limit: no caller (a client provoking broker warnings) can grow a log without bound.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "base/log.hpp"
#include "os/memfd.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

std::string capture_stderr(const std::function<void()>& body) {
  auto file = os::memfd_create("log", 0);
  const int saved = ::dup(STDERR_FILENO);
  ::dup2(file.get(), STDERR_FILENO);
  body();
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  std::string text(os::fd_size(file.get()), '\0');
  EXPECT_EQ(::pread(file.get(), text.data(), text.size(), 0), static_cast<ssize_t>(text.size()));
  return text;
}

TEST(Log, AFloodIsCutToAHundredLinesASecondAndTheDropsAreCounted) {
  const std::string text = capture_stderr([] {
    for (int i = 0; i < 5000; ++i) log::write(log::Level::Warn, "flood");
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    log::write(log::Level::Warn, "after");
  });
  const auto lines = std::count(text.begin(), text.end(), '\n');
  EXPECT_LE(lines, 2 * 100 + 2) << "at most two one-second windows of lines, plus the drop count";
  EXPECT_NE(text.find("log lines dropped"), std::string::npos);
  EXPECT_NE(text.find("after"), std::string::npos);
}

}  // namespace
}  // namespace gpuipc
