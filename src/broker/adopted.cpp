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

namespace gpuipc::broker {

std::string adopt_device_ipc_record(const proto::Create& req, int fd, os::Mapping& out) {
  if (req.flags != 0 || req.view_size != 0) return "a device_ipc segment takes no flags and no view";
  try {
    (void)os::memfd_seals(fd);  // first: a memfd, so nothing below asks another file's filesystem (FUSE)
    const std::size_t actual = os::fd_size(fd);
    if (actual != proto::kDeviceIpcRecordBytes) {
      return fmt::format("its record memfd is {} bytes, not {}", actual, proto::kDeviceIpcRecordBytes);
    }
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
