// An NVTX injection library for tests/integration/test_trace.cpp: loaded by NVTX through NVTX_INJECTION64_PATH, it
// records the domains created and the ranges pushed and popped, which the test reads through
// gpuipc_nvtx_recorded(). What nsys does with the same calls, without nsys.
#include <nvtx3/nvToolsExt.h>

#include <mutex>
#include <string>

namespace {

std::mutex g_mutex;
std::string g_log;  // "domain NAME\n", "push NAME\n", "pop\n"

nvtxDomainHandle_t create_domain(const char* name) {
  std::lock_guard lock(g_mutex);
  g_log += std::string("domain ") + name + "\n";
  static int token;
  return reinterpret_cast<nvtxDomainHandle_t>(&token);
}

int push(nvtxDomainHandle_t, const nvtxEventAttributes_t* a) {
  std::lock_guard lock(g_mutex);
  g_log += std::string("push ") + (a->messageType == NVTX_MESSAGE_TYPE_ASCII ? a->message.ascii : "?") + "\n";
  return 0;
}

int pop(nvtxDomainHandle_t) {
  std::lock_guard lock(g_mutex);
  g_log += "pop\n";
  return 0;
}

template <typename F>
void install(NvtxFunctionTable table, unsigned size, unsigned id, F* f) {
  if (id < size && table[id] != nullptr) *table[id] = reinterpret_cast<NvtxFunctionPointer>(f);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_table) {
  const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_table(NVTX_ETID_CALLBACKS));
  if (callbacks == nullptr) return 0;
  NvtxFunctionTable table = nullptr;
  unsigned size = 0;
  if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) || table == nullptr) return 0;
  install(table, size, NVTX_CBID_CORE2_DomainCreateA, &create_domain);
  install(table, size, NVTX_CBID_CORE2_DomainRangePushEx, &push);
  install(table, size, NVTX_CBID_CORE2_DomainRangePop, &pop);
  return 1;
}

/// What was recorded so far (a copy).
__attribute__((visibility("default"))) const char* gpuipc_nvtx_recorded() {
  std::lock_guard lock(g_mutex);
  static thread_local std::string copy;
  copy = g_log;
  return copy.c_str();
}

}  // extern "C"
