#include "gpuipc/version.hpp"

#include "proto/messages.hpp"

namespace gpuipc {

const char* version() noexcept { return GPUIPC_VERSION_STRING; }

unsigned protocol_version() noexcept { return proto::kVersion; }

}  // namespace gpuipc
