#include "pool_workers.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "bench.hpp"
#include "cuda/context.hpp"
#include "cuda/vmm.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/pool.hpp"
#include "legacy_opens.hpp"
#include "pair.hpp"
#include "statedict.hpp"

namespace gpuipc::bench::pools {
namespace {

using json = nlohmann::json;

double ms_between(std::int64_t t0_ns, std::int64_t t1_ns) { return static_cast<double>(t1_ns - t0_ns) / 1e6; }

std::string ref_hex(const BlockRef& ref) {
  const auto bytes = encode_block_ref(ref);
  return pair::to_hex(bytes.data(), bytes.size());
}

BlockRef ref_of(const json& hex) {
  std::array<std::byte, kBlockRefBytes> bytes{};
  pair::from_hex("pools", hex.get<std::string>(), bytes.data(), bytes.size());
  return decode_block_ref(bytes);
}

CUdeviceptr device_address(const void* p) { return reinterpret_cast<CUdeviceptr>(p); }  // NOLINT: a device address

SegmentKind kind_of(const std::string& k) {
  if (k == "device") return SegmentKind::Device;
  if (k == "host_pinned") return SegmentKind::HostPinned;
  if (k == "host") return SegmentKind::Host;
  throw Error(ErrorCode::InvalidArgument, fmt::format("pools bench: unknown pool kind '{}'", k));
}

/// GPU 0's primary context, current on this thread (a fresh consumer that launches nothing).
struct Context {
  cuda::PrimaryContext ctx{kDevice};
  int made_current = (ctx.make_current(), 0);
};

class Producer {
 public:
  json handle(const std::string& cmd, const json& in) {
    if (cmd == "alloc") return alloc(in);
    if (cmd == "resolve_setup") return resolve_setup(in.at("name").get<std::string>());
    if (cmd == "share_setup") return share_setup(in.at("prefix").get<std::string>(), in.at("n").get<std::size_t>());
    if (cmd == "statedict_setup") {
      return statedict_setup(in.at("pool").get<std::string>(), in.at("index").get<std::string>());
    }
    if (cmd == "release") return release();
    throw Error(ErrorCode::Protocol, fmt::format("producer: unknown command '{}'", cmd));
  }

 private:
  json alloc(const json& in) {
    const auto kind = kind_of(in.at("kind").get<std::string>());
    const auto name = in.at("name").get<std::string>();
    const auto n = in.at("n").get<std::size_t>();
    const auto warmup = in.at("warmup").get<std::size_t>();
    Pool pool =
        Pool::create(name, {.kind = kind, .device = kDevice, .chunk_bytes = 64 * kMiB, .max_bytes = 1024 * kMiB});
    // Host pools free at once; the others free in stream order on an idle stream (cuStreamWriteValue64).
    const StreamHandle stream = kind == SegmentKind::Host ? nullptr : static_cast<StreamHandle>(m_gpu.stream.get());
    std::vector<double> alloc_us, free_us, total_us;
    for (std::size_t i = 0; i < warmup + n; ++i) {
      const auto t0 = now_ns();
      Block b = pool.allocate(kBlockBytes);
      const auto t1 = now_ns();
      pool.free(std::move(b), stream);
      const auto t2 = now_ns();
      if (i < warmup) continue;
      alloc_us.push_back(static_cast<double>(t1 - t0) / 1e3);
      free_us.push_back(static_cast<double>(t2 - t1) / 1e3);
      total_us.push_back(static_cast<double>(t2 - t0) / 1e3);
    }
    const PoolStats st = pool.stats();
    Pool::unlink(name);
    return {{"alloc_us", values_json(alloc_us)},
            {"free_us", values_json(free_us)},
            {"total_us", values_json(total_us)},
            {"chunks", st.chunks},
            {"allocations", st.allocations}};
  }

  json resolve_setup(const std::string& name) {
    m_resolve = made(Pool::create(name, {.kind = SegmentKind::Device,
                                         .device = kDevice,
                                         .chunk_bytes = kResolveChunkBytes,
                                         .max_bytes = 2 * kResolveChunkBytes}));
    json refs = json::array();
    for (std::size_t i = 0; i < kResolveBlocks; ++i) {
      m_blocks.push_back(m_resolve.allocate(kBlockBytes));
      refs.push_back(ref_hex(m_blocks.back().ref()));
    }
    // A block as large as a chunk cannot go into chunk 0 (half used): the pool adds chunk 1 for it.
    m_blocks.push_back(m_resolve.allocate(kResolveChunkBytes));
    if (m_blocks.back().ref().chunk != 1) {
      throw Error(ErrorCode::Protocol, "resolve_setup: the far block is not in chunk 1");
    }
    const json raw = m_legacy.alloc(kResolveChunkBytes, 2);
    return {{"refs", refs}, {"far_ref", ref_hex(m_blocks.back().ref())}, {"handles", raw.at("handles")}};
  }

