// Pausing a pool (its memory released, optionally its blocks' contents saved) and resuming it, and refresh() of a
// member that mapped chunks before a pause (docs/pools.md). Part of Pool (gpuipc/pool.hpp, core/pool_impl.hpp).
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "base/format.hpp"
#include "base/log.hpp"
#include "core/pool_impl.hpp"
#include "cuda/context.hpp"
#include "cuda/host_registration.hpp"
#include "cuda/stream_ops.hpp"
#include "cuda/trace.hpp"
#include "gpuipc/pool.hpp"
#include "os/identity.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc {

using pool_detail::kLockTimeout;
using proto::atomic;

namespace {

/// The chunks that exist (Ready) now.
std::vector<std::uint32_t> ready_chunks(const shm::PoolBlock& b) {
  std::vector<std::uint32_t> out;
  for (std::uint32_t c = 0; c < b.geometry().max_chunks; ++c) {
    if (atomic(b.header().chunks[c].state).load() == static_cast<std::uint32_t>(shm::ChunkState::Ready))
      out.push_back(c);
  }
  return out;
}

/// Waits until no chunk is being made. A member (or a thread of this process) that reserved a chunk before this
/// pause began makes it afterwards: made after the pause's look at the chunks, it kept its memory while the pool
/// read paused. None begins now (allocate refuses a pool that is not active), and a maker that dies is repaired (its
/// chunk goes back to Absent). Throws Timeout after kChunkWait.
void wait_for_chunks_in_making(const Pool::Impl& im) {
  const auto deadline = std::chrono::steady_clock::now() + pool_detail::kChunkWait;
  for (;;) {
    std::optional<std::uint32_t> making;
    for (std::uint32_t c = 0; c < im.block.geometry().max_chunks && !making; ++c) {
      if (atomic(im.block.header().chunks[c].state).load() == static_cast<std::uint32_t>(shm::ChunkState::Creating)) {
        making = c;
      }
    }
    if (!making) return;
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(ErrorCode::Timeout,
                  fmt::format("pool '{}': pause refused: chunk {} is still being made by another member after {} s "
                              "(the pool stays active); try again",
                              im.name, *making,
                              std::chrono::duration_cast<std::chrono::seconds>(pool_detail::kChunkWait).count()),
                  "pause");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void check_writer(const Pool::Impl& im, std::string_view call) {
  im.check_here(call);
  if (im.access != Access::ReadWrite) {
    throw Error(ErrorCode::PermissionDenied,
                fmt::format("pool '{}': {} refused: this handle maps the pool read-only; only a member with write "
                            "access may pause or resume it (open it with access ReadWrite)",
                            im.name, call),
                std::string(call));
  }
}

}  // namespace

void Pool::pause(const PauseOptions& options) {
  GPUIPC_TRACE("gpuipc::Pool::pause");
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "pause on an empty Pool handle", "pause");
  auto& im = *m_impl;
  check_writer(im, "pause");
  if (im.kind == SegmentKind::HostPinned) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("pool '{}': host_pinned pools cannot be paused: their pages are pinned "
                            "(cuMemHostRegister) in every member that maps them, so releasing them would not return "
                            "the memory; use a device or host pool",
                            im.name),
                "pause");
  }
  std::lock_guard pause_lock(im.pause_mutex);
  const auto pid = static_cast<std::uint32_t>(os::current_pid());
  switch (im.block.begin_pause(im.member, pid, kLockTimeout)) {
    case shm::PoolStatus::Ok:
      break;
    case shm::PoolStatus::LockTimeout:
      throw im.lock_busy_error("pause");
    case shm::PoolStatus::Paused:
      throw im.paused_error("pause");
    default:
      throw Error(ErrorCode::InvalidArgument, fmt::format("pool '{}': cannot pause", im.name), "pause");
  }
  bool released = false;
  try {
    wait_for_chunks_in_making(im);
    const std::vector<std::uint32_t> ready = ready_chunks(im.block);
    const bool device = im.kind == SegmentKind::Device;
    std::lock_guard chunks_lock(im.chunks_mutex);
    for (const std::uint32_t c : ready) im.map_chunk_locked(c);
    std::optional<cuda::ScopedContext> scope;
    if (device) {
      scope.emplace(im.ctx.get());
      cuda::synchronize_context("waiting for this process's work before pausing the pool");
    }
    // A buffer an earlier pause kept (PauseOptions::keep_buffer) is reused when it is large enough.
    if (options.keep_contents) {
      im.saved.clear();
    } else {
      im.drop_saved();
    }
    im.keep_saved_buffer = options.keep_buffer;
    if (options.keep_contents) {
      std::vector<shm::OccupiedRange> ranges;
      ranges.reserve(im.geo().max_records);
      if (!im.block.occupied(ranges)) {
        throw Error(ErrorCode::System, fmt::format("pool '{}': cannot list its blocks", im.name), "pause");
      }
      std::uint64_t total = 0;
      for (const auto& r : ranges) {
        if (im.bases[r.chunk].load() == nullptr) continue;  // not a ready chunk (a record a repair has yet to undo)
        im.saved.push_back({r.chunk, r.begin, r.end - r.begin, total});
        total += r.end - r.begin;
      }
      if (im.saved_capacity() < total) im.drop_saved_buffer();
      if (total > 0 && device && im.saved_capacity() == 0) {
        try {
          im.saved_pinned = std::make_unique<cuda::PinnedHostBuffer>(total);
        } catch (const Error& e) {
          GPUIPC_LOG_INFO("pool '{}': no pinned host memory for the {} paused (saving in pageable memory): {}", im.name,
                          human_bytes(total), e.what());
        }
      }
      if (total > 0 && im.saved_capacity() == 0) im.saved_host = os::Mapping::anonymous(total);
      std::byte* dst = im.saved_data();
      for (const auto& r : im.saved) {
        const std::byte* src = im.bases[r.chunk].load() + r.offset;
        if (device) {
          cuda::copy_to_host(dst + r.at, reinterpret_cast<CUdeviceptr>(src), r.size);
        } else {
          std::memcpy(dst + r.at, src, r.size);
        }
      }
    }
    for (const std::uint32_t c : ready) {
      if (device) {
        // The broker's fd goes with the name once no process has the segment open; ours with the mapping. By id:
        // after Pool::unlink the name may stand for another pool's chunk.
        (void)detail::unlink_if_still_named(im.chunks[c]);
        released = true;
        im.unmap_chunk_locked(c);
      } else {
        released = true;
        os::discard_pages(im.chunks[c].data(), im.chunks[c].size());
      }
    }
  } catch (...) {
    if (!released) im.drop_saved();
    im.block.end_pause(im.member, released);
    throw;
  }
  im.block.end_pause(im.member, true);
}

