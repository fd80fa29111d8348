#include "views.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <cstring>
#include <limits>
#include <new>

#include "dlpack.hpp"
#include "gpuipc/device.hpp"

namespace gpuipc::py {

using namespace nb::literals;

namespace {

/// What a DLPack export owns: the shape array and a reference that keeps the mapping alive.
struct Exported {
  dlpack::ManagedTensorVersioned versioned{};
  dlpack::ManagedTensor legacy{};
  std::array<std::int64_t, 8> small{};  // shape then strides, up to 4 dimensions (no second allocation)
  std::vector<std::int64_t> large;      // more dimensions
  std::shared_ptr<const void> owner;
  LiveCount<Live::DLPackExport> counted;
};

void delete_versioned(dlpack::ManagedTensorVersioned* t) { delete static_cast<Exported*>(t->manager_ctx); }
void delete_legacy(dlpack::ManagedTensor* t) { delete static_cast<Exported*>(t->manager_ctx); }

/// A capsule nobody consumed (its name was not changed to "used_…") still owns its tensor.
void capsule_destructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, dlpack::kCapsuleVersioned) != 0) {
    auto* t = static_cast<dlpack::ManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, dlpack::kCapsuleVersioned));
    if (t != nullptr && t->deleter != nullptr) t->deleter(t);
  } else if (PyCapsule_IsValid(capsule, dlpack::kCapsule) != 0) {
    auto* t = static_cast<dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule, dlpack::kCapsule));
    if (t != nullptr && t->deleter != nullptr) t->deleter(t);
  }
}

[[noreturn]] void buffer_error(const std::string& message) {
  PyErr_SetString(PyExc_BufferError, message.c_str());
  throw nb::python_error();
}

std::string device_name(int type, int id) {
  return type == kDLCUDA ? "cuda:" + std::to_string(id) : std::string("cpu");
}

}  // namespace

nb::object dlpack_capsule(std::shared_ptr<const void> owner, std::uintptr_t address, int device_type, int device_id,
                          ElementType dtype, std::span<const std::int64_t> shape, std::span<const std::int64_t> strides,
                          bool readonly, bool versioned) {
  auto e = std::make_unique<Exported>();
  const std::size_t nd = shape.size();
  std::int64_t* dims = e->small.data();
  if (nd + strides.size() > e->small.size()) {
    e->large.resize(nd + strides.size());
    dims = e->large.data();
  }
  std::copy(shape.begin(), shape.end(), dims);
  std::copy(strides.begin(), strides.end(), dims + nd);
  e->owner = std::move(owner);
  dlpack::Tensor t{};
  t.data = reinterpret_cast<void*>(address);  // NOLINT(performance-no-int-to-ptr)
  t.device = {device_type, device_id};
  t.ndim = static_cast<std::int32_t>(nd);
  t.dtype = {dtype.code, dtype.bits, dtype.lanes};
  t.shape = dims;
  t.strides = strides.empty() ? nullptr : dims + nd;
  t.byte_offset = 0;
  PyObject* capsule = nullptr;
  if (versioned) {
    e->versioned.version = {dlpack::kMajorVersion, dlpack::kMinorVersion};
    e->versioned.manager_ctx = e.get();
    e->versioned.deleter = delete_versioned;
    e->versioned.flags = readonly ? dlpack::kFlagReadOnly : 0;
    e->versioned.dl_tensor = t;
    capsule = PyCapsule_New(&e->versioned, dlpack::kCapsuleVersioned, capsule_destructor);
  } else {
    // The legacy format cannot say read-only; a read-only mapping still refuses writes (the MMU faults them).
    e->legacy.dl_tensor = t;
    e->legacy.manager_ctx = e.get();
    e->legacy.deleter = delete_legacy;
    capsule = PyCapsule_New(&e->legacy, dlpack::kCapsule, capsule_destructor);
  }
  if (capsule == nullptr) throw nb::python_error();
  e.release();  // NOLINT(bugprone-unused-return-value): the capsule owns it now
  return nb::steal(capsule);
}