  json share_setup(const std::string& prefix, std::size_t n) {
    json names = json::array();
    for (std::size_t i = 0; i < n; ++i) names.push_back(fmt::format("{}-{}", prefix, i));
    const std::string warm = prefix + "-warm";
    m_legacy.share(json::array({warm}), kShareBytes);
    m_legacy.share(names, kShareBytes);
    const json raw = m_legacy.alloc(kShareBytes, n);
    return {{"warm", warm}, {"names", names}, {"handles", raw.at("handles")}};
  }

  json statedict_setup(const std::string& pool, const std::string& index) {
    const auto tensors = statedict::make();
    const std::size_t total = statedict::total_bytes(tensors);
    const std::size_t chunk = cuda::round_up(total, cuda::allocation_granularity(kDevice, false));
    const auto t0 = now_ns();
    m_dict = made(Pool::create(pool, {.kind = SegmentKind::Device,
                                      .device = kDevice,
                                      .chunk_bytes = chunk,
                                      .max_bytes = chunk,
                                      .max_blocks = 1024}));
    const auto t1 = now_ns();
    std::vector<BlockRef> refs;
    for (const auto& t : tensors) {
      m_dict_blocks.push_back(m_dict.allocate(t.bytes()));
      refs.push_back(m_dict_blocks.back().ref());
    }
    const auto t2 = now_ns();
    const CUstream s = m_gpu.stream.get();
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      m_gpu.k.fill_pattern(s, device_address(m_dict_blocks[i].data()), tensors[i].bytes() / 4, i + 1);
    }
    m_gpu.stream.synchronize();
    const auto t3 = now_ns();
    m_index = Segment::create(index, statedict::index_bytes(tensors.size()), {.kind = SegmentKind::Host});
    m_names.push_back(index);
    statedict::write_index(m_index.data(), pool, tensors, refs);
    const auto t4 = now_ns();
    return {{"create_ms", ms_between(t0, t1)},
            {"allocate_ms", ms_between(t1, t2)},
            {"fill_ms", ms_between(t2, t3)},
            {"publish_ms", ms_between(t3, t4)},
            {"total_ms", ms_between(t0, t4)},
            {"tensors", tensors.size()},
            {"bytes", total},
            {"chunk_bytes", chunk},
            {"chunks", m_dict.stats().chunks}};
  }

  json release() {
    m_index = Segment();
    m_dict_blocks.clear();
    m_blocks.clear();
    m_dict = Pool();
    m_resolve = Pool();
    m_legacy = legacy::Exports();
    for (const auto& n : m_pools) Pool::unlink(n);
    for (const auto& n : m_names) Segment::unlink(n);
    m_pools.clear();
    m_names.clear();
    return json::object();
  }

  Pool made(Pool pool) {
    m_pools.push_back(pool.name());
    return pool;
  }

  // Declared first: destroyed last, after everything made in its context.
  Gpu m_gpu{kDevice};
  legacy::Exports m_legacy;
  Pool m_resolve, m_dict;
  std::vector<Block> m_blocks, m_dict_blocks;
  Segment m_index;
  std::vector<std::string> m_pools, m_names;  // to unlink
};

/// The steps of one open of the state dict, in milliseconds.
struct DictOpen {
  Segment index;
  Pool pool;
  std::vector<CUdeviceptr> ptrs;
  std::vector<BlockRef> refs;
  json ms;
};

DictOpen open_dict(const std::string& index_name) {
  DictOpen d;
  const auto t0 = now_ns();
  d.index = Segment::open(index_name);
  const auto& h = statedict::read_index(d.index.data(), d.index.size());
  const auto t1 = now_ns();
  d.pool = Pool::open(h.pool.data());
  const auto t2 = now_ns();
  d.ptrs.resize(h.count);
  d.refs.resize(h.count);
  d.refs[0] = statedict::entry(h, 0).ref;
  d.ptrs[0] = device_address(d.pool.resolve(d.refs[0]));
  const auto t3 = now_ns();
  for (std::size_t i = 1; i < h.count; ++i) {
    d.refs[i] = statedict::entry(h, i).ref;
    d.ptrs[i] = device_address(d.pool.resolve(d.refs[i]));
  }
  const auto t4 = now_ns();
  d.ms = {{"open_ms", ms_between(t0, t4)},
          {"index_ms", ms_between(t0, t1)},
          {"pool_ms", ms_between(t1, t2)},
          {"first_resolve_ms", ms_between(t2, t3)},
          {"resolves_ms", ms_between(t3, t4)}};
  return d;
}

}  // namespace