void Pool::resume() {
  GPUIPC_TRACE("gpuipc::Pool::resume");
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "resume on an empty Pool handle", "resume");
  auto& im = *m_impl;
  check_writer(im, "resume");
  std::lock_guard pause_lock(im.pause_mutex);
  const auto pid = static_cast<std::uint32_t>(os::current_pid());
  switch (im.block.begin_resume(im.member, pid, kLockTimeout)) {
    case shm::PoolStatus::Ok:
      break;
    case shm::PoolStatus::LockTimeout:
      throw im.lock_busy_error("resume");
    case shm::PoolStatus::NotPaused: {
      const auto p = im.block.pause_info();
      if (p.state == shm::PauseState::Active) {
        throw Error(ErrorCode::InvalidState, fmt::format("pool '{}': resume refused: it is not paused", im.name),
                    "resume");
      }
      throw Error(
          ErrorCode::InvalidState,
          fmt::format("pool '{}': resume refused: it is {} through another handle (of pid {}); only that "
                      "handle may resume it (any writer may once it is closed, or its process gone)",
                      im.name, p.state == shm::PauseState::Paused ? "paused" : "being paused or resumed", p.pid),
          "resume");
    }
    default:
      throw Error(ErrorCode::InvalidArgument, fmt::format("pool '{}': cannot resume", im.name), "resume");
  }
  const bool device = im.kind == SegmentKind::Device;
  std::vector<std::uint32_t> made;  // device chunks this attempt backed with new memory
  try {
    const std::uint64_t epoch = im.block.pause_info().epoch;
    std::lock_guard chunks_lock(im.chunks_mutex);
    std::optional<cuda::ScopedContext> scope;
    if (device) scope.emplace(im.ctx.get());
    for (const std::uint32_t c : ready_chunks(im.block)) {
      if (device) {
        im.unmap_chunk_locked(c);  // a mapping of released memory (this process did not pause the pool)
        im.create_chunk_locked(c, epoch);
        made.push_back(c);
      } else if (im.bases[c].load() != nullptr) {
        im.mapped_epoch[c].store(epoch);  // the memfd stayed; only its pages went
      }
    }
    const std::byte* src = im.saved_data();
    for (const auto& r : im.saved) {
      std::byte* dst = im.map_chunk_locked(r.chunk) + r.offset;
      if (device) {
        cuda::copy_to_device(reinterpret_cast<CUdeviceptr>(dst), src + r.at, r.size);
      } else {
        std::memcpy(dst, src + r.at, r.size);
      }
    }
  } catch (...) {
    // Back to paused, so the new memory goes too (a paused pool holds none; a later resume makes it again).
    try {
      std::lock_guard chunks_lock(im.chunks_mutex);
      std::optional<cuda::ScopedContext> scope;
      if (device && !made.empty()) scope.emplace(im.ctx.get());
      for (const std::uint32_t c : made) {
        (void)detail::unlink_if_still_named(im.chunks[c]);
        im.unmap_chunk_locked(c);
      }
    } catch (const std::exception& e) {
      GPUIPC_LOG_WARN("pool '{}': memory made by a failed resume stays until the next resume: {}", im.name, e.what());
    }
    im.block.end_resume(im.member, false);
    throw;
  }
  if (im.keep_saved_buffer) {
    im.saved.clear();  // the buffer stays, for the next pause
  } else {
    im.drop_saved();
  }
  im.block.end_resume(im.member, true);
}

bool Pool::paused() const noexcept { return m_impl && m_impl->block.pause_info().state != shm::PauseState::Active; }

void Pool::refresh() {
  GPUIPC_TRACE("gpuipc::Pool::refresh");
  if (!m_impl) throw Error(ErrorCode::InvalidArgument, "refresh on an empty Pool handle", "refresh");
  auto& im = *m_impl;
  std::lock_guard chunks_lock(im.chunks_mutex);
  const auto p = im.block.pause_info();
  const bool active = p.state == shm::PauseState::Active;
  for (std::uint32_t c = 0; c < im.geo().max_chunks; ++c) {
    const std::uint64_t mapped = im.mapped_epoch[c].load();
    if (im.bases[c].load() == nullptr || mapped == pool_detail::kUnmapped || mapped == p.epoch) continue;
    if (im.kind == SegmentKind::Device) {
      im.unmap_chunk_locked(c);  // frees the old memory, once no other process maps it
      if (active) im.map_chunk_locked(c);
    } else {
      im.mapped_epoch[c].store(active ? p.epoch : pool_detail::kUnmapped);
    }
  }
}

}  // namespace gpuipc
