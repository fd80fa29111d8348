// gpuipc._gpuipc.Segment: gpuipc::Segment with Python argument conventions. python/gpuipc/segment.py wraps it.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include "gpuipc/share.hpp"

#include "common.hpp"
#include "views.hpp"

namespace gpuipc::py {

using namespace nb::literals;

namespace {

struct PySegment {
  explicit PySegment(Segment s) : seg(shared_without_gil(std::move(s))) {}
  /// Shared with the views made from it: the last of them (or this handle, freed without close()) unmaps without
  /// the GIL (common.hpp).
  std::shared_ptr<Segment> seg;
  LiveCount<Live::Segment> counted;

  const Segment& get() const {
    if (!seg) raise_closed("segment");
    return *seg;
  }
};

nb::dict info_dict(const SegmentInfo& i) {
  nb::dict d;
  d["id"] = i.id;
  d["name"] = i.name;
  d["kind"] = std::string(to_string(i.kind));
  d["size"] = i.size;
  d["device_uuid"] = i.device_uuid;
  d["owner_uid"] = i.owner_uid;
  d["owner_gid"] = i.owner_gid;
  d["mode"] = i.mode;
  d["created_unix_ns"] = i.created_unix_ns;
  d["references"] = i.references;
  nb::list pids;
  for (auto p : i.mapper_pids) pids.append(p);
  d["mapper_pids"] = nb::tuple(pids);
  d["mapper_count"] = i.mapper_count;
  return d;
}

}  // namespace

void bind_segment(nb::module_& m) {
  nb::class_<PySegment>(m, "Segment", "A mapped gpuipc segment (low level; see gpuipc.Segment).")
      .def_static(
          "create",
          [](std::string_view name, std::size_t size, std::string_view kind, int device, unsigned mode) {
            CreateOptions o{.kind = parse_kind(kind), .device = device, .mode = mode};
            GilReleased unlocked;
            return PySegment(Segment::create(name, size, o));
          },
          "name"_a, "size"_a, nb::kw_only(), "kind"_a = "host", "device"_a = 0, "mode"_a = 0600,
          "Creates segment ``name`` of at least ``size`` bytes and maps it read-write.")
      .def_static(
          "open",
          [](std::string_view name, bool readonly, std::optional<double> wait, std::optional<int> device) {
            return open_in_slices(wait, "segment '" + std::string(name) + "'", [&](std::chrono::milliseconds slice) {
              OpenOptions o{.access = readonly ? Access::ReadOnly : Access::ReadWrite, .wait = slice,
                            .device = device.value_or(-1)};
              return PySegment(Segment::open(name, o));
            });
          },
          "name"_a, nb::kw_only(), "readonly"_a = false, "wait"_a = nb::none(), "device"_a = nb::none(),
          "Opens segment ``name``; ``wait`` seconds for it to be created (None: not at all).")
      .def_static(
          "unlink",
          [](std::string_view name) {
            GilReleased unlocked;
            Segment::unlink(name);
          },
          "name"_a, "Removes the name; mappings stay valid until closed.")
      .def_static(
          "stat",
          [](std::string_view name) {
            SegmentInfo i;
            {
              GilReleased unlocked;
              i = Segment::stat(name);
            }
            return info_dict(i);
          },
          "name"_a, "The broker's record of segment ``name`` as a dict.")
      .def_static(
          "list",
          []() {
            std::vector<SegmentInfo> all;
            {
              GilReleased unlocked;
              all = Segment::list();
            }
            nb::list out;
            for (const auto& i : all) out.append(info_dict(i));
            return out;
          },
          "Every segment the broker knows, as dicts.")
      .def_prop_ro("name", [](const PySegment& s) { return s.get().name(); })
      .def_prop_ro("size", [](const PySegment& s) { return s.get().size(); })
      .def_prop_ro("kind", [](const PySegment& s) { return std::string(to_string(s.get().kind())); })
      .def_prop_ro("readonly", [](const PySegment& s) { return s.get().access() == Access::ReadOnly; })
      .def_prop_ro("device", [](const PySegment& s) { return s.get().device(); })
      .def_prop_ro("id", [](const PySegment& s) { return s.get().id(); })
      .def_prop_ro("owner_uid", [](const PySegment& s) { return s.get().owner_uid(); })
      .def_prop_ro("owner_gid", [](const PySegment& s) { return s.get().owner_gid(); })
      .def_prop_ro("mode", [](const PySegment& s) { return s.get().mode(); })
      .def_prop_ro("address", [](const PySegment& s) { return reinterpret_cast<std::uintptr_t>(s.get().data()); })
      .def_prop_ro("device_pointer", [](const PySegment& s) { return s.get().device_pointer(); })
      .def_prop_ro("closed", [](const PySegment& s) { return !s.seg; })
      .def(
          "view",
          [](const PySegment& s) {
            const Segment& g = s.get();
            const bool gpu = g.kind() == SegmentKind::Device || g.kind() == SegmentKind::DeviceIpc;
            return ArrayView::bytes(s.seg, reinterpret_cast<std::uintptr_t>(g.data()), g.size(),
                                    g.access() == Access::ReadOnly, gpu ? kDLCUDA : kDLCPU, gpu ? g.device() : 0);
          },
          "The whole segment as bytes (GPU memory for device segments, host memory otherwise).")
      .def(
          "close", [](PySegment& s) { s.seg.reset(); },  // unmaps (without the GIL) unless views keep the mapping
          "Drops this handle; views keep the mapping until they go.");

  m.def(
      "share",
      [](std::string_view name, std::uintptr_t ptr, std::size_t nbytes, unsigned mode, int device) {
        const ShareOptions o{.device = device, .mode = mode};
        GilReleased unlocked;
        return PySegment(share(name, reinterpret_cast<const void*>(ptr), nbytes, o));  // NOLINT(performance-no-int-to-ptr)
      },
      "name"_a, "ptr"_a, "nbytes"_a, nb::kw_only(), "mode"_a = 0600, "device"_a = -1,
      "Shares ``nbytes`` of device memory at ``ptr`` as segment ``name``; returns the exporter's handle.");
}

}  // namespace gpuipc::py