nb::object dlpack_export(const ArrayView& v, nb::handle /*stream*/, std::optional<std::tuple<int, int>> max_version,
                         std::optional<std::tuple<int, int>> dl_device, std::optional<bool> copy) {
  if (copy.value_or(false)) buffer_error("gpuipc views are zero-copy: __dlpack__(copy=True) is not supported");
  if (dl_device && (std::get<0>(*dl_device) != v.device_type || std::get<1>(*dl_device) != v.device_id)) {
    buffer_error("this view lives on " + device_name(v.device_type, v.device_id) +
                 "; __dlpack__(dl_device=...) cannot move it (copy it with your framework instead)");
  }
  return dlpack_capsule(v.owner, v.address, v.device_type, v.device_id, v.dtype, v.shape, v.strides, v.readonly,
                        max_version && std::get<0>(*max_version) >= 1);
}

ElementType element_type(std::tuple<int, int, int> element) {
  const auto [code, bits, lanes] = element;
  if (code < 0 || code > 255 || bits < 0 || bits > 255 || lanes < 0 || lanes > 65535) {
    throw Error(ErrorCode::InvalidArgument, "bad DLPack element type", "as_array");
  }
  const ElementType dtype{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits),
                          static_cast<std::uint16_t>(lanes)};
  if (dtype.bits == 0 || dtype.lanes == 0)
    throw Error(ErrorCode::InvalidArgument, "element type of zero bits", "as_array");
  return dtype;
}

std::size_t strided_span(std::span<const std::int64_t> shape, std::span<const std::int64_t> strides, std::size_t item) {
  if (shape.size() != strides.size()) {
    throw Error(ErrorCode::InvalidArgument, "shape and strides differ in length", "as_strided");
  }
  // The last element's offset, in elements from the first; an empty array touches nothing.
  std::uint64_t last = 0;
  bool empty = false;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0 || strides[i] < 0) {
      throw Error(ErrorCode::InvalidArgument, "negative dimension or stride", "as_strided");
    }
    if (shape[i] == 0) empty = true;
    if (shape[i] > 0 && strides[i] > 0) {
      // Every step checked: a sum of dimensions each under the cap, or the byte count, could wrap round to a
      // small span that passes the caller's bound (a forged index made a reader read 2^63 bytes away).
      std::uint64_t step = 0;
      if (__builtin_mul_overflow(static_cast<std::uint64_t>(shape[i] - 1), static_cast<std::uint64_t>(strides[i]),
                                 &step) ||
          __builtin_add_overflow(last, step, &last) || last > (std::uint64_t{1} << 62)) {
        throw Error(ErrorCode::InvalidArgument, "shape and strides too large", "as_strided");
      }
    }
  }
  std::uint64_t bytes = 0;
  if (!empty && __builtin_mul_overflow(last + 1, static_cast<std::uint64_t>(item), &bytes)) {
    throw Error(ErrorCode::InvalidArgument, "shape and strides too large", "as_strided");
  }
  return empty ? 0 : static_cast<std::size_t>(bytes);
}

