// Per-uid quotas (docs/segments.md#quotas, GPUIPC_QUOTA_BYTES, GPUIPC_QUOTA_SEGMENTS) with device segments, on a
// broker of this test's own started with small limits: a device segment counts its size rounded up to the
// allocation granularity against the byte quota and one against the count quota; a create past either fails with
// QuotaExceeded naming the limit; the bytes and the count come back only when the segment is both unlinked and no
// longer mapped, whether its last holder closes it or is SIGKILLed. All CUDA work runs in forked children (the test
// process never initialises CUDA, so it can keep forking).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>

#include "cuda/context.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/segment.hpp"
#include "support/broker_env.hpp"
#include "support/gpu.hpp"
#include "support/gpu_worker.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

/// The allocation granularity of GPU 0 (what a device segment's size is rounded up to), asked in a child; 0 when
/// the child failed.
std::uint64_t device_granularity() {
  Shared<std::uint64_t> out;
  const int code = run_child([&] {
    Gpu g;
    out[0] = cuda::allocation_granularity(0, false);
    return 0;
  });
  return code == 0 ? out[0] : 0;
}

/// A broker of this test's own (the gpuipcd of this build, CUDA-free) on a fresh runtime directory, with the given
/// quotas. A child calls use() before any gpuipc call to talk to it. SIGTERMed on destruction.
class QuotaBroker {
 public:
  QuotaBroker(std::uint64_t bytes, std::uint64_t segments) {
    const std::string daemon = build_bin_dir() + "/gpuipcd";
    m_pid = start_child([&] {
      const std::string dir = "--runtime-dir=" + m_dir.path();
      const std::string quota_bytes = "--quota-bytes=" + std::to_string(bytes);
      const std::string quota_segments = "--quota-segments=" + std::to_string(segments);
      ::execl(daemon.c_str(), daemon.c_str(), dir.c_str(), quota_bytes.c_str(), quota_segments.c_str(),
              static_cast<char*>(nullptr));
      return 91;
    });
    m_listening = wait_until([&] { return ::access(m_dir.file("broker.sock").c_str(), F_OK) == 0; }, 5s);
  }
  ~QuotaBroker() {
    ::kill(m_pid, SIGTERM);
    (void)wait_child(m_pid, 5s);
  }
  QuotaBroker(const QuotaBroker&) = delete;
  QuotaBroker& operator=(const QuotaBroker&) = delete;

  bool listening() const noexcept { return m_listening; }

  /// In a child, before its first gpuipc call: every call goes to this broker (and never starts another).
  void use() const {
    ::setenv("GPUIPC_RUNTIME_DIR", m_dir.path().c_str(), 1);
    ::setenv("GPUIPC_NO_AUTOSTART", "1", 1);
  }

 private:
  TempDir m_dir{"gpuipc-quota"};
  pid_t m_pid = 0;
  bool m_listening = false;
};

Segment create_device(const std::string& name, std::size_t bytes) {
  return Segment::create(name, bytes, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
}

/// The QuotaExceeded error of creating device segment `name` of `bytes`, or an empty string (and the segment is
/// unlinked again) when the create succeeded or failed otherwise: then the caller's check fails.
std::string quota_error(const std::string& name, std::size_t bytes) {
  try {
    auto seg = create_device(name, bytes);
    Segment::unlink(name);
    std::fprintf(stderr, "creating '%s' (%zu bytes) succeeded past the quota\n", name.c_str(), bytes);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::QuotaExceeded) return e.what();
    std::fprintf(stderr, "creating '%s' failed with something else than QuotaExceeded: %s\n", name.c_str(), e.what());
  }
  return {};
}

/// Creates device segment `name` of `bytes`, retrying while the broker says QuotaExceeded for at most `timeout`:
/// the broker frees a segment when it sees its last holder's connection close, a little after that process ended.
std::optional<Segment> create_within(const std::string& name, std::size_t bytes, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    try {
      return create_device(name, bytes);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::QuotaExceeded || std::chrono::steady_clock::now() >= deadline) {
        std::fprintf(stderr, "creating '%s' (%zu bytes): %s\n", name.c_str(), bytes, e.what());
        return std::nullopt;
      }
    }
    std::this_thread::sleep_for(10ms);
  }
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// Steps of a long-lived holder child, driven by the test process.
struct Steps {
  std::atomic<std::uint32_t> at;  // how far the holder got
  std::atomic<std::uint32_t> go;  // how far the test lets it go
};

/// A long-lived child: SIGKILLed and reaped on destruction unless waited for (a failed assertion returns early).
class Holder {
 public:
  explicit Holder(const std::function<int()>& body) : m_pid(start_child(body)) {}
  ~Holder() {
    if (m_pid > 0) {
      ::kill(m_pid, SIGKILL);
      (void)wait_child(m_pid, 10s);
    }
  }
  Holder(const Holder&) = delete;
  Holder& operator=(const Holder&) = delete;

