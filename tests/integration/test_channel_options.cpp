// Per-handle channel options (pacing, pacing_ahead): the environment variables are the defaults, options given at
// create or open win, setters change them later; and Channel::stat / stats() counters. Host channels (no GPU).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <optional>
#include <string>

#include "gpuipc/channel.hpp"
#include "support/broker_env.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

using namespace std::chrono_literals;

/// Sets (or, with nullopt, unsets) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : m_name(name) {
    if (const char* old = ::getenv(name)) m_old = old;  // NOLINT(concurrency-mt-unsafe): single-threaded test
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (m_old) {
      ::setenv(m_name, m_old->c_str(), 1);
    } else {
      ::unsetenv(m_name);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* m_name;
  std::optional<std::string> m_old;
};

ChannelOptions host(std::uint32_t slots) {
  return {.slots = slots, .slot_bytes = 256, .header_bytes = 16, .kind = SegmentKind::Host};
}

TEST(ChannelOptions, DefaultsComeFromTheEnvironment) {
  const std::string name = unique_name("ch");
  {
    const ScopedEnv p("GPUIPC_CHANNEL_PACING_US", std::nullopt);
    const ScopedEnv a("GPUIPC_CHANNEL_PACING_AHEAD", std::nullopt);
    auto ch = Channel::create(name, host(8), ChannelRole::Producer);
    EXPECT_EQ(ch.pacing(), 200us);
    EXPECT_EQ(ch.pacing_ahead(), 4U) << "half of a ring of 8";
    auto small = Channel::create(name + "-4", host(4), ChannelRole::Producer);
    EXPECT_EQ(small.pacing_ahead(), 4U) << "the whole of a ring under 8";
    Channel::unlink(name + "-4");
  }
  {
    const ScopedEnv p("GPUIPC_CHANNEL_PACING_US", "35");
    const ScopedEnv a("GPUIPC_CHANNEL_PACING_AHEAD", "3");
    auto ch = Channel::open(name, ChannelRole::Consumer);
    EXPECT_EQ(ch.pacing(), 35us);
    EXPECT_EQ(ch.pacing_ahead(), 3U);
  }
  Channel::unlink(name);
}

TEST(ChannelOptions, OptionsOverrideTheEnvironmentAndSettersChangeThem) {
  const std::string name = unique_name("ch");
  const ScopedEnv p("GPUIPC_CHANNEL_PACING_US", "35");
  const ScopedEnv a("GPUIPC_CHANNEL_PACING_AHEAD", "3");
  ChannelOptions o = host(16);
  o.pacing = 0ns;
  o.pacing_ahead = 5;
  auto ch = Channel::create(name, o, ChannelRole::Producer);
  EXPECT_EQ(ch.pacing(), 0ns);
  EXPECT_EQ(ch.pacing_ahead(), 5U);
  auto other = Channel::open(name, ChannelRole::Consumer, {.pacing = 1ms, .pacing_ahead = 100});
  EXPECT_EQ(other.pacing(), 1ms);
  EXPECT_EQ(other.pacing_ahead(), 16U) << "clamped to the ring";
  auto defaults = Channel::open(name, ChannelRole::Consumer);
  EXPECT_EQ(defaults.pacing(), 35us) << "one handle's options are not another's";
  ch.set_pacing(70us);
  ch.set_pacing_ahead(0);
  EXPECT_EQ(ch.pacing(), 70us);
  EXPECT_EQ(ch.pacing_ahead(), 1U) << "clamped to at least 1";
  ch.set_pacing(-5us);
  EXPECT_EQ(ch.pacing(), 0ns);
  Channel::unlink(name);
}

TEST(ChannelOptions, StatReadsTheCountersWithoutJoining) {
  const std::string name = unique_name("ch");
  auto ch = Channel::create(name, host(4), ChannelRole::Producer);
  for (std::size_t bytes : {10U, 20U}) {
    SlotView slot;
    ASSERT_EQ(ch.acquire(nullptr, 1s, slot), Status::Ok);
    ASSERT_EQ(ch.publish(nullptr, {}, bytes), Status::Ok);
  }
  const ChannelStats s = Channel::stat(name);
  EXPECT_EQ(s.published, 2U);
  EXPECT_EQ(s.published_bytes, 30U);
  EXPECT_EQ(s.queued, 2U);
  EXPECT_EQ(s.free_slots, 2U);
  EXPECT_EQ(s.slots, 4U);
  EXPECT_EQ(s.slot_bytes, 256U);
  EXPECT_EQ(s.producers, 1U);
  EXPECT_EQ(s.consumers, 0U) << "stat does not join";
  EXPECT_EQ(ch.stats().published_bytes, 30U);
  EXPECT_THROW((void)Channel::stat(name + "-none"), Error);
  Channel::unlink(name);
}

}  // namespace
}  // namespace gpuipc::test