namespace {

nb::dict cuda_array_interface(const ArrayView& v) {
  if (v.device_type != kDLCUDA) {
    throw nb::attribute_error("host memory has no __cuda_array_interface__ (use it as a NumPy array)");
  }
  nb::dict d;
  nb::list shape;
  for (auto s : v.shape) shape.append(s);
  d["shape"] = nb::tuple(shape);
  d["typestr"] = v.typestr;
  d["data"] = nb::make_tuple(v.address, v.readonly);
  d["version"] = 3;
  if (v.strides.empty()) {
    d["strides"] = nb::none();
  } else {
    nb::list strides;
    for (auto s : v.strides) strides.append(s * static_cast<std::int64_t>(v.dtype.itemsize()));
    d["strides"] = nb::tuple(strides);
  }
  d["stream"] = nb::none();  // ordered by the stream passed to receive/acquire: nothing to synchronise here
  return d;
}

/// Whether strided view `v`'s elements lie in row-major order with no gaps (a dimension of one element may have any
/// stride): its bytes are then those of an unstrided view of the same shape.
bool row_major(const ArrayView& v) noexcept {
  std::int64_t expected = 1;
  for (std::size_t i = v.shape.size(); i-- > 0;) {
    if (v.shape[i] == 0) return true;  // no elements
    if (v.shape[i] != 1 && v.strides[i] != expected) return false;
    expected *= v.shape[i];
  }
  return true;
}

/// Whether view `v`'s elements lie in column-major (Fortran) order with no gaps (a dimension of one element may have
/// any stride); a view of at most one dimension of more than one element is both this and row-major.
bool column_major(const ArrayView& v) noexcept {
  if (v.strides.empty()) {  // C-contiguous: Fortran order too when at most one dimension has more than one element
    int longer = 0;
    for (auto d : v.shape) {
      if (d == 0) return true;  // no elements
      longer += d > 1 ? 1 : 0;
    }
    return longer <= 1;
  }
  std::int64_t expected = 1;
  for (std::size_t i = 0; i < v.shape.size(); ++i) {
    if (v.shape[i] == 0) return true;  // no elements
    if (v.shape[i] != 1 && v.strides[i] != expected) return false;
    expected *= v.shape[i];
  }
  return true;
}

/// The struct-module format of element type `t`, which the buffer protocol gives its consumers (NumPy, memoryview);
/// empty when it has none (bfloat16, several lanes).
const char* buffer_format(const ElementType& t) noexcept {
  if (t.lanes != 1) return "";
  switch (t.code) {
    case 0:  // int
      return t.bits == 8 ? "b" : t.bits == 16 ? "h" : t.bits == 32 ? "i" : t.bits == 64 ? "q" : "";
    case 1:  // uint
      return t.bits == 8 ? "B" : t.bits == 16 ? "H" : t.bits == 32 ? "I" : t.bits == 64 ? "Q" : "";
    case 2:  // float
      return t.bits == 16 ? "e" : t.bits == 32 ? "f" : t.bits == 64 ? "d" : "";
    case 5:  // complex
      return t.bits == 64 ? "Zf" : t.bits == 128 ? "Zd" : "";
    case 6:  // bool
      return t.bits == 8 ? "?" : "";
    default:
      return "";
  }
}

/// What a host view's buffer points its consumer at (Py_buffer::internal, freed by release_buffer).
struct BufferLayout {
  std::vector<Py_ssize_t> shape;
  std::vector<Py_ssize_t> strides;  // in bytes
};

int refuse_buffer(Py_buffer* view, const char* why) {
  PyErr_SetString(PyExc_BufferError, why);
  view->obj = nullptr;
  return -1;
}

/// The buffer protocol of a host view: its element type, shape and strides (it gave bytes only, so that
/// `numpy.asarray(view.typed(...))` was a flat uint8 array and a strided view a 0-d object array).
int get_buffer(PyObject* self, Py_buffer* view, int flags) {
  const ArrayView* v = nb::inst_ptr<ArrayView>(nb::handle(self));
  if (v->device_type != kDLCPU) {
    return refuse_buffer(view,
                         "GPU memory has no buffer interface: use DLPack (torch.from_dlpack, cupy.from_dlpack) or "
                         "__cuda_array_interface__");
  }
  if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE && v->readonly) {
    return refuse_buffer(view, "the view is read-only");
  }
  const bool contiguous = v->strides.empty() || row_major(*v);
  if (!contiguous && (flags & PyBUF_STRIDES) != PyBUF_STRIDES) {
    return refuse_buffer(view,
                         "a view whose strides are not row-major has a buffer only for consumers that take strides "
                         "(numpy.asarray does): or use numpy.from_dlpack(view)");
  }
  // A consumer that asks for contiguous memory reads len bytes from buf as they lie: a strided view (a stride of 0
  // spans less than len) must be refused, and Fortran order given only where the elements lie so.
  const bool c_order = contiguous;
  const bool f_order = column_major(*v);
  if (((flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS && !c_order) ||
      ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !f_order) ||
      ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS && !c_order && !f_order)) {
    return refuse_buffer(view,
                         "the view's elements do not lie in the order the consumer asked for (C or Fortran "
                         "contiguous): take its strides (numpy.asarray does), or use numpy.from_dlpack(view)");
  }
  const char* format = buffer_format(v->dtype);
  if ((flags & PyBUF_FORMAT) == PyBUF_FORMAT && *format == '\0') {
    return refuse_buffer(view,
                         "its element type has no buffer format (bfloat16, or several lanes): use "
                         "numpy.from_dlpack(view) with ml_dtypes, or torch.from_dlpack(view)");
  }
  auto* layout = new (std::nothrow) BufferLayout;
  if (layout == nullptr) {
    PyErr_NoMemory();
    view->obj = nullptr;
    return -1;
  }
  const auto item = static_cast<Py_ssize_t>(v->dtype.itemsize());
  Py_ssize_t count = 1;
  try {
    for (std::size_t i = 0; i < v->shape.size(); ++i) {
      layout->shape.push_back(static_cast<Py_ssize_t>(v->shape[i]));
      count *= static_cast<Py_ssize_t>(v->shape[i]);
    }
    layout->strides.resize(v->shape.size());
    Py_ssize_t step = item;  // C-contiguous strides, unless the view has its own
    for (std::size_t i = v->shape.size(); i-- > 0;) {
      layout->strides[i] = v->strides.empty() ? step : static_cast<Py_ssize_t>(v->strides[i]) * item;
      step *= static_cast<Py_ssize_t>(v->shape[i]);
    }
  } catch (const std::bad_alloc&) {
    delete layout;
    PyErr_NoMemory();
    view->obj = nullptr;
    return -1;
  }
  static char empty = 0;
  view->buf = count == 0 ? &empty : reinterpret_cast<void*>(v->address);  // NOLINT(performance-no-int-to-ptr)
  Py_INCREF(self);
  view->obj = self;
  view->len = count * item;
  view->itemsize = item;
  view->readonly = v->readonly ? 1 : 0;
  view->format = (flags & PyBUF_FORMAT) == PyBUF_FORMAT ? const_cast<char*>(format) : nullptr;
  if ((flags & PyBUF_ND) == PyBUF_ND) {
    view->ndim = static_cast<int>(layout->shape.size());
    view->shape = layout->shape.empty() ? nullptr : layout->shape.data();
  } else {
    view->ndim = 1;  // the consumer takes len bytes as they lie (the view is contiguous: checked above)
    view->shape = nullptr;
  }
  view->strides =
      (flags & PyBUF_STRIDES) == PyBUF_STRIDES && !layout->strides.empty() ? layout->strides.data() : nullptr;
  view->suboffsets = nullptr;
  view->internal = layout;
  return 0;
}

