// Suite "counting": gpuipc::CountingSemaphore against POSIX named semaphores (sem_open), host only.
//  - uncontended acquire(1) + release(1) in one process (no broker round trip: a few atomics on a shared page),
//    beside sem_wait + sem_post on a named POSIX semaphore, same loop;
//  - a contended handoff between two processes: one releases the permit the other is blocked on, timed from
//    just before the release to the return of the other's acquire (CLOCK_MONOTONIC is system-wide), beside the
//    same handoff through sem_post / sem_wait of two named POSIX semaphores.
#include <fcntl.h>
#include <semaphore.h>
#include <time.h>
#include <unistd.h>

#include <fmt/format.h>
#include <atomic>
#include <cerrno>
#include <string>
#include <thread>

#include "bench.hpp"
#include "gpuipc/counting_semaphore.hpp"
#include "workers.hpp"

namespace gpuipc::bench {
namespace {

using namespace std::chrono_literals;

struct Shared {
  std::atomic<std::int64_t> stamp{0};  // now_ns() just before the handoff's release / post
  std::atomic<int> ready{0};
};

std::string unique(const char* what) { return fmt::format("bench-{}-{}-{}", what, ::getpid(), now_ns()); }
/// A fresh POSIX semaphore name. Not "/" + unique(what): once inlined, GCC 12 takes that for an overlapping memcpy
/// (a -Wrestrict false positive), an error under -Werror.
std::string posix_name(const char* what) { return fmt::format("/bench-{}-{}-{}", what, ::getpid(), now_ns()); }

std::vector<double> counting_uncontended(int iters) {
  const auto name = unique("csem");
  auto s = CountingSemaphore::create(name, {.initial = 1, .max_count = 1});
  CountingSemaphore::unlink(name);
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    const std::int64_t t0 = now_ns();
    if (s.acquire(1, 1s) != Status::Ok) throw Error(ErrorCode::Timeout, "uncontended acquire failed", "bench");
    s.release(1);
    us.push_back(us_since(t0));
  }
  return us;
}

std::vector<double> posix_uncontended(int iters) {
  const auto name = posix_name("psem");
  sem_t* s = ::sem_open(name.c_str(), O_CREAT | O_EXCL, 0600, 1);
  if (s == SEM_FAILED) throw Error(ErrorCode::System, "sem_open failed", "sem_open", errno);
  ::sem_unlink(name.c_str());
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    const std::int64_t t0 = now_ns();
    ::sem_wait(s);
    ::sem_post(s);
    us.push_back(us_since(t0));
  }
  ::sem_close(s);
  return us;
}

