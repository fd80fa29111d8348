#include "cuda/trace.hpp"

#include <nvtx3/nvToolsExt.h>

#include "base/config.hpp"
#include "base/log.hpp"

namespace gpuipc::trace {

namespace {

nvtxDomainHandle_t domain() noexcept {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA("gpuipc");
  return d;
}

}  // namespace

bool enabled() noexcept {  // NOLINT(bugprone-exception-escape): logging is noexcept in effect
  static const bool on = [] {
    try {
      return config::env_bool("GPUIPC_NVTX", true);
    } catch (const std::exception& e) {
      GPUIPC_LOG_WARN("{}: NVTX ranges stay on", e.what());
      return true;
    }
  }();
  return on;
}

Range::Range(const char* name) noexcept {
  if (!enabled()) return;
  nvtxEventAttributes_t a{};
  a.version = NVTX_VERSION;
  a.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  a.messageType = NVTX_MESSAGE_TYPE_ASCII;
  a.message.ascii = name;
  nvtxDomainRangePushEx(domain(), &a);
  m_open = true;
}

Range::~Range() {
  if (m_open) nvtxDomainRangePop(domain());
}

}  // namespace gpuipc::trace
