// gpuipc._gpuipc.Channel: gpuipc::Channel with interruptible waits and views that keep the slot memory mapped,
// and the array header's layout (include/gpuipc/array_header.hpp) for python/gpuipc/_array_header.py.
// python/gpuipc/channel.py wraps it (send/recv, message objects). What a handle holds is core's (Channel::held):
// neither this file nor channel.py keeps a copy; this file keeps only which of those a thread has already published
// or released ahead of older ones (ChannelState::early), which the core Channel does not allow.
#include <fmt/ranges.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "common.hpp"
#include "gpuipc/array_header.hpp"
#include "views.hpp"

namespace gpuipc::py {

using namespace nb::literals;

namespace {

/// One joined channel. Calls are serialised by `mutex` (the core Channel is not thread-safe), taken without the
/// GIL so that a holder waiting in slices can take the GIL back.
struct ChannelState {
  /// Held by one call at a time, and by a wait (acquire, send, receive) for one slice at a time only: close(), a
  /// message's release or stats from another thread go on between its slices.
  std::timed_mutex mutex;
  /// Calls waiting for `mutex` that do not wait themselves (lock(), close()): a wait lets them have it between its
  /// slices (the mutex is not fair: the waiter would take it again at once).
  std::atomic<int> contenders{0};
  /// A second handle on the slots' mapping (Channel::slots_segment): views of slots keep it, so they stay valid
  /// after close(). Empty only for an empty channel; views then keep this state.
  Segment slots;
  /// What a view of a slot holds: one shared handle on `slots`, made once (a view per acquire and receive).
  std::shared_ptr<const void> slots_owner;
  std::string name;  // the channel's, for messages while the state is not locked
  /// A slot published or a message released ahead of older ones of this handle (threads sharing it), by sequence.
  /// The core Channel publishes and releases the oldest only: these go once every older one has. Host channels
  /// (device channels: only an aborted message that recv skips, released from the host; their other calls keep
  /// the order, as a stream kept for later might be destroyed meanwhile).
  struct Early {
    std::string header;      // a publish's
    std::size_t nbytes = 0;  // a publish's
  };
  std::map<std::uint64_t, Early> early;
  Channel ch;  // declared last: leaves the channel first
};

struct PyChannel {
  explicit PyChannel(std::shared_ptr<ChannelState> s) noexcept : state(std::move(s)) {}
  PyChannel(PyChannel&&) noexcept = default;
  PyChannel& operator=(PyChannel&&) noexcept = default;
  ~PyChannel() { drop_without_gil(state); }  // a handle Python frees without close() (common.hpp)
  std::shared_ptr<ChannelState> state;
  LiveCount<Live::Channel> counted;
};

ChannelRole parse_role(std::string_view role) {
  if (role == "producer") return ChannelRole::Producer;
  if (role == "consumer") return ChannelRole::Consumer;
  throw Error(ErrorCode::InvalidArgument, "role must be 'producer' or 'consumer', not '" + std::string(role) + "'",
              "channel");
}

/// Wraps a joined channel with the second handle on its slots.
PyChannel attach(Channel ch) {
  auto st = std::make_shared<ChannelState>();
  st->slots = ch.slots_segment();
  if (st->slots) st->slots_owner = shared_without_gil(Segment(st->slots));
  st->name = ch.name();
  st->ch = std::move(ch);
  return PyChannel(std::move(st));
}

/// A channel's state, locked. Holds a reference: a concurrent close() cannot free it under the holder.
struct Locked {
  std::shared_ptr<ChannelState> state;
  std::unique_lock<std::timed_mutex> lock;
  Channel& ch() const noexcept { return state->ch; }
};

/// Counts a call among the state's contenders while it exists.
struct Contending {
  explicit Contending(ChannelState& s) noexcept : state(s) { state.contenders.fetch_add(1, std::memory_order_acq_rel); }
  ~Contending() { state.contenders.fetch_sub(1, std::memory_order_acq_rel); }
  Contending(const Contending&) = delete;
  Contending& operator=(const Contending&) = delete;
  ChannelState& state;
};

/// Locks the channel's state (the GIL released while waiting for the lock, signals looked at every slice). A closed
/// handle raises Closed.
Locked lock(const PyChannel& c) {
  Locked g{c.state, {}};
  if (!g.state) raise_closed("channel");
  g.lock = std::unique_lock<std::timed_mutex>(g.state->mutex, std::try_to_lock);
  if (!g.lock.owns_lock()) {  // held by another thread: wait without the GIL (uncontended, this costs nothing)
    const Contending waiting(*g.state);
    for (;;) {
      {
        GilReleased unlocked;
        if (g.lock.try_lock_for(kWaitSlice)) break;
      }
      check_signals();
    }
  }
  if (!g.state->ch) raise_closed("channel");
  return g;
}

/// wait_in_slices for a channel call that waits (acquire, send, receive): `attempt(channel, slice)` runs with the
/// state locked for that slice only, so that a wait keeps no other call of the handle waiting for its end (close()
/// from another thread ends it at the next slice with Closed). Returns the state still locked after the slice that
/// succeeded; raises what check_status raises for the rest, naming `op`.
template <class Attempt>
Locked wait_locked(const PyChannel& c, std::optional<double> timeout, std::string_view op, Attempt&& attempt) {
  Locked g{c.state, {}};
  if (!g.state) raise_closed("channel");
  const auto limit = to_timeout(timeout, "timeout");
  bool closed = false;
  const Status s = wait_in_slices(limit, [&](std::chrono::nanoseconds slice) {
    while (g.state->contenders.load(std::memory_order_acquire) > 0) {  // their turn first (each holds it briefly)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    std::unique_lock<std::timed_mutex> held(g.state->mutex);
    if (!g.state->ch) {
      closed = true;
      return Status::Closed;
    }
    const Status r = attempt(g.state->ch, slice);
    if (r != Status::Timeout) g.lock = std::move(held);
    return r;
  });
  if (closed) raise_closed("channel");
  if (s != Status::Ok) check_status(s, fmt::format("{} on channel '{}'", op, g.state->name));
  return g;
}

/// What keeps a view of `address` alive: the slots handle when the address is inside it, else the whole channel.
std::shared_ptr<const void> owner_of(const Locked& g, std::uintptr_t address) {
  const Segment& s = g.state->slots;
  const auto base = reinterpret_cast<std::uintptr_t>(s.data());
  if (s && address >= base && address < base + s.size()) return g.state->slots_owner;
  return g.state;
}

/// Whether this handle holds `sequence` (an acquired slot or a received message) and has not published or released
/// it ahead of older ones.
bool holds(const ChannelState& st, std::uint64_t sequence) {
  if (st.early.count(sequence) != 0) return false;
  for (std::uint32_t i = 0; i < st.ch.held(); ++i) {
    if (st.ch.held_sequence(i) == sequence) return true;
  }
  return false;
}

/// What this handle holds and has not published or released, oldest first.
std::vector<std::uint64_t> held_sequences(const ChannelState& st) {
  std::vector<std::uint64_t> held;
  for (std::uint32_t i = 0; i < st.ch.held(); ++i) {
    if (st.early.count(st.ch.held_sequence(i)) == 0) held.push_back(st.ch.held_sequence(i));
  }
  return held;
}

/// After the oldest went: publishes or releases, from the host, those that waited for it (ChannelState::early).
void settle_early(ChannelState& st) {
  while (st.ch.held() > 0) {
    const auto at = st.early.find(st.ch.held_sequence(0));
    if (at == st.early.end()) return;
    const std::uint64_t sequence = at->first;
    const ChannelState::Early e = std::move(at->second);
    st.early.erase(at);
    const auto what = [&] {
      return fmt::format("{} of {} {} on channel '{}' (held back until the older ones went)",
                         st.ch.role() == ChannelRole::Producer ? "publish" : "release",
                         st.ch.role() == ChannelRole::Producer ? "slot" : "message", sequence, st.name);
    };
    const std::span<const std::byte> h(reinterpret_cast<const std::byte*>(e.header.data()), e.header.size());
    const Status s =
        st.ch.role() == ChannelRole::Producer ? st.ch.publish(nullptr, h, e.nbytes) : st.ch.release(nullptr);
    if (s != Status::Ok) check_status(s, what());
  }
}

std::string role_name(ChannelRole r) { return r == ChannelRole::Producer ? "producer" : "consumer"; }

/// Pacing in seconds (Python's unit for durations) to the library's nanoseconds; None: the environment's default.
std::optional<std::chrono::nanoseconds> to_pacing(std::optional<double> seconds) {
  if (!seconds) return std::nullopt;
  if (!(*seconds >= 0) || *seconds > 3600) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("pacing must be 0 to 3600 seconds, not {}", *seconds),
                "channel");
  }
  return std::chrono::nanoseconds(static_cast<std::int64_t>(*seconds * 1e9));
}

std::optional<std::uint32_t> to_ahead(std::optional<std::int64_t> messages) {
  if (!messages) return std::nullopt;
  if (*messages < 1) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("pacing_ahead must be at least 1, not {}", *messages),
                "channel");
  }
  return static_cast<std::uint32_t>(std::min<std::int64_t>(*messages, 0xFFFFFFFFLL));  // the core clamps to slots
}

