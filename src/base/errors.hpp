// Helpers to build gpuipc::Error values from errno, for every layer.
#pragma once

#include <cerrno>
#include <string_view>

#include "gpuipc/error.hpp"

namespace gpuipc {

/// Maps an errno value to the ErrorCode a user would expect (ENOENT -> NotFound, EACCES -> PermissionDenied, ...).
ErrorCode error_code_from_errno(int err) noexcept;

/// An Error for a failed system call: "<what>: <call> failed: <strerror> (errno N)".
/// what: the object or purpose ("socket /run/user/1000/gpuipc/broker.sock"); call: "connect".
Error system_error(std::string_view call, std::string_view what, int err = errno);

/// Throws system_error(call, what, err).
[[noreturn]] inline void throw_system(std::string_view call, std::string_view what, int err = errno) {
  throw system_error(call, what, err);
}

}  // namespace gpuipc
