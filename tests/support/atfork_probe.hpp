// Watches the fork handlers this program registers, to check the signal mask they are registered under.
#pragma once

namespace gpuipc::test {

/// How many pthread_atfork calls of this program the probe saw, and how many of them ran with a catchable signal
/// unblocked in the registering thread.
struct AtforkRegistrations {
  int count = 0;
  int with_signals_open = 0;
};

/// What the probe saw so far in this process (a forked child starts with its parent's record). glibc links
/// pthread_atfork into each program (libc_nonshared.a) and it calls __register_atfork, which atfork_probe.cpp
/// defines over libc's: a count of 0 after a registration means the build bypasses it (a TSan build leaves it
/// out), and a test should skip.
AtforkRegistrations atfork_registrations() noexcept;

}  // namespace gpuipc::test
