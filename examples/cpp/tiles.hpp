// The work of the master/worker example: tiles of C = A x B, on the GPU or the CPU, and the messages about them.
#pragma once

#include <cstdint>

namespace example {

/// A task (the header of a message on NAME.tasks): compute tile (row, col) of C.
struct Task {
  std::uint32_t id, row, col;
  std::uint32_t tile;   ///< tile edge
  std::uint32_t tiles;  ///< tiles per edge of C
  std::uint32_t k;      ///< A is (tile*tiles) x k, B is k x (tile*tiles)
};
/// A result (the header of a message on NAME.results, whose payload is the tile, row-major floats).
struct Result {
  std::uint32_t id;
  std::int32_t worker_pid;
};

/// Small integers, so that every product and sum is exact in float and any order of summation gives the same tile.
inline float a_at(std::uint32_t i, std::uint32_t k) { return static_cast<float>((i + 2 * k) % 7); }
inline float b_at(std::uint32_t k, std::uint32_t j) { return static_cast<float>((3 * k + j) % 5); }

/// One element of C's tile on the CPU, A and B row-major as the master lays them out.
inline float tile_element(const float* a, const float* b, const Task& t, std::uint32_t r, std::uint32_t c) {
  const std::uint32_t n = t.tile * t.tiles, i = t.row * t.tile + r, j = t.col * t.tile + c;
  float sum = 0;
  for (std::uint32_t k = 0; k < t.k; ++k) sum += a[std::size_t{i} * t.k + k] * b[std::size_t{k} * n + j];
  return sum;
}

}  // namespace example
