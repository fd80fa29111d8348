// The multi-GPU decisions without a GPU: which GPU maps memory of another (core/device_choice.hpp), the
// Unsupported error when two GPUs have no peer access, NoDevice for GPUs hidden by CUDA_VISIBLE_DEVICES, how a link
// is classified (cuda/topology.hpp), and UUID parsing and the pool header's UUID. GPU runs of the same paths:
// tests/gpu/test_multigpu_device.cpp.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/device_choice.hpp"
#include "cuda/device.hpp"
#include "cuda/nvml.hpp"
#include "cuda/topology.hpp"
#include "gpuipc/error.hpp"
#include "shm/pool_block.hpp"

namespace gpuipc {
namespace {

constexpr const char* kOwner = "GPU-11111111-2222-3333-4444-555555555555";

core::DeviceChoice two_gpus(std::optional<int> owner, int requested, std::optional<int> current) {
  return {.owner_uuid = kOwner, .owner = owner, .requested = requested, .current = current, .device_count = 2};
}

core::DeviceChoice hidden_owner(int requested, int device_count) {
  return {.owner_uuid = kOwner, .owner = std::nullopt, .requested = requested, .current = std::nullopt,
          .device_count = device_count};
}

cuda::P2PAttributes attrs(bool access, int rank, bool atomics) {
  return {.access = access, .performance_rank = rank, .native_atomics = atomics, .array_access = false};
}

const auto kAllPeers = [](int, int) { return true; };
const auto kNoPeers = [](int, int) { return false; };

TEST(DeviceChoice, RequestedWinsThenCurrentThenOwner) {
  EXPECT_EQ(core::choose_mapping_device(two_gpus(1, 0, std::nullopt), kAllPeers), 0);
  EXPECT_EQ(core::choose_mapping_device(two_gpus(1, 0, 1), kAllPeers), 0);
  EXPECT_EQ(core::choose_mapping_device(two_gpus(1, -1, 0), kAllPeers), 0);
  EXPECT_EQ(core::choose_mapping_device(two_gpus(1, -1, std::nullopt), kAllPeers), 1);
}

TEST(DeviceChoice, SameGpuNeedsNoPeerAccess) {
  EXPECT_EQ(core::choose_mapping_device(two_gpus(1, 1, std::nullopt), kNoPeers), 1);
  EXPECT_EQ(core::choose_mapping_device(two_gpus(0, -1, std::nullopt), kNoPeers), 0);
}

TEST(DeviceChoice, NoPeerAccessIsUnsupportedWithAMessage) {
  int asked_from = -1, asked_to = -1;
  try {
    core::choose_mapping_device(two_gpus(1, 0, std::nullopt), [&](int from, int to) {
      asked_from = from;
      asked_to = to;
      return false;
    });
    FAIL() << "expected Unsupported";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Unsupported);
    const std::string m = e.what();
    EXPECT_NE(m.find("GPU 0 cannot map memory of GPU 1"), std::string::npos) << m;
    EXPECT_NE(m.find(kOwner), std::string::npos) << m;
    EXPECT_NE(m.find("no peer access"), std::string::npos) << m;
    EXPECT_NE(m.find("open it from GPU 1"), std::string::npos) << m;
  }
  EXPECT_EQ(asked_from, 0);  // the mapping GPU's access to the owner's memory
  EXPECT_EQ(asked_to, 1);
  // The current context's GPU is checked the same way.
  EXPECT_THROW(core::choose_mapping_device(two_gpus(1, -1, 0), kNoPeers), Error);
}

/// Sets an environment variable for a scope, and puts back what was there (or its absence) on the way out.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : m_name(name) {
    if (const char* old = std::getenv(name)) m_old = old;
    ::setenv(name, value, 1);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    if (m_old) {
      ::setenv(m_name, m_old->c_str(), 1);
    } else {
      ::unsetenv(m_name);
    }
  }

 private:
  const char* m_name;
  std::optional<std::string> m_old;
};

TEST(DeviceChoice, HiddenOwnerWithoutADeviceIsNoDeviceNamingTheUuid) {
  const ScopedEnv visible("CUDA_VISIBLE_DEVICES", "1");  // only for the message; nothing loads the driver here
  try {
    core::choose_mapping_device(hidden_owner(-1, 1), kAllPeers);
    FAIL() << "expected NoDevice";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NoDevice);
    const std::string m = e.what();
    EXPECT_NE(m.find(kOwner), std::string::npos) << m;
    EXPECT_NE(m.find("CUDA_VISIBLE_DEVICES \"1\""), std::string::npos) << m;
  }
}

