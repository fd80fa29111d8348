// src/shm: the shared-memory protocol of semaphores, channels and pools. Every transition of a control block
// that more than one process makes (join, leave, the repair of a dead member) lives here once, CUDA-free, so that
// a client leaving cleanly and the broker repairing a crashed one run the same code with a different reason
// (iceoryx2's dynamic config is the model). Callers: src/core (clients) and src/broker (repairs). This layer calls
// only src/os and src/proto. Every function here tolerates any content of the shared words: a member with write
// access can scribble on them, and the broker must not crash or loop on what it reads.
//
// sync.hpp: the word-level helpers every block uses.
#pragma once

#include <cstdint>

#include "proto/shm.hpp"

namespace gpuipc::shm {

/// Bumps a futex word and wakes everyone sleeping on it. With `sleepers` (a count the waiters keep), the wake
/// system call is made only when someone sleeps: the common case of a busy peer costs no syscall.
void bump_and_wake(std::uint32_t& word, std::uint32_t* sleepers = nullptr) noexcept;

/// Most compare-and-swap attempts on a word other processes may write: a member that keeps writing it must not
/// hold up the broker, so after these the write is given up (that member garbles its own object, no more).
inline constexpr int kMostCasTries = 64;

/// Whether a 64-bit value word holds what no value is: its top bit set (values stay below 2^62, with the poison
/// bit below 2^63). Only a member that wrote garbage leaves one; as a number it passes every host comparison, yet a
/// stream waiting on the word compares cyclically and sees it below every value, so it is always replaced.
constexpr bool garbage(std::uint64_t word) noexcept { return (word >> 63) != 0; }

/// Stores max(word, value), ignoring the poison bit of the current value: GPU-visible words only ever grow. A
/// garbage word is replaced by `value`.
void raise_to(std::uint64_t& word, std::uint64_t value) noexcept;

/// Decrements `word` unless it is already 0 (a count never wraps, whatever another process wrote into it).
/// Returns the value before the decrement. Like raise_to, gives up after kMostCasTries lost races: only a member
/// rewriting the word all the while makes it, and that garbles the count of its own object.
std::uint32_t saturating_decrement(std::uint32_t& word) noexcept;

/// Increments `word` unless it is at its maximum. Returns the value before. Bounded as saturating_decrement.
std::uint32_t saturating_increment(std::uint32_t& word) noexcept;

}  // namespace gpuipc::shm