void release_buffer(PyObject* /*self*/, Py_buffer* view) { delete static_cast<BufferLayout*>(view->internal); }

PyType_Slot kViewSlots[] = {{Py_bf_getbuffer, reinterpret_cast<void*>(get_buffer)},
                            {Py_bf_releasebuffer, reinterpret_cast<void*>(release_buffer)},
                            {0, nullptr}};

ArrayView typed(const ArrayView& v, std::tuple<int, int, int> element, const std::string& typestr,
                const std::vector<std::int64_t>& shape, std::size_t offset) {
  const ElementType dtype = element_type(element);
  const std::size_t item = dtype.itemsize();
  if (offset % item != 0) {
    throw Error(ErrorCode::InvalidArgument,
                "offset " + std::to_string(offset) + " is not a multiple of the element size " + std::to_string(item),
                "as_array");
  }
  std::size_t count = 1;
  for (auto s : shape) {
    if (s < 0) throw Error(ErrorCode::InvalidArgument, "negative dimension in shape", "as_array");
    if (s != 0 && count > std::numeric_limits<std::size_t>::max() / static_cast<std::size_t>(s)) {
      throw Error(ErrorCode::InvalidArgument, "shape too large", "as_array");
    }
    count *= static_cast<std::size_t>(s);
  }
  if (offset > v.nbytes || count > (v.nbytes - offset) / item) {
    throw Error(ErrorCode::InvalidArgument,
                std::to_string(count) + " elements of " + std::to_string(item) + " bytes at offset " +
                    std::to_string(offset) + " do not fit in " + std::to_string(v.nbytes) + " bytes",
                "as_array");
  }
  ArrayView out = v;
  out.address = v.address + offset;
  out.nbytes = count * item;
  out.dtype = dtype;
  out.shape = shape;
  out.strides.clear();  // contiguous: a strided parent's strides would step past what was checked
  out.typestr = typestr;
  return out;
}