TEST(DeviceChoice, HiddenOwnerWithARequestedDeviceIsLeftToTheDriver) {
  // No peer question can be asked about a GPU this process does not see: the driver decides at import.
  EXPECT_EQ(core::choose_mapping_device(hidden_owner(0, 1), kNoPeers), 0);
  const std::string m = core::invisible_owner_message(kOwner, 0, "cuMemImportFromShareableHandle failed");
  EXPECT_NE(m.find(kOwner), std::string::npos);
  EXPECT_NE(m.find("Make " + std::string(kOwner) + " visible"), std::string::npos) << m;
}

TEST(DeviceChoice, RequestedOrdinalBeyondTheVisibleGpusIsNoDevice) {
  try {
    core::choose_mapping_device(two_gpus(0, 2, std::nullopt), kAllPeers);
    FAIL() << "expected NoDevice";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NoDevice);
    EXPECT_NE(std::string(e.what()).find("sees 2 GPUs"), std::string::npos) << e.what();
  }
}

TEST(LinkClassification, NvmlWordFirstThenTheDriversHint) {
  PeerLink l;
  cuda::classify_link(l, attrs(true, 0, true),
                      cuda::NvmlLink{.nvlink = true, .nvlinks = 18, .pcie_path = "system"});
  EXPECT_EQ(l.link, "nvlink");
  EXPECT_EQ(l.link_source, "nvml");
  EXPECT_EQ(l.nvlinks, 18);
  EXPECT_EQ(l.pcie_path, "system");
  EXPECT_TRUE(l.native_atomics);

  PeerLink p;
  cuda::classify_link(p, attrs(true, 1, false),
                      cuda::NvmlLink{.nvlink = false, .nvlinks = 0, .pcie_path = "switch"});
  EXPECT_EQ(p.link, "pcie");
  EXPECT_EQ(p.link_source, "nvml");

  PeerLink inferred;
  cuda::classify_link(inferred, attrs(true, 0, true), std::nullopt);
  EXPECT_EQ(inferred.link, "nvlink");
  EXPECT_EQ(inferred.link_source, "cuda");
  PeerLink inferred_pcie;
  cuda::classify_link(inferred_pcie, attrs(true, 0, false), std::nullopt);
  EXPECT_EQ(inferred_pcie.link, "pcie");

  PeerLink none;
  cuda::classify_link(none, attrs(false, -1, false), std::nullopt);
  EXPECT_EQ(none.link, "unknown");
  EXPECT_EQ(none.link_source, "none");
  EXPECT_EQ(cuda::pcie_path_name(50), "system");
  EXPECT_EQ(cuda::pcie_path_name(7), "");
}

TEST(DeviceUuid, ParsesWhatFormatPrints) {
  const auto u = cuda::parse_uuid(kOwner);
  ASSERT_TRUE(u.has_value());
  EXPECT_EQ(cuda::format_uuid(*u), kOwner);
  EXPECT_TRUE(cuda::parse_uuid("11111111-2222-3333-4444-555555555555").has_value());  // prefix optional
  EXPECT_FALSE(cuda::parse_uuid("GPU-0").has_value());
  EXPECT_FALSE(cuda::parse_uuid("MIG-11111111-2222-3333-4444-55555555555x").has_value());
}

TEST(PoolHeader, KeepsTheDevicesUuidForEveryMember) {
  std::vector<std::byte> control(shm::pool_control_bytes(4));
  shm::PoolGeometry g;
  g.pool_id = 7;
  g.mode = shm::PoolMode::Variable;
  g.kind = 1;  // device
  g.device = 1;
  g.device_uuid = *cuda::parse_uuid(kOwner);
  g.max_chunks = 2;
  g.chunk_bytes = 2 << 20;
  g.max_records = 4;
  shm::init_pool(control.data(), g);
  shm::PoolGeometry read;
  ASSERT_TRUE(shm::read_geometry(control.data(), control.size(), read));
  EXPECT_EQ(read.device_uuid, g.device_uuid);
  EXPECT_EQ(read.device, 1);
}

}  // namespace
}  // namespace gpuipc
