// Events: timing on the GPU, and the legacy cross-process synchronisation (cuIpc*EventHandle, event waits in
// stream order) that gpuipc's semaphores replace, kept for the benchmarks that compare the two. Part of testkit/
// (README.md there): not in libgpuipc.
#pragma once

#include <cuda.h>

#include "cuda/unique_handle.hpp"

namespace gpuipc::cuda {

/// An event of the current context; cuEventDestroy on destruction.
class Event {
 public:
  Event() noexcept = default;
  /// cuEventCreate(flags) (CU_EVENT_DEFAULT records timing; add CU_EVENT_DISABLE_TIMING for pure sync). Throws.
  static Event create(unsigned flags = CU_EVENT_DEFAULT);

  CUevent get() const noexcept { return m_owned.get().event; }
  void record(CUstream stream) const;
  void synchronize() const;
  /// True when the recorded work is done.
  bool query() const;
  /// Milliseconds between two recorded, completed events (cuEventElapsedTime). Throws Error(Cuda).
  static float elapsed_ms(const Event& start, const Event& end);
  explicit operator bool() const noexcept { return get() != nullptr; }

 private:
  struct Created {
    CUevent event = nullptr;
    CUcontext ctx = nullptr;
    bool operator==(const Created&) const = default;
  };
  struct Release {
    void operator()(const Created& created) const noexcept;
  };
  explicit Event(Created created) noexcept : m_owned(created) {}
  UniqueHandle<Created, Release> m_owned;
};

/// cuIpcGetEventHandle of an event created with CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING. Throws Error.
CUipcEventHandle ipc_get_event_handle(const Event& event);

/// Another process's event opened with cuIpcOpenEventHandle; cuEventDestroy on destruction. Move-only.
class ImportedEvent {
 public:
  ImportedEvent() noexcept = default;
  /// Throws Error(Cuda), Error(Unsupported) when the driver lacks IPC events.
  static ImportedEvent open(const CUipcEventHandle& handle);
  CUevent get() const noexcept { return m_owned.get(); }

 private:
  struct Release {
    void operator()(CUevent event) const noexcept;
  };
  explicit ImportedEvent(CUevent event) noexcept : m_owned(event) {}
  UniqueHandle<CUevent, Release> m_owned;
};

/// cuStreamWaitEvent(stream, event, 0). Throws Error.
void stream_wait_event(CUstream stream, CUevent event);

/// cuEventSynchronize of any event (own or imported). Throws Error.
void event_synchronize(CUevent event);

}  // namespace gpuipc::cuda
