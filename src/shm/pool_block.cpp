#include "shm/pool_block.hpp"

#include <algorithm>
#include <cstring>
#include <thread>

#include "os/futex.hpp"

namespace gpuipc::shm {

using proto::atomic;

namespace {

template <typename T>
T load(T& word) noexcept {
  return atomic(word).load(std::memory_order_acquire);
}
template <typename T>
void store(T& word, T value) noexcept {
  atomic(word).store(value, std::memory_order_release);
}

RecordState state_of(BlockRecord& r) noexcept { return static_cast<RecordState>(load(r.state)); }
void set_state(BlockRecord& r, RecordState s) noexcept { store(r.state, static_cast<std::uint32_t>(s)); }
ChunkState state_of(PoolChunk& c) noexcept { return static_cast<ChunkState>(load(c.state)); }
void set_state(PoolChunk& c, ChunkState s) noexcept { store(c.state, static_cast<std::uint32_t>(s)); }

constexpr std::uint32_t pause_word(PauseState s, std::uint32_t member) noexcept {
  return static_cast<std::uint32_t>(s) | ((member & 0xFFU) << 8);
}
constexpr PauseState pause_state_of(std::uint32_t word) noexcept { return static_cast<PauseState>(word & 0xFFU); }
constexpr std::uint32_t pauser_of(std::uint32_t word) noexcept { return (word >> 8) & 0xFFU; }

constexpr std::uint64_t align_up(std::uint64_t v, std::uint64_t a) noexcept { return (v + a - 1) & ~(a - 1); }
constexpr std::uint64_t bit(std::uint32_t member) noexcept { return std::uint64_t{1} << member; }

void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

void wake(std::uint32_t& word) noexcept {
  atomic(word).fetch_add(1, std::memory_order_acq_rel);
  try {
    os::futex_wake(reinterpret_cast<const std::atomic<std::uint32_t>*>(&word));  // NOLINT: same-size atomic view
  } catch (...) {  // NOLINT(bugprone-empty-catch): waiters also poll with a bounded sleep
  }
}

}  // namespace

std::uint32_t pool_version_of(const void* control, std::size_t size) noexcept {
  if (control == nullptr || size < sizeof(PoolHeader)) return 0;
  auto& h = *static_cast<PoolHeader*>(const_cast<void*>(control));
  return load(h.magic) == kPoolMagic ? load(h.version) : 0;
}

bool read_geometry(const void* control, std::size_t size, PoolGeometry& out) noexcept {
  if (control == nullptr || size < sizeof(PoolHeader)) return false;
  auto& h = *static_cast<PoolHeader*>(const_cast<void*>(control));
  if (load(h.magic) != kPoolMagic || load(h.version) != kPoolVersion) return false;
  PoolGeometry g;
  g.pool_id = load(h.pool_id);
  g.mode = static_cast<PoolMode>(load(h.mode));
  g.kind = load(h.kind);
  g.device = load(h.device);
  std::memcpy(g.device_uuid.data(), h.device_uuid, sizeof h.device_uuid);  // written once, before the magic
  g.max_chunks = load(h.max_chunks);
  g.chunk_bytes = load(h.chunk_bytes);
  g.block_bytes = load(h.block_bytes);
  g.max_records = load(h.max_records);
  if (g.mode != PoolMode::Variable && g.mode != PoolMode::Fixed) return false;
  if (g.max_chunks == 0 || g.max_chunks > kMaxChunks || g.max_records == 0 || g.max_records > kMaxRecords) return false;
  if (g.chunk_bytes == 0 || g.chunk_bytes > (std::uint64_t{1} << 40)) return false;
  if (pool_control_bytes(g.max_records) > size) return false;
  if (g.mode == PoolMode::Fixed &&
      (g.max_chunks != 1 || g.block_bytes == 0 || g.block_bytes > g.chunk_bytes / g.max_records)) {
    return false;
  }
  out = g;
  return true;
}

void init_pool(void* control, const PoolGeometry& g) noexcept {
  auto& h = *static_cast<PoolHeader*>(control);
  h.pool_id = g.pool_id;
  h.mode = static_cast<std::uint32_t>(g.mode);
  h.kind = g.kind;
  h.device = g.device;
  std::memcpy(h.device_uuid, g.device_uuid.data(), sizeof h.device_uuid);
  h.max_chunks = g.max_chunks;
  h.chunk_bytes = g.chunk_bytes;
  h.block_bytes = g.block_bytes;
  h.max_records = g.max_records;
  h.next_generation = 1;
  auto* records = reinterpret_cast<BlockRecord*>(static_cast<std::byte*>(control) + sizeof(PoolHeader));
  for (std::uint32_t i = 0; i < g.max_records; ++i) records[i].releaser = proto::kNoMember;
  h.version = kPoolVersion;
  store(h.magic, kPoolMagic);
}

PoolBlock::PoolBlock(void* control, std::size_t size) noexcept {
  if (!read_geometry(control, size, m_geo)) return;
  m_header = static_cast<PoolHeader*>(control);
  m_records = reinterpret_cast<BlockRecord*>(static_cast<std::byte*>(control) + sizeof(PoolHeader));
}

bool PoolBlock::lock(std::uint32_t owner, std::chrono::nanoseconds timeout, std::uint32_t breakable) noexcept {
  auto w = atomic(m_header->lock);
  const std::uint32_t me = owner + 1;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (std::uint32_t i = 0;; ++i) {
    std::uint32_t cur = 0;
    // The member being removed died holding the lock: the repair takes it over (it holds the same value).
    if (w.compare_exchange_weak(cur, me, std::memory_order_acq_rel) ||
        (breakable != proto::kNoMember && cur == breakable + 1 && owner == breakable)) {
      if (load(m_header->deferred) != 0) remove_deferred();
      return true;
    }
    if (i % 64 == 63 && std::chrono::steady_clock::now() >= deadline) return false;
    if (i < 2048) {
      pause();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

void PoolBlock::unlock() noexcept { store(m_header->lock, 0U); }

void PoolBlock::retire(BlockRecord& r) noexcept {
  const std::uint32_t releaser = load(r.releaser);
  atomic(m_header->frees).fetch_add(1, std::memory_order_relaxed);
  if (releaser != proto::kNoMember && load(r.released) < load(r.generation)) {
    set_state(r, RecordState::Draining);
    atomic(m_header->draining).fetch_add(1, std::memory_order_relaxed);
    return;
  }
  store(r.releaser, proto::kNoMember);
  set_unused(r);
  wake(m_header->wake_seq);
}

void PoolBlock::sweep_drained() noexcept {
  if (load(m_header->draining) == 0) return;
  std::uint32_t left = 0;
  const std::uint32_t end = record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = m_records[i];
    if (state_of(r) != RecordState::Draining) continue;
    if (load(r.released) >= load(r.generation)) {
      store(r.releaser, proto::kNoMember);
      set_unused(r);
    } else {
      ++left;
    }
  }
  store(m_header->draining, left);
}

std::uint32_t PoolBlock::record_end() const noexcept { return std::min(load(m_header->record_end), m_geo.max_records); }

bool PoolBlock::find_record(std::uint32_t& index) noexcept {
  const std::uint32_t n = m_geo.max_records;
  // The hint is the lowest record that may be unused (set_unused lowers it): the records in use stay packed at the
  // bottom. The search still goes round, so a hint too high never hides a free record.
  const std::uint32_t start = load(m_header->record_hint) % n;
  for (std::uint32_t k = 0; k < n; ++k) {
    const std::uint32_t i = (start + k) % n;
    if (state_of(m_records[i]) == RecordState::Unused) {
      if (load(m_header->record_end) <= i) store(m_header->record_end, i + 1);  // first: see PoolHeader
      set_state(m_records[i], RecordState::Claimed);
      store(m_header->record_hint, (i + 1) % n);
      index = i;
      return true;
    }
  }
  return false;
}

void PoolBlock::set_unused(BlockRecord& r) noexcept {
  set_state(r, RecordState::Unused);
  const auto i = static_cast<std::uint32_t>(&r - m_records);
  if (i < load(m_header->record_hint)) store(m_header->record_hint, i);
}

void PoolBlock::commit(std::uint32_t member, std::uint32_t index, std::uint32_t chunk, std::uint64_t offset,
                       std::uint64_t bytes, BlockLocation& out) noexcept {
  BlockRecord& r = m_records[index];
  PoolChunk& c = m_header->chunks[chunk];
  // The chunk's top first: a crash from here on leaves it too high (a hint) but never too low (an overlap).
  if (load(c.top) < offset + bytes) store(c.top, offset + bytes);
  const std::uint64_t gen = atomic(m_header->next_generation).fetch_add(1, std::memory_order_acq_rel);
  store(r.chunk, chunk);
  store(r.offset, offset);
  store(r.size, bytes);
  store(r.releaser, proto::kNoMember);
  store(r.holders, bit(member));
  store(r.generation, gen);
  set_state(r, RecordState::Live);
  atomic(m_header->allocations).fetch_add(1, std::memory_order_relaxed);
  out = BlockLocation{chunk, index, offset, bytes, gen};
}

PoolStatus PoolBlock::allocate_fixed(std::uint32_t member, std::uint64_t bytes, BlockLocation& out) noexcept {
  if (state_of(m_header->chunks[0]) != ChunkState::Ready) return PoolStatus::NoSpace;
  std::uint32_t index = 0;
  if (!find_record(index)) return PoolStatus::NoSpace;
  commit(member, index, 0, static_cast<std::uint64_t>(index) * m_geo.block_bytes, bytes, out);
  return PoolStatus::Ok;
}

bool PoolBlock::collect(std::vector<OccupiedRange>& scratch) const noexcept {
  scratch.clear();
  const std::uint32_t end = record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = m_records[i];
    const RecordState s = state_of(r);
    if (s != RecordState::Live && s != RecordState::Draining) continue;
    const std::uint32_t chunk = load(r.chunk);
    const std::uint64_t offset = load(r.offset);
    const std::uint64_t size = load(r.size);
    if (chunk >= m_geo.max_chunks || offset > m_geo.chunk_bytes || size > m_geo.chunk_bytes - offset) continue;
    if (scratch.size() == scratch.capacity()) return false;
    scratch.push_back(OccupiedRange{offset, offset + size, chunk});
  }
  std::sort(scratch.begin(), scratch.end(), [](const OccupiedRange& a, const OccupiedRange& b) {
    return a.chunk != b.chunk ? a.chunk < b.chunk : a.begin < b.begin;
  });
  return true;
}

PoolStatus PoolBlock::allocate_variable(std::uint32_t member, std::uint64_t bytes, std::uint64_t alignment,
                                        BlockLocation& out, std::vector<OccupiedRange>& scratch) noexcept {
  auto& chunks = m_header->chunks;
  // Bump first: past the top of a chunk nothing is occupied.
  for (std::uint32_t c = 0; c < m_geo.max_chunks; ++c) {
    if (state_of(chunks[c]) != ChunkState::Ready) continue;
    const std::uint64_t at = align_up(std::min(load(chunks[c].top), m_geo.chunk_bytes), alignment);
    if (at <= m_geo.chunk_bytes && bytes <= m_geo.chunk_bytes - at) {
      std::uint32_t index = 0;
      if (!find_record(index)) return PoolStatus::NoRecord;
      commit(member, index, c, at, bytes, out);
      return PoolStatus::Ok;
    }
  }
  // First fit over the gaps between occupied ranges (freed blocks coalesce by themselves: only occupied ranges
  // are recorded). Tops come down to the highest occupied byte on the way.
  if (!collect(scratch)) return PoolStatus::NoRecord;
  std::size_t k = 0;
  for (std::uint32_t c = 0; c < m_geo.max_chunks; ++c) {
    while (k < scratch.size() && scratch[k].chunk < c) ++k;
    if (state_of(chunks[c]) != ChunkState::Ready) continue;
    std::uint64_t cursor = 0;
    std::uint64_t found = UINT64_MAX;
    for (; k < scratch.size() && scratch[k].chunk == c; ++k) {
      const std::uint64_t at = align_up(cursor, alignment);
      if (found == UINT64_MAX && at <= scratch[k].begin && bytes <= scratch[k].begin - at) found = at;
      cursor = std::max(cursor, scratch[k].end);
    }
    store(chunks[c].top, cursor);
    const std::uint64_t at = align_up(cursor, alignment);
    if (found == UINT64_MAX && at <= m_geo.chunk_bytes && bytes <= m_geo.chunk_bytes - at) found = at;
    if (found != UINT64_MAX) {
      std::uint32_t index = 0;
      if (!find_record(index)) return PoolStatus::NoRecord;
      commit(member, index, c, found, bytes, out);
      return PoolStatus::Ok;
    }
  }
  return PoolStatus::NoSpace;
}

PoolStatus PoolBlock::allocate(std::uint32_t member, std::uint64_t bytes, std::uint64_t alignment, BlockLocation& out,
                               std::vector<OccupiedRange>& scratch, std::chrono::nanoseconds lock_timeout) noexcept {
  if (!valid() || member >= proto::kMaxMembers || bytes == 0 || alignment == 0 || (alignment & (alignment - 1)) != 0 ||
      bytes > m_geo.chunk_bytes) {
    return PoolStatus::Invalid;
  }
  if (m_geo.mode == PoolMode::Fixed && (bytes > m_geo.block_bytes || m_geo.block_bytes % alignment != 0)) {
    return PoolStatus::Invalid;
  }
  if (!lock(member, lock_timeout)) return PoolStatus::LockTimeout;
  if (pause_state_of(load(m_header->pause)) != PauseState::Active) {
    unlock();
    return PoolStatus::Paused;
  }
  PoolStatus st = PoolStatus::NoSpace;
  for (int pass = 0; pass < 2 && st != PoolStatus::Ok; ++pass) {
    if (pass == 1 && load(m_header->draining) == 0) break;
    sweep_drained();
    st = m_geo.mode == PoolMode::Fixed ? allocate_fixed(member, bytes, out)
                                       : allocate_variable(member, bytes, alignment, out, scratch);
  }
  if (st == PoolStatus::NoSpace && m_geo.mode == PoolMode::Variable) {
    // Grow: reserve the first absent chunk for this caller, unless another member is creating one.
    for (std::uint32_t c = 0; c < m_geo.max_chunks; ++c) {
      const ChunkState cs = state_of(m_header->chunks[c]);
      if (cs == ChunkState::Creating) {
        st = PoolStatus::ChunkBusy;
        break;
      }
      if (cs == ChunkState::Absent) {
        store(m_header->chunks[c].creator, member);
        store(m_header->chunks[c].bytes, m_geo.chunk_bytes);
        store(m_header->chunks[c].top, std::uint64_t{0});
        set_state(m_header->chunks[c], ChunkState::Creating);
        out = BlockLocation{};
        out.chunk = c;
        st = PoolStatus::NeedChunk;
        break;
      }
    }
  }
  unlock();
  return st;
}

void PoolBlock::chunk_created(std::uint32_t member, std::uint32_t chunk, bool ok) noexcept {
  if (!valid() || chunk >= m_geo.max_chunks) return;
  PoolChunk& c = m_header->chunks[chunk];
  std::uint32_t expected = static_cast<std::uint32_t>(ChunkState::Creating);
  if (load(c.creator) == member) {
    atomic(c.state).compare_exchange_strong(expected,
                                            static_cast<std::uint32_t>(ok ? ChunkState::Ready : ChunkState::Absent));
  }
  wake(m_header->wake_seq);
}

PoolStatus PoolBlock::check_live(const BlockLocation& loc) const noexcept {
  if (!valid() || loc.record >= m_geo.max_records || loc.chunk >= m_geo.max_chunks || loc.generation == 0) {
    return PoolStatus::Invalid;
  }
  BlockRecord& r = m_records[loc.record];
  if (state_of(r) != RecordState::Live || load(r.generation) != loc.generation || load(r.chunk) != loc.chunk ||
      load(r.offset) != loc.offset || load(r.size) != loc.size) {
    return PoolStatus::Stale;
  }
  if (state_of(m_header->chunks[loc.chunk]) != ChunkState::Ready || loc.offset > m_geo.chunk_bytes ||
      loc.size > m_geo.chunk_bytes - loc.offset) {
    return PoolStatus::Invalid;
  }
  // Generations are unique: the same generation still there means the fields read belong to it.
  return load(r.generation) == loc.generation && state_of(r) == RecordState::Live ? PoolStatus::Ok : PoolStatus::Stale;
}

PoolStatus PoolBlock::hold(std::uint32_t member, const BlockLocation& loc,
                           std::chrono::nanoseconds lock_timeout) noexcept {
  if (member >= proto::kMaxMembers) return PoolStatus::Invalid;
  if (const PoolStatus st = check_live(loc); st != PoolStatus::Ok) return st;
  if (!lock(member, lock_timeout)) return PoolStatus::LockTimeout;
  PoolStatus st = check_live(loc);
  if (st == PoolStatus::Ok && pause_state_of(load(m_header->pause)) != PauseState::Active) st = PoolStatus::Paused;
  if (st == PoolStatus::Ok) atomic(m_records[loc.record].holders).fetch_or(bit(member), std::memory_order_acq_rel);
  unlock();
  return st;
}

PoolStatus PoolBlock::release(std::uint32_t member, const BlockLocation& loc, bool pending_stream,
                              std::chrono::nanoseconds lock_timeout) noexcept {
  if (member >= proto::kMaxMembers) return PoolStatus::Invalid;
  if (const PoolStatus st = check_live(loc); st != PoolStatus::Ok) return st;
  if (!lock(member, lock_timeout)) return PoolStatus::LockTimeout;
  PoolStatus st = check_live(loc);
  BlockRecord& r = m_records[loc.record];
  if (st == PoolStatus::Ok && (load(r.holders) & bit(member)) == 0) st = PoolStatus::NotHeld;
  if (st == PoolStatus::Ok) {
    if (pending_stream) store(r.releaser, member);
    if ((atomic(r.holders).fetch_and(~bit(member), std::memory_order_acq_rel) & ~bit(member)) == 0) retire(r);
  }
  unlock();
  return st;
}

PauseInfo PoolBlock::pause_info() const noexcept {
  PauseInfo p;
  if (!valid()) return p;
  const std::uint32_t w = load(m_header->pause);
  p.state = pause_state_of(w);
  p.member = p.state == PauseState::Active ? kNoPauser : pauser_of(w);
  p.pid = load(m_header->pauser_pid);
  p.epoch = load(m_header->epoch);
  return p;
}

PoolStatus PoolBlock::begin_pause(std::uint32_t member, std::uint32_t pid,
                                  std::chrono::nanoseconds lock_timeout) noexcept {
  if (!valid() || member >= proto::kMaxMembers) return PoolStatus::Invalid;
  if (!lock(member, lock_timeout)) return PoolStatus::LockTimeout;
  PoolStatus st = PoolStatus::Paused;
  if (pause_state_of(load(m_header->pause)) == PauseState::Active) {
    store(m_header->pauser_pid, pid);
    store(m_header->pause, pause_word(PauseState::Pausing, member));
    st = PoolStatus::Ok;
  }
  unlock();
  return st;
}

void PoolBlock::end_pause(std::uint32_t member, bool released) noexcept {
  if (!valid()) return;
  std::uint32_t w = load(m_header->pause);
  if (pause_state_of(w) != PauseState::Pausing || pauser_of(w) != member) return;
  // The epoch moves on only once every chunk's memory is released (names unlinked): a member that read the old
  // epoch before mapping a chunk has a mapping of the old memory, and sees it stale.
  if (released) atomic(m_header->epoch).fetch_add(1, std::memory_order_acq_rel);
  const std::uint32_t next = released ? pause_word(PauseState::Paused, member) : 0U;
  atomic(m_header->pause).compare_exchange_strong(w, next, std::memory_order_acq_rel);
  wake(m_header->wake_seq);
}

PoolStatus PoolBlock::begin_resume(std::uint32_t member, std::uint32_t pid,
                                   std::chrono::nanoseconds lock_timeout) noexcept {
  if (!valid() || member >= proto::kMaxMembers) return PoolStatus::Invalid;
  if (!lock(member, lock_timeout)) return PoolStatus::LockTimeout;
  PoolStatus st = PoolStatus::NotPaused;
  const std::uint32_t w = load(m_header->pause);
  if (pause_state_of(w) == PauseState::Paused && (pauser_of(w) == member || pauser_of(w) == kNoPauser)) {
    store(m_header->pauser_pid, pid);
    store(m_header->pause, pause_word(PauseState::Resuming, member));
    st = PoolStatus::Ok;
  }
  unlock();
  return st;
}

void PoolBlock::end_resume(std::uint32_t member, bool ok) noexcept {
  if (!valid()) return;
  std::uint32_t w = load(m_header->pause);
  if (pause_state_of(w) != PauseState::Resuming || pauser_of(w) != member) return;
  // A failed resume released the memory it had made (its chunks' names unlinked): a member that mapped one of them
  // meanwhile, at this epoch, must see its mapping stale, as after a pause.
  if (!ok) atomic(m_header->epoch).fetch_add(1, std::memory_order_acq_rel);
  atomic(m_header->pause)
      .compare_exchange_strong(w, ok ? 0U : pause_word(PauseState::Paused, member), std::memory_order_acq_rel);
  wake(m_header->wake_seq);
}

bool PoolBlock::occupied(std::vector<OccupiedRange>& scratch) const noexcept {
  if (!valid() || !collect(scratch)) return false;
  std::size_t out = 0;
  for (std::size_t k = 0; k < scratch.size(); ++k) {
    if (out > 0 && scratch[out - 1].chunk == scratch[k].chunk && scratch[k].begin <= scratch[out - 1].end) {
      scratch[out - 1].end = std::max(scratch[out - 1].end, scratch[k].end);
    } else {
      scratch[out++] = scratch[k];
    }
  }
  scratch.resize(out);
  return true;
}

std::uint64_t PoolBlock::largest_free(std::vector<OccupiedRange>& scratch) const noexcept {
  if (!valid() || !collect(scratch)) return 0;
  std::uint64_t best = 0;
  std::size_t k = 0;
  for (std::uint32_t c = 0; c < m_geo.max_chunks; ++c) {
    std::uint64_t cursor = 0;
    for (; k < scratch.size() && scratch[k].chunk == c; ++k) {
      if (scratch[k].begin > cursor) best = std::max(best, scratch[k].begin - cursor);
      cursor = std::max(cursor, scratch[k].end);
    }
    if (state_of(m_header->chunks[c]) == ChunkState::Ready && m_geo.mode == PoolMode::Variable) {
      best = std::max(best, m_geo.chunk_bytes - std::min(cursor, m_geo.chunk_bytes));
    }
  }
  if (m_geo.mode == PoolMode::Fixed) {
    if (record_end() < m_geo.max_records) return m_geo.block_bytes;  // never claimed: unused
    for (std::uint32_t i = 0; i < m_geo.max_records; ++i) {
      if (state_of(m_records[i]) == RecordState::Unused) return m_geo.block_bytes;
    }
    return 0;
  }
  return best;
}

PoolCounts PoolBlock::counts() const noexcept {
  PoolCounts c;
  if (!valid()) return c;
  c.max_chunks = m_geo.max_chunks;
  c.max_bytes = m_geo.max_chunks * m_geo.chunk_bytes;
  for (std::uint32_t i = 0; i < m_geo.max_chunks; ++i) {
    if (state_of(m_header->chunks[i]) == ChunkState::Ready) ++c.chunks;
  }
  c.capacity_bytes = static_cast<std::uint64_t>(c.chunks) * m_geo.chunk_bytes;
  const std::uint32_t end = record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = m_records[i];
    const RecordState s = state_of(r);
    if (s != RecordState::Live && s != RecordState::Draining) continue;
    (s == RecordState::Live ? c.live_blocks : c.draining_blocks) += 1;
    c.used_bytes += m_geo.mode == PoolMode::Fixed ? m_geo.block_bytes : std::min(load(r.size), m_geo.chunk_bytes);
  }
  c.free_bytes = c.capacity_bytes - std::min(c.used_bytes, c.capacity_bytes);
  for (auto& m : m_header->members) c.members += load(m.token) != 0 ? 1U : 0U;
  c.allocations = load(m_header->allocations);
  c.frees = load(m_header->frees);
  const PauseInfo p = pause_info();
  c.state = static_cast<gpuipc::PoolState>(p.state);
  c.paused_by_pid = p.state == PauseState::Active ? 0 : p.pid;
  c.pauser_gone = p.state != PauseState::Active && p.member == kNoPauser;
  c.epoch = p.epoch;
  try {
    std::vector<OccupiedRange> scratch;
    scratch.reserve(m_geo.max_records);
    c.largest_free_block = largest_free(scratch);
  } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory: the statistic stays 0
  }
  return c;
}

