#include "pair.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <csignal>
#include <optional>

#include "gpuipc/error.hpp"
#include "os/child.hpp"
#include "os/memfd.hpp"
#include "os/socket.hpp"
#include "workers.hpp"

namespace gpuipc::bench::pair {

using json = nlohmann::json;

namespace {
constexpr std::size_t kMaxMessage = 60 * 1024;
/// The envelope key of a message longer than kMaxMessage, whose text travels in a memfd (its size in bytes).
constexpr const char* kSpilled = "gpuipc_bench_spilled_bytes";
}  // namespace

void Link::send(const json& body, std::span<const int> fds) const {
  std::string text = body.dump();
  os::UniqueFd spill;
  std::vector<int> attached(fds.begin(), fds.end());
  if (text.size() > kMaxMessage) {
    // Too long for one datagram: the text goes in a memfd sent along, as the last fd, under a small envelope.
    spill = os::memfd_create("gpuipc-bench-message", text.size());
    for (std::size_t done = 0; done < text.size();) {
      const ssize_t n = ::pwrite(spill.get(), text.data() + done, text.size() - done, static_cast<off_t>(done));
      if (n <= 0)
        throw Error(ErrorCode::System, fmt::format("bench {}: writing a long message failed", m_suite), "pwrite");
      done += static_cast<std::size_t>(n);
    }
    text = json{{kSpilled, text.size()}}.dump();
    attached.push_back(spill.get());
  }
  const auto bytes = std::as_bytes(std::span<const char>(text.data(), text.size()));
  if (os::send_message(m_fd, bytes, attached, kMaxMessage) != os::IoStatus::Ok) {
    throw Error(ErrorCode::PeerDied, fmt::format("bench {}: the {} went away (send)", m_suite, m_peer), "send_message");
  }
}

json Link::receive(int timeout_ms, std::vector<os::UniqueFd>* fds_out) const {
  if (!os::wait_readable(m_fd, timeout_ms)) {
    throw Error(ErrorCode::Timeout,
                fmt::format("bench {}: no message from the {} within {} s", m_suite, m_peer, timeout_ms / 1000),
                "receive_message");
  }
  std::vector<std::byte> buffer(kMaxMessage + 1);
  std::size_t size = 0;
  std::vector<os::UniqueFd> fds;
  const auto status = os::receive_message(m_fd, buffer, size, fds);
  if (status == os::IoStatus::Closed) {
    throw Error(ErrorCode::PeerDied, fmt::format("bench {}: the {} went away", m_suite, m_peer), "receive_message");
  }
  if (status != os::IoStatus::Ok) {
    throw Error(ErrorCode::Protocol, fmt::format("bench {}: a truncated message from the {}", m_suite, m_peer),
                "receive_message");
  }
  const char* text = reinterpret_cast<const char*>(buffer.data());  // NOLINT: bytes of JSON text
  json body = json::parse(text, text + size, nullptr, false);
  if (body.is_object() && body.contains(kSpilled) && body[kSpilled].is_number_unsigned() && !fds.empty()) {
    std::string long_text(body[kSpilled].get<std::size_t>(), '\0');
    for (std::size_t done = 0; done < long_text.size();) {
      const ssize_t n =
          ::pread(fds.back().get(), long_text.data() + done, long_text.size() - done, static_cast<off_t>(done));
      if (n <= 0) {
        throw Error(ErrorCode::Protocol,
                    fmt::format("bench {}: a long message from the {} is cut short", m_suite, m_peer),
                    "receive_message");
      }
      done += static_cast<std::size_t>(n);
    }
    fds.pop_back();
    body = json::parse(long_text, nullptr, false);
  }
  if (body.is_discarded() || !body.is_object()) {
    throw Error(ErrorCode::Protocol, fmt::format("bench {}: a message from the {} is not a JSON object", m_suite, m_peer),
                "receive_message");
  }
  if (body.contains("error")) {
    throw Error(ErrorCode::PeerDied, fmt::format("bench {}: the {} failed: {}", m_suite, m_peer,
                                                 body["error"].is_string() ? body["error"].get<std::string>()
                                                                           : body["error"].dump()),
                "receive_message");
  }
  if (fds_out != nullptr) *fds_out = std::move(fds);
  return body;
}


std::pair<json, json> run_pair(const std::string& suite, const Body& a, const Body& b, std::chrono::seconds timeout,
                               bool b_drives) {
  auto [end_a, end_b] = os::seqpacket_pair();
  const int fa = end_a.get(), fb = end_b.get();
  const pid_t parent = ::getpid();
  auto body = [parent, &suite](int mine, int theirs, const char* peer, const Body& f) {
    return [=, &f]() -> json {
      if (!os::tie_to_parent(parent)) ::_exit(3);
      ::close(theirs);
      const Link link(mine, peer, suite);
      json out = f(link);
      ::close(mine);
      return out;
    };
  };
  Worker wa = spawn_worker(body(fa, fb, "importer process (B)", a));
  std::optional<Worker> wb;
  try {
    wb.emplace(spawn_worker(body(fb, fa, "exporter process (A)", b)));
  } catch (...) {
    end_a.reset();
    end_b.reset();
    join_worker(wa, std::chrono::seconds(30));
    throw;
  }
  end_a.reset();  // the workers hold the only ends now: either one's exit closes the other's socket
  end_b.reset();
  json ra, rb;
  if (b_drives) {
    rb = join_worker(*wb, timeout);
    ra = join_worker(wa, std::chrono::seconds(60));
  } else {
    ra = join_worker(wa, timeout);
    rb = join_worker(*wb, std::chrono::seconds(60));
  }
  if (ra.contains("error") || rb.contains("error")) {
    throw Error(ErrorCode::System,
                fmt::format("gpuipc bench {}: exporter process (A): {}; importer process (B): {}", suite,
                            ra.contains("error") ? ra["error"].dump() : "ok",
                            rb.contains("error") ? rb["error"].dump() : "ok"),
                "bench " + suite);
  }
  return {std::move(ra), std::move(rb)};
}

std::string to_hex(const void* data, std::size_t n) {
  std::string s;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) s += fmt::format("{:02x}", p[i]);
  return s;
}

void from_hex(const std::string& suite, const std::string& s, void* data, std::size_t n) {
  if (s.size() != 2 * n) throw Error(ErrorCode::Protocol, fmt::format("bench {}: malformed IPC handle", suite), "from_hex");
  auto* p = static_cast<unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<unsigned char>(std::stoul(s.substr(2 * i, 2), nullptr, 16));
}

std::string size_label(std::size_t bytes) {
  if (bytes >= kGiB && bytes % kGiB == 0) return fmt::format("{}GiB", bytes / kGiB);
  if (bytes >= kMiB && bytes % kMiB == 0) return fmt::format("{}MiB", bytes / kMiB);
  if (bytes >= kKiB && bytes % kKiB == 0) return fmt::format("{}KiB", bytes / kKiB);
  return fmt::format("{}B", bytes);
}

}  // namespace gpuipc::bench::pair
