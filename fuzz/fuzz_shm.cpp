// libFuzzer target for the shared-memory control blocks (src/shm): a channel ring, a pool, a counting semaphore and
// a semaphore, each made the way its creator makes it and then driven by a sequence of operations from the input.
// Two kinds of operation are mixed: what honest members and the broker do (join, acquire, publish, receive,
// release, allocate, hold, free, pause, leave, a dead member's repair, a stream's write landing), and what a
// hostile or broken member with the block mapped read-write can do: write any bytes anywhere in the block, at
// any moment. The layer's rule (src/shm/sync.hpp) is that every transition is safe on any memory contents: no
// read or write outside the block, no undefined behaviour (ASan + UBSan) and no loop without a bound (libFuzzer's
// -timeout, set by scripts/fuzz.sh). The broker runs these repairs for every user of the machine, so a crash or a
// hang here would be one user stopping everyone's broker.
//
// As in the broker and the library, the geometry a party trusts is the copy it read when it created or opened the
// block (the broker's never changes; a member's is read again by a "reopen" operation, from the scribbled block,
// and must validate against the mapping's size before it is used).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <optional>
#include <vector>

#include "fuzz_input.hpp"
#include "proto/shm.hpp"
#include "shm/channel_ring.hpp"
#include "shm/counting_block.hpp"
#include "shm/members.hpp"
#include "shm/pool_block.hpp"
#include "shm/semaphore_block.hpp"
#include "shm/sync.hpp"