int PoolBlock::remove_locked(std::uint64_t members, bool keep_pending_frees) noexcept {
  int released = 0;
  const auto removed = [members](std::uint32_t m) { return m < proto::kMaxMembers && (members & bit(m)) != 0; };
  const std::uint32_t end = record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = m_records[i];
    const RecordState s = state_of(r);
    // Its stream will never write `released` (the process is gone, or waited for its stream before leaving).
    if (!keep_pending_frees && removed(load(r.releaser))) {
      store(r.releaser, proto::kNoMember);
      if (s == RecordState::Draining) set_unused(r);
    }
    if (s != RecordState::Live || (load(r.holders) & members) == 0) continue;
    ++released;
    if ((atomic(r.holders).fetch_and(~members, std::memory_order_acq_rel) & ~members) == 0) retire(r);
  }
  for (std::uint32_t c = 0; c < m_geo.max_chunks; ++c) {
    PoolChunk& ch = m_header->chunks[c];
    if (state_of(ch) == ChunkState::Creating && removed(load(ch.creator))) set_state(ch, ChunkState::Absent);
  }
  // It paused the pool (or was pausing or resuming it): the pool stays paused, with no pauser, so that any member
  // may resume it; the contents it saved are gone with it. Memory it may have released: the epoch moves on.
  const std::uint32_t w = load(m_header->pause);
  if (pause_state_of(w) != PauseState::Active && removed(pauser_of(w))) {
    if (pause_state_of(w) == PauseState::Pausing) atomic(m_header->epoch).fetch_add(1, std::memory_order_acq_rel);
    store(m_header->pause, pause_word(PauseState::Paused, kNoPauser));
  }
  return released;
}