/// Copies `n` bytes from `src` (DLPack device type `src_type`) into `dst` after `stream` has finished its work.
/// Host to host: memcpy. Anything with a GPU side: synchronous driver copies, after synchronizing `stream` so the
/// source is complete (gpuipc::copy_synchronous).
void copy_bytes(const ArrayView& dst, std::uintptr_t src, int src_type, int src_id, std::size_t n,
                std::uintptr_t stream) {
  if (dst.readonly) throw Error(ErrorCode::InvalidArgument, "cannot copy into a read-only view", "copy");
  if (n > dst.nbytes) {
    throw Error(ErrorCode::InvalidArgument,
                std::to_string(n) + " bytes do not fit in " + std::to_string(dst.nbytes), "copy");
  }
  if (n == 0) return;
  const bool dst_gpu = dst.device_type == kDLCUDA;
  const bool src_gpu = src_type == kDLCUDA || src_type == kDLCUDAManaged;
  if (!src_gpu && src_type != kDLCPU && src_type != kDLCUDAHost) {
    throw Error(ErrorCode::Unsupported, "cannot copy from DLPack device type " + std::to_string(src_type), "copy");
  }
  GilReleased unlocked;
  copy_synchronous({.address = dst.address, .device = dst_gpu ? dst.device_id : -1},
                   {.address = src, .device = src_gpu ? src_id : -1}, n, to_stream(stream));
}

/// Copies a compact (C-contiguous) DLPack tensor into `dst`. Returns (code, bits, lanes, shape, nbytes), or None
/// when the tensor is strided (the caller makes it contiguous first). The capsule is only borrowed.
nb::object copy_from_dlpack(const ArrayView& dst, nb::handle capsule, std::uintptr_t stream) {
  const dlpack::Tensor* t = nullptr;
  if (PyCapsule_IsValid(capsule.ptr(), dlpack::kCapsuleVersioned) != 0) {
    const auto* m =
        static_cast<const dlpack::ManagedTensorVersioned*>(PyCapsule_GetPointer(capsule.ptr(), dlpack::kCapsuleVersioned));
    if (m->version.major != dlpack::kMajorVersion) {
      throw Error(ErrorCode::Unsupported, "DLPack major version " + std::to_string(m->version.major), "copy");
    }
    t = &m->dl_tensor;
  } else if (PyCapsule_IsValid(capsule.ptr(), dlpack::kCapsule) != 0) {
    t = &static_cast<const dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), dlpack::kCapsule))->dl_tensor;
  } else {
    throw Error(ErrorCode::InvalidArgument, "not an unused DLPack capsule", "copy");
  }
  if (t->ndim < 0 || t->ndim > 64) throw Error(ErrorCode::InvalidArgument, "DLPack tensor of bad rank", "copy");
  const ElementType et{t->dtype.code, t->dtype.bits, t->dtype.lanes};
  std::size_t count = 1;
  std::int64_t expect = 1;
  bool compact = true;
  nb::list shape;
  for (int i = t->ndim - 1; i >= 0; --i) {
    const std::int64_t s = t->shape[i];
    if (s < 0) throw Error(ErrorCode::InvalidArgument, "DLPack tensor with a negative dimension", "copy");
    if (t->strides != nullptr && s > 1 && t->strides[i] != expect) compact = false;
    expect *= s;
    count *= static_cast<std::size_t>(s);
  }
  for (int i = 0; i < t->ndim; ++i) shape.append(t->shape[i]);
  if (!compact) return nb::none();
  const std::size_t n = count * et.itemsize();
  const auto src = reinterpret_cast<std::uintptr_t>(t->data) + t->byte_offset;
  copy_bytes(dst, src, t->device.device_type, t->device.device_id, n, stream);
  return nb::make_tuple(t->dtype.code, t->dtype.bits, t->dtype.lanes, nb::tuple(shape), n);
}


/// A view of `shape` elements of `dtype` with `strides` (elements, >= 0) whose first element is `offset` bytes in;
/// every element must lie inside `v`.
ArrayView strided(const ArrayView& v, std::tuple<int, int, int> element, const std::string& typestr,
                  const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& strides,
                  std::size_t offset) {
  ArrayView out = typed(v, element, typestr, {0}, 0);  // checks the element type
  const std::size_t item = out.dtype.itemsize();
  if (offset % item != 0) {
    throw Error(ErrorCode::InvalidArgument, "offset is not a multiple of the element size", "as_strided");
  }
  const std::size_t span = strided_span(shape, strides, item);
  if (offset > v.nbytes || span > v.nbytes - offset) {
    throw Error(ErrorCode::InvalidArgument,
                "a strided view of " + std::to_string(span) + " bytes at offset " + std::to_string(offset) +
                    " does not fit in " + std::to_string(v.nbytes) + " bytes",
                "as_strided");
  }
  out.address = v.address + offset;
  out.nbytes = span;
  out.shape = shape;
  out.strides = strides;
  return out;
}