nb::dict stats_dict(const ChannelStats& s) {
  nb::dict d;
  d["head"] = s.head;
  d["tail"] = s.tail;
  d["producers"] = s.producers;
  d["consumers"] = s.consumers;
  d["redelivered"] = s.redelivered;
  d["abandoned"] = s.abandoned;
  d["free_slots"] = s.free_slots;
  d["published"] = s.published;
  d["published_bytes"] = s.published_bytes;
  d["queued"] = s.queued;
  d["slots"] = s.slots;
  d["slot_bytes"] = s.slot_bytes;
  return d;
}

/// Bytes per item of the struct format characters kArrayHeaderFormat uses.
constexpr std::size_t format_item_bytes(char c) {
  switch (c) {
    case 's': case 'B': return 1;
    case 'H': return 2;
    case 'I': return 4;
    case 'Q': return 8;
    default: return 0;
  }
}

/// The offset Python's struct gives field `field` of `format` (standard sizes, no padding: '<'); the number of
/// fields gives the total size.
constexpr std::size_t format_offset(std::string_view format, std::size_t field) {
  std::size_t offset = 0;
  std::size_t count = 0;
  std::size_t index = 0;
  for (const char c : format.substr(1)) {
    if (c >= '0' && c <= '9') {
      count = count * 10 + static_cast<std::size_t>(c - '0');
      continue;
    }
    if (index++ == field) return offset;
    offset += (count == 0 ? 1 : count) * format_item_bytes(c);
    count = 0;
  }
  return offset;
}

