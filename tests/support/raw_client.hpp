// A client that speaks the wire protocol by hand, for tests that play a hostile or broken client against the
// real broker: it sends what the library never would.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"

namespace gpuipc::test {

/// Connects to this test process's broker (starting it if needed), without saying Hello.
os::UniqueFd raw_connect();

/// Receives one message within `timeout_ms`; decodes it into `msg` when Ok (a failed decode fails the test).
/// The fds that came with it go to `fds` when given.
os::IoStatus receive(int sock, proto::Message& msg, int timeout_ms = 3000, std::vector<os::UniqueFd>* fds = nullptr);

/// Sends raw bytes (and fds) as one message; fails the test when that does not go through.
void send_bytes(int sock, const std::vector<std::byte>& bytes, std::span<const int> fds = {});

/// Connects, says Hello with `pid` (whatever the test wants the broker to be told) and reads the reply.
os::UniqueFd raw_hello(std::uint32_t pid, const char* name = "raw");

/// Sends `body` as request `rid` (with `fds`) and returns the reply (a default Message when none came).
proto::Message raw_request(int sock, std::uint32_t rid, const proto::Body& body, std::span<const int> fds = {},
                           std::vector<os::UniqueFd>* reply_fds = nullptr);

/// After an error reply the broker must close: the next receive sees EOF.
void expect_error_then_closed(int sock, ErrorCode code);

/// Creates and unlinks a segment through the library: the broker still serves.
void expect_still_serving();

// A broker played by the test (a listening socket of its own, which the library of a child process connects to).

/// In the client process (one thread, before its first library call): its library connects to the broker played in
/// `dir` (never starting one), and with `connect_timeout_ms` gives up on an answer after that long.
void use_played_broker(const std::string& dir, const char* connect_timeout_ms = nullptr);

/// A reply to request `rid`.
proto::Message reply_to(std::uint32_t rid, proto::Body body);

/// The played broker's side of a client's connect: accepts it and answers its Hello, with `status_page` as the
/// status page's fd when >= 0. An empty fd when it did not come.
os::UniqueFd accept_and_greet(int listener, int status_page = -1);

}  // namespace gpuipc::test
