#include "core/membership.hpp"

#include <fmt/format.h>

#include <atomic>
#include <map>
#include <mutex>
#include <variant>

#include "base/log.hpp"
#include "core/segment_internal.hpp"
#include "os/process.hpp"
#include "proto/messages.hpp"

namespace gpuipc::core {
namespace {

struct Joined {
  std::weak_ptr<detail::Mapping> control;
  proto::Role role = proto::Role::None;
  std::uint32_t forks = 0;  ///< forks_so_far() at the join: a forked child does not rejoin its parent's entries
};

/// The memberships this process holds, by (index, token): tokens are the broker's and unique while held.
struct Registry {
  std::mutex mutex;
  std::map<std::pair<std::uint32_t, std::uint32_t>, Joined> joined;
};

Registry& registry() {
  static auto* r = new Registry();  // NOLINT: process lifetime (objects with static duration may leave late)
  return *r;
}

std::atomic<std::uint32_t> g_forks{0};  // NOLINT: process-wide by nature

void count_fork_in_child() { g_forks.fetch_add(1, std::memory_order_relaxed); }  // async-signal-safe

/// The broker's id of `control` on the connection of `generation`, for a request made under the client's lock
/// (BrokerClient::request_built): after a broker restart, the new broker's. Throws InvalidState when the mapping is
/// not registered through that connection (the new broker did not take its name back).
std::uint64_t id_on(const Segment& control, std::uint64_t generation) {
  const auto& map = detail::SegmentAccess::mapping(control);
  if (!map || map->client_generation.load() != generation) {
    throw Error(ErrorCode::InvalidState,
                fmt::format("segment '{}' is not registered with the running broker (it was restarted and did not "
                            "take the name back): open it again",
                            map ? map->name : std::string()),
                "join");
  }
  return map->id.load();
}

}  // namespace

std::uint32_t forks_so_far() noexcept { return g_forks.load(std::memory_order_relaxed); }

Membership join_member(const Segment& control, proto::Role role) {
  static std::once_flag counting_forks;
  std::call_once(counting_forks, [] { os::at_fork(nullptr, nullptr, count_fork_in_child); });
  auto reply = BrokerClient::instance().request_built([&](std::uint64_t generation) -> proto::Body {
    proto::Join req;
    req.id = id_on(control, generation);
    req.role = static_cast<std::uint8_t>(role);
    return req;
  });
  const auto* r = std::get_if<proto::JoinReply>(&reply.msg.body);
  if (r == nullptr) throw Error(ErrorCode::Protocol, "the broker answered Join with something else", "join");
  auto& reg = registry();
  {
    std::lock_guard lock(reg.mutex);
    reg.joined[{r->member, r->token}] = Joined{detail::SegmentAccess::mapping(control), role, forks_so_far()};
  }
  // Rejoins at once when the broker dies (its mapping did this already). Not under reg.mutex: keep_connected may
  // take the client's mutex, which a reconnect holds while its rebind hook takes reg.mutex (rejoin_members).
  BrokerClient::instance().keep_connected();
  return Membership{r->member, r->token, forks_so_far()};
}

bool leave_through_broker(const Segment& control, const Membership& member) noexcept {
  try {
    auto reply = BrokerClient::instance().request_built([&](std::uint64_t generation) -> proto::Body {
      proto::Leave req;
      req.id = id_on(control, generation);
      req.member = member.index;
      req.token = member.token;
      return req;
    });
    if (std::holds_alternative<proto::OkReply>(reply.msg.body)) return true;
    GPUIPC_LOG_DEBUG("the broker did not take over member {}'s leave: it leaves on its own", member.index);
  } catch (const std::exception& e) {
    GPUIPC_LOG_DEBUG("member {} leaves without the broker: {}", member.index, e.what());
  }
  return false;
}

void forget_member(const Membership& member) noexcept {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  reg.joined.erase({member.index, member.token});
}

void rejoin_members(std::uint64_t generation, const BrokerClient::Exchange& exchange) noexcept {
  auto& reg = registry();
  std::lock_guard lock(reg.mutex);
  for (auto& [key, j] : reg.joined) {
    if (j.forks != forks_so_far()) continue;  // the entry of a process this one was forked from
    auto control = j.control.lock();
    if (!control || control->client_generation != generation) continue;  // its name did not come back
    proto::Rejoin req;
    req.id = control->id;
    req.member = key.first;
    req.token = key.second;
    req.role = static_cast<std::uint8_t>(j.role);
    try {
      (void)exchange(req, {});
    } catch (const std::exception& e) {
      GPUIPC_LOG_INFO("member {} of '{}' not rejoined after the broker restart: {}", key.first, control->name,
                      e.what());
    }
  }
}

}  // namespace gpuipc::core
