// memfd creation, sizes, seals, read-only reopening and shared mappings.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "os/memfd.hpp"
#include "support/support.hpp"

namespace gpuipc {
namespace {

TEST(OsMemfd, CreateGivesASizedCloexecSealableFile) {
  const os::UniqueFd fd = os::memfd_create("gpuipc-test-create", 12345);
  ASSERT_TRUE(fd.valid());
  EXPECT_EQ(os::fd_size(fd.get()), 12345u);
  EXPECT_EQ(::fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  EXPECT_EQ(os::memfd_seals(fd.get()), 0u) << "MFD_ALLOW_SEALING leaves no seal in force";
  const auto target = std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(fd.get()));
  EXPECT_NE(target.string().find("gpuipc-test-create"), std::string::npos) << target;

  const os::UniqueFd empty = os::memfd_create("empty", 0);
  EXPECT_EQ(os::fd_size(empty.get()), 0u);
}

TEST(OsMemfd, SealsStopResizing) {
  const os::UniqueFd fd = os::memfd_create("sealed", 4096);
  ASSERT_EQ(::ftruncate(fd.get(), 8192), 0) << "resizing works before sealing";
  os::memfd_seal(fd.get(), F_SEAL_SHRINK | F_SEAL_GROW);
  EXPECT_EQ(os::memfd_seals(fd.get()), static_cast<unsigned>(F_SEAL_SHRINK | F_SEAL_GROW));
  errno = 0;
  EXPECT_NE(::ftruncate(fd.get(), 4096), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(::ftruncate(fd.get(), 16384), 0);
  EXPECT_EQ(os::fd_size(fd.get()), 8192u);

  os::memfd_seal(fd.get(), F_SEAL_SEAL);
  try {
    os::memfd_seal(fd.get(), F_SEAL_WRITE);
    FAIL() << "adding a seal after F_SEAL_SEAL succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::PermissionDenied) << e.what();
    EXPECT_NE(e.call().find("F_ADD_SEALS"), std::string::npos);
  }
}

TEST(OsMemfd, MappingIsSharedBetweenProcesses) {
  const std::size_t size = os::page_size();
  const os::UniqueFd fd = os::memfd_create("shared", size);
  const os::Mapping mine = os::Mapping::map(fd.get(), size, /*writable=*/true);
  ASSERT_TRUE(mine);
  ASSERT_EQ(mine.size(), size);
  std::memcpy(mine.data(), "from parent", 12);

  // The child maps the inherited fd on its own and writes after reading what the parent wrote.
  const int rc = test::run_child([&] {
    const os::Mapping theirs = os::Mapping::map(fd.get(), size, true);
    GPUIPC_CHILD_CHECK(std::strcmp(static_cast<const char*>(theirs.data()), "from parent") == 0);
    std::memcpy(theirs.data(), "from child", 11);
    return 0;
  });
  ASSERT_EQ(rc, 0);
  EXPECT_STREQ(static_cast<const char*>(mine.data()), "from child");
}

TEST(OsMemfd, MappingAtAnOffset) {
  const std::size_t page = os::page_size();
  const os::UniqueFd fd = os::memfd_create("offset", 2 * page);
  ASSERT_EQ(::pwrite(fd.get(), "second page", 11, static_cast<off_t>(page)), 11);
  const os::Mapping second = os::Mapping::map(fd.get(), page, false, page);
  EXPECT_EQ(std::memcmp(second.data(), "second page", 11), 0);
  EXPECT_THROW((void)os::Mapping::map(fd.get(), page, false, 1), Error) << "unaligned offsets are refused";
  EXPECT_THROW((void)os::Mapping::map(fd.get(), 0, false), Error);
}

TEST(OsMemfd, ReopenReadonlyCannotBeMappedWritable) {
  const std::size_t size = os::page_size();
  const os::UniqueFd fd = os::memfd_create("ro", size);
  {
    const os::Mapping rw = os::Mapping::map(fd.get(), size, true);
    std::memcpy(rw.data(), "weights", 8);
  }
  const os::UniqueFd ro = os::reopen_readonly(fd.get());
  ASSERT_TRUE(ro.valid());
  EXPECT_EQ(::fcntl(ro.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  EXPECT_EQ(::fcntl(ro.get(), F_GETFL) & O_ACCMODE, O_RDONLY);
  EXPECT_EQ(::write(ro.get(), "x", 1), -1);

  try {
    (void)os::Mapping::map(ro.get(), size, /*writable=*/true);
    FAIL() << "a read-only reopened memfd was mapped writable";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::PermissionDenied) << e.what();
    EXPECT_EQ(e.call(), "mmap");
  }
  const os::Mapping reader = os::Mapping::map(ro.get(), size, false);
  EXPECT_STREQ(static_cast<const char*>(reader.data()), "weights");
  // Reading the same file: a later write through the original fd shows.
  ASSERT_EQ(::pwrite(fd.get(), "W", 1, 0), 1);
  EXPECT_STREQ(static_cast<const char*>(reader.data()), "Weights");
}

TEST(OsMemfd, MappingMovesAndUnmaps) {
  os::Mapping a = os::Mapping::anonymous(os::page_size());
  ASSERT_TRUE(a);
  static_cast<char*>(a.data())[0] = 'a';  // writable private memory
  void* const where = a.data();
  os::Mapping b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): the moved-from state is what is tested
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.data(), where);

  os::Mapping c = os::Mapping::anonymous(os::page_size());
  void* const other = c.data();
  c = std::move(b);  // unmaps `other`
  EXPECT_EQ(c.data(), where);
  unsigned char vec = 0;
  errno = 0;
  EXPECT_EQ(::mincore(other, os::page_size(), &vec), -1) << "the replaced mapping was not unmapped";
  EXPECT_EQ(errno, ENOMEM);
  { const os::Mapping gone = std::move(c); }
  EXPECT_EQ(::mincore(where, os::page_size(), &vec), -1) << "the destructor did not unmap";
}

TEST(OsMemfd, ErrorsNameTheObject) {
  try {
    (void)os::memfd_create(std::string(300, 'n'), 1);  // names are limited to 249 bytes
    FAIL() << "an over-long memfd name was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.call(), "memfd_create");
    EXPECT_NE(std::string(e.what()).find("nnnn"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)os::fd_size(-1), Error);
  EXPECT_THROW((void)os::reopen_readonly(-1), Error);
  EXPECT_GE(os::page_size(), 4096u);
}

}  // namespace
}  // namespace gpuipc