  /// Waits at most 60 s for steps.at to reach `step`; false at once when the child ended first (it failed).
  bool reached(const Steps& steps, std::uint32_t step) const {
    const auto gone = [&] {
      const char state = task_state(m_pid);
      return state == 'Z' || state == '\0';
    };
    return wait_until([&] { return steps.at.load() >= step || gone(); }, 60s, 10ms) && steps.at.load() >= step;
  }
  void kill() const { ::kill(m_pid, SIGKILL); }
  /// wait_child, once.
  int wait() {
    const int code = wait_child(m_pid);
    m_pid = 0;
    return code;
  }

 private:
  pid_t m_pid;
};

// Quota 4 granules, count not limiting: 3 granules held leave room for one granule, not for one granule plus a
// byte (rounded up to two), and not for a host page either (both kinds share the byte quota). Then the freeing:
// unlinked but mapped still counts; the last holder's close gives the bytes back; so does a SIGKILLed last holder;
// a named segment whose creator was SIGKILLed counts until it is unlinked.
TEST(QuotaDevice, DeviceSegmentsCountTheirRoundedSizeAgainstTheByteQuotaUntilFreed) {
  GPUIPC_REQUIRE_GPU();
  const std::uint64_t g = device_granularity();
  ASSERT_GT(g, 0U) << "the granularity child failed";
  QuotaBroker broker(4 * g, 64);
  ASSERT_TRUE(broker.listening());
  Shared<Steps> a_steps;
  Steps* as = a_steps.get();
  Holder a([&] {
    broker.use();
    Gpu gpu;
    auto big = create_device("quota-big", 3 * g);
    GPUIPC_CHILD_CHECK(big.size() == 3 * g);
    as->at.store(1);
    GPUIPC_CHILD_CHECK(wait_until([&] { return as->go.load() >= 1; }, 120s, 10ms));
    big.close();  // its last mapping: the segment was unlinked meanwhile
    as->at.store(2);
    // Alive on, with its context: what frees the bytes is the close, not the process's end.
    GPUIPC_CHILD_CHECK(wait_until([&] { return as->go.load() >= 2; }, 120s, 10ms));
    return 0;
  });
  ASSERT_TRUE(a.reached(*as, 1)) << "the holder did not create its segment";

  EXPECT_EQ(run_child([&] {
              broker.use();
              Gpu gpu;
              const std::string over = quota_error("quota-over", g + 1);  // rounded up to 2 granules
              GPUIPC_CHILD_CHECK(contains(over, "GPUIPC_QUOTA_BYTES") && contains(over, "quota-over"));
              GPUIPC_CHILD_CHECK(contains(over, "uid " + std::to_string(::getuid())));
              {
                auto fit = create_device("quota-fit", g);  // exactly at the limit
                GPUIPC_CHILD_CHECK(fit.size() == g);
                try {
                  (void)Segment::create("quota-host", 4096, {.kind = SegmentKind::Host});
                  return 2;
                } catch (const Error& e) {
                  GPUIPC_CHILD_CHECK(e.code() == ErrorCode::QuotaExceeded && contains(e.what(), "GPUIPC_QUOTA_BYTES"));
                }
                Segment::unlink("quota-fit");
              }  // closed: freed
              // Unlinked, still mapped by the holder: still counted.
              Segment::unlink("quota-big");
              GPUIPC_CHILD_CHECK(contains(quota_error("quota-again", 3 * g), "GPUIPC_QUOTA_BYTES"));
              GPUIPC_CHILD_CHECK(create_within("quota-one", g, 5s).has_value());  // quota-fit's granule is back
              Segment::unlink("quota-one");
              return 0;
            }),
            0);

  as->go.store(1);
  ASSERT_TRUE(a.reached(*as, 2)) << "the holder did not close its segment";
  EXPECT_EQ(run_child([&] {
              broker.use();
              Gpu gpu;
              auto again = create_within("quota-again", 3 * g, 5s);  // the holder's close gave the 3 granules back
              GPUIPC_CHILD_CHECK(again.has_value());
              Segment::unlink("quota-again");
              return 0;
            }),
            0);

  // A SIGKILLed last holder of an unlinked segment gives its bytes back.
  Shared<Steps> b_steps;
  Steps* bs = b_steps.get();
  Holder b([&] {
    broker.use();
    Gpu gpu;
    auto seg = create_within("quota-kill", 3 * g, 5s);  // quota-again goes when that child's connection closes
    GPUIPC_CHILD_CHECK(seg.has_value());
    Segment::unlink("quota-kill");
    bs->at.store(1);
    ::pause();
    return 0;
  });
  ASSERT_TRUE(b.reached(*bs, 1)) << "the holder to kill did not create its segment";
  EXPECT_EQ(run_child([&] {
              broker.use();
              Gpu gpu;
              GPUIPC_CHILD_CHECK(contains(quota_error("quota-after-kill", 3 * g), "GPUIPC_QUOTA_BYTES"));
              return 0;
            }),
            0);
  b.kill();
  EXPECT_EQ(b.wait(), 128 + SIGKILL);
  EXPECT_EQ(run_child([&] {
              broker.use();
              Gpu gpu;
              auto seg = create_within("quota-after-kill", 3 * g, 10s);
              GPUIPC_CHILD_CHECK(seg.has_value());
              Segment::unlink("quota-after-kill");
              return 0;
            }),
            0);

  // A named segment outlives its SIGKILLed creator (the broker holds its fd) and counts until it is unlinked.
  Shared<Steps> c_steps;
  Steps* cs = c_steps.get();
  Holder c([&] {
    broker.use();
    Gpu gpu;
    auto seg = create_within("quota-named", 3 * g, 5s);
    GPUIPC_CHILD_CHECK(seg.has_value());
    cs->at.store(1);
    ::pause();
    return 0;
  });
  ASSERT_TRUE(c.reached(*cs, 1)) << "the named segment's creator did not create it";
  c.kill();
  EXPECT_EQ(c.wait(), 128 + SIGKILL);
  EXPECT_EQ(run_child([&] {
              broker.use();
              Gpu gpu;
              GPUIPC_CHILD_CHECK(contains(quota_error("quota-last", 3 * g), "GPUIPC_QUOTA_BYTES"));
              Segment::unlink("quota-named");  // nobody maps it: freed now
              auto seg = create_within("quota-last", 3 * g, 5s);
              GPUIPC_CHILD_CHECK(seg.has_value());
              Segment::unlink("quota-last");
              return 0;
            }),
            0);

  as->go.store(2);
  EXPECT_EQ(a.wait(), 0);
  // Nothing is left registered once the last holders are gone.
  EXPECT_EQ(run_child([&] {
              broker.use();
              GPUIPC_CHILD_CHECK(wait_until([] { return Segment::list().empty(); }, 5s, 10ms));
              return 0;
            }),
            0);
}

