#include "testkit/cuda/events.hpp"

#include "cuda/context.hpp"

namespace gpuipc::cuda {

Event Event::create(unsigned flags) {
  const DriverApi& api = driver();
  const CUcontext ctx = current_context();
  CUevent event = nullptr;
  check(api.cuEventCreate(&event, flags), "cuEventCreate", "new event");
  return Event(Created{event, ctx});
}

void Event::Release::operator()(const Created& created) const noexcept {
  release_in(
      created.ctx, "cuEventDestroy", [&](const DriverApi& api) { return api.cuEventDestroy(created.event); },
      [] { return "event"; });
}

void Event::record(CUstream stream) const { check(driver().cuEventRecord(get(), stream), "cuEventRecord", "event"); }

void Event::synchronize() const { event_synchronize(get()); }

bool Event::query() const {
  const CUresult r = driver().cuEventQuery(get());
  if (r == CUDA_ERROR_NOT_READY) return false;
  check(r, "cuEventQuery", "event");
  return true;
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0.0F;
  check(driver().cuEventElapsedTime(&ms, start.get(), end.get()), "cuEventElapsedTime", "event pair");
  return ms;
}

CUipcEventHandle ipc_get_event_handle(const Event& event) {
  const DriverApi& api = driver();
  if (api.cuIpcGetEventHandle == nullptr) {
    throw Error(ErrorCode::Unsupported, "this CUDA driver has no IPC events", "cuIpcGetEventHandle");
  }
  CUipcEventHandle h{};
  check(api.cuIpcGetEventHandle(&h, event.get()), "cuIpcGetEventHandle", "interprocess event");
  return h;
}

ImportedEvent ImportedEvent::open(const CUipcEventHandle& handle) {
  const DriverApi& api = driver();
  if (api.cuIpcOpenEventHandle == nullptr) {
    throw Error(ErrorCode::Unsupported, "this CUDA driver has no IPC events", "cuIpcOpenEventHandle");
  }
  CUevent event = nullptr;
  check(api.cuIpcOpenEventHandle(&event, handle), "cuIpcOpenEventHandle", "another process's event");
  return ImportedEvent(event);
}

void ImportedEvent::Release::operator()(CUevent event) const noexcept {
  release_in(
      nullptr, "cuEventDestroy", [&](const DriverApi& api) { return api.cuEventDestroy(event); },
      [] { return "imported event"; });
}

void stream_wait_event(CUstream stream, CUevent event) {
  check(driver().cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent", "stream");
}

void event_synchronize(CUevent event) { check(driver().cuEventSynchronize(event), "cuEventSynchronize", "event"); }

}  // namespace gpuipc::cuda