/// Two processes pass one permit back and forth; each measures the handoffs that land on it.
std::vector<double> counting_handoff(int rounds) {
  const auto name = unique("csem-handoff");
  SharedPage page;
  auto* sh = page.as<Shared>();
  new (sh) Shared();
  auto owner = CountingSemaphore::create(name, {.initial = 1, .max_count = 1});
  const UnlinkOnExit unlink_name([&] { CountingSemaphore::unlink(name); });
  auto side = [&name, sh, rounds](bool first) -> nlohmann::json {
    auto s = CountingSemaphore::open(name);
    std::vector<double> us;
    // The first side takes the one permit before the other starts.
    if (first) {
      if (s.acquire(1, 10s) != Status::Ok) throw Error(ErrorCode::Timeout, "first acquire", "bench");
      sh->ready.store(1);
    } else {
      while (sh->ready.load() == 0) std::this_thread::yield();
    }
    for (int i = 0; i < rounds; ++i) {
      if ((i % 2 == 0) == first) {
        // The holder: wait (outside the timing) until the other is queued, then hand the permit over.
        const std::int64_t give_up = now_ns() + 10'000'000'000;
        while (s.waiting() == 0) {
          if (now_ns() > give_up) throw Error(ErrorCode::Timeout, "the other side never queued", "bench");
          std::this_thread::yield();
        }
        std::this_thread::sleep_for(1us);  // as the POSIX side does: the other is asleep, not about to sleep
        sh->stamp.store(now_ns());
        s.release(1);
      } else {
        if (s.acquire(1, 10s) != Status::Ok) throw Error(ErrorCode::Timeout, "handoff acquire timed out", "bench");
        us.push_back(us_since(sh->stamp.load()));
      }
    }
    if (s.held() > 0) s.release(1);
    return nlohmann::json{{"us", values_json(us)}};
  };
  const auto out = run_workers({[&] { return side(true); }, [&] { return side(false); }}, {}, 120s);
  std::vector<double> all;
  for (const auto& j : out) {
    const auto v = values_of(j, "us");
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

/// A named POSIX semaphore of a fresh name made of `what`, created (O_EXCL) with value 0; closed and unlinked however
/// the measurement ends, so a failed worker leaves no /dev/shm/sem.* behind.
class PosixSem {
 public:
  explicit PosixSem(const char* what)
      : m_name(posix_name(what)), m_sem(::sem_open(m_name.c_str(), O_CREAT | O_EXCL, 0600, 0)) {
    if (m_sem == SEM_FAILED) throw Error(ErrorCode::System, "sem_open failed: " + m_name, "sem_open", errno);
  }
  ~PosixSem() {
    ::sem_close(m_sem);
    ::sem_unlink(m_name.c_str());
  }
  PosixSem(const PosixSem&) = delete;
  PosixSem& operator=(const PosixSem&) = delete;
  sem_t* get() const noexcept { return m_sem; }

 private:
  std::string m_name;
  sem_t* m_sem;
};

/// sem_wait with the bound the gpuipc side's acquire has (10 s): a peer that died must fail the measurement, not
/// leave this worker waiting for run_workers to kill it.
void timed_sem_wait(sem_t* s) {
  timespec deadline{};
  ::clock_gettime(CLOCK_REALTIME, &deadline);  // sem_timedwait's clock
  deadline.tv_sec += 10;
  while (::sem_timedwait(s, &deadline) != 0) {
    if (errno == ETIMEDOUT) throw Error(ErrorCode::Timeout, "handoff sem_timedwait timed out after 10 s", "bench");
    if (errno != EINTR) throw Error(ErrorCode::System, "handoff sem_timedwait failed", "sem_timedwait", errno);
  }
}

std::vector<double> posix_handoff(int rounds) {
  const PosixSem sems[2] = {PosixSem("psem-a"), PosixSem("psem-b")};
  SharedPage page;
  auto* sh = page.as<Shared>();
  new (sh) Shared();
  // Side k posts sems[k] and waits on sems[1 - k]; the handoff is post -> the other's sem_wait returning.
  auto side = [&](int k) -> nlohmann::json {
    std::vector<double> us;
    for (int i = 0; i < rounds; ++i) {
      if (i % 2 == k) {
        std::this_thread::sleep_for(1us);  // let the other reach sem_wait, as the gpuipc side waits for a queue
        sh->stamp.store(now_ns());
        ::sem_post(sems[k].get());
      } else {
        timed_sem_wait(sems[1 - k].get());
        us.push_back(us_since(sh->stamp.load()));
      }
    }
    return nlohmann::json{{"us", values_json(us)}};
  };
  const auto out = run_workers({[&] { return side(0); }, [&] { return side(1); }}, {}, 120s);
  std::vector<double> all;
  for (const auto& j : out) {
    const auto v = values_of(j, "us");
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

Result run(const Options& o, const DeviceMeta&) {
  Result r;
  const int iters = o.quick ? 20000 : 200000;
  const int rounds = o.quick ? 2000 : 20000;
  progress(o, "counting: uncontended");
  const auto cu = summarize(counting_uncontended(iters));
  const auto pu = summarize(posix_uncontended(iters));
  progress(o, "counting: handoff between two processes");
  const auto ch_v = counting_handoff(rounds);
  const auto ph_v = posix_handoff(rounds);
  const auto ch = summarize(ch_v);
  const auto ph = summarize(ph_v);
  r.metrics["counting_uncontended_acquire_release_p50_us"] = cu.median;
  r.metrics["counting_uncontended_acquire_release_p99_us"] = cu.p99;
  r.metrics["posix_sem_uncontended_wait_post_p50_us"] = pu.median;
  r.metrics["posix_sem_uncontended_wait_post_p99_us"] = pu.p99;
  r.metrics["counting_handoff_p50_us"] = ch.median;
  r.metrics["counting_handoff_p99_us"] = ch.p99;
  r.metrics["posix_sem_handoff_p50_us"] = ph.median;
  r.metrics["posix_sem_handoff_p99_us"] = ph.p99;
  r.metrics["counting_handoff_p50_ratio"] = ph.median > 0 ? ch.median / ph.median : 0.0;
  r.samples.push_back(
      nlohmann::json{{"name", "counting_uncontended_acquire_release"}, {"unit", "us"}, {"summary", to_json(cu)}});
  r.samples.push_back(
      nlohmann::json{{"name", "posix_sem_uncontended_wait_post"}, {"unit", "us"}, {"summary", to_json(pu)}});
  r.samples.push_back(sample("counting_handoff", "us", ch_v, {}, false));
  r.samples.push_back(sample("posix_sem_handoff", "us", ph_v, {}, false));
  r.notes.push_back(fmt::format(
      "uncontended acquire+release: gpuipc {:.3f} us p50 ({:.3f} p99), POSIX sem_wait+sem_post {:.3f} us p50 ({:.3f} "
      "p99); each includes one clock read",
      cu.median, cu.p99, pu.median, pu.p99));
  r.notes.push_back(fmt::format(
      "handoff between two processes (release -> the sleeping acquirer returns): gpuipc {:.1f} us p50 ({:.1f} p99), "
      "POSIX named semaphores {:.1f} us p50 ({:.1f} p99)",
      ch.median, ch.p99, ph.median, ph.p99));
  return r;
}

GPUIPC_BENCH_SUITE(Suite{"counting",
                         "counting semaphore: uncontended acquire+release and a two-process handoff, beside POSIX "
                         "named semaphores",
                         false, run});

}  // namespace
}  // namespace gpuipc::bench
