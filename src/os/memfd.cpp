#include "os/memfd.hpp"

#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <utility>

#include "base/errors.hpp"

namespace gpuipc::os {

UniqueFd memfd_create(const std::string& name, std::size_t size) {
  const std::string what = fmt::format("memfd '{}'", name);
  UniqueFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw_system("memfd_create", what);
  fd = above_stdio(std::move(fd), what.c_str());
  if (::fchmod(fd.get(), 0600) != 0) throw_system("fchmod", what);
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) != 0) {
    throw_system("ftruncate", fmt::format("{} ({} bytes)", what, size));
  }
  return fd;
}

FileOwner file_owner(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_system("fstat", fmt::format("fd {}", fd));
  return FileOwner{st.st_uid, static_cast<unsigned>(st.st_mode & 07777)};
}

void file_chmod(int fd, unsigned mode) {
  if (::fchmod(fd, static_cast<mode_t>(mode)) != 0) throw_system("fchmod", fmt::format("fd {} to {:04o}", fd, mode));
}

namespace {

/// statx of `fd` from the inode as the kernel has it (AT_STATX_DONT_SYNC): the broker looks at fds clients send,
/// and fstat of a FUSE file asks its daemon (GETATTR), which may never answer. Its file type cannot be forged that
/// way: a FUSE inode keeps its type, and a character device opens through its driver (FUSE mounts of users are
/// nodev). Returns false when statx fails.
bool cached_statx(int fd, unsigned mask, struct statx& out) noexcept {
  return ::statx(fd, "", AT_EMPTY_PATH | AT_STATX_DONT_SYNC, mask, &out) == 0;
}

}  // namespace

std::uint64_t filesystem_device(int fd) noexcept {
  struct statx sx {};
  if (!cached_statx(fd, STATX_TYPE, sx)) return 0;
  return (static_cast<std::uint64_t>(sx.stx_dev_major) << 20) | sx.stx_dev_minor;
}

bool abort_fuse_connection(std::uint64_t dev) noexcept {
  try {
    const UniqueFd abort(::open(fmt::format("/sys/fs/fuse/connections/{}/abort", dev).c_str(), O_WRONLY | O_CLOEXEC));
    return abort && ::write(abort.get(), "1", 1) == 1;
  } catch (...) {
    return false;
  }
}

bool is_nvidia_export(int fd) {
  // Measured on H100 and H200 (driver 580): the exported fd is an open file of /dev/nvidiactl, 195:255.
  constexpr unsigned kNvidiaMajor = 195;
  struct statx sx {};
  return cached_statx(fd, STATX_TYPE, sx) && S_ISCHR(sx.stx_mode) && sx.stx_rdev_major == kNvidiaMajor;
}

void memfd_seal(int fd, unsigned seals) {
  if (::fcntl(fd, F_ADD_SEALS, static_cast<int>(seals)) != 0) {
    throw_system("fcntl(F_ADD_SEALS)", fmt::format("memfd fd {} (seals {:#x})", fd, seals));
  }
}

unsigned memfd_seals(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) throw_system("fcntl(F_GET_SEALS)", fmt::format("memfd fd {}", fd));
  return static_cast<unsigned>(seals);
}

std::size_t fd_size(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_system("fstat", fmt::format("fd {}", fd));
  return static_cast<std::size_t>(st.st_size);
}

UniqueFd reopen_readonly(int fd) {
  const std::string path = fmt::format("/proc/self/fd/{}", fd);
  UniqueFd ro(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!ro) throw_system("open(O_RDONLY)", path);
  return above_stdio(std::move(ro), path.c_str());
}

UniqueFd reopen_readwrite(int fd) {
  const std::string path = fmt::format("/proc/self/fd/{}", fd);
  UniqueFd rw(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!rw) throw_system("open(O_RDWR)", path);
  return above_stdio(std::move(rw), path.c_str());
}

FileId file_id(int fd) {
  struct statx sx {};
  if (!cached_statx(fd, STATX_INO, sx)) throw_system("statx", fmt::format("fd {}", fd));
  // dev_t as fstat gives it (journals recorded those).
  return FileId{static_cast<std::uint64_t>(makedev(sx.stx_dev_major, sx.stx_dev_minor)), sx.stx_ino};
}

Mapping Mapping::map(int fd, std::size_t size, bool writable, std::size_t offset) {
  const auto what = [&] {
    return fmt::format("mapping of {} bytes at offset {} of fd {} ({})", size, offset, fd,
                       writable ? "read-write" : "read-only");
  };
  if (size == 0) throw Error(ErrorCode::InvalidArgument, what() + ": mmap failed: the size is 0", "mmap", EINVAL);
  // A file shorter than the mapping maps without error, and the first touch past its end raises SIGBUS: the fd came
  // from another process (the broker's answer, a client's create), which says how large it is.
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_system("fstat", what());
  if (S_ISREG(st.st_mode) &&
      (static_cast<std::uint64_t>(st.st_size) < offset || static_cast<std::uint64_t>(st.st_size) - offset < size)) {
    throw Error(ErrorCode::Protocol, fmt::format("{}: the file holds only {} bytes", what(), st.st_size), "mmap");
  }
  const int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  void* data = ::mmap(nullptr, size, prot, MAP_SHARED, fd, static_cast<off_t>(offset));
  if (data == MAP_FAILED) throw_system("mmap", what());
  return Mapping(data, size);
}

Mapping Mapping::anonymous(std::size_t size) {
  const auto what = [&] { return fmt::format("anonymous mapping of {} bytes", size); };
  if (size == 0) throw Error(ErrorCode::InvalidArgument, what() + ": mmap failed: the size is 0", "mmap", EINVAL);
  void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw_system("mmap", what());
  return Mapping(data, size);
}

void discard_pages(void* addr, std::size_t size) {
  if (::madvise(addr, size, MADV_REMOVE) != 0) {
    throw_system("madvise", fmt::format("releasing the pages of {} bytes at {} (MADV_REMOVE)", size, addr));
  }
}

Mapping::Mapping(Mapping&& other) noexcept
    : m_data(std::exchange(other.m_data, nullptr)), m_size(std::exchange(other.m_size, 0)) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    if (m_data != nullptr) ::munmap(m_data, m_size);
    m_data = std::exchange(other.m_data, nullptr);
    m_size = std::exchange(other.m_size, 0);
  }
  return *this;
}

Mapping::~Mapping() {
  if (m_data != nullptr) ::munmap(m_data, m_size);
}

std::size_t page_size() noexcept {
  static const std::size_t size = [] {
    const long value = ::sysconf(_SC_PAGESIZE);
    return value > 0 ? static_cast<std::size_t>(value) : std::size_t{4096};
  }();
  return size;
}

bool host_readable(const void* ptr) noexcept {
  std::FILE* maps = std::fopen("/proc/self/maps", "re");
  if (maps == nullptr) return false;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  bool readable = false;
  char line[512];
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    std::uintmax_t start = 0;
    std::uintmax_t end = 0;
    char perms[5] = {};
    if (std::sscanf(line, "%" SCNxMAX "-%" SCNxMAX " %4s", &start, &end, perms) != 3) continue;
    if (addr >= start && addr < end) {
      readable = perms[0] == 'r';
      break;
    }
  }
  std::fclose(maps);
  return readable;
}

}  // namespace gpuipc::os