/// What a DLPack capsule describes, without consuming it: (address of the first element, device type, device id,
/// (code, bits, lanes), shape, strides in elements or None, read-only flag).
nb::tuple dlpack_info(nb::handle capsule) {
  const dlpack::Tensor* t = nullptr;
  bool readonly = false;
  if (PyCapsule_IsValid(capsule.ptr(), dlpack::kCapsuleVersioned) != 0) {
    const auto* m = static_cast<const dlpack::ManagedTensorVersioned*>(
        PyCapsule_GetPointer(capsule.ptr(), dlpack::kCapsuleVersioned));
    if (m->version.major != dlpack::kMajorVersion) {
      throw Error(ErrorCode::Unsupported, "DLPack major version " + std::to_string(m->version.major), "dlpack");
    }
    t = &m->dl_tensor;
    readonly = (m->flags & dlpack::kFlagReadOnly) != 0;
  } else if (PyCapsule_IsValid(capsule.ptr(), dlpack::kCapsule) != 0) {
    t = &static_cast<const dlpack::ManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), dlpack::kCapsule))->dl_tensor;
  } else {
    throw Error(ErrorCode::InvalidArgument, "not an unused DLPack capsule", "dlpack");
  }
  if (t->ndim < 0 || t->ndim > 64) throw Error(ErrorCode::InvalidArgument, "DLPack tensor of bad rank", "dlpack");
  nb::list shape;
  nb::list strides;
  for (int i = 0; i < t->ndim; ++i) {
    shape.append(t->shape[i]);
    if (t->strides != nullptr) strides.append(t->strides[i]);
  }
  const auto address = reinterpret_cast<std::uintptr_t>(t->data) + t->byte_offset;
  return nb::make_tuple(address, t->device.device_type, t->device.device_id,
                        nb::make_tuple(t->dtype.code, t->dtype.bits, t->dtype.lanes), nb::tuple(shape),
                        t->strides != nullptr ? nb::object(nb::tuple(strides)) : nb::none(), readonly);
}

}  // namespace

ArrayView strided_view(const ArrayView& v, std::tuple<int, int, int> element, const std::string& typestr,
                       const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& strides,
                       std::size_t offset) {
  return strided(v, element, typestr, shape, strides, offset);
}

ArrayView ArrayView::bytes(std::shared_ptr<const void> owner, std::uintptr_t address, std::size_t nbytes,
                           bool readonly, int device_type, int device_id) {
  ArrayView v;
  v.owner = std::move(owner);
  v.address = address;
  v.nbytes = nbytes;
  v.readonly = readonly;
  v.device_type = device_type;
  v.device_id = device_id;
  v.shape = {static_cast<std::int64_t>(nbytes)};
  return v;
}

