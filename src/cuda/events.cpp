#include "cuda/events.hpp"

#include <utility>

#include "base/log.hpp"
#include "cuda/driver.hpp"

namespace gpuipc::cuda {

CUipcEventHandle ipc_get_event_handle(const Event& event) {
  const auto& d = driver();
  if (d.cuIpcGetEventHandle == nullptr) {
    throw Error(ErrorCode::Unsupported, "this CUDA driver has no IPC events", "cuIpcGetEventHandle");
  }
  CUipcEventHandle h{};
  check(d.cuIpcGetEventHandle(&h, event.get()), "cuIpcGetEventHandle", "interprocess event");
  return h;
}

ImportedEvent ImportedEvent::open(const CUipcEventHandle& handle) {
  const auto& d = driver();
  if (d.cuIpcOpenEventHandle == nullptr) {
    throw Error(ErrorCode::Unsupported, "this CUDA driver has no IPC events", "cuIpcOpenEventHandle");
  }
  CUevent e = nullptr;
  check(d.cuIpcOpenEventHandle(&e, handle), "cuIpcOpenEventHandle", "another process's event");
  return ImportedEvent(e);
}

ImportedEvent::ImportedEvent(ImportedEvent&& other) noexcept : m_event(std::exchange(other.m_event, nullptr)) {}

ImportedEvent& ImportedEvent::operator=(ImportedEvent&& other) noexcept {
  if (this != &other) {
    ImportedEvent tmp(std::move(*this));
    m_event = std::exchange(other.m_event, nullptr);
  }
  return *this;
}

ImportedEvent::~ImportedEvent() {
  if (m_event == nullptr) return;
  if (const auto* d = loaded_driver()) {
    if (const CUresult r = d->cuEventDestroy(m_event); r != CUDA_SUCCESS) {
      GPUIPC_LOG_WARN("cuEventDestroy of an imported event failed: {}", result_name(r));
    }
  }
}

void stream_wait_event(CUstream stream, CUevent event) {
  check(driver().cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent", "stream");
}

void event_synchronize(CUevent event) { check(driver().cuEventSynchronize(event), "cuEventSynchronize", "event"); }

}  // namespace gpuipc::cuda
