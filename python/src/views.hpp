// ArrayView: a window on mapped segment or channel memory that keeps the mapping alive. Host views export the
// buffer protocol (NumPy wraps them without a copy); device views export DLPack and __cuda_array_interface__.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "common.hpp"

namespace gpuipc::py {

/// DLPack device types (dlpack.h DLDeviceType) that views use.
inline constexpr int kDLCPU = 1;
inline constexpr int kDLCUDA = 2;
inline constexpr int kDLCUDAHost = 3;
inline constexpr int kDLCUDAManaged = 13;

/// A DLPack element type (dlpack.h DLDataType): code (0 int, 1 uint, 2 float, 4 bfloat, 5 complex, 6 bool),
/// bits per lane, lanes.
struct ElementType {
  std::uint8_t code = 1;
  std::uint8_t bits = 8;
  std::uint16_t lanes = 1;
  std::size_t itemsize() const noexcept { return (static_cast<std::size_t>(bits) * lanes + 7) / 8; }
};

struct ArrayView {
  /// Keeps the memory mapped (a gpuipc::Segment sharing the mapping, or the channel that owns it). Never a Python
  /// object: DLPack deleters may run on threads that do not hold the GIL.
  std::shared_ptr<const void> owner;
  std::uintptr_t address = 0;  ///< host address (kDLCPU) or device address (kDLCUDA)
  std::size_t nbytes = 0;
  bool readonly = false;
  int device_type = kDLCPU;
  int device_id = 0;
  ElementType dtype;                ///< bytes (uint8) unless typed
  std::vector<std::int64_t> shape;  ///< {nbytes} unless typed
  std::vector<std::int64_t> strides;  ///< in elements; empty: C-contiguous
  std::string typestr = "|u1";      ///< __cuda_array_interface__ typestr
  LiveCount<Live::ArrayView> counted;

  /// An untyped (bytes) view of [address, address + nbytes).
  static ArrayView bytes(std::shared_ptr<const void> owner, std::uintptr_t address, std::size_t nbytes, bool readonly,
                         int device_type, int device_id);
};

/// The DLPack element type (code, bits, lanes) checked: InvalidArgument when a field is out of range or it has zero
/// bits.
ElementType element_type(std::tuple<int, int, int> element);

/// The bytes a strided array spans from its first element: `shape` and `strides` (in elements) of `item`-byte
/// elements; 0 when it is empty. InvalidArgument for lengths that differ, a negative dimension or stride, or a span
/// that does not fit 64 bits.
std::size_t strided_span(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, std::size_t item);

/// A typed view of `v`: elements of `element` (DLPack code, bits, lanes; `typestr` for __cuda_array_interface__),
/// `shape` and `strides` (in elements) from byte `offset`. InvalidArgument when it does not fit in `v`.
ArrayView strided_view(const ArrayView& v, std::tuple<int, int, int> element, const std::string& typestr,
                       const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& strides,
                       std::size_t offset);

/// A DLPack capsule of the array at `address` (`shape`, `strides` in elements, empty strides: C-contiguous) that owns
/// `owner` until its consumer deletes it: "dltensor_versioned" (which carries `readonly`) when `versioned`, else the
/// legacy "dltensor". One allocation besides the capsule for up to 4 dimensions (tensors_of_index makes one per
/// tensor of a state dict).
nb::object dlpack_capsule(std::shared_ptr<const void> owner, std::uintptr_t address, int device_type, int device_id,
                          ElementType dtype, std::span<const std::int64_t> shape, std::span<const std::int64_t> strides,
                          bool readonly, bool versioned);

/// A DLPack capsule of `v` ("dltensor_versioned" when `max_version` >= 1.0, else the legacy "dltensor"), owning a
/// copy of `v.owner`. `copy` true and a `dl_device` other than the view's raise BufferError.
nb::object dlpack_export(const ArrayView& v, nb::handle stream, std::optional<std::tuple<int, int>> max_version,
                         std::optional<std::tuple<int, int>> dl_device, std::optional<bool> copy);

}  // namespace gpuipc::py
