// The DLPack 1.0 ABI (https://dmlc.github.io/dlpack/latest/c_api.html): the structures exchanged in "dltensor" and
// "dltensor_versioned" capsules. Declared here rather than vendored: they are a fixed, versioned ABI.
#pragma once

#include <cstdint>

namespace gpuipc::py::dlpack {

struct Version {
  std::uint32_t major;
  std::uint32_t minor;
};

struct Device {
  std::int32_t device_type;
  std::int32_t device_id;
};

struct DataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};

struct Tensor {
  void* data;
  Device device;
  std::int32_t ndim;
  DataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;  ///< in elements; nullptr: compact row-major
  std::uint64_t byte_offset;
};

/// The pre-1.0 capsule payload ("dltensor").
struct ManagedTensor {
  Tensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(ManagedTensor* self);
};

/// The 1.0 capsule payload ("dltensor_versioned").
struct ManagedTensorVersioned {
  Version version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  std::uint64_t flags;
  Tensor dl_tensor;
};

inline constexpr std::uint32_t kMajorVersion = 1;
inline constexpr std::uint32_t kMinorVersion = 0;
inline constexpr std::uint64_t kFlagReadOnly = 1ULL << 0;

inline constexpr const char* kCapsule = "dltensor";
inline constexpr const char* kCapsuleVersioned = "dltensor_versioned";

}  // namespace gpuipc::py::dlpack
