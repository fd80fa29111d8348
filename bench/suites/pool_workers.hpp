// The processes of the pools suite (bench/suites/suite_pools.cpp). The producer is one long-lived worker (ServedWorker)
// that makes pools, blocks, legacy allocations and the state dict; each consumer is a fresh forked process that
// opens what the producer made and times it. Every body here runs in a child with its own CUDA context on GPU 0;
// the parent stays CUDA-free.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>

#include "served.hpp"

namespace gpuipc::bench::pools {

inline constexpr int kDevice = 0;
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
/// Blocks of the allocation and resolve measurements.
inline constexpr std::size_t kBlockBytes = kMiB;
/// Chunks of the resolve pool (the pool default), and the size of the raw legacy allocations beside them.
inline constexpr std::size_t kResolveChunkBytes = 64 * kMiB;
/// 1 MiB blocks the resolve pool holds in chunk 0 (a 64 MiB block fills chunk 1).
inline constexpr std::size_t kResolveBlocks = 32;
/// Sizes of the share_legacy_open measurement (as the segments suite's share_legacy_open_p50_us).
inline constexpr std::size_t kShareBytes = 2 * kMiB;

/// The producer's command handler. Commands (arguments -> reply):
///   alloc {kind, n, warmup, name}: a pool of that kind; n timed allocate + free of 1 MiB blocks ->
///     {alloc_us, free_us, total_us, stats}; the pool is unlinked after.
///   resolve_setup {name}: a device pool with kResolveBlocks 1 MiB blocks in chunk 0 and a 64 MiB block in chunk 1,
///     and two cuMemAlloc allocations of 64 MiB -> {refs: [hex], far_ref: hex, handles: [hex]}.
///   share_setup {prefix, n}: n + 1 shared and n raw 2 MiB cuMemAlloc allocations -> {warm, names, handles}.
///   statedict_setup {pool, index}: the state dict in one device pool, its index in a host segment ->
///     {create_ms, allocate_ms, fill_ms, publish_ms, total_ms, tensors, bytes, chunk_bytes}.
///   release {}: drops everything and unlinks every name it made.
CommandHandler make_producer();

/// A fresh consumer of the resolve pool: Pool::open, the first resolve (maps chunk 0), `cached_calls` resolves of
/// blocks in chunk 0 timed in groups of `group`, then the first resolve of chunk 1 ->
/// {open_us, first_us, cached_us: [per call, per group], far_us}.
nlohmann::json resolve_consumer(const std::string& pool, const nlohmann::json& setup, std::size_t cached_calls,
                                std::size_t group);
/// A fresh consumer of the raw legacy handles: cuIpcOpenMemHandle of the first (first in this process) and of the
/// second -> {first_us, second_us}.
nlohmann::json raw_consumer(const nlohmann::json& setup);
/// A fresh consumer of the shared allocations: opens `warm` (its broker connection), then times legacy opens of
/// `handles` and Segment::open of `names` -> {legacy_us, share_us}.
nlohmann::json share_consumer(const nlohmann::json& setup);
/// A fresh consumer of the state dict: from the index name to every tensor's device pointer, timed per step; the
/// content of every tensor checked (untimed); holds on every block (timed apart); then the same open again in this
/// process -> {open_ms, index_ms, pool_ms, first_resolve_ms, resolves_ms, hold_ms, reopen_ms}.
nlohmann::json statedict_consumer(const std::string& index);

}  // namespace gpuipc::bench::pools
