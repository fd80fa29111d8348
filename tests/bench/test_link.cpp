// The bench suites' worker link (bench/harness/pair.hpp): a message longer than one datagram travels whole, with its fds.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "os/socket.hpp"
#include "pair.hpp"

namespace gpuipc::bench::pair {
namespace {

TEST(BenchLink, AMessageOfManySamplesArrivesWholeWithItsFds) {
  auto [a, b] = os::seqpacket_pair();
  const Link sender(a.get(), "receiver", "test"), receiver(b.get(), "sender", "test");
  // 3 x 22000 samples, as the pools suite's allocate worker reports: about 1 MB of JSON, far over one datagram.
  std::vector<double> samples(66'000);
  for (std::size_t i = 0; i < samples.size(); ++i) samples[i] = 12.5 + static_cast<double>(i) * 1e-3;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const os::UniqueFd read_end(fds[0]), write_end(fds[1]);
  sender.send({{"samples", samples}}, std::vector<int>{write_end.get()});
  std::vector<os::UniqueFd> got_fds;
  const nlohmann::json got = receiver.receive(5000, &got_fds);
  EXPECT_EQ(got.at("samples").get<std::vector<double>>(), samples);
  ASSERT_EQ(got_fds.size(), 1U);  // the caller's fd only; the memfd that carried the text is not handed on
  ASSERT_EQ(::write(got_fds[0].get(), "x", 1), 1);
  char c = 0;
  ASSERT_EQ(::read(read_end.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
  // A short one still goes as one datagram.
  sender.send({{"n", 1}});
  EXPECT_EQ(receiver.receive(5000).at("n"), 1);
}

}  // namespace
}  // namespace gpuipc::bench::pair