void PoolBlock::remove_deferred() noexcept {
  // All of them in one pass over the records: a pass each made a word that any member can write (all 64 bits set)
  // cost every lock holder, the broker's repairs included, 64 passes over up to kMaxRecords records.
  const std::uint64_t dead = load(m_header->deferred);
  remove_locked(dead);
  for (std::uint32_t m = 0; m < proto::kMaxMembers; ++m) {
    if ((dead & bit(m)) != 0) store(m_header->members[m].token, 0U);  // kept until now: nobody could claim it
  }
  atomic(m_header->deferred).fetch_and(~dead, std::memory_order_acq_rel);
}

int pool_remove_member(void* control, std::size_t size, std::uint32_t member_index, bool keep_pending_frees,
                       std::chrono::nanoseconds lock_wait) noexcept {
  PoolBlock b(control, size);
  if (!b.valid() || member_index >= proto::kMaxMembers) return -1;
  const bool dead_owner = load(b.m_header->lock) == member_index + 1;
  if (keep_pending_frees) {  // a live member: it holds no lock now, and its entry stays for the broker's removal
    if (!b.lock(member_index, lock_wait)) return -1;
    const int released = b.remove_locked(bit(member_index), true);
    b.unlock();
    wake(b.m_header->wake_seq);
    return released;
  }
  const bool deferred_before = load(b.m_header->deferred) != 0;
  if (!b.lock(member_index, deferred_before ? std::chrono::nanoseconds{0} : lock_wait, member_index)) {
    // The lock stays taken (most likely by another dead member whose repair comes next): whoever takes the lock
    // next finishes this removal, and frees the member's entry then.
    atomic(b.m_header->deferred).fetch_or(bit(member_index), std::memory_order_acq_rel);
    return -1;
  }
  if (dead_owner) {
    // It died inside a critical section: undo a half-made allocation, finish a half-made release.
    const std::uint32_t end = b.record_end();
    for (std::uint32_t i = 0; i < end; ++i) {
      BlockRecord& r = b.m_records[i];
      if (state_of(r) == RecordState::Claimed) b.set_unused(r);
      if (state_of(r) == RecordState::Live && load(r.holders) == 0) b.retire(r);
    }
  }
  const int released = b.remove_locked(bit(member_index));
  b.unlock();
  wake(b.m_header->wake_seq);
  return released;
}

