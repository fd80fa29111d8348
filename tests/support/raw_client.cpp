#include "support/raw_client.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "base/config.hpp"
#include "gpuipc/segment.hpp"
#include "support/broker_env.hpp"

namespace gpuipc::test {

os::UniqueFd raw_connect() {
  BrokerEnvironment::broker_pid();  // make sure it runs
  return os::connect_seqpacket(config::socket_path());
}

os::IoStatus receive(int sock, proto::Message& msg, int timeout_ms, std::vector<os::UniqueFd>* fds_out) {
  if (!os::wait_readable(sock, timeout_ms)) return os::IoStatus::WouldBlock;
  std::vector<std::byte> buf(proto::kMaxMessageSize);
  std::size_t n = 0;
  std::vector<os::UniqueFd> fds;
  auto st = os::receive_message(sock, buf, n, fds);
  if (st != os::IoStatus::Ok) return st;
  std::string why;
  if (!proto::decode(std::span<const std::byte>(buf.data(), n), fds.size(), msg, why)) {
    ADD_FAILURE() << "broker sent an undecodable message: " << why;
  }
  if (fds_out != nullptr) *fds_out = std::move(fds);
  return st;
}

void send_bytes(int sock, const std::vector<std::byte>& bytes, std::span<const int> fds) {
  ASSERT_EQ(os::send_message(sock, bytes, fds, proto::kMaxMessageSize + 4096), os::IoStatus::Ok);
}

os::UniqueFd raw_hello(std::uint32_t pid, const char* name) {
  auto sock = raw_connect();
  send_bytes(sock.get(), proto::encode(proto::Message{1, proto::Hello{pid, name}}));
  proto::Message msg;
  EXPECT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
  EXPECT_TRUE(std::holds_alternative<proto::HelloReply>(msg.body));
  return sock;
}

proto::Message raw_request(int sock, std::uint32_t rid, const proto::Body& body, std::span<const int> fds,
                           std::vector<os::UniqueFd>* reply_fds) {
  send_bytes(sock, proto::encode(proto::Message{rid, body}, fds.size()), fds);
  proto::Message msg;
  EXPECT_EQ(receive(sock, msg, 3000, reply_fds), os::IoStatus::Ok);
  return msg;
}

void expect_error_then_closed(int sock, ErrorCode code) {
  proto::Message msg;
  ASSERT_EQ(receive(sock, msg), os::IoStatus::Ok);
  const auto* e = std::get_if<proto::ErrorReply>(&msg.body);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->code, static_cast<std::uint8_t>(code)) << e->message;
  EXPECT_EQ(receive(sock, msg), os::IoStatus::Closed);
}

void expect_still_serving() {
  const auto name = unique_name("alive");
  auto s = Segment::create(name, 4096);
  Segment::unlink(name);
}

void use_played_broker(const std::string& dir, const char* connect_timeout_ms) {
  ::setenv("GPUIPC_RUNTIME_DIR", dir.c_str(), 1);  // NOLINT(concurrency-mt-unsafe): documented: one thread
  ::setenv("GPUIPC_NO_AUTOSTART", "1", 1);         // NOLINT(concurrency-mt-unsafe)
  if (connect_timeout_ms != nullptr) ::setenv("GPUIPC_CONNECT_TIMEOUT_MS", connect_timeout_ms, 1);  // NOLINT
}

proto::Message reply_to(std::uint32_t rid, proto::Body body) {
  proto::Message m;
  m.request_id = rid;
  m.body = std::move(body);
  return m;
}

os::UniqueFd accept_and_greet(int listener, int status_page) {
  if (!os::wait_readable(listener, 10000)) return {};
  auto sock = os::accept_seqpacket(listener);
  proto::Message hello;
  if (!sock || receive(sock.get(), hello) != os::IoStatus::Ok || !std::holds_alternative<proto::Hello>(hello.body)) {
    return {};
  }
  const bool page = status_page >= 0;
  send_bytes(sock.get(), proto::encode(reply_to(hello.request_id, proto::HelloReply{1, 0, 0, "test"}), page ? 1 : 0),
             page ? std::span<const int>(&status_page, 1) : std::span<const int>());
  return sock;
}

}  // namespace gpuipc::test
