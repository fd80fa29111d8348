// libFuzzer target for the broker wire-protocol decoder (src/proto). Input: one byte whose value mod 17 is the
// number of fds that "arrived" with the datagram, then the datagram. Beyond "never crashes, never reads out of
// bounds, never leaks" (ASan + UBSan), it checks the round-trip property: whatever decode accepts, encode
// reproduces byte for byte (the encoding is canonical), and decoding that again gives the same message.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "proto/messages.hpp"

namespace {

[[noreturn]] void die(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_proto_decode: %s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace gpuipc::proto;
  if (size == 0) return 0;
  const std::size_t fds = data[0] % 17;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data + 1), size - 1);

  Message msg;
  std::string error;
  if (!decode(bytes, fds, msg, error)) {
    if (error.empty() || error.find('\n') != std::string::npos) die("refusal without a one-line reason", error);
    return 0;
  }
  if (!error.empty()) die("accepted with an error set", error);

  std::vector<std::byte> again;
  try {
    again = encode(msg, fds);
  } catch (const std::invalid_argument& e) {
    die("encode refused what decode accepted", e.what());
  }
  if (again.size() != bytes.size() || std::memcmp(again.data(), bytes.data(), bytes.size()) != 0) {
    die("re-encoding differs from the accepted bytes",
        std::to_string(again.size()) + " vs " + std::to_string(bytes.size()) + " bytes");
  }
  Message twice;
  if (!decode(again, fds, twice, error)) die("decode refused its own encoding", error);
  if (!(twice == msg)) die("decode(encode(m)) != m", "");
  return 0;
}