CommandHandler make_producer() {
  auto p = std::make_shared<Producer>();
  return [p](const std::string& cmd, const json& in, std::vector<os::UniqueFd>& /*fds*/) {
    return Reply{p->handle(cmd, in), {}};
  };
}

json resolve_consumer(const std::string& pool, const json& setup, std::size_t cached_calls, std::size_t group) {
  const Context c;
  std::vector<BlockRef> refs;
  for (const auto& h : setup.at("refs")) refs.push_back(ref_of(h));
  const BlockRef far = ref_of(setup.at("far_ref"));
  const auto t0 = now_ns();
  const Pool p = Pool::open(pool);
  const auto t1 = now_ns();
  auto* const base = static_cast<std::byte*>(p.resolve(refs[0]));
  const auto t2 = now_ns();
  // Mapping-cache hits: blocks of chunk 0, in turn. Timed in groups (a clock read costs ~20 ns).
  std::vector<double> cached;
  std::size_t k = 0, bad = 0;
  for (std::size_t g = 0; g < cached_calls / group; ++g) {
    const auto tg = now_ns();
    for (std::size_t j = 0; j < group; ++j, ++k) {
      const BlockRef& r = refs[k % refs.size()];
      bad += static_cast<std::byte*>(p.resolve(r)) != base + (r.offset - refs[0].offset) ? 1 : 0;
    }
    cached.push_back(us_since(tg) / static_cast<double>(group));
  }
  if (bad != 0) throw Error(ErrorCode::Protocol, fmt::format("resolve: {} cached resolves gave another address", bad));
  const auto t3 = now_ns();
  if (p.resolve(far) == nullptr) throw Error(ErrorCode::Protocol, "resolve: chunk 1 resolved to null");
  const auto t4 = now_ns();
  return {{"open_us", static_cast<double>(t1 - t0) / 1e3},
          {"first_us", static_cast<double>(t2 - t1) / 1e3},
          {"cached_us", values_json(cached)},
          {"far_us", static_cast<double>(t4 - t3) / 1e3}};
}

json raw_consumer(const json& setup) {
  const Context c;
  const auto us = legacy::time_legacy_opens(setup.at("handles"));
  return {{"first_us", us.at(0)}, {"second_us", us.at(1)}};
}

json share_consumer(const json& setup) {
  const Context c;
  legacy::time_share_opens(json::array({setup.at("warm")}));  // connects to the broker
  const auto legacy_us = legacy::time_legacy_opens(setup.at("handles"));
  const auto share_us = legacy::time_share_opens(setup.at("names"));
  return {{"legacy_us", values_json(legacy_us)}, {"share_us", values_json(share_us)}};
}

json statedict_consumer(const std::string& index) {
  Gpu gpu{kDevice};  // context, stream and kernels: made before the clock starts
  DictOpen d = open_dict(index);
  json out = d.ms;
  // Checked, untimed: the names and shapes are the generator's, every tensor holds its pattern.
  const auto tensors = statedict::make();
  const auto& h = statedict::read_index(d.index.data(), d.index.size());
  if (h.count != tensors.size()) throw Error(ErrorCode::Protocol, "statedict: the index has another tensor count");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& e = statedict::entry(h, i);
    if (tensors[i].name != e.name.data() || e.ndim != tensors[i].shape.size() || e.ref.size != tensors[i].bytes()) {
      throw Error(ErrorCode::Protocol, fmt::format("statedict: entry {} is not '{}' as generated", i, tensors[i].name));
    }
    const auto bad = gpu.k.count_mismatches(gpu.stream.get(), d.ptrs[i], tensors[i].bytes() / 4, i + 1);
    if (bad != 0) {
      throw Error(ErrorCode::Protocol,
                  fmt::format("statedict: {} words of '{}' differ from what the producer wrote", bad, tensors[i].name));
    }
  }
  // What holds on every block add (the consumer keeps the producer from reusing them).
  const auto t0 = now_ns();
  for (const auto& r : d.refs) d.pool.hold(r);
  out["hold_ms"] = ms_between(t0, now_ns());
  for (const auto& r : d.refs) d.pool.release(r);
  // Everything dropped, then opened again in this (now warm) process.
  d = DictOpen();
  out["reopen_ms"] = open_dict(index).ms.at("open_ms");
  return out;
}

}  // namespace gpuipc::bench::pools
