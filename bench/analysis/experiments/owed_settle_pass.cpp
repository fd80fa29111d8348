// How long one settle pass of the broker (settle_owed: what settle_owing runs for each channel that owes writes,
// every 1 to 32 ms) takes for one channel of 4096 slots that owes as many stream writes as the broker keeps for it
// (max_owed_writes: 64 tables of 4096), none of them due. Built by hand against a build tree:
//   g++ -std=c++20 -O2 -DFMT_HEADER_ONLY=1 -Iinclude -Ibuild/generated/include -Isrc \
//     bench/analysis/experiments/owed_settle_pass.cpp build/src/libgpuipc_broker.a build/src/libgpuipc_shm.a \
//     build/src/libgpuipc_proto.a build/src/libgpuipc_os.a build/src/libgpuipc_base.a -lpthread -o /tmp/settle
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "broker/repair.hpp"
#include "proto/shm.hpp"

using namespace gpuipc;
int main() {
  constexpr std::uint32_t slots = 4096;
  constexpr std::uint32_t header_bytes = 16;
  const std::size_t bytes = proto::channel_control_bytes(slots, header_bytes);
  std::vector<std::uint64_t> mem(bytes / 8 + 1, 0);
  auto& h = *reinterpret_cast<proto::ChannelHeader*>(mem.data());
  h.magic = proto::kChannelMagic;
  h.version = proto::kChannelVersion;
  h.slots = slots;
  h.header_bytes = header_bytes;
  h.slot_bytes = 4096;
  h.record_bytes = proto::record_bytes(header_bytes);
  auto* base = reinterpret_cast<std::byte*>(mem.data()) + sizeof(proto::ChannelHeader);
  for (std::uint32_t i = 0; i < slots; ++i) {
    reinterpret_cast<proto::Slot*>(base + static_cast<std::size_t>(i) * h.record_bytes)->state =
        proto::pack_state(i, proto::Phase::Free, proto::kNoMember);
  }
  broker::ControlBlock cb{mem.data(), bytes, proto::kFlagChannel, {}};
  if (const auto why = broker::check_control(cb); !why.empty()) {
    std::printf("check_control: %s\n", why.c_str());
    return 1;
  }
  const std::size_t n = broker::max_owed_writes(slots);
  for (std::size_t i = 0; i < n; ++i) cb.owed.push_back(proto::OwedWrite{10'000'000 + i, 1ULL << 30});  // never due
  std::vector<double> ms;
  for (int run = 0; run < 15; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    const bool left = broker::settle_owed(cb);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (!left || cb.owed.size() != n) return 2;
  }
  std::sort(ms.begin(), ms.end());
  std::printf("one channel, %zu owed writes not due: settle pass median %.3f ms, min %.3f, max %.3f (15 passes)\n",
              n, ms[ms.size() / 2], ms.front(), ms.back());
}
