#include "core/membership.hpp"

#include <variant>

#include "core/client.hpp"
#include "proto/messages.hpp"

namespace gpuipc::core {

Membership join_member(const Segment& control, proto::Role role) {
  proto::Join req;
  req.id = control.id();
  req.role = static_cast<std::uint8_t>(role);
  auto reply = BrokerClient::instance().request(req);
  const auto* r = std::get_if<proto::JoinReply>(&reply.msg.body);
  if (r == nullptr) throw Error(ErrorCode::Protocol, "the broker answered Join with something else", "join");
  return Membership{r->member, r->token};
}

}  // namespace gpuipc::core
