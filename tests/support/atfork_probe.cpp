#include "support/atfork_probe.hpp"

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <csignal>

namespace gpuipc::test {
namespace {

std::atomic<int> g_count{0};
std::atomic<int> g_open{0};

[[maybe_unused]] bool every_catchable_signal_blocked() noexcept {
  sigset_t mask{};
  (void)::pthread_sigmask(SIG_SETMASK, nullptr, &mask);
  for (int sig = 1; sig < SIGRTMIN; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP || sig > 31) continue;  // 32 and 33 are glibc's own, never blocked
    if (sigismember(&mask, sig) != 1) return false;
  }
  for (int sig = SIGRTMIN; sig <= SIGRTMAX; ++sig) {
    if (sigismember(&mask, sig) != 1) return false;
  }
  return true;
}

}  // namespace

AtforkRegistrations atfork_registrations() noexcept { return {g_count.load(), g_open.load()}; }

}  // namespace gpuipc::test

// Not under TSan: its runtime registers its own fork handlers through this name before it can run instrumented code
// (the probe's tests skip there).
#if !defined(__SANITIZE_THREAD__)
using RegisterAtfork = int (*)(void (*)(), void (*)(), void (*)(), void*);

// glibc's own name, defined over libc's on purpose (see atfork_probe.hpp).
// NOLINTNEXTLINE(bugprone-reserved-identifier,cert-dcl37-c,cert-dcl51-cpp)
extern "C" int __register_atfork(void (*prepare)(), void (*parent)(), void (*child)(), void* dso_handle) {
  if (!gpuipc::test::every_catchable_signal_blocked()) gpuipc::test::g_open.fetch_add(1);
  gpuipc::test::g_count.fetch_add(1);
  static const auto real = reinterpret_cast<RegisterAtfork>(::dlvsym(RTLD_NEXT, "__register_atfork", "GLIBC_2.3.2"));
  return real == nullptr ? -1 : real(prepare, parent, child, dso_handle);
}
#endif
