// What a channel handle holds, read from the library (Channel::held, held_sequence, incomplete, slots_segment: the
// accessors the Python binding uses instead of keeping its own copy), and an array header (gpuipc/array_header.hpp)
// carried through a channel from a C++ producer to a C++ consumer.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "gpuipc/array_header.hpp"
#include "gpuipc/channel.hpp"
#include "support/broker_env.hpp"

namespace gpuipc::test {
namespace {

using namespace std::chrono_literals;

const bool kRegistered = register_broker_environment();

/// A host channel `name` with a producer (its creator) and a consumer; the destructor unlinks it.
struct HostPair {
  HostPair(std::uint32_t slots, std::uint32_t header_bytes)
      : name(unique_name("held")),
        prod(Channel::create(name, {.slots = slots, .slot_bytes = 64, .header_bytes = header_bytes,
                                    .kind = SegmentKind::Host}, ChannelRole::Producer)),
        cons(Channel::open(name, ChannelRole::Consumer)) {}
  ~HostPair() { Channel::unlink(name); }
  HostPair(const HostPair&) = delete;
  HostPair& operator=(const HostPair&) = delete;
  std::string name;
  Channel prod;
  Channel cons;
};

std::vector<std::uint64_t> held(const Channel& ch) {
  std::vector<std::uint64_t> out;
  for (std::uint32_t i = 0; i < ch.held(); ++i) out.push_back(ch.held_sequence(i));
  return out;
}

TEST(ChannelHeld, FollowsAcquirePublishReceiveRelease) {
  HostPair pair(3, 8);
  Channel& prod = pair.prod;
  Channel& cons = pair.cons;
  EXPECT_EQ(Channel().held(), 0U);
  EXPECT_FALSE(Channel().slots_segment());
  for (std::uint64_t round = 0; round < 3; ++round) {  // past the ring's end: the held ring wraps as well
    const std::uint64_t first = round * 2;
    SlotView s;
    ASSERT_EQ(prod.acquire(nullptr, 1s, s), Status::Ok);
    ASSERT_EQ(prod.acquire(nullptr, 1s, s), Status::Ok);
    EXPECT_EQ(held(prod), (std::vector<std::uint64_t>{first, first + 1}));
    EXPECT_EQ(prod.held_sequence(2), 0U);
    EXPECT_FALSE(prod.incomplete(first).has_value());  // a producer holds no messages
    ASSERT_EQ(prod.publish(nullptr, {}, 1), Status::Ok);
    EXPECT_EQ(held(prod), (std::vector<std::uint64_t>{first + 1}));
    ASSERT_EQ(prod.publish(nullptr, {}, 1), Status::Ok);
    EXPECT_EQ(prod.held(), 0U);

    MessageView m;
    ASSERT_EQ(cons.receive(nullptr, 1s, m), Status::Ok);
    ASSERT_EQ(cons.receive(nullptr, 1s, m), Status::Ok);
    EXPECT_EQ(held(cons), (std::vector<std::uint64_t>{first, first + 1}));
    EXPECT_EQ(cons.incomplete(first), std::optional<bool>(false));
    ASSERT_EQ(cons.release(nullptr), Status::Ok);
    EXPECT_EQ(held(cons), (std::vector<std::uint64_t>{first + 1}));
    EXPECT_EQ(cons.incomplete(first), std::optional<bool>(false));  // released: its flag can still be read
    ASSERT_EQ(cons.release(nullptr), Status::Ok);
    EXPECT_EQ(cons.held(), 0U);
  }
}

TEST(ChannelHeld, SlotsSegmentIsTheMembersMapping) {
  HostPair pair(2, 0);
  Channel& prod = pair.prod;
  Channel& cons = pair.cons;
  const Segment mine = prod.slots_segment();
  const Segment theirs = cons.slots_segment();
  ASSERT_TRUE(mine && theirs);
  EXPECT_EQ(mine.name(), pair.name + ".slots");
  EXPECT_EQ(mine.access(), Access::ReadWrite);
  EXPECT_EQ(theirs.access(), Access::ReadOnly);  // consumers map the slots read-only
  SlotView s;
  ASSERT_EQ(prod.acquire(nullptr, 1s, s), Status::Ok);
  EXPECT_GE(static_cast<std::byte*>(s.data), static_cast<std::byte*>(mine.data()));
  EXPECT_LT(static_cast<std::byte*>(s.data), static_cast<std::byte*>(mine.data()) + mine.size());
  std::memset(s.data, 7, 4);
  ASSERT_EQ(prod.publish(nullptr, {}, 4), Status::Ok);
  MessageView m;
  ASSERT_EQ(cons.receive(nullptr, 1s, m), Status::Ok);
  const auto offset = static_cast<const std::byte*>(m.data) - static_cast<const std::byte*>(theirs.data());
  ASSERT_GE(offset, 0);
  ASSERT_LT(static_cast<std::size_t>(offset), theirs.size());  // the message lies in the consumer's mapping
  cons = Channel();  // the segment handle keeps the mapping after the member has left
  prod = Channel();
  EXPECT_EQ(static_cast<const std::uint8_t*>(theirs.data())[offset], 7);
}

TEST(ChannelHeld, ArrayHeaderFromCppToCpp) {
  HostPair pair(2, 256);
  Channel& prod = pair.prod;
  Channel& cons = pair.cons;
  const std::array<float, 6> values{1, 2, 3, 4, 5, 6};
  const ArrayHeader sent{.dtype_code = 2, .dtype_bits = 32, .nbytes = sizeof values, .shape = {2, 3}};
  std::array<std::byte, 256> buffer{};
  const std::size_t bytes = encode_array_header(sent, buffer);
  ASSERT_EQ(bytes, sent.encoded_bytes());
  std::uint64_t seq = 0;
  ASSERT_EQ(prod.send(nullptr, values.data(), sizeof values, std::span(buffer).first(bytes), 1s, seq), Status::Ok);
  MessageView m;
  ASSERT_EQ(cons.receive(nullptr, 1s, m), Status::Ok);
  const auto got = decode_array_header(m.header);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->shape, sent.shape);
  EXPECT_EQ(got->nbytes, m.size);
  EXPECT_EQ(std::memcmp(m.data, values.data(), sizeof values), 0);
  ASSERT_EQ(cons.release(nullptr), Status::Ok);
}

}  // namespace
}  // namespace gpuipc::test
