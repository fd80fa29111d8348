// Requests sent together (BrokerClient::request_batch): the client sends them all before it reads an answer (one
// round trip's latency for all), matches each answer to its request by id, gives each request its own error, and
// goes over the broker's bound of queued replies in several batches. Against a broker played by the test (which
// reads every request before it answers any, and answers them in reverse) and against the real gpuipcd. Also what
// the library does with answers such a played broker gets wrong.
#include <gtest/gtest.h>

#include <sys/socket.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "core/client.hpp"
#include "gpuipc/segment.hpp"
#include "os/memfd.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "support/broker_env.hpp"
#include "support/raw_client.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

TEST(BrokerBatch, EveryRequestIsSentBeforeAnyAnswerAndAnswersAreMatchedById) {
  TempDir dir("gpuipc-batch");
  const auto listener = os::listen_seqpacket(dir.path() + "/broker.sock", 0600);
  const std::vector<std::string> names = {"a", "missing", "b", "c", "d"};
  const pid_t child = start_child([&] {
    use_played_broker(dir.path());
    std::vector<proto::Body> bodies;
    for (const auto& n : names) bodies.emplace_back(proto::Stat{n});
    auto answers = core::BrokerClient::instance().request_batch(bodies);
    GPUIPC_CHILD_CHECK(answers.size() == names.size());
    for (std::size_t i = 0; i < names.size(); ++i) {
      if (names[i] == "missing") {
        GPUIPC_CHILD_CHECK(!answers[i].reply && answers[i].error && answers[i].error->code() == ErrorCode::NotFound);
        continue;
      }
      GPUIPC_CHILD_CHECK(answers[i].reply && !answers[i].error);
      const auto* st = std::get_if<proto::StatReply>(&answers[i].reply->msg.body);
      GPUIPC_CHILD_CHECK(st != nullptr && st->info.name == names[i]);
    }
    return 0;
  });
  const auto sock = accept_and_greet(listener.get());
  ASSERT_TRUE(sock);
  // A client that waited for each answer before sending the next request would leave the second receive empty.
  std::vector<proto::Message> requests(names.size());
  for (auto& r : requests) ASSERT_EQ(receive(sock.get(), r, 3000), os::IoStatus::Ok);
  for (auto it = requests.rbegin(); it != requests.rend(); ++it) {
    const auto& name = std::get<proto::Stat>(it->body).name;
    if (name == "missing") {
      send_bytes(sock.get(), proto::encode(reply_to(it->request_id,
                                                    proto::ErrorReply{static_cast<std::uint8_t>(ErrorCode::NotFound), 0,
                                                                      "no segment 'missing'"})));
    } else {
      proto::StatReply st;
      st.info.name = name;
      st.info.id = it->request_id;
      st.info.size = 4096;
      send_bytes(sock.get(), proto::encode(reply_to(it->request_id, st)));
    }
  }
  EXPECT_EQ(wait_child(child), 0);
}

/// In a child, against the broker played in `dir` (300 ms for an answer): `bodies` as one batch must time out, and a
/// Stat of "c" sent after it on the same connection must get its own answer. The child's exit status.
int batch_times_out_then_stat(const std::string& dir, std::vector<proto::Body> bodies) {
  use_played_broker(dir, "300");
  try {
    (void)core::BrokerClient::instance().request_batch(bodies);
    return 3;
  } catch (const Error& e) {
    GPUIPC_CHILD_CHECK(e.code() == ErrorCode::Timeout);
  }
  // The same connection: the late answers come first, and this request gets its own.
  const auto r = core::BrokerClient::instance().request(proto::Stat{"c"});
  const auto* st = std::get_if<proto::StatReply>(&r.msg.body);
  GPUIPC_CHILD_CHECK(st != nullptr && st->info.name == "c");
  return 0;
}

