// The kill scenarios of the faults suite (faults.hpp): a table of {workers, victim, judge, verdict}, each run by
// run_kill (suite_faults.cpp), and the broker's death, whose victim is no worker.
#include <fmt/format.h>
#include <signal.h>
#include <stdlib.h>

#include <cstdlib>
#include <cstring>
#include <thread>

#include "core/client.hpp"
#include "cuda/context.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/vmm.hpp"
#include "faults.hpp"
#include "gpu.hpp"
#include "gpuipc/channel.hpp"
#include "gpuipc/segment.hpp"
#include "os/process.hpp"
#include "testkit/cuda/device_memory.hpp"
#include "testkit/cuda/stream.hpp"

namespace gpuipc::bench::faults {
namespace {

constexpr CreateOptions device_segment() { return {.kind = SegmentKind::Device, .device = 0, .mode = 0600}; }

/// A creator's first steps: the segment, filled with the old pattern (on the GPU), then a_ready.
Segment create_filled(const Scene& s, Gpu& g) {
  auto seg = Segment::create(s.name, s.bytes, device_segment());
  g.k.fill_pattern(g.stream.get(), seg.device_pointer(), s.bytes / 4, kSeedOld);
  sync_bounded(g.stream, std::chrono::seconds(30), "fill");
  s.sync->a_ready = 1;
  return seg;
}

// --- 1. the creator dies ------------------------------------------------------------------------------------------
KillScenario kill_creator() {
  return {
      .name = "kill_creator",
      .tag = "creator",
      .workers = {{"creator",
                   [](const Scene& s) {
                     Gpu g;
                     auto seg = create_filled(s, g);
                     s.await([&] { return s.sync->done.load() != 0; }, "being killed", std::chrono::seconds(120));
                     return json::object();
                   }}},
      .victim = 0,
      .ready = [](const Sync& sync) { return sync.a_ready.load() == 1; },
      .judge_role = "opener after the creator's death",
      .judge =
          [](const Scene& s) {
            Gpu g;
            const auto t0 = Clock::now();
            auto seg = Segment::open(s.name, {.access = Access::ReadWrite});
            const double open_ms = ms_since(t0);
            const auto mismatches = g.k.count_mismatches(g.stream.get(), seg.device_pointer(), s.bytes / 4, kSeedOld);
            const auto info = Segment::stat(s.name);
            Segment::unlink(s.name);
            seg.close();
            return json{{"open_ms", open_ms},
                        {"mismatches", mismatches},
                        {"references", info.references},
                        {"mappers", info.mapper_pids}};
          },
      .verdict =
          [](const Scene& s, const json& rb, Outcome& o) {
            o.memory_survives = true;
            o.data_intact = rb["mismatches"].get<std::uint64_t>() == 0;
            const auto refs = rb["references"].get<std::uint32_t>();
            o.detail.push_back(fmt::format(
                "a fresh process opened '{}' after its creator was SIGKILLed ({:.1f} ms to open) and verified {} MiB "
                "on the GPU: {} mismatching words; references then {} (the opener's own: the creator's was "
                "dropped{})",
                s.name, rb["open_ms"].get<double>(), s.bytes >> 20, rb["mismatches"].get<std::uint64_t>(), refs,
                refs == 1 ? "" : ": NOT dropped"));
            o.extra["creator_reference_dropped"] = refs == 1;
            o.extra_ok = refs == 1;
          },
  };
}

// --- 2. an opener dies --------------------------------------------------------------------------------------------
KillScenario kill_opener() {
  auto creator = [](const Scene& s) {
    Gpu g;
    auto seg = create_filled(s, g);
    s.await([&] { return s.sync->killed.load() != 0; }, "the opener to be killed");
    const auto t0 = Clock::now();
    std::uint32_t refs = 0;
    bool dropped = false;
    while (ms_since(t0) < 10000) {
      refs = Segment::stat(s.name).references;
      if (refs == 1) {
        dropped = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const double dropped_ms = ms_since(t0);
    const auto mismatches = g.k.count_mismatches(g.stream.get(), seg.device_pointer(), s.bytes / 4, kSeedOld);
    Segment::unlink(s.name);
    return json{{"dropped", dropped}, {"references", refs}, {"dropped_ms", dropped_ms}, {"mismatches", mismatches}};
  };
  auto opener = [](const Scene& s) {
    Gpu g;
    s.await([&] { return s.sync->a_ready.load() == 1; }, "the segment");
    auto seg = Segment::open(s.name, {.access = Access::ReadWrite});
    auto out = cuda::DeviceBuffer::allocate(8);
    cuda::memset_d8(out.get(), 0, 8);
    // Reading the segment with kernels when the SIGKILL comes.
    for (int i = 0; i < 8; ++i) g.k.read_sum(g.stream.get(), seg.device_pointer(), s.bytes / 16, out.get());
    s.sync->b_ready = 1;
    const auto t0 = Clock::now();
    while (ms_since(t0) < 120000) {
      g.k.read_sum(g.stream.get(), seg.device_pointer(), s.bytes / 16, out.get());
      sync_bounded(g.stream, std::chrono::seconds(30), "read");
    }
    return json::object();
  };
  return {
      .name = "kill_opener",
      .tag = "opener",
      .workers = {{"creator", creator}, {"opener", opener}},
      .victim = 1,
      .ready = [](const Sync& sync) { return sync.b_ready.load() == 1; },
      .settle = std::chrono::milliseconds(20),
      .verdict =
          [](const Scene& /*s*/, const json& ra, Outcome& o) {
            o.memory_survives = true;
            o.data_intact = ra["mismatches"].get<std::uint64_t>() == 0;
            const bool dropped = ra["dropped"].get<bool>();
            o.extra["opener_reference_dropped"] = dropped;
            o.extra["reference_dropped_ms"] = ra["dropped_ms"];
            o.extra_ok = dropped;
            // A reference that is never dropped: the broker did not notice the death in 10 s.
            if (!dropped) o.hang = true;
            o.detail.push_back(fmt::format(
                "opener SIGKILLed while its kernels read the segment; the broker dropped "
                "its reference {} ({:.1f} ms after the creator started polling); the "
                "creator's mapping still works: {} mismatching words",
                dropped ? "yes" : "NO (10 s)", ra["dropped_ms"].get<double>(), ra["mismatches"].get<std::uint64_t>()));
          },
  };
}

// --- 3. a writer dies in the middle of writing ----------------------------------------------------------------------
KillScenario kill_mid_write() {
  auto creator = [](const Scene& s) {
    Gpu g;
    auto seg = create_filled(s, g);
    s.await([&] { return s.sync->killed.load() != 0; }, "the writer to be killed");
    auto counts = cuda::DeviceBuffer::allocate(4 * sizeof(std::uint64_t));
    cuda::memset_d8(counts.get(), 0, 4 * sizeof(std::uint64_t));
    g.k.classify_patterns(g.stream.get(), seg.device_pointer(), s.bytes / 4, kSeedOld, kSeedNewA, kSeedNewB,
                          counts.get());
    sync_bounded(g.stream, std::chrono::seconds(30), "classify");
    std::uint64_t c[4] = {};
    cuda::copy_to_host(c, counts.get(), sizeof c);
    Segment::unlink(s.name);
    return json{{"old", c[0]}, {"new_a", c[1]}, {"new_b", c[2]}, {"garbage", c[3]}};
  };
  auto writer = [](const Scene& s) {
    Gpu g;
    s.await([&] { return s.sync->a_ready.load() == 1; }, "the segment");
    auto seg = Segment::open(s.name, {.access = Access::ReadWrite});
    // Rewrites the whole segment, alternating two patterns, far longer than the kill takes to land.
    const auto t0 = Clock::now();
    for (int i = 0; ms_since(t0) < 120000; ++i) {
      g.k.fill_pattern(g.stream.get(), seg.device_pointer(), s.bytes / 4, (i % 2) == 0 ? kSeedNewA : kSeedNewB);
      if (i == 16) s.sync->b_ready = 1;  // the GPU is busy writing (launches block once the queue is full)
    }
    return json::object();
  };
  return {
      .name = "kill_mid_write",
      .tag = "midwrite",
      .workers = {{"creator", creator}, {"writer", writer}},
      .victim = 1,
      .ready = [](const Sync& sync) { return sync.b_ready.load() == 1; },
      .settle = std::chrono::milliseconds(5),
      .verdict =
          [](const Scene& s, const json& ra, Outcome& o) {
            o.memory_survives = true;
            const auto old = ra["old"].get<std::uint64_t>();
            const auto na = ra["new_a"].get<std::uint64_t>();
            const auto nb = ra["new_b"].get<std::uint64_t>();
            const auto garbage = ra["garbage"].get<std::uint64_t>();
            // Intact = every word is a whole word of one of the writes; which mix of them is the writer's timing.
            o.data_intact = garbage == 0 && old + na + nb == s.bytes / 4;
            o.extra["words_old"] = old;
            o.extra["words_new"] = na + nb;
            o.extra["words_garbage"] = garbage;
            const bool mixed = (old != 0 ? 1 : 0) + (na != 0 ? 1 : 0) + (nb != 0 ? 1 : 0) > 1;
            o.detail.push_back(fmt::format(
                "writer SIGKILLed while its kernels rewrote {} MiB: the survivor's mapping works; words: {} old "
                "pattern, {} and {} of the two new ones, {} of none (garbage){}",
                s.bytes >> 20, old, na, nb, garbage,
                mixed ? "; the buffer is a MIX of writes: a reader cannot tell a half-written buffer from a whole one "
                        "(hand buffers over with a channel or a semaphore signalled after the writing kernel)"
                      : "; the buffer holds one whole pattern"));
          },
  };
}

// --- 4. a channel producer dies between publish and the end of its writes ------------------------------------------
KillScenario kill_mid_publish() {
  auto producer = [](const Scene& s) {
    Gpu g;
    auto ch = Channel::create(
        s.name,
        {.slots = 2, .slot_bytes = s.bytes, .header_bytes = 64, .kind = SegmentKind::Device, .device = 0, .mode = 0600},
        ChannelRole::Producer);
    s.sync->a_ready = 1;
    s.await([&] { return s.sync->b_ready.load() == 1; }, "the consumer");
    SlotView slot;
    if (const auto st = ch.acquire(g.stream.get(), std::chrono::seconds(10), slot); st != Status::Ok) {
      throw Error(ErrorCode::System, fmt::format("acquire: {}", to_string(st)), "bench");
    }
    // The stream is held at a gate nobody opens (a word of registered host memory), so the writes and the
    // stream-ordered part of publish are still pending when the producer dies.
    void* gate = std::aligned_alloc(4096, 4096);
    std::memset(gate, 0, 4096);
    auto reg = cuda::HostRegistration::register_memory(gate, 4096);
    if (cuda::stream_wait_value64(g.stream.get(), reg.device_pointer(), 1) != CUDA_SUCCESS) {
      throw Error(ErrorCode::Cuda, "cuStreamWaitValue64 (gate) failed", "bench");
    }
    g.k.fill_pattern(g.stream.get(), slot.device_pointer, s.bytes / 4, kSeedNewA);
    if (const auto st = ch.publish(g.stream.get(), {}, s.bytes); st != Status::Ok) {
      throw Error(ErrorCode::System, fmt::format("publish: {}", to_string(st)), "bench");
    }
    s.sync->a_ready = 2;
    s.await([&] { return s.sync->done.load() != 0; }, "being killed", std::chrono::seconds(120));
    return json::object();
  };
  auto consumer = [](const Scene& s) {
    Gpu g;
    s.await([&] { return s.sync->a_ready.load() >= 1; }, "the channel");
    auto ch = Channel::open(s.name, ChannelRole::Consumer);
    s.sync->b_ready = 1;
    s.await([&] { return s.sync->a_ready.load() == 2; }, "the publish");
    MessageView m;
    const auto t_recv = Clock::now();
    const Status st1 = ch.receive(g.stream.get(), std::chrono::seconds(10), m);
    const double recv_ms = ms_since(t_recv);
    s.sync->b_ready = 2;
    s.await([&] { return s.sync->killed.load() != 0; }, "the producer to be killed");
    const auto t0 = Clock::now();
    json out{{"first_receive", std::string(to_string(st1))}, {"first_receive_ms", recv_ms}};
    if (st1 == Status::Ok) {
      // The stream waits for the dead producer's `filled`: the broker must release it.
      sync_bounded(g.stream, std::chrono::seconds(20), "the consumer's stream (waiting for the dead producer)");
      out["stream_released_ms"] = ms_since(t0);
      out["incomplete"] = m.incomplete();
      out["mismatches"] = g.k.count_mismatches(g.stream.get(), m.device_pointer, s.bytes / 4, kSeedNewA);
      out["release"] = std::string(to_string(ch.release(g.stream.get())));
      sync_bounded(g.stream, std::chrono::seconds(20), "release");
    }
    MessageView m2;
    const auto t1 = Clock::now();
    const Status st2 = ch.receive(g.stream.get(), std::chrono::seconds(10), m2);
    out["second_receive"] = std::string(to_string(st2));
    out["second_receive_ms"] = ms_since(t1);
    out["outcome_ms"] = ms_since(t0);
    ch = Channel();
    Channel::unlink(s.name);
    return out;
  };
  return {
      .name = "kill_mid_publish",
      .tag = "midpublish",
      .bytes = 64ULL << 20,
      .workers = {{"producer", producer}, {"consumer", consumer}},
      .victim = 0,
      .ready = [](const Sync& sync) { return sync.b_ready.load() == 2; },
      .verdict =
          [](const Scene& /*s*/, const json& rc, Outcome& o) {
            const std::string first = rc["first_receive"].get<std::string>();
            const std::string second = rc["second_receive"].get<std::string>();
            const bool got = first == "Ok";
            const bool incomplete = got && rc["incomplete"].get<bool>();
            const std::uint64_t mism = got ? rc["mismatches"].get<std::uint64_t>() : 0;
            o.memory_survives = got;  // the consumer ran a kernel over the slot after the producer's death
            // Intact, or flagged: a consumer is told when the data is partial.
            o.data_intact = got && (mism == 0 || incomplete);
            const bool peer_reported = second == "PeerDied" || second == "Closed";
            o.extra["message_incomplete_flagged"] = incomplete;
            o.extra["next_receive"] = second;
            o.extra_ok = peer_reported;
            if (!peer_reported && second == "Timeout") o.hang = true;
            o.detail.push_back(fmt::format(
                "producer SIGKILLed after publish, its stream still held before the writes: the consumer received "
                "the message ({}), its stream was released {} ms after the kill, incomplete() = {}, {} words differ "
                "from what the producer meant to write ({}); the next receive returned {} in {:.1f} ms",
                first, got ? fmt::format("{:.1f}", rc["stream_released_ms"].get<double>()) : std::string("-"),
                incomplete, mism,
                mism == 0    ? "intact"
                : incomplete ? "partial, and flagged"
                             : "partial and NOT flagged",
                second, rc["second_receive_ms"].get<double>()));
          },
  };
}

}  // namespace

std::vector<KillScenario> worker_kills() {
  return {kill_creator(), kill_opener(), kill_mid_write(), kill_mid_publish()};
}

// --- 5. the broker dies (no worker is the victim: not in the table) -----------------------------------------
Outcome kill_daemon(const Env& env, std::size_t bytes, pid_t* broker_out) {
  Outcome o;
  o.scenario = "kill_daemon";
  const SyncPage page;
  Sync* sync = page.get();
  const std::string name = seg_name("daemon");
  const Scene scene{sync, name, bytes};
  auto verify_after_kill = [&](Gpu& g, const Segment& seg) {
    scene.await([&] { return sync->killed.load() != 0; }, "the broker to be killed");
    const auto t0 = Clock::now();
    const auto mismatches = g.k.count_mismatches(g.stream.get(), seg.device_pointer(), bytes / 4, kSeedOld);
    const double ms = ms_since(t0);
    scene.await([&] { return sync->done.load() != 0; }, "the end of the scenario");
    return json{{"mismatches", mismatches}, {"verify_ms", ms}};
  };
  auto a = spawn_synced(
      sync,
      [&] {
        Gpu g;
        sync->pid = core::BrokerClient::instance().broker_pid();
        auto seg = create_filled(scene, g);
        return verify_after_kill(g, seg);
      },
      env);
  auto b = spawn_synced(
      sync,
      [&] {
        Gpu g;
        scene.await([&] { return sync->a_ready.load() == 1; }, "the segment");
        auto seg = Segment::open(name, {.access = Access::ReadOnly});
        sync->b_ready = 1;
        return verify_after_kill(g, seg);
      },
      env);
  auto give_up = [&](const char* why) {
    sync->done = 1;
    sigkill(a);
    sigkill(b);
    finish(a, o, "creator");
    finish(b, o, "opener");
    o.detail.push_back(why);
    return o;
  };
  if (!wait_for(
          sync, [&] { return sync->b_ready.load() == 1; }, std::chrono::seconds(60))) {
    return give_up("the workers did not get ready");
  }
  const auto broker = static_cast<pid_t>(sync->pid.load());
  os::UniqueFd pidfd;
  try {
    pidfd = os::pidfd_open(broker);
  } catch (const std::exception& e) {
    return give_up(fmt::format("pidfd_open(broker {}): {}", broker, e.what()).c_str());
  }
  const auto t_kill = Clock::now();
  ::kill(broker, SIGKILL);
  const bool gone = os::pidfd_wait_exit(pidfd.get(), 5000);
  o.extra["old_broker_exited"] = gone;
  sync->killed = 1;
  // A fresh process's first request: does the library start a new broker, and does the old name come back (its
  // creator's watcher gives it back to the new broker at once: the journal keeps names across a broker's death)?
  const SyncPage page_c;
  auto c = spawn_synced(
      page_c.get(),
      [&] {
        const auto t0 = Clock::now();
        (void)Segment::list();
        const double first_ms = ms_since(t0);
        const auto pid = core::BrokerClient::instance().broker_pid();
        bool name_back = false;
        double back_ms = 0;
        std::string open_error;
        try {
          const auto t1 = Clock::now();
          const auto back = Segment::open(name, {.access = Access::ReadOnly, .wait = std::chrono::seconds(10)});
          back_ms = ms_since(t1);
          name_back = back.size() >= bytes;
          open_error = fmt::format("opened (id {}, {} MiB)", back.id(), back.size() >> 20);
          // The name outlives every holder until it is unlinked (it is a name like any other now): the scenario
          // removes it, so that the memory goes once the creator and the opener have exited.
          Segment::unlink(name);
        } catch (const Error& e) {
          open_error = e.what();
        }
        bool create_ok = false;
        {
          cuda::PrimaryContext ctx(0);
          ctx.make_current();
          const std::string fresh = name + "-after";
          auto s = Segment::create(fresh, 2 << 20, {.kind = SegmentKind::Device, .device = 0, .mode = 0600});
          create_ok = static_cast<bool>(s);
          Segment::unlink(fresh);
        }
        return json{{"first_request_ms", first_ms}, {"broker", pid},
                    {"name_back", name_back},       {"name_back_ms", back_ms},
                    {"open_error", open_error},     {"create_ok", create_ok}};
      },
      env);
  const json rc = finish(c, o, "fresh process after the broker's death");
  sync->done = 1;
  const json ra = finish(a, o, "creator");
  const json rb = finish(b, o, "opener");
  if (!ra.contains("error") && !rb.contains("error")) {
    o.time_to_outcome_ms = ms_since(t_kill);
    o.memory_survives = true;  // both existing mappings ran a kernel over the segment after the kill
    o.data_intact = ra["mismatches"].get<std::uint64_t>() == 0 && rb["mismatches"].get<std::uint64_t>() == 0;
    o.detail.push_back(
        fmt::format("broker {} SIGKILLed ({}): the creator's and the opener's existing mappings still "
                    "work, {} and {} mismatching words",
                    broker, gone ? "exited" : "STILL ALIVE after 5 s", ra["mismatches"].get<std::uint64_t>(),
                    rb["mismatches"].get<std::uint64_t>()));
  }
  if (!rc.contains("error")) {
    const auto fresh = static_cast<pid_t>(rc["broker"].get<std::uint32_t>());
    const bool restarted = fresh > 0 && fresh != broker;
    const bool back = rc["name_back"].get<bool>();
    *broker_out = fresh;
    o.extra["new_broker_started"] = restarted;
    o.extra["old_name_back"] = back;
    o.extra["old_name_back_ms"] = rc["name_back_ms"];
    o.extra["first_request_ms"] = rc["first_request_ms"];
    o.extra_ok = restarted && back && rc["create_ok"].get<bool>();
    o.detail.push_back(
        fmt::format("a new request started a new broker: {} (pid {}, first request {:.1f} ms); the old name came "
                    "back: {} ({:.1f} ms after the fresh process asked for it; open: {}); creating a new segment "
                    "works: {}",
                    restarted ? "yes" : "NO", fresh, rc["first_request_ms"].get<double>(), back ? "yes" : "NO",
                    rc["name_back_ms"].get<double>(), rc["open_error"].get<std::string>(),
                    rc["create_ok"].get<bool>() ? "yes" : "no"));
  } else {
    o.extra_ok = false;
  }
  return o;
}

}  // namespace gpuipc::bench::faults