// The struct format Python reads the header with lays the fields where ArrayHeaderPrefix has them.
constexpr std::string_view kFormat = kArrayHeaderFormat;
static_assert(kFormat.front() == '<' && format_offset(kFormat, 0) == offsetof(ArrayHeaderPrefix, magic) &&
              format_offset(kFormat, 1) == offsetof(ArrayHeaderPrefix, version) &&
              format_offset(kFormat, 2) == offsetof(ArrayHeaderPrefix, ndim) &&
              format_offset(kFormat, 3) == offsetof(ArrayHeaderPrefix, flags) &&
              format_offset(kFormat, 4) == offsetof(ArrayHeaderPrefix, dtype_code) &&
              format_offset(kFormat, 5) == offsetof(ArrayHeaderPrefix, dtype_bits) &&
              format_offset(kFormat, 6) == offsetof(ArrayHeaderPrefix, dtype_lanes) &&
              format_offset(kFormat, 7) == offsetof(ArrayHeaderPrefix, meta_len) &&
              format_offset(kFormat, 8) == offsetof(ArrayHeaderPrefix, nbytes) &&
              format_offset(kFormat, 9) == sizeof(ArrayHeaderPrefix));

/// include/gpuipc/array_header.hpp's constants, for python/gpuipc/_array_header.py.
nb::dict array_header_layout() {
  nb::dict d;
  d["magic"] = nb::bytes(kArrayHeaderMagic.data(), kArrayHeaderMagic.size());
  d["version"] = kArrayHeaderVersion;
  d["format"] = kArrayHeaderFormat;
  d["fixed_bytes"] = sizeof(ArrayHeaderPrefix);
  d["flag_aborted"] = kArrayHeaderAborted;
  d["max_ndim"] = kArrayHeaderMaxNdim;
  return d;
}

}  // namespace