TEST(BrokerBatch, ABatchThatTimesOutKeepsTheConnectionAndGivesBackWhatItsLateAnswersCounted) {
  TempDir dir("gpuipc-batch");
  const auto listener = os::listen_seqpacket(dir.path() + "/broker.sock", 0600);
  const pid_t child = start_child([&] {
    return batch_times_out_then_stat(dir.path(), {proto::Open{"a", proto::Access::ReadOnly, 0}, proto::Stat{"b"}});
  });
  const auto sock = accept_and_greet(listener.get());
  ASSERT_TRUE(sock);
  proto::Message open, stat;
  ASSERT_EQ(receive(sock.get(), open, 3000), os::IoStatus::Ok);
  ASSERT_EQ(receive(sock.get(), stat, 3000), os::IoStatus::Ok);
  // Unanswered: the client times out and sends its next request on the same connection (a client that dropped it
  // would make a broker take its process for dead).
  proto::Message next;
  ASSERT_EQ(receive(sock.get(), next, 5000), os::IoStatus::Ok);
  ASSERT_TRUE(std::holds_alternative<proto::Stat>(next.body));
  EXPECT_EQ(std::get<proto::Stat>(next.body).name, "c");
  proto::OpenReply opened;
  opened.info.id = 77;
  opened.info.name = "a";
  opened.info.size = 4096;
  send_bytes(sock.get(), proto::encode(reply_to(open.request_id, opened)));
  proto::StatReply late;
  late.info.name = "b";
  late.info.id = 78;
  late.info.size = 4096;
  send_bytes(sock.get(), proto::encode(reply_to(stat.request_id, late)));
  proto::StatReply answer;
  answer.info.name = "c";
  answer.info.id = 79;
  answer.info.size = 4096;
  send_bytes(sock.get(), proto::encode(reply_to(next.request_id, answer)));
  // The reference the late Open's answer counted is given back.
  proto::Message close;
  ASSERT_EQ(receive(sock.get(), close, 5000), os::IoStatus::Ok);
  ASSERT_TRUE(std::holds_alternative<proto::Close>(close.body));
  EXPECT_EQ(std::get<proto::Close>(close.body).id, 77U);
  EXPECT_EQ(wait_child(child), 0);
}

TEST(BrokerBatch, ABatchThatTimesOutGivesBackWhatItsAnsweredOpensCounted) {
  // Only the unanswered requests were abandoned: the answers that had come were dropped with the exception, and the
  // references their Opens counted stayed on the connection until the process exited (an unlinked pool chunk's GPU
  // memory with them).
  TempDir dir("gpuipc-batch");
  const auto listener = os::listen_seqpacket(dir.path() + "/broker.sock", 0600);
  const pid_t child = start_child([&] {
    return batch_times_out_then_stat(
        dir.path(), {proto::Open{"a", proto::Access::ReadOnly, 0}, proto::Open{"b", proto::Access::ReadOnly, 0}});
  });
  const auto sock = accept_and_greet(listener.get());
  ASSERT_TRUE(sock);
  proto::Message a, b;
  ASSERT_EQ(receive(sock.get(), a, 3000), os::IoStatus::Ok);
  ASSERT_EQ(receive(sock.get(), b, 3000), os::IoStatus::Ok);
  proto::OpenReply opened;
  opened.info.id = 77;
  opened.info.name = "a";
  opened.info.size = 4096;
  send_bytes(sock.get(), proto::encode(reply_to(a.request_id, opened)));  // in time; b is never answered
  std::vector<std::uint64_t> closed;
  for (proto::Message m; receive(sock.get(), m, 5000) == os::IoStatus::Ok;) {
    if (const auto* c = std::get_if<proto::Close>(&m.body)) {
      closed.push_back(c->id);
      send_bytes(sock.get(), proto::encode(reply_to(m.request_id, proto::OkReply{})));
    } else if (const auto* st = std::get_if<proto::Stat>(&m.body)) {
      proto::StatReply answer;
      answer.info.name = st->name;
      answer.info.id = 79;
      answer.info.size = 4096;
      send_bytes(sock.get(), proto::encode(reply_to(m.request_id, answer)));
      break;
    }
  }
  EXPECT_EQ(closed, std::vector<std::uint64_t>{77});
  EXPECT_EQ(wait_child(child), 0);
}

proto::SegmentInfo host_info(std::uint64_t id, const std::string& name, std::uint64_t size) {
  proto::SegmentInfo i;
  i.id = id;
  i.name = name;
  i.kind = proto::Kind::Host;
  i.mode = 0600;
  i.size = size;
  i.references = 1;
  i.mapper_count = 1;
  return i;
}