bool pool_member_frees_pending(void* control, std::size_t size, std::uint32_t member_index) noexcept {
  const PoolBlock b(control, size);
  if (!b.valid() || member_index >= proto::kMaxMembers) return false;
  const std::uint32_t end = b.record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = b.record(i);
    if (load(r.releaser) == member_index && load(r.released) < load(r.generation)) return true;
  }
  return false;
}

std::vector<PendingFree> pool_member_pending_frees(void* control, std::size_t size, std::uint32_t member_index) {
  std::vector<PendingFree> out;
  const PoolBlock b(control, size);
  if (!b.valid() || member_index >= proto::kMaxMembers) return out;
  const std::uint32_t end = b.record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = b.record(i);
    const std::uint64_t generation = load(r.generation);
    if (load(r.releaser) == member_index && load(r.released) < generation) out.push_back({i, generation});
  }
  return out;
}

bool pool_frees_landed(void* control, std::size_t size, const std::vector<PendingFree>& frees) noexcept {
  const PoolBlock b(control, size);
  if (!b.valid()) return true;
  for (const PendingFree& f : frees) {
    if (f.index < b.geometry().max_records && load(b.record(f.index).released) < f.generation) return false;
  }
  return true;
}

std::uint64_t pool_members_with_frees_pending(void* control, std::size_t size) noexcept {
  const PoolBlock b(control, size);
  if (!b.valid()) return 0;
  std::uint64_t pending = 0;
  const std::uint32_t end = b.record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = b.record(i);
    const std::uint32_t member = load(r.releaser);
    if (member < proto::kMaxMembers && load(r.released) < load(r.generation)) pending |= bit(member);
  }
  return pending;
}

bool pool_member_uses_memory(void* control, std::size_t size, std::uint32_t member_index) noexcept {
  const PoolBlock b(control, size);
  if (!b.valid() || member_index >= proto::kMaxMembers) return false;
  const std::uint64_t mine = bit(member_index);
  const std::uint32_t end = b.record_end();
  for (std::uint32_t i = 0; i < end; ++i) {
    BlockRecord& r = b.record(i);
    const RecordState s = state_of(r);
    if (s == RecordState::Live && (load(r.holders) & mine) != 0) return true;
    if (s == RecordState::Draining && load(r.releaser) == member_index) return true;
  }
  return false;
}

}  // namespace gpuipc::shm