namespace {

using namespace gpuipc;  // NOLINT(google-build-using-namespace): a test harness

using fuzz::Input;

/// A zeroed block of exactly `size` bytes (rounded to the 64-byte alignment of the layouts) on the heap, so that
/// ASan sees any access past it.
struct Block {
  explicit Block(std::size_t bytes) : size(bytes) {
    data = static_cast<std::byte*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
    if (data == nullptr) std::abort();
    std::memset(data, 0, (bytes + 63) / 64 * 64);
  }
  ~Block() { std::free(data); }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  std::byte* data;
  std::size_t size;
};

/// A peer's write of 1 to 8 arbitrary bytes at an arbitrary offset.
void scribble(Block& b, Input& in) {
  const std::size_t at = in.u32() % b.size;
  const auto width = static_cast<std::size_t>(1 + in.byte() % 8);
  const std::uint64_t v = in.u64();
  std::memcpy(b.data + at, &v, std::min(width, b.size - at));
}

/// A token the broker would choose: never 0.
std::uint32_t token_for(std::uint32_t i) noexcept { return 0x1000U + i; }

// Channel --------------------------------------------------------------------------------------------------------

struct ChannelMember {
  std::uint32_t index = proto::kNoMember;
  std::uint32_t token = 0;
  proto::Role role = proto::Role::None;
  std::deque<std::uint64_t> held;  // claimed slots (producer) or received messages (consumer), oldest first
  shm::RingGeometry geometry;      // as this member read it when it opened the channel
  shm::OwnOwed own;                // its own record of what it owes (core's Channel keeps one); empty: the table's
  shm::OwnOwed* record() noexcept { return own.entries.empty() ? nullptr : &own; }
};

void run_channel(Input& in) {
  static constexpr std::uint32_t kSlots[] = {1, 2, 3, 4, 8, 16, 17};
  static constexpr std::uint32_t kHeaders[] = {0, 8, 64, 200};
  const std::uint8_t shape = in.byte();
  const std::uint32_t slots = kSlots[shape % std::size(kSlots)];
  const std::uint32_t header_bytes = kHeaders[(shape / 8) % std::size(kHeaders)];
  Block b(proto::channel_control_bytes(slots, header_bytes));
  shm::ring_init(b.data, slots, header_bytes, 4096, static_cast<std::uint32_t>(proto::Kind::Device));
  const auto created = shm::ring_geometry(b.data, b.size);
  if (!created) std::abort();                // the creator's own block must validate
  const shm::Ring broker{b.data, *created};  // the broker read it once, at the Create
  std::vector<ChannelMember> members(4);
  std::vector<proto::OwedWrite> owed(proto::owed_capacity(slots));
  std::vector<proto::OwedWrite> broker_owed;  // what the broker keeps writing for the dead, as repair.cpp does
  std::byte header[4096] = {};

  for (int op = 0; op < 256 && !in.empty(); ++op) {
    const std::uint8_t code = in.byte();
    ChannelMember& m = members[(code >> 5) % members.size()];
    const std::uint32_t number = static_cast<std::uint32_t>(&m - members.data());
    const shm::Ring ring{b.data, m.geometry};
    const bool joined = m.index != proto::kNoMember;
    proto::PoisonReason gone = proto::PoisonReason::None;
    std::uint64_t seq = 0;
    switch (code % 16) {
      case 0: {  // the broker answers a Join
        if (joined) break;
        const proto::Role role = (in.byte() & 1) != 0 ? proto::Role::Producer : proto::Role::Consumer;
        const std::uint32_t index = shm::channel_join(broker, token_for(number), role);
        if (index != proto::kNoMember) m = ChannelMember{index, token_for(number), role, {}, *created, {}};
        if (index != proto::kNoMember && number % 2 == 0) m.own.entries.resize(proto::owed_capacity(slots));
        break;
      }
      case 1:  // acquire, with room for the write it will owe (as core does)
        if (joined && m.role == proto::Role::Producer && m.held.size() < 8 &&
            shm::ring_owed_room(ring, m.index, m.record()) > 0 && shm::ring_try_acquire(ring, m.index, seq, gone) &&
            gone == proto::PoisonReason::None) {
          (void)shm::ring_free_mark(ring, seq);
          m.held.push_back(seq);
        }
        break;
      case 2:  // publish the oldest claim
        if (joined && m.role == proto::Role::Producer && !m.held.empty()) {
          const std::size_t n = std::min<std::size_t>(in.byte(), m.geometry.header_bytes);
          shm::ring_publish(ring, m.held.front(), m.index, std::span(header, n), in.u32(), (in.byte() & 1) != 0,
                            m.record());
          m.held.pop_front();
        }
        break;
      case 3:  // give the newest claim back
        if (joined && m.role == proto::Role::Producer && !m.held.empty()) {
          shm::ring_give_back(ring, m.held.back(), m.index);
          m.held.pop_back();
        }
        break;
      case 4:  // receive
        if (joined && m.role == proto::Role::Consumer && m.held.size() < 8 &&
            shm::ring_owed_room(ring, m.index, m.record()) > 0 && shm::ring_try_receive(ring, m.index, seq, gone) &&
            gone == proto::PoisonReason::None) {
          m.held.push_back(seq);
        }
        break;
      case 5:  // release the oldest message, or hand the newest back
        if (joined && m.role == proto::Role::Consumer && !m.held.empty()) {
          if ((in.byte() & 1) != 0) {
            shm::ring_release(ring, m.held.front(), m.index, (in.byte() & 1) != 0, m.record());
            m.held.pop_front();
          } else {
            shm::ring_hand_back(ring, m.held.back(), m.index);
            m.held.pop_back();
          }
        }
        break;
      case 6: {  // a stream's write lands (the GPU writing `filled` or `freed` of a message)
        const bool filled = (in.byte() & 1) != 0;
        seq = in.u32();
        shm::raise_to(filled ? broker.slot(seq).filled : broker.slot(seq).freed, seq + 1);
        break;
      }
      case 7:  // what a member and the broker read without changing anything
        if (joined) {
          (void)shm::ring_member_writes_done(ring, m.index, m.record());
          (void)shm::ring_owed_room(ring, m.index, m.record());
        }
        (void)shm::ring_member_claims(broker, in.byte());
        shm::ring_mark_incomplete(broker.slot(in.u32()), in.u32());
        break;
      case 8:  // the member's process dies: the broker's repair (repair.cpp's order)
        if (joined || (in.byte() & 1) != 0) {
          const std::uint32_t index = joined ? m.index : in.byte() % 64;
          owed.resize(proto::owed_capacity(slots));
          owed.resize(shm::ring_take_owed(broker, index, owed));
          (void)shm::channel_remove_member(b.data, broker.geometry, index, joined ? m.token : in.u32(),
                                           joined ? m.role : proto::Role::Producer, proto::PoisonReason::PeerDied);
          broker_owed.insert(broker_owed.end(), owed.begin(), owed.end());
          m = ChannelMember{};
        }
        break;
      case 9:  // a clean leave of its own
        if (joined) {
          if (m.record() != nullptr) shm::ring_restore_owed(ring, m.index, m.own);
          (void)shm::channel_remove_member(b.data, m.geometry, m.index, m.token, m.role, proto::PoisonReason::Closed);
          m = ChannelMember{};
        }
        break;
      case 10:  // a leave through the broker, which takes the owed writes over
        if (joined) {
          if (m.record() != nullptr) shm::ring_restore_owed(ring, m.index, m.own);
          owed.resize(proto::owed_capacity(slots));
          owed.resize(shm::ring_take_owed(broker, m.index, owed));
          shm::ring_forget_owed(broker, m.index);
          (void)shm::channel_remove_member(b.data, broker.geometry, m.index, m.token, m.role,
                                           proto::PoisonReason::Closed);
          broker_owed.insert(broker_owed.end(), owed.begin(), owed.end());
          m = ChannelMember{};
        }
        break;
      case 11:  // the broker's periodic pass over what it owes
        broker_owed.resize(shm::ring_drop_landed(broker, broker_owed));
        broker_owed.resize(shm::ring_settle_owed(broker, broker_owed));
        break;
      case 12:  // the member opens the channel again: it trusts only a geometry that fits the mapping
        if (const auto g = shm::ring_geometry(b.data, b.size)) {
          if (proto::channel_control_bytes(g->slots, g->header_bytes) > b.size) std::abort();
          m.geometry = *g;
          m.held.clear();  // a new handle holds nothing
        }
        break;
      default:  // 13-15: a peer writes anything anywhere
        scribble(b, in);
        break;
    }
  }
  // Everyone goes: the broker repairs whoever is left.
  for (auto& m : members) {
    if (m.index == proto::kNoMember) continue;
    owed.resize(proto::owed_capacity(slots));
    owed.resize(shm::ring_take_owed(broker, m.index, owed));
    (void)shm::channel_remove_member(b.data, broker.geometry, m.index, m.token, m.role, proto::PoisonReason::PeerDied);
  }
}

// Pool -----------------------------------------------------------------------------------------------------------

struct PoolMember {
  std::uint32_t index = proto::kNoMember;
  std::uint32_t token = 0;
  shm::PoolBlock view;                     // as this member validated the block when it joined
  std::vector<shm::BlockLocation> blocks;  // blocks it holds, as its allocations or holds returned them
};

shm::BlockLocation location_from(Input& in, const std::vector<shm::BlockLocation>& known) {
  if (!known.empty() && (in.byte() & 1) != 0) return known[in.byte() % known.size()];
  shm::BlockLocation loc;  // a reference another process sent: any fields at all
  loc.chunk = in.u32();
  loc.record = in.u32();
  loc.offset = in.u64();
  loc.size = in.u64();
  loc.generation = in.u64();
  return loc;
}

void run_pool(Input& in) {
  const std::uint8_t shape = in.byte();
  shm::PoolGeometry g;
  g.pool_id = 0x1234;
  g.mode = (shape & 1) != 0 ? shm::PoolMode::Fixed : shm::PoolMode::Variable;
  g.kind = static_cast<std::uint32_t>(proto::Kind::Host);
  g.max_records = 1 + (shape >> 1) % 32;
  g.max_chunks = g.mode == shm::PoolMode::Fixed ? 1 : 1 + (shape >> 6);
  g.chunk_bytes = std::uint64_t{1} << 20;
  g.block_bytes = g.mode == shm::PoolMode::Fixed ? g.chunk_bytes / g.max_records : 0;
  Block b(shm::pool_control_bytes(g.max_records));
  shm::init_pool(b.data, g);
  if (!shm::PoolBlock(b.data, b.size).valid()) std::abort();
  auto& header = *reinterpret_cast<shm::PoolHeader*>(b.data);
  std::vector<PoolMember> members(4);
  std::vector<shm::BlockLocation> seen;  // every location any member got, for references between members
  std::vector<shm::OccupiedRange> scratch;
  scratch.reserve(g.max_records);
  constexpr auto kNoWait = std::chrono::nanoseconds(0);

  for (int op = 0; op < 256 && !in.empty(); ++op) {
    const std::uint8_t code = in.byte();
    PoolMember& m = members[(code >> 5) % members.size()];
    const std::uint32_t number = static_cast<std::uint32_t>(&m - members.data());
    const bool joined = m.index != proto::kNoMember && m.view.valid();
    switch (code % 16) {
      case 0:  // the broker answers a Join; the member validates the block it maps
        if (m.index != proto::kNoMember) break;
        m.index = shm::claim_member(header.members, token_for(number), proto::Role::Holder);
        m.token = token_for(number);
        m.view = shm::PoolBlock(b.data, b.size);
        if (m.index == proto::kNoMember) m = PoolMember{};
        break;
      case 1: {  // allocate
        if (!joined) break;
        shm::BlockLocation loc;
        const shm::PoolStatus s = m.view.allocate(m.index, 1 + in.u32() % (2 * g.chunk_bytes),
                                                  std::uint64_t{1} << (in.byte() % 13), loc, scratch, kNoWait);
        if (s == shm::PoolStatus::Ok) {
          m.blocks.push_back(loc);
          seen.push_back(loc);
        } else if (s == shm::PoolStatus::NeedChunk) {
          m.view.chunk_created(m.index, loc.chunk, (in.byte() & 1) != 0);
        }
        break;
      }
      case 2: {  // hold a block another member sent
        if (!joined) break;
        const shm::BlockLocation loc = location_from(in, seen);
        (void)m.view.check_live(loc);
        if (m.view.hold(m.index, loc, kNoWait) == shm::PoolStatus::Ok) m.blocks.push_back(loc);
        break;
      }
      case 3: {  // free (release a hold), at once or on a stream
        if (!joined) break;
        const shm::BlockLocation loc = location_from(in, m.blocks);
        if (m.view.release(m.index, loc, (in.byte() & 1) != 0, kNoWait) == shm::PoolStatus::Ok) {
          std::erase_if(m.blocks, [&](const shm::BlockLocation& l) {
            return l.record == loc.record && l.generation == loc.generation;
          });
        }
        break;
      }
      case 4: {  // a stream's free lands: the GPU writes `released` of a record
        const std::uint32_t i = in.u32() % g.max_records;
        auto& r = *reinterpret_cast<shm::BlockRecord*>(b.data + sizeof(shm::PoolHeader) + i * sizeof(shm::BlockRecord));
        shm::raise_to(r.released, proto::atomic(r.generation).load());
        break;
      }
      case 5:  // pause and resume
        if (!joined) break;
        if ((in.byte() & 1) != 0) {
          if (m.view.begin_pause(m.index, 100 + number, kNoWait) == shm::PoolStatus::Ok) {
            m.view.end_pause(m.index, (in.byte() & 1) != 0);
          }
        } else if (m.view.begin_resume(m.index, 100 + number, kNoWait) == shm::PoolStatus::Ok) {
          m.view.end_resume(m.index, (in.byte() & 1) != 0);
        }
        break;
      case 6:  // what members, `gpuipc stat` and the broker read
        if (joined) {
          (void)m.view.counts();
          (void)m.view.occupied(scratch);
          (void)m.view.pause_info();
        }
        (void)shm::pool_members_with_frees_pending(b.data, b.size);
        (void)shm::pool_member_frees_pending(b.data, b.size, in.byte() % 64);
        (void)shm::pool_member_uses_memory(b.data, b.size, in.byte() % 64);
        {  // what a closing handle parks on, and its later checks (core/stream_park.hpp), on scribbled records too
          auto frees = shm::pool_member_pending_frees(b.data, b.size, in.byte() % 66);
          if (!frees.empty() && in.byte() % 2 == 0) frees.front().index = in.u32();  // a record index out of range
          (void)shm::pool_frees_landed(b.data, b.size, frees);
        }
        break;
      case 7:  // the member's process dies: the broker's repair (repair.cpp)
        if (m.index != proto::kNoMember) {
          if (shm::holds_token(header.members, m.index, m.token) &&
              shm::pool_remove_member(b.data, b.size, m.index) >= 0) {
            (void)shm::clear_member(header.members, m.index, m.token);
          }
          m = PoolMember{};
        }
        break;
      case 8:  // a leave that hands its pending stream frees to the broker, which removes it later
        if (m.index != proto::kNoMember) {
          (void)shm::pool_remove_member(b.data, b.size, m.index, true);
          if (shm::holds_token(header.members, m.index, m.token) &&
              shm::pool_remove_member(b.data, b.size, m.index) >= 0) {
            (void)shm::clear_member(header.members, m.index, m.token);
          }
          m = PoolMember{};
        }
        break;
      case 9:  // the repair of a member index the broker has on record (any index, any token)
        if (const std::uint32_t index = in.byte() % 64; shm::holds_token(header.members, index, in.u32())) {
          (void)shm::pool_remove_member(b.data, b.size, index);
        }
        break;
      case 10:  // the member opens the pool again
        if (m.index != proto::kNoMember) m.view = shm::PoolBlock(b.data, b.size);
        break;
      default:  // 11-15: a peer writes anything anywhere
        scribble(b, in);
        break;
    }
  }
  for (auto& m : members) {
    if (m.index != proto::kNoMember) (void)shm::pool_remove_member(b.data, b.size, m.index);
  }
}

// Counting semaphore ----------------------------------------------------------------------------------------------

void run_counting(Input& in) {
  Block b(sizeof(proto::CountingBlock));
  auto* block = reinterpret_cast<proto::CountingBlock*>(b.data);
  const std::uint32_t max_count = 1 + in.byte() % 16;
  const std::uint32_t initial = in.byte() % (max_count + 1);
  block->version = proto::kCountingVersion;  // as CountingSemaphore::create writes it
  block->max_count = max_count;
  block->initial = initial;
  block->state = initial;
  block->magic = proto::kCountingMagic;
  if (shm::counting_block(b.data, b.size) == nullptr || shm::counting_check_new(*block) != nullptr) std::abort();
  struct Member {
    std::uint32_t index = proto::kNoMember;
    std::uint32_t token = 0;
  };
  std::vector<Member> members(4);
  bool creator_joined = false;

  for (int op = 0; op < 256 && !in.empty(); ++op) {
    const std::uint8_t code = in.byte();
    Member& m = members[(code >> 5) % members.size()];
    const auto number = static_cast<std::uint32_t>(&m - members.data());
    const bool joined = m.index != proto::kNoMember;
    switch (code % 8) {
      case 0:
        if (!joined) {
          m = Member{shm::counting_join(*block, token_for(number), creator_joined ? 0 : max_count - initial),
                     token_for(number)};
          creator_joined = true;
        }
        break;
      case 1:  // acquire or release, as core makes them (a waiter queues first)
        if (joined) {
          const bool release = (in.byte() & 1) != 0;
          const std::uint32_t n = 1 + in.byte() % 4;
          if (!release) shm::counting_enqueue(*block, m.index, n);
          if (release || shm::counting_is_head(*block, m.index)) {
            (void)shm::counting_apply(*block, m.index, release, n, max_count, in.byte());
          }
          if (!release) shm::counting_dequeue(*block, m.index, shm::counting_available(*block) > 0);
        }
        break;
      case 2:
        (void)shm::counting_held(*block, in.byte() % 64);
        (void)shm::counting_available(*block);
        (void)shm::counting_members(*block);
        break;
      case 3:  // a leave, or the repair of a dead member: the same function
        if (joined) {
          (void)shm::counting_remove_member(*block, m.index, m.token, max_count);
          m = Member{};
        }
        break;
      default:
        scribble(b, in);
        break;
    }
  }
  for (auto& m : members) {
    if (m.index != proto::kNoMember) (void)shm::counting_remove_member(*block, m.index, m.token, max_count);
  }
}

// Semaphore ------------------------------------------------------------------------------------------------------

void run_semaphore(Input& in) {
  Block b(sizeof(proto::SemaphoreBlock));
  shm::semaphore_init(b.data, in.byte());
  auto* block = shm::semaphore_block(b.data, b.size);
  if (block == nullptr) std::abort();
  std::vector<std::uint32_t> index(4, proto::kNoMember);
  for (int op = 0; op < 256 && !in.empty(); ++op) {
    const std::uint8_t code = in.byte();
    const std::uint32_t number = (code >> 5) % index.size();
    switch (code % 8) {
      case 0:
        if (index[number] == proto::kNoMember) index[number] = shm::semaphore_join(*block, token_for(number));
        break;
      case 1: {
        const std::uint64_t v = in.u64();
        (void)shm::semaphore_raise(*block, v);
        (void)shm::semaphore_poison(*block, proto::atomic(block->value).load());
        break;
      }
      case 2:
        if (index[number] != proto::kNoMember) {
          (void)shm::semaphore_remove_member(
              *block, index[number], token_for(number),
              (in.byte() & 1) != 0 ? proto::PoisonReason::Closed : proto::PoisonReason::PeerDied);
          index[number] = proto::kNoMember;
        }
        break;
      default:
        scribble(b, in);
        break;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  switch (in.byte() % 4) {
    case 0:
      run_channel(in);
      break;
    case 1:
      run_pool(in);
      break;
    case 2:
      run_counting(in);
      break;
    default:
      run_semaphore(in);
      break;
  }
  return 0;
}
