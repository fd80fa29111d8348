// gpuipc: the one exception type of the setup API, and the status values of the hot path.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace gpuipc {

/// What went wrong, independent of the layer that noticed it. Stable: the Python module maps each to a class.
enum class ErrorCode : std::uint8_t {
  InvalidArgument = 1,  ///< a caller-supplied value is out of range or malformed
  NotFound,             ///< no such segment, semaphore, channel, device or file
  AlreadyExists,        ///< create of a name that is taken
  PermissionDenied,     ///< the mode bits or uid/gid of the object refuse this caller
  QuotaExceeded,        ///< a per-uid limit of bytes or objects would be exceeded
  PeerDied,             ///< the other side of a semaphore or channel is gone
  Timeout,              ///< a blocking call ran out of time
  Interrupted,          ///< a blocking call was interrupted by a signal the caller wants to see
  NoDriver,             ///< libcuda.so.1 could not be loaded or initialised
  NoDevice,             ///< the driver works but there is no (such) GPU
  Unsupported,          ///< the device or driver lacks a needed capability
  Cuda,                 ///< a CUDA driver call failed
  System,               ///< a system call failed
  Protocol,             ///< a malformed or unexpected message on the broker socket
  InvalidState,         ///< the call does not fit the object's state now (a paused pool, a stale mapping)
};

/// The enumerator's name, e.g. "PermissionDenied".
std::string_view to_string(ErrorCode code) noexcept;

/// The exception thrown by every setup call (create, open, unlink, connect). what() is a complete sentence
/// that names the failing call and the object, and says what to do where there is something to do.
class Error : public std::runtime_error {
 public:
  /// call: the failing function ("connect", "cuMemCreate"); sys_errno / cu_result: 0 when not applicable.
  Error(ErrorCode code, const std::string& message, std::string call = {}, int sys_errno = 0, int cu_result = 0);

  ErrorCode code() const noexcept { return m_code; }
  /// errno of the failing system call, or 0.
  int sys_errno() const noexcept { return m_errno; }
  /// CUresult of the failing driver call, or 0.
  int cu_result() const noexcept { return m_cu_result; }
  /// Name of the failing call, or empty.
  const std::string& call() const noexcept { return m_call; }

 private:
  ErrorCode m_code;
  int m_errno;
  int m_cu_result;
  std::string m_call;
};

/// Result of a hot-path call (acquire, publish, receive, release, wait): these never throw or allocate.
enum class Status : std::uint8_t {
  Ok = 0,
  Timeout,       ///< nothing arrived before the deadline
  PeerDied,      ///< the peer is gone (the semaphore or channel is poisoned); drained data was delivered first
  Interrupted,   ///< a signal arrived and the caller asked to see it
  Closed,        ///< the channel was closed by its owner
  InvalidState,  ///< the call does not fit the object's state (release without receive, ...)
  DriverError,   ///< the CUDA driver refused a stream operation (bad stream, wrong context, no driver)
  WouldBlock,    ///< a zero timeout and nothing ready
};

/// The enumerator's name, e.g. "PeerDied".
std::string_view to_string(Status status) noexcept;

}  // namespace gpuipc
