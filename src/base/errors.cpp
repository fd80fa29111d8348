// gpuipc::Error and the names of ErrorCode and Status (gpuipc/error.hpp), and the errno helpers of base/errors.hpp.
#include "base/errors.hpp"

#include <fmt/format.h>

#include <cstring>

#include "gpuipc/error.hpp"

namespace gpuipc {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::InvalidArgument: return "InvalidArgument";
    case ErrorCode::NotFound: return "NotFound";
    case ErrorCode::AlreadyExists: return "AlreadyExists";
    case ErrorCode::PermissionDenied: return "PermissionDenied";
    case ErrorCode::QuotaExceeded: return "QuotaExceeded";
    case ErrorCode::PeerDied: return "PeerDied";
    case ErrorCode::Timeout: return "Timeout";
    case ErrorCode::Interrupted: return "Interrupted";
    case ErrorCode::NoDriver: return "NoDriver";
    case ErrorCode::NoDevice: return "NoDevice";
    case ErrorCode::Unsupported: return "Unsupported";
    case ErrorCode::Cuda: return "Cuda";
    case ErrorCode::System: return "System";
    case ErrorCode::Protocol: return "Protocol";
    case ErrorCode::InvalidState:
      return "InvalidState";
  }
  return "Unknown";
}

std::string_view to_string(Status status) noexcept {
  switch (status) {
    case Status::Ok: return "Ok";
    case Status::Timeout: return "Timeout";
    case Status::PeerDied: return "PeerDied";
    case Status::Interrupted: return "Interrupted";
    case Status::Closed: return "Closed";
    case Status::InvalidState: return "InvalidState";
    case Status::DriverError: return "DriverError";
    case Status::WouldBlock: return "WouldBlock";
  }
  return "Unknown";
}

Error::Error(ErrorCode code, const std::string& message, std::string call, int sys_errno, int cu_result)
    : std::runtime_error(message), m_code(code), m_errno(sys_errno), m_cu_result(cu_result), m_call(std::move(call)) {}

ErrorCode error_code_from_errno(int err) noexcept {
  switch (err) {
    case ENOENT: return ErrorCode::NotFound;
    case EEXIST: return ErrorCode::AlreadyExists;
    case EACCES:
    case EPERM: return ErrorCode::PermissionDenied;
    case EINVAL:
    case ENAMETOOLONG: return ErrorCode::InvalidArgument;
    case ETIMEDOUT: return ErrorCode::Timeout;
    case EINTR: return ErrorCode::Interrupted;
    case EPIPE:
    case ECONNRESET: return ErrorCode::PeerDied;
    case EDQUOT: return ErrorCode::QuotaExceeded;
    default: return ErrorCode::System;
  }
}

Error system_error(std::string_view call, std::string_view what, int err) {
  return Error(error_code_from_errno(err), fmt::format("{}: {} failed: {} (errno {})", what, call, std::strerror(err), err),
               std::string(call), err);
}

}  // namespace gpuipc
