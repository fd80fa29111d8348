// The broker's side of adopted legacy memory (Kind::DeviceIpc): it cannot hold such memory alive (only the
// exporting process can), so it checks the record at Create and, when the exporter goes, removes the name and
// tells the openers through the record.
#include <fcntl.h>
#include <fmt/format.h>

#include <atomic>
#include <cstring>

#include "base/log.hpp"
#include "broker/registry.hpp"
#include "os/memfd.hpp"
#include "os/process.hpp"

namespace gpuipc::broker {

std::string adopt_device_ipc_record(const proto::Create& req, int fd, os::Mapping& out) {
  if (req.flags != 0 || req.view_size != 0) return "a device_ipc segment takes no flags and no view";
  try {
    // First a memfd that can still be sealed, so that nothing below asks another file's filesystem (FUSE) or
    // chmods another file: F_GET_SEALS fails on any other file, and a tmpfs file or a memfd made without
    // MFD_ALLOW_SEALING reports F_SEAL_SEAL (a root broker chmodded such a file of another user to 0600).
    if ((os::memfd_seals(fd) & F_SEAL_SEAL) != 0) {
      return "its record must be a memfd created with MFD_ALLOW_SEALING; this fd is sealed against sealing (a memfd "
             "without MFD_ALLOW_SEALING, or a tmpfs file)";
    }
    const std::size_t actual = os::fd_size(fd);
    if (actual != proto::kDeviceIpcRecordBytes) {
      return fmt::format("its record memfd is {} bytes, not {}", actual, proto::kDeviceIpcRecordBytes);
    }
    // Every opener gets the record read-only: one of another uid that could reopen it writable would rewrite the
    // handle the other openers open, or clear exporter_gone under them.
    if (auto why = keep_to_owner(fd); !why.empty()) return why;
    os::memfd_seal(fd, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
    out = os::Mapping::map(fd, proto::kDeviceIpcRecordBytes, true);
  } catch (const Error& e) {
    return fmt::format("its record must be a memfd created with MFD_ALLOW_SEALING: {}", e.what());
  }
  auto* record = static_cast<proto::DeviceIpcRecord*>(out.data());
  proto::DeviceIpcRecord copy{};
  std::memcpy(&copy, record, sizeof copy);
  std::string why = proto::check_device_ipc_record(copy, req.size, req.device);
  if (why.empty() && copy.exporter_gone != 0) why = "its record says the exporter is already gone";
  if (!why.empty()) out = os::Mapping();
  return why;
}

bool Registry::await_exporter(SegmentRecord& seg) {
  // (Its name, or the unlinked_key its exporter's Announce finds it by: an unlinked share that nobody held then ends.)
  if (seg.kind != proto::Kind::DeviceIpc || !seg.control || seg.journal_name().empty() || m_rejoin_grace_ns <= 0 ||
      seg.exporter_pid <= 0) {
    return false;
  }
  // A connection can close while its process lives on (the broker cut it, its library dropped it), and a broker
  // can die while it does: the memory lives as long as the process, so its openers keep it and its name stays for
  // the process to announce again. A killed process's connection closes before it exits: its share ends at the
  // exit, as a member's repair does.
  ProcessWatch process = watch_process(seg.exporter_pid, seg.exporter_start, seg.owner_uid);
  if (!process || exited(process)) return false;  // gone, or a process this broker cannot see
  GPUIPC_LOG_INFO(
      "segment '{}' id {}: its exporter (pid {}) is not connected but its process runs: the share ends "
      "once it exits, or in {} ms unless it announces it again",
      shown(seg), seg.id, seg.exporter_pid, m_rejoin_grace_ns / 1'000'000);
  seg.exporter_away =
      SegmentRecord::ExporterAway{std::move(process), seg.exporter_pid, os::monotonic_ns() + m_rejoin_grace_ns};
  seg.creator = 0;
  m_exiting.insert(seg.id);
  look_at_exiting_soon(seg);
  return true;
}

bool Registry::exporter_back_or_gone(SegmentRecord& seg, std::int64_t now_ns) {
  if (!seg.exporter_away) return false;
  const bool gone = exited(seg.exporter_away->process);
  if (!gone && now_ns < seg.exporter_away->back_by_ns) return false;
  if (!gone) {
    GPUIPC_LOG_INFO(
        "segment '{}' id {}: its exporter (pid {}) has neither announced it again nor exited within {} ms "
        "of losing its connection (it may have exec'd): the share ends",
        shown(seg), seg.id, seg.exporter_away->pid, m_rejoin_grace_ns / 1'000'000);
  }
  seg.exporter_away.reset();
  exporter_left(seg, proto::PoisonReason::PeerDied);
  return true;
}

void Registry::exporter_left(SegmentRecord& seg, proto::PoisonReason why) {
  if (seg.kind != proto::Kind::DeviceIpc || !seg.control) return;
  auto* record = static_cast<proto::DeviceIpcRecord*>(seg.control.data());
  std::atomic_ref<std::uint32_t>(record->exporter_gone).store(static_cast<std::uint32_t>(why),
                                                              std::memory_order_release);
  if (seg.name.empty()) return;
  GPUIPC_LOG_INFO("segment '{}' id {}: its exporter {}; legacy IPC memory dies with it, so the name goes",
                  seg.name, seg.id, why == proto::PoisonReason::PeerDied ? "is gone" : "dropped its share");
  m_names.erase(seg.name);
  m_journal.unlinked(seg.name);
  seg.name.clear();
  bump_names_generation();
}

}  // namespace gpuipc::broker
