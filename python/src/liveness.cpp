// gpuipc._gpuipc.holders / heartbeat: the liveness calls of gpuipc/liveness.hpp (the Watcher is C++ and CLI only).
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "common.hpp"
#include "gpuipc/liveness.hpp"

namespace gpuipc::py {

using namespace nb::literals;

void bind_liveness(nb::module_& m) {
  m.def(
      "holders",
      [](std::string_view name) {
        std::vector<Holder> hs;
        {
          GilReleased unlocked;
          hs = holders(name);
        }
        nb::list out;
        for (const auto& h : hs) {
          nb::dict d;
          d["pid"] = h.pid;
          d["uid"] = h.uid;
          d["role"] = h.role;
          d["references"] = h.references;
          d["read_write"] = h.read_write;
          d["creator"] = h.creator;
          d["heartbeat"] = std::string(to_string(h.heartbeat));
          d["heartbeat_deadline"] = static_cast<double>(h.heartbeat_deadline.count()) / 1000.0;
          out.append(d);
        }
        return out;
      },
      "name"_a, "The processes that hold `name` open (see gpuipc.holders).");
  m.def(
      "heartbeat",
      [](std::string_view name, double deadline) {
        // (Bounded before the cast: a huge or infinite value must not overflow; the library says the real limit.)
        if (!(deadline >= 0)) throw Error(ErrorCode::InvalidArgument, "deadline must be >= 0 seconds", "heartbeat");
        deadline = std::min(deadline, 1e9);
        // Rounded up: a deadline under a millisecond is 1 ms, not 0 (which stops the heartbeats).
        const auto ms = std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(deadline * 1000.0)));
        GilReleased unlocked;
        heartbeat(name, ms);
      },
      "name"_a, "deadline"_a,
      "Promises the next heartbeat for `name` within `deadline` seconds (see gpuipc.heartbeat).");
}

}  // namespace gpuipc::py