TEST(BrokerBatch, MemoryShorterThanTheBrokerSaysIsRefusedNotABusError) {
  // The library mapped a broker's fds at the sizes the broker's answer gave: an Open whose memfd was shorter than
  // its size, or a status page of 0 bytes, mapped without error and raised SIGBUS at the first touch past the end.
  TempDir dir("gpuipc-batch");
  const auto listener = os::listen_seqpacket(dir.path() + "/broker.sock", 0600);
  const pid_t child = start_child([&] {
    use_played_broker(dir.path());
    GPUIPC_CHILD_CHECK(fails_with(
        [] {
          const Segment s = Segment::open("short", {.access = Access::ReadOnly});
          (void)static_cast<const volatile char*>(s.data())[s.size() - 1];
        },
        ErrorCode::Protocol, "the file holds only 4096 bytes"));
    return 0;
  });
  const auto empty_page = os::memfd_create("status", 0);
  const auto sock = accept_and_greet(listener.get(), empty_page.get());
  ASSERT_TRUE(sock);
  proto::Message open;
  if (receive(sock.get(), open, 5000) == os::IoStatus::Ok && std::holds_alternative<proto::Open>(open.body)) {
    const auto memory = os::memfd_create("short", 4096);
    const int fd = memory.get();
    send_bytes(sock.get(),
               proto::encode(reply_to(open.request_id, proto::OpenReply{host_info(7, "short", 1 << 20)}), 1),
               std::span<const int>(&fd, 1));
    for (proto::Message m; receive(sock.get(), m, 2000) == os::IoStatus::Ok;) {
      send_bytes(sock.get(), proto::encode(reply_to(m.request_id, proto::OkReply{})));  // the refused open's Close
    }
  } else {
    ADD_FAILURE() << "the client sent no Open (it died at its Hello?)";
  }
  EXPECT_EQ(wait_child(child), 0) << "128 + 7: SIGBUS";
}

TEST(BrokerBatch, AListThatDoesNotGoForwardIsAProtocolErrorNotALoop) {
  // Segment::list asked for the next page until `more` was false: a broker that answered the same page again kept
  // it asking for ever, its result growing.
  TempDir dir("gpuipc-batch");
  const auto listener = os::listen_seqpacket(dir.path() + "/broker.sock", 0600);
  const pid_t child = start_child([&] {
    use_played_broker(dir.path());
    GPUIPC_CHILD_CHECK(fails_with([] { (void)Segment::list(); }, ErrorCode::Protocol, "the broker's list went back"));
    return 0;
  });
  const auto sock = accept_and_greet(listener.get());
  ASSERT_TRUE(sock);
  int pages = 0;
  for (proto::Message m; pages < 1000 && receive(sock.get(), m, 2000) == os::IoStatus::Ok; ++pages) {
    proto::ListReply page;
    page.entries.push_back(host_info(5, "same", 4096));
    page.more = true;
    send_bytes(sock.get(), proto::encode(reply_to(m.request_id, page)));
  }
  EXPECT_EQ(pages, 2);
  EXPECT_EQ(wait_child(child, 10s), 0);
}

/// In a client process: the send buffer of its connection to the broker (the one connected seqpacket socket that
/// is not listening) made as small as the kernel allows, so that a few unread requests fill it. False when none.
bool shrink_broker_connection_send_buffer() {
  for (int fd = 3; fd < 1024; ++fd) {
    int type = 0;
    int listening = 0;
    socklen_t len = sizeof(int);
    if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_SEQPACKET) continue;
    len = sizeof(int);
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || listening != 0) continue;
    const int one = 1;
    return ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &one, sizeof(one)) == 0;
  }
  return false;
}

