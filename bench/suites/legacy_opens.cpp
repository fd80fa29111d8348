#include "legacy_opens.hpp"

#include "bench.hpp"
#include "cuda/legacy_ipc.hpp"
#include "gpuipc/error.hpp"
#include "gpuipc/share.hpp"
#include "pair.hpp"

namespace gpuipc::bench::legacy {
namespace {

cuda::DeviceBuffer touched(std::size_t size) {
  auto buf = cuda::DeviceBuffer::allocate(size);
  cuda::memset_d8(buf.get(), 0xa5, size);  // physically touched, and not zeros
  return buf;
}

}  // namespace

nlohmann::json Exports::alloc(std::size_t size, std::size_t count) {
  nlohmann::json ids = nlohmann::json::array(), handles = nlohmann::json::array();
  for (std::size_t i = 0; i < count; ++i) {
    auto buf = touched(size);
    const CUipcMemHandle h = cuda::ipc_get_mem_handle(buf.get());
    const auto id = m_next_id++;
    m_buffers.emplace(id, std::move(buf));
    ids.push_back(id);
    handles.push_back(pair::to_hex(&h, sizeof h));
  }
  return {{"ids", ids}, {"handles", handles}};
}

void Exports::free(const nlohmann::json& ids) {
  for (const auto& id : ids) m_buffers.erase(id.get<std::uint64_t>());
}

void Exports::share(const nlohmann::json& names, std::size_t size) {
  for (const auto& n : names) {
    auto buf = touched(size);
    const auto name = n.get<std::string>();
    m_shares[name] = gpuipc::share(name, reinterpret_cast<void*>(buf.get()), size);  // NOLINT: a device address
    m_shared.push_back(std::move(buf));
  }
}

void Exports::unshare(const nlohmann::json& names) {
  // Dropping the exporter's handles ends the shares (the broker removes the names), then the memory goes.
  for (const auto& n : names) m_shares.erase(n.get<std::string>());
  m_shared.clear();
}

std::vector<double> time_legacy_opens(const nlohmann::json& handles) {
  std::vector<double> us;
  for (const auto& hex : handles) {
    CUipcMemHandle h{};
    pair::from_hex("legacy", hex.get<std::string>(), &h, sizeof h);
    const auto t0 = now_ns();
    auto mapping = cuda::IpcMapping::open(h);
    us.push_back(us_since(t0));
    if (!mapping) throw Error(ErrorCode::Cuda, "legacy_open: cuIpcOpenMemHandle gave a null pointer");
    mapping = cuda::IpcMapping();  // cuIpcCloseMemHandle, not timed
  }
  return us;
}

std::vector<double> time_share_opens(const nlohmann::json& names) {
  std::vector<double> us;
  for (const auto& n : names) {
    const auto t0 = now_ns();
    Segment seg = Segment::open(n.get<std::string>());
    us.push_back(us_since(t0));
    if (seg.kind() != SegmentKind::DeviceIpc || seg.device_pointer() == 0) {
      throw Error(ErrorCode::Protocol, "share_open: not a mapped device_ipc segment");
    }
    seg.close();  // cuIpcCloseMemHandle and the broker's Close: not timed
  }
  return us;
}

}  // namespace gpuipc::bench::legacy
