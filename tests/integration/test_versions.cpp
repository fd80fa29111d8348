// One version number, from project(VERSION) in CMakeLists.txt, everywhere: the library, both programs' --version,
// HelloReply. And the protocol handshake: a client and a broker of different protocol versions refuse each other
// with a message naming both versions and what to do, and the broker stays up.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <cstdlib>
#include <regex>
#include <string>
#include <thread>

#include "gpuipc/error.hpp"
#include "gpuipc/segment.hpp"
#include "gpuipc/version.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "support/broker_env.hpp"
#include "support/raw_client.hpp"
#include "support/support.hpp"

namespace gpuipc::test {
namespace {

const bool kRegistered = register_broker_environment();

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The bytes of `msg` with another protocol version in the header (the header is the same in every version).
std::vector<std::byte> with_version(const proto::Message& msg, std::uint16_t version) {
  auto bytes = proto::encode(msg);
  bytes[4] = static_cast<std::byte>(version & 0xff);
  bytes[5] = static_cast<std::byte>(version >> 8);
  return bytes;
}

TEST(Versions, OneNumberFromCMakeLists) {
  const auto cmake = read_file(GPUIPC_SOURCE_DIR "/CMakeLists.txt");
  ASSERT_TRUE(cmake.has_value());
  std::smatch m;
  ASSERT_TRUE(std::regex_search(*cmake, m, std::regex(R"(project\(gpuipc VERSION ([0-9]+\.[0-9]+\.[0-9]+))")));
  EXPECT_EQ(m[1].str(), GPUIPC_VERSION_STRING);
  EXPECT_STREQ(gpuipc::version(), GPUIPC_VERSION_STRING);
  EXPECT_EQ(gpuipc::protocol_version(), proto::kVersion);
  // The wheel takes it from the same line: pyproject.toml writes no version of its own.
  const auto pyproject = read_file(GPUIPC_SOURCE_DIR "/pyproject.toml");
  ASSERT_TRUE(pyproject.has_value());
  EXPECT_TRUE(contains(*pyproject, "dynamic = [\"version\"]"));
  EXPECT_FALSE(std::regex_search(*pyproject, std::regex(R"(\nversion *=)")));
}

TEST(Versions, ProgramsAndTheBrokerReportIt) {
  const std::string want =
      std::string(GPUIPC_VERSION_STRING) + " (protocol version " + std::to_string(proto::kVersion) + ")";
  const auto cli = run_program(GPUIPC_BUILD_BIN_DIR "/gpuipc", {"--version"});
  EXPECT_EQ(cli.exit_code, 0) << cli.err;
  EXPECT_EQ(cli.out, "gpuipc " + want + "\n");
  const auto daemon = run_program(GPUIPC_BUILD_BIN_DIR "/gpuipcd", {"--version"});
  EXPECT_EQ(daemon.exit_code, 0) << daemon.err;
  EXPECT_EQ(daemon.out, "gpuipcd " + want + "\n");

  auto sock = raw_connect();
  send_bytes(sock.get(), proto::encode(proto::Message{1, proto::Hello{1, "versions"}}));
  proto::Message msg;
  std::vector<os::UniqueFd> fds;
  ASSERT_EQ(receive(sock.get(), msg, 3000, &fds), os::IoStatus::Ok);
  const auto* hello = std::get_if<proto::HelloReply>(&msg.body);
  ASSERT_NE(hello, nullptr);
  EXPECT_EQ(hello->broker_version, GPUIPC_VERSION_STRING);
}

// Hello from an older and from a newer client: an Error(Protocol) that names both versions and the way out, then the
// connection closes, and the broker goes on serving everyone else.
TEST(Versions, BrokerRefusesAClientOfAnotherProtocolVersion) {
  for (const std::uint16_t theirs :
       {static_cast<std::uint16_t>(proto::kVersion - 1), static_cast<std::uint16_t>(proto::kVersion + 1)}) {
    SCOPED_TRACE(theirs);
    auto sock = raw_connect();
    send_bytes(sock.get(), with_version(proto::Message{1, proto::Hello{1, "other-release"}}, theirs));
    proto::Message msg;
    ASSERT_EQ(receive(sock.get(), msg), os::IoStatus::Ok);
    const auto* e = std::get_if<proto::ErrorReply>(&msg.body);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->code, static_cast<std::uint8_t>(ErrorCode::Protocol));
    EXPECT_TRUE(contains(e->message, "protocol version mismatch")) << e->message;
    EXPECT_TRUE(contains(e->message, "the client speaks gpuipc protocol version " + std::to_string(theirs)))
        << e->message;
    EXPECT_TRUE(contains(e->message, "speaks version " + std::to_string(proto::kVersion))) << e->message;
    EXPECT_TRUE(contains(e->message, "gpuipc daemon --stop")) << e->message;
    EXPECT_TRUE(contains(e->message, "upgrade the older side")) << e->message;
    EXPECT_EQ(receive(sock.get(), msg), os::IoStatus::Closed);
    expect_still_serving();
  }
}

// The other way round: the library meets a broker of a newer release (a fake one here, answering Hello in its
// version). The library's error names both versions and what to do, whatever the broker said.
TEST(Versions, LibraryRefusesABrokerOfAnotherProtocolVersion) {
  EXPECT_EQ(run_child([] {
              TempDir dir("gpuipc-vers");
              auto listener = os::listen_seqpacket(dir.file("broker.sock"));
              const std::uint16_t theirs = proto::kVersion + 1;
              std::thread fake([&] {
                if (!os::wait_readable(listener.get(), 10000)) return;
                auto sock = os::accept_seqpacket(listener.get());
                if (!sock) return;
                os::set_nonblocking(sock.get(), false);
                std::vector<std::byte> buf(proto::kMaxMessageSize);
                std::size_t n = 0;
                std::vector<os::UniqueFd> fds;
                if (os::receive_message(sock.get(), buf, n, fds) != os::IoStatus::Ok) return;
                proto::ErrorReply refusal{static_cast<std::uint8_t>(ErrorCode::Protocol), 0, "a newer broker says no"};
                (void)os::send_message(sock.get(), with_version(proto::Message{0, refusal}, theirs));
                (void)os::wait_readable(sock.get(), 5000);  // until the library hangs up
              });
              ::setenv("GPUIPC_RUNTIME_DIR", dir.path().c_str(), 1);
              ::setenv("GPUIPC_NO_AUTOSTART", "1", 1);
              std::string what;
              ErrorCode code{};
              try {
                (void)Segment::create(unique_name(), 4096);
              } catch (const Error& e) {
                what = e.what();
                code = e.code();
              }
              fake.join();
              std::fprintf(stderr, "library said: %s\n", what.c_str());  // NOLINT(cert-err33-c)
              GPUIPC_CHILD_CHECK(code == ErrorCode::Protocol);
              GPUIPC_CHILD_CHECK(contains(what, "protocol version mismatch"));
              GPUIPC_CHILD_CHECK(contains(what, "speaks protocol version " + std::to_string(theirs)));
              GPUIPC_CHILD_CHECK(contains(what, std::string("this library (gpuipc ") + GPUIPC_VERSION_STRING +
                                                    ") speaks version " + std::to_string(proto::kVersion)));
              GPUIPC_CHILD_CHECK(contains(what, "gpuipc daemon --stop"));
              return 0;
            }),
            0);
}

}  // namespace
}  // namespace gpuipc::test