TEST(BrokerBatch, ABrokerThatStopsReadingGivesTimeoutInsteadOfASendThatBlocks) {
  TempDir dir("gpuipc-batch");
  const auto listener = os::listen_seqpacket(dir.path() + "/broker.sock", 0600);
  const SyncPipe timed_out;
  const pid_t child = start_child([&] {
    use_played_broker(dir.path(), "300");
    auto& client = core::BrokerClient::instance();
    (void)client.request(proto::Stat{"first"});
    GPUIPC_CHILD_CHECK(shrink_broker_connection_send_buffer());
    // More requests than the shrunk queue holds, to a broker that reads none of them: a blocking send would wait
    // (holding the client's lock) until the broker reads again, here for ever.
    std::vector<proto::Body> bodies(core::BrokerClient::kMaxBatch, proto::Body{proto::Stat{"queued"}});
    const auto start = std::chrono::steady_clock::now();
    try {
      (void)client.request_batch(bodies);
      return 3;
    } catch (const Error& e) {
      GPUIPC_CHILD_CHECK(e.code() == ErrorCode::Timeout);
      GPUIPC_CHILD_CHECK(std::string(e.what()).find("stopped reading") != std::string::npos);
    }
    GPUIPC_CHILD_CHECK(std::chrono::steady_clock::now() - start < 3s);
    timed_out.notify();
    // The connection stays: once the broker reads again, the answers to what was sent are discarded and the next
    // request gets its own.
    const auto r = client.request(proto::Stat{"after"});
    const auto* st = std::get_if<proto::StatReply>(&r.msg.body);
    GPUIPC_CHILD_CHECK(st != nullptr && st->info.name == "after");
    return 0;
  });
  const auto sock = accept_and_greet(listener.get());
  ASSERT_TRUE(sock);
  const auto answer = [&](const proto::Message& m) {
    proto::StatReply st;
    st.info.name = std::get<proto::Stat>(m.body).name;
    st.info.id = m.request_id;
    st.info.size = 4096;
    send_bytes(sock.get(), proto::encode(reply_to(m.request_id, st)));
  };
  proto::Message first;
  ASSERT_EQ(receive(sock.get(), first, 3000), os::IoStatus::Ok);
  answer(first);
  const bool in_time = timed_out.wait(10s);  // the old client blocked in a send until this side read
  int queued = 0;
  for (;;) {
    proto::Message m;
    ASSERT_EQ(receive(sock.get(), m, 5000), os::IoStatus::Ok);
    answer(m);
    if (std::get<proto::Stat>(m.body).name == "after") break;
    ++queued;
  }
  EXPECT_TRUE(in_time);
  EXPECT_GT(queued, 0);
  EXPECT_LT(queued, static_cast<int>(core::BrokerClient::kMaxBatch));
  EXPECT_EQ(wait_child(child), 0);
}

TEST(BrokerBatch, MoreRequestsThanTheBrokerQueuesGoInSeveralBatches) {
  const auto a = unique_name("a"), b = unique_name("b");
  auto sa = Segment::create(a, 4096), sb = Segment::create(b, 4096);
  std::vector<proto::Body> bodies;
  const std::size_t n = 4 * core::BrokerClient::kMaxBatch + 3;  // the broker cuts off a client with 256 queued
  for (std::size_t i = 0; i < n; ++i) bodies.emplace_back(proto::Stat{i % 3 == 0 ? a : i % 3 == 1 ? b : a + "-x"});
  auto answers = core::BrokerClient::instance().request_batch(bodies);
  ASSERT_EQ(answers.size(), n);
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 3 == 2) {
      ASSERT_TRUE(answers[i].error) << i;
      EXPECT_EQ(answers[i].error->code(), ErrorCode::NotFound) << answers[i].error->what();
    } else {
      ASSERT_TRUE(answers[i].reply) << i;
      EXPECT_EQ(std::get<proto::StatReply>(answers[i].reply->msg.body).info.name, i % 3 == 0 ? a : b);
    }
  }
  EXPECT_EQ(Segment::stat(a).size, 4096U);  // the connection still serves one at a time
}

TEST(BrokerBatch, AnOpenThatWaitsForItsNameIsAnsweredAfterTheRequestsBehindIt) {
  const std::uint64_t before = BrokerEnvironment::broker_references();
  const auto late = unique_name("late"), here = unique_name("here");
  auto seg = Segment::create(here, 4096);
  SyncPipe go;
  const pid_t maker = start_child([&] {
    if (!go.wait(10s)) return 2;
    std::this_thread::sleep_for(100ms);
    Segment::create(late, 8192);  // dropped at once: the name stays until it is unlinked
    return 0;
  });
  std::vector<proto::Body> bodies;
  bodies.emplace_back(proto::Open{late, proto::Access::ReadOnly, 10000});
  bodies.emplace_back(proto::Stat{here});
  go.notify();
  auto answers = core::BrokerClient::instance().request_batch(bodies, 10s);
  EXPECT_EQ(wait_child(maker), 0);
  ASSERT_TRUE(answers[0].reply && answers[1].reply);
  const auto& opened = std::get<proto::OpenReply>(answers[0].reply->msg.body);
  EXPECT_EQ(opened.info.size, 8192U);
  EXPECT_EQ(answers[0].reply->fds.size(), 1U);
  EXPECT_EQ(std::get<proto::StatReply>(answers[1].reply->msg.body).info.name, here);
  core::BrokerClient::instance().request(proto::Close{opened.info.id});  // the reference the Open counted
  Segment::unlink(late);
  Segment::unlink(here);
  seg = Segment();
  EXPECT_TRUE(wait_until([&] { return BrokerEnvironment::broker_references() == before; }, 5s));
}

}  // namespace
}  // namespace gpuipc::test
