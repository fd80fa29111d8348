// core/stream_park: what a handle closed under its own streams parks is let go once its streams are done, by the
// reaper thread when the process opens and closes nothing more, and across fork(2) and exit(3).
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <thread>

#include "core/stream_park.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

using namespace std::chrono_literals;

/// A parked record whose streams are done when `done` says so; `gone` is set when it is let go.
struct Flags {
  std::atomic<bool> done{false};
  std::atomic<bool> gone{false};
};

class FakeTouches final : public core::StreamTouches {
 public:
  explicit FakeTouches(std::shared_ptr<Flags> flags) : m_flags(std::move(flags)) {}
  ~FakeTouches() override { m_flags->gone = true; }
  bool done() const noexcept override { return m_flags->done.load(); }

 private:
  std::shared_ptr<Flags> m_flags;
};

std::shared_ptr<Flags> park_one() {
  auto flags = std::make_shared<Flags>();
  core::park(std::make_unique<FakeTouches>(flags));
  return flags;
}

// Before, a record was let go only at a later open or close of a semaphore, channel or pool: a process that closed
// its last handle under a waiting stream and then opened nothing kept the memory (GPU chunks, for a pool) until
// it exited.
TEST(StreamPark, ARecordIsLetGoOnceItsStreamsAreDoneWithoutAnotherOpenOrClose) {
  core::reap_parked();
  const std::size_t before = core::parked_count();
  auto flags = park_one();
  EXPECT_EQ(core::parked_count(), before + 1);
  std::this_thread::sleep_for(300ms);  // the reaper looked several times: not done, kept
  EXPECT_FALSE(flags->gone);
  flags->done = true;
  EXPECT_TRUE(test::wait_until([&] { return flags->gone.load(); }, 10s)) << "still parked";
  EXPECT_EQ(core::parked_count(), before);
}

TEST(StreamPark, AReapLetsGoOfTheDoneRecordsOnly) {
  auto kept = park_one();
  auto done = park_one();
  done->done = true;
  core::reap_parked();
  EXPECT_TRUE(done->gone);
  EXPECT_FALSE(kept->gone);
  kept->done = true;
  core::reap_parked();
  EXPECT_TRUE(kept->gone);
}

// The reaper takes the list's lock every few milliseconds: a child forked meanwhile must not find it taken for
// good (its first open or close would hang), and must reap what it parks itself, with a reaper of its own.
TEST(StreamPark, AChildForkedWhileTheReaperRunsParksAndReapsItsOwn) {
  auto parent_flags = park_one();  // never done while the children run: the parent's reaper keeps looking
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(test::run_child(
                  [] {
                    core::reap_parked();  // (hung when fork copied the lock taken)
                    auto mine = park_one();
                    mine->done = true;
                    GPUIPC_CHILD_CHECK(test::wait_until([&] { return mine->gone.load(); }, 10s));
                    return 0;
                  },
                  30s),
              0)
        << "child " << i;
    std::this_thread::sleep_for(std::chrono::milliseconds(i % 5));
  }
  parent_flags->done = true;
  EXPECT_TRUE(test::wait_until([&] { return parent_flags->gone.load(); }, 10s));
}

// exit(3) stops the reaper first (it would otherwise reap while the broker connection and the driver are torn
// down), and does not wait for records whose streams are not done: they stay mapped, as a stream may still run.
TEST(StreamPark, AProcessExitsPromptlyWithRecordsStillParked) {
  EXPECT_EQ(test::run_child(
                []() -> int {
                  auto flags = park_one();
                  (void)park_one();
                  std::this_thread::sleep_for(20ms);
                  std::exit(flags->gone ? 3 : 0);
                },
                20s),
            0);
}

}  // namespace
}  // namespace gpuipc