// Count 3, bytes not limiting: three device segments fill it and a fourth (device or host) is refused naming
// GPUIPC_QUOTA_SEGMENTS; an unlinked one still mapped still counts; its close frees its place; a SIGKILLed holder
// of an unlinked one frees its place too.
TEST(QuotaDevice, DeviceSegmentsCountAgainstTheSegmentQuotaUntilFreed) {
  GPUIPC_REQUIRE_GPU();
  const std::uint64_t g = device_granularity();
  ASSERT_GT(g, 0U) << "the granularity child failed";
  QuotaBroker broker(64 * g, 3);
  ASSERT_TRUE(broker.listening());
  Shared<Steps> h_steps;
  Steps* hs = h_steps.get();
  Holder h([&] {
    broker.use();
    Gpu gpu;
    auto d0 = create_device("count-0", g);
    auto d1 = create_device("count-1", g);
    auto d2 = create_device("count-2", g);
    const std::string full = quota_error("count-3", g);
    GPUIPC_CHILD_CHECK(contains(full, "GPUIPC_QUOTA_SEGMENTS") && contains(full, "3 segments"));
    try {
      (void)Segment::create("count-host", 4096, {.kind = SegmentKind::Host});
      return 2;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::QuotaExceeded && contains(e.what(), "GPUIPC_QUOTA_SEGMENTS"));
    }
    Segment::unlink("count-0");  // still mapped here: still counted
    GPUIPC_CHILD_CHECK(contains(quota_error("count-3", g), "GPUIPC_QUOTA_SEGMENTS"));
    d0.close();  // its place is free
    auto d3 = create_within("count-3", g, 5s);
    GPUIPC_CHILD_CHECK(d3.has_value());
    Segment::unlink("count-1");  // still mapped here, until this process is killed
    hs->at.store(1);
    ::pause();
    return 0;
  });
  ASSERT_TRUE(h.reached(*hs, 1)) << "the holder did not get through";
  EXPECT_EQ(run_child([&] {
              broker.use();
              Gpu gpu;
              GPUIPC_CHILD_CHECK(contains(quota_error("count-4", g), "GPUIPC_QUOTA_SEGMENTS"));
              return 0;
            }),
            0);
  h.kill();
  EXPECT_EQ(h.wait(), 128 + SIGKILL);
  EXPECT_EQ(run_child([&] {
              broker.use();
              Gpu gpu;
              // count-1 is freed with its holder; count-2 and count-3 keep their names.
              auto d4 = create_within("count-4", g, 10s);
              GPUIPC_CHILD_CHECK(d4.has_value());
              GPUIPC_CHILD_CHECK(contains(quota_error("count-5", g), "GPUIPC_QUOTA_SEGMENTS"));
              for (const char* n : {"count-2", "count-3", "count-4"}) Segment::unlink(n);
              return 0;
            }),
            0);
  EXPECT_EQ(run_child([&] {
              broker.use();
              GPUIPC_CHILD_CHECK(wait_until([] { return Segment::list().empty(); }, 5s, 10ms));
              return 0;
            }),
            0);
}

}  // namespace
}  // namespace gpuipc::test