void bind_channel(nb::module_& m) {
  m.attr("array_header_layout") = array_header_layout();
  nb::class_<PyChannel>(m, "Channel", "A joined producer/consumer channel (low level; see gpuipc.Channel).")
      .def_static(
          "create",
          [](std::string_view name, std::uint32_t slots, std::size_t slot_bytes, std::uint32_t header_bytes,
             std::string_view kind, int device, unsigned mode, std::string_view role, std::optional<double> pacing,
             std::optional<std::int64_t> pacing_ahead) {
            const ChannelOptions o{.slots = slots,
                                   .slot_bytes = slot_bytes,
                                   .header_bytes = header_bytes,
                                   .kind = parse_kind(kind),
                                   .device = device,
                                   .mode = mode,
                                   .pacing = to_pacing(pacing),
                                   .pacing_ahead = to_ahead(pacing_ahead)};
            const ChannelRole r = parse_role(role);
            GilReleased unlocked;
            return attach(Channel::create(name, o, r));
          },
          "name"_a, nb::kw_only(), "slots"_a = 4, "slot_bytes"_a = 1 << 20, "header_bytes"_a = 256, "kind"_a = "device",
          "device"_a = 0, "mode"_a = 0600, "role"_a = "producer", "pacing"_a = nb::none(),
          "pacing_ahead"_a = nb::none())
      .def_static(
          "open",
          [](std::string_view name, std::string_view role, std::optional<double> wait, std::optional<int> device,
             std::optional<double> pacing, std::optional<std::int64_t> pacing_ahead) {
            const ChannelRole r = parse_role(role);
            const int dev = device.value_or(-1);
            const auto p = to_pacing(pacing);
            const auto a = to_ahead(pacing_ahead);
            return open_in_slices(wait, "channel '" + std::string(name) + "'", [&](std::chrono::milliseconds slice) {
              return attach(Channel::open(name, r, {.wait = slice, .device = dev, .pacing = p, .pacing_ahead = a}));
            });
          },
          "name"_a, nb::kw_only(), "role"_a, "wait"_a = nb::none(), "device"_a = nb::none(), "pacing"_a = nb::none(),
          "pacing_ahead"_a = nb::none())
      .def_static(
          "stat",
          [](std::string_view name) {
            ChannelStats st;
            {
              GilReleased unlocked;
              st = Channel::stat(name);
            }
            return stats_dict(st);
          },
          "name"_a, "The counters of channel ``name`` without joining it (read permission needed).")
      .def_static(
          "unlink",
          [](std::string_view name) {
            GilReleased unlocked;
            Channel::unlink(name);
          },
          "name"_a)
      .def(
          "acquire",
          [](PyChannel& c, std::uintptr_t stream, std::optional<double> timeout) {
            SlotView slot;
            const Locked g = wait_locked(c, timeout, "acquire", [&](Channel& ch, std::chrono::nanoseconds slice) {
              return ch.acquire(to_stream(stream), slice, slot);
            });
            const bool gpu = g.ch().kind() == SegmentKind::Device;
            const std::uintptr_t address = gpu ? slot.device_pointer : reinterpret_cast<std::uintptr_t>(slot.data);
            auto view = ArrayView::bytes(owner_of(g, address), address, slot.capacity, false, gpu ? kDLCUDA : kDLCPU,
                                         gpu ? g.ch().device() : 0);
            return std::make_tuple(std::move(view), slot.sequence);
          },
          "stream"_a, "timeout"_a = nb::none(), "Claims the next free slot: (bytes view of its capacity, sequence).")
      .def(
          "publish",
          [](PyChannel& c, nb::bytes header, std::size_t nbytes, std::uintptr_t stream,
             std::optional<std::uint64_t> slot) {
            const Locked g = lock(c);
            auto what = [&] { return "publish on channel '" + g.ch().name() + "'"; };
            if (slot && !holds(*g.state, *slot)) {
              throw StatusError(Status::InvalidState,
                                fmt::format("slot {} of channel '{}': already published", *slot, g.ch().name()));
            }
            if (g.ch().held() == 0) throw StatusError(Status::InvalidState, what() + ": no slot is acquired");
            const std::uint64_t sequence = g.ch().held_sequence(0);
            if (slot && *slot != sequence) {
              if (g.ch().kind() == SegmentKind::Device) {
                throw StatusError(Status::InvalidState,
                                  fmt::format("slot {} of channel '{}': publish the older acquired slots first (a "
                                              "device channel's slots are published in the order acquired: give each "
                                              "thread a handle of its own)",
                                              *slot, g.ch().name()));
              }
              // A host channel: published once the older ones are (another thread of this handle has them).
              g.state->early[*slot] = {std::string(header.c_str(), header.size()), nbytes};
              return *slot;
            }
            const std::span<const std::byte> h(static_cast<const std::byte*>(header.data()), header.size());
            const std::uint32_t held = g.ch().held();
            const Status s = g.ch().publish(to_stream(stream), h, nbytes);
            if (s == Status::InvalidState && g.ch().held() + 1 == held) {  // the slot was dropped: not ours any more
              throw StatusError(s, what() +
                                       ": the broker took this process for gone (its connection closed and it "
                                       "neither rejoined nor exited in time) and gave its slot up");
            }
            if (s != Status::Ok) check_status(s, what());
            settle_early(*g.state);
            return sequence;
          },
          "header"_a, "nbytes"_a, "stream"_a, "slot"_a = nb::none(),
          "Publishes the oldest acquired slot; returns its sequence. ``slot``: the one to publish: on a host "
          "channel, one behind older acquired slots is published once they are; InvalidState when already "
          "published, or, on a device channel, when older slots are still acquired.")
      .def(
          "send_copy",
          [](PyChannel& c, std::uintptr_t source, std::size_t nbytes, nb::bytes header, std::uintptr_t stream,
             std::optional<double> timeout) {
            const std::span<const std::byte> h(static_cast<const std::byte*>(header.data()), header.size());
            const void* src = reinterpret_cast<const void*>(source);  // NOLINT(performance-no-int-to-ptr)
            std::uint64_t sequence = 0;
            wait_locked(c, timeout, "send", [&](Channel& ch, std::chrono::nanoseconds slice) {
              return ch.send(to_stream(stream), src, nbytes, h, slice, sequence);
            });
            return sequence;
          },
          "source"_a, "nbytes"_a, "header"_a, "stream"_a, "timeout"_a = nb::none(),
          "Copies ``nbytes`` at address ``source`` (device channels: GPU or host memory, copied in ``stream`` "
          "order; host channels: host memory) into the next free slot and publishes it with ``header``.")
      .def(
          "receive",
          [](PyChannel& c, std::uintptr_t stream, std::optional<double> timeout) {
            MessageView msg;
            const Locked g = [&] {
              try {
                return wait_locked(c, timeout, "receive", [&](Channel& ch, std::chrono::nanoseconds slice) {
                  return ch.receive(to_stream(stream), slice, msg);
                });
              } catch (const StatusError& e) {
                // The generic text lists five causes; a consumer holding every slot's message is the likely one.
                if (e.status() != Status::InvalidState || !c.state) throw;
                const Locked held = lock(c);
                if (held.ch().role() != ChannelRole::Consumer || held.ch().held() < held.ch().slots()) throw;
                throw StatusError(Status::InvalidState,
                                  fmt::format("receive on channel '{}': this handle holds a message in each of its "
                                              "{} slots; release one first (one released ahead of older ones is "
                                              "held until they are)",
                                              held.ch().name(), held.ch().slots()));
              }
            }();
            const bool gpu = g.ch().kind() == SegmentKind::Device;
            const std::uintptr_t address = gpu ? msg.device_pointer : reinterpret_cast<std::uintptr_t>(msg.data);
            auto view = ArrayView::bytes(owner_of(g, address), address, msg.size, true, gpu ? kDLCUDA : kDLCPU,
                                         gpu ? g.ch().device() : 0);
            nb::bytes header(msg.header.data(), msg.header.size());
            return std::make_tuple(std::move(view), std::move(header), msg.sequence);
          },
          "stream"_a, "timeout"_a = nb::none(),
          "Takes the next message: (read-only bytes view of its payload, header bytes, sequence).")
      .def(
          "release",
          [](PyChannel& c, std::uintptr_t stream, std::optional<std::uint64_t> message,
             bool skipped) -> std::optional<std::uint64_t> {
            if (message && !c.state) return std::nullopt;  // a closed handle gave its messages back
            const Locked g = lock(c);
            auto what = [&] { return "release on channel '" + g.ch().name() + "'"; };
            if (message && !holds(*g.state, *message)) return std::nullopt;  // released already
            if (g.ch().held() == 0) throw StatusError(Status::InvalidState, what() + ": no message is held");
            const std::uint64_t sequence = g.ch().held_sequence(0);
            if (message && *message != sequence) {
              if (g.ch().kind() == SegmentKind::Device && !skipped) {
                throw StatusError(Status::InvalidState,
                                  fmt::format("message {} of channel '{}': release the older messages first (held: "
                                              "[{}]; a device channel's messages are released in the order received: "
                                              "give each thread a handle of its own)",
                                              *message, g.ch().name(), fmt::join(held_sequences(*g.state), ", ")));
              }
              // Released once the older ones are (another thread of this handle has them), from the host: a host
              // channel's release waits for no stream, and an aborted message was read by none.
              g.state->early[*message] = {};
              return *message;
            }
            const std::uint32_t held = g.ch().held();
            const Status s = g.ch().release(to_stream(stream));
            if (s == Status::InvalidState && g.ch().held() + 1 == held) {  // the message was dropped: not ours any more
              throw StatusError(s, what() +
                                       ": the broker took this process for gone (its connection closed and it "
                                       "neither rejoined nor exited in time) and gave the message to another "
                                       "consumer");
            }
            if (s != Status::Ok) check_status(s, what());
            settle_early(*g.state);
            return sequence;
          },
          "stream"_a, "message"_a = nb::none(), "skipped"_a = false,
          "Releases the oldest received message; returns its sequence. ``message``: the one to release: None when "
          "it is no longer held (released, or this handle closed); on a host channel (or ``skipped``: an aborted "
          "message recv skips), one behind older held messages is released once they are; on a device channel "
          "InvalidState.")
      .def(
          "incomplete",
          [](PyChannel& c, std::uint64_t sequence) {
            const Locked g = lock(c);
            if (const auto partial = g.ch().incomplete(sequence)) return *partial;
            throw Error(ErrorCode::InvalidArgument, "only a consumer receives messages", "incomplete");
          },
          "sequence"_a,
          "Whether message ``sequence`` may be partial (its producer died while writing), held or released.")
      .def_prop_ro("name", [](PyChannel& c) { return lock(c).ch().name(); })
      .def_prop_ro("role", [](PyChannel& c) { return role_name(lock(c).ch().role()); })
      .def_prop_ro("kind", [](PyChannel& c) { return std::string(to_string(lock(c).ch().kind())); })
      .def_prop_ro("slots", [](PyChannel& c) { return lock(c).ch().slots(); })
      .def_prop_ro("slot_bytes", [](PyChannel& c) { return lock(c).ch().slot_bytes(); })
      .def_prop_ro("header_bytes", [](PyChannel& c) { return lock(c).ch().header_bytes(); })
      .def_prop_ro("device", [](PyChannel& c) { return lock(c).ch().device(); })
      .def_prop_ro("closed", [](const PyChannel& c) { return !c.state; })
      .def(
          "holds",
          [](const PyChannel& c, std::uint64_t sequence) {
            if (!c.state) return false;
            return holds(*lock(c).state, sequence);
          },
          "sequence"_a,
          "Whether this handle holds ``sequence`` (an acquired slot, a received message); False once closed.")
      .def_prop_ro(
          "held", [](PyChannel& c) { return held_sequences(*lock(c).state); },
          "Sequences of the slots this producer acquired and has not published, or of the messages this consumer "
          "received and has not released, oldest first.")
      .def_prop_ro(
          "held_back", [](PyChannel& c) { return lock(c).state->early.size(); },
          "How many slots published, or messages released, ahead of older ones wait for those (host channels).")
      .def_prop_ro("stats", [](PyChannel& c) { return stats_dict(lock(c).ch().stats()); })
      .def_prop_rw(
          "pacing", [](PyChannel& c) { return std::chrono::duration<double>(lock(c).ch().pacing()).count(); },
          [](PyChannel& c, double seconds) { lock(c).ch().set_pacing(*to_pacing(seconds)); },
          "Seconds acquire and receive watch a peer's GPU progress on the host before a stream wait.")
      .def_prop_rw(
          "pacing_ahead", [](PyChannel& c) { return lock(c).ch().pacing_ahead(); },
          [](PyChannel& c, std::int64_t messages) { lock(c).ch().set_pacing_ahead(*to_ahead(messages)); },
          "How many messages a pacing producer may run ahead of the consumers' streams (1..slots).")
      .def("close", [](PyChannel& c) {
        std::shared_ptr<ChannelState> st = std::move(c.state);
        if (!st) return;
        GilReleased unlocked;
        {
          const Contending waiting(*st);
          std::unique_lock<std::timed_mutex> l(st->mutex);
          // Views hold the slots' mapping through their own handle: leave the channel now. Without that handle
          // the views hold this state, and the channel is left when the last of them goes.
          if (st->slots) {
            Channel gone = std::move(st->ch);
          }
        }
        st.reset();
      });
}

}  // namespace gpuipc::py
