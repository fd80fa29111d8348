// Events across processes (cuIpc*EventHandle) and event waits in stream order: the legacy cross-process
// synchronisation that gpuipc's semaphores replace, kept for the benchmarks that compare the two.
#pragma once

#include <cuda.h>

#include "cuda/resources.hpp"

namespace gpuipc::cuda {

/// cuIpcGetEventHandle of an event created with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING. Throws Error.
CUipcEventHandle ipc_get_event_handle(const Event& event);

/// Another process's event opened with cuIpcOpenEventHandle; cuEventDestroy on destruction. Move-only.
class ImportedEvent {
 public:
  ImportedEvent() noexcept = default;
  /// Throws Error(Cuda), Error(Unsupported) when the driver lacks IPC events.
  static ImportedEvent open(const CUipcEventHandle& handle);
  ImportedEvent(const ImportedEvent&) = delete;
  ImportedEvent& operator=(const ImportedEvent&) = delete;
  ImportedEvent(ImportedEvent&& other) noexcept;
  ImportedEvent& operator=(ImportedEvent&& other) noexcept;
  ~ImportedEvent();
  CUevent get() const noexcept { return m_event; }

 private:
  explicit ImportedEvent(CUevent e) noexcept : m_event(e) {}
  CUevent m_event = nullptr;
};

/// cuStreamWaitEvent(stream, event, 0). Throws Error.
void stream_wait_event(CUstream stream, CUevent event);

/// cuEventSynchronize of any event (own or imported). Throws Error.
void event_synchronize(CUevent event);

}  // namespace gpuipc::cuda