void bind_views(nb::module_& m) {
  nb::class_<ArrayView>(m, "ArrayView", nb::type_slots(kViewSlots),
                        "A window on mapped gpuipc memory that keeps the mapping alive while it (or anything made\n"
                        "from it) lives. Host memory: the buffer protocol (``numpy.asarray(view)``), with the\n"
                        "view's element type, shape and strides. GPU memory: DLPack (``torch.from_dlpack(view)``,\n"
                        "``cupy.from_dlpack(view)``, ``jax.dlpack.from_dlpack``) and ``__cuda_array_interface__``\n"
                        "(CuPy, Numba). C-contiguous unless made by as_strided; read-only when the memory was opened\n"
                        "read-only.")
      .def_prop_ro("address", [](const ArrayView& v) { return v.address; },
                   "Host address (host memory) or device address (GPU memory) of the first byte.")
      .def_prop_ro("nbytes", [](const ArrayView& v) { return v.nbytes; }, "Size in bytes.")
      .def_prop_ro("readonly", [](const ArrayView& v) { return v.readonly; }, "Whether writes are refused.")
      .def_prop_ro("shape", [](const ArrayView& v) {
        nb::list l;
        for (auto s : v.shape) l.append(s);
        return nb::tuple(l);
      }, "Dimensions (C order).")
      .def_prop_ro("dlpack_dtype", [](const ArrayView& v) {
        return std::make_tuple(v.dtype.code, v.dtype.bits, v.dtype.lanes);
      }, "DLPack element type (code, bits, lanes).")
      .def_prop_ro("typestr", [](const ArrayView& v) { return v.typestr; }, "Array-interface type string.")
      .def_prop_ro("is_cuda", [](const ArrayView& v) { return v.device_type == kDLCUDA; },
                   "Whether the memory is GPU memory.")
      .def("typed", &typed, "dtype"_a, "typestr"_a, "shape"_a, "offset"_a,
           "A view of ``shape`` elements of ``dtype`` starting ``offset`` bytes in. Raises InvalidArgument when it\n"
           "does not fit or ``offset`` is not a multiple of the element size.")
      .def("as_strided", &strided, "dtype"_a, "typestr"_a, "shape"_a, "strides"_a, "offset"_a,
           "A view of ``shape`` elements of ``dtype`` with ``strides`` (in elements, >= 0) starting ``offset`` bytes\n"
           "in. Raises InvalidArgument when an element falls outside this view.")
      .def_prop_ro("strides", [](const ArrayView& v) -> nb::object {
        if (v.strides.empty()) return nb::none();
        nb::list l;
        for (auto s : v.strides) l.append(s);
        return nb::tuple(l);
      }, "Strides in elements, or None when C-contiguous.")
      .def("__dlpack__", &dlpack_export, nb::kw_only(), "stream"_a = nb::none(), "max_version"_a = nb::none(),
           "dl_device"_a = nb::none(), "copy"_a = nb::none(),
           "Exports the view as a DLPack capsule (versioned, with the read-only flag, when the consumer passes\n"
           "``max_version >= (1, 0)``). ``stream`` is accepted and not waited on: the data is ordered by the\n"
           "stream given to the gpuipc call that produced the view.")
      .def("__dlpack_device__", [](const ArrayView& v) { return std::make_tuple(v.device_type, v.device_id); },
           "(device type, device ordinal) as DLPack numbers: (1, 0) host, (2, n) CUDA device n.")
      .def_prop_ro("__cuda_array_interface__", &cuda_array_interface,
                   "The CUDA array interface (version 3) of GPU views; AttributeError for host views.")
      .def("__repr__", [](const ArrayView& v) {
        std::string dims;
        for (auto d : v.shape) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
        if (v.shape.size() == 1) dims += ",";
        return "ArrayView(" + device_name(v.device_type, v.device_id) + ", address=" + std::to_string(v.address) +
               ", shape=(" + dims + "), typestr='" + v.typestr + "'" + (v.readonly ? ", readonly)" : ")");
      });
  m.def("_dlpack_info", &dlpack_info, "capsule"_a,
        "What a DLPack capsule describes, without consuming it: (address, device type, device id, (code, bits,\n"
        "lanes), shape, strides in elements or None, read-only).");
  m.def(
      "_copy_to_view",
      [](const ArrayView& dst, std::size_t offset, std::uintptr_t src, int src_type, int src_id, std::size_t nbytes,
         std::uintptr_t stream) {
        if (offset > dst.nbytes) throw Error(ErrorCode::InvalidArgument, "offset past the end of the view", "copy");
        ArrayView part = dst;
        part.address += offset;
        part.nbytes -= offset;
        copy_bytes(part, src, src_type, src_id, nbytes, stream);
      },
      "dst"_a, "offset"_a, "src"_a, "src_device_type"_a, "src_device_id"_a, "nbytes"_a, "stream"_a,
      "Copies ``nbytes`` at ``src`` (DLPack device type and id) to byte ``offset`` of ``dst``, after\n"
      "synchronizing ``stream`` (GPU copies are synchronous).");
  m.def("_copy_from_dlpack", &copy_from_dlpack, "dst"_a, "capsule"_a, "stream"_a,
        "Copies a C-contiguous DLPack tensor into ``dst`` (after synchronizing ``stream``). Returns\n"
        "(code, bits, lanes, shape, nbytes), or None when the tensor is strided.");
}

}  // namespace gpuipc::py
