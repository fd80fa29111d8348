// How long the broker's check of a new pool's chunk names (Registry::pool_chunks_refusal: up to kMaxChunks = 1024
// names formatted and looked up in the linked names and the names held over a restart) takes among 20000 linked names.
// Built by hand: g++ -O2 -std=c++20 bench/analysis/experiments/chunk_name_lookups.cpp -lfmt -o /tmp/lookups
#include <fmt/format.h>
#include <chrono>
#include <map>
#include <string>
#include <unordered_map>
#include <cstdio>
int main() {
  std::unordered_map<std::string, std::uint64_t> names;
  std::map<std::string, int> restore;
  for (int i = 0; i < 20000; ++i) names[fmt::format("user.model.layer{}.weights", i)] = i;
  std::string pool = "trainer.policy.pool";
  double best = 1e9;
  for (int rep = 0; rep < 50; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    int found = 0;
    for (unsigned c = 0; c < 1024; ++c) {
      const std::string chunk = fmt::format("{}.chunk.{}", pool, c);
      found += names.count(chunk) + restore.count(chunk);
    }
    auto us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (us < best) best = us;
    if (found) return 1;
  }
  std::printf("1024 chunk-name lookups among 20000 names: best of 50 %.1f us\n", best);
}
