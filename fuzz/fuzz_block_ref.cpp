// libFuzzer target for BlockRef decoding (gpuipc::decode_block_ref), which a process runs on references that came
// from another process in any message. Beyond "never crashes, never reads out of bounds" (ASan + UBSan), it checks
// that a refusal is an Error(InvalidArgument) with a one-line message, and the round trip: whatever decode accepts,
// encode reproduces byte for byte, and it is within the limits of every pool (shm::kMaxChunks, kMaxRecords).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>

#include "gpuipc/pool.hpp"
#include "shm/pool_block.hpp"

namespace {

[[noreturn]] void die(const char* what, const std::string& detail) {
  std::fprintf(stderr, "fuzz_block_ref: %s: %s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  gpuipc::BlockRef ref;
  try {
    ref = gpuipc::decode_block_ref(bytes);
  } catch (const gpuipc::Error& e) {
    const std::string what = e.what();
    if (e.code() != gpuipc::ErrorCode::InvalidArgument) die("refused with another code", what);
    if (what.empty() || what.find('\n') != std::string::npos) die("refusal without a one-line reason", what);
    return 0;
  }
  if (ref.pool == 0 || ref.generation == 0 || ref.size == 0 || ref.chunk >= gpuipc::shm::kMaxChunks ||
      ref.index >= gpuipc::shm::kMaxRecords || ref.offset + ref.size < ref.offset) {
    die("accepted a reference out of every pool's limits", std::to_string(ref.chunk));
  }
  const auto again = gpuipc::encode_block_ref(ref);
  if (again.size() != size || std::memcmp(again.data(), data, size) != 0) die("re-encoding differs", "");
  if (!(gpuipc::decode_block_ref(again) == ref)) die("decode(encode(r)) != r", "");
  return 0;
}
