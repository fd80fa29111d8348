// Anonymous shared memory files (memfd) and memory mappings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "os/fd.hpp"

namespace gpuipc::os {

/// memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING) and ftruncate to `size`. The inode gets mode 0600 (memfds
/// are born 0777): a process of another uid that is handed a read-only fd cannot reopen it writable through
/// /proc/self/fd/N. Throws Error naming `name`.
UniqueFd memfd_create(const std::string& name, std::size_t size);

/// Owner uid and permission bits of the inode behind fd (fstat).
struct FileOwner {
  uid_t uid = 0;
  unsigned mode = 0;  ///< st_mode & 07777
};
FileOwner file_owner(int fd);

/// A new read-write open file description of the same file; throws Error(PermissionDenied) when the inode does
/// not allow this process to open it writable.
UniqueFd reopen_readwrite(int fd);

/// The identity of the file behind fd (st_dev, st_ino): two fds of one memfd have the same.
struct FileId {
  std::uint64_t dev = 0;
  std::uint64_t ino = 0;
  friend bool operator==(const FileId&, const FileId&) = default;
};
FileId file_id(int fd);

/// Makes the inode behind fd mode `mode` (fchmod). Throws Error(PermissionDenied) when the caller may not.
void file_chmod(int fd, unsigned mode);

/// Whether fd is an NVIDIA driver object exported as a POSIX fd (cuMemExportToShareableHandle): a file of the
/// driver's control device (character device major 195, /dev/nvidiactl), not a socket, pipe, memfd or file.
bool is_nvidia_export(int fd);

/// The device of `fd`'s filesystem as the kernel numbers it (MKDEV: major << 20 | minor; for a FUSE filesystem the
/// name of its connection's folder under /sys/fs/fuse/connections), from the inode as the kernel has it: no FUSE
/// daemon is asked. 0 when unknown.
std::uint64_t filesystem_device(int fd) noexcept;
/// Aborts FUSE connection `dev` (filesystem_device): its pending requests fail, a FLUSH a close waits for included.
/// False when there is no such connection or this process may not (only root may).
bool abort_fuse_connection(std::uint64_t dev) noexcept;

/// Adds seals (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL, ...) with F_ADD_SEALS. Throws Error.
void memfd_seal(int fd, unsigned seals);

/// The seals in force (F_GET_SEALS).
unsigned memfd_seals(int fd);

/// The size of the file behind fd (fstat).
std::size_t fd_size(int fd);

/// A new read-only open file description of the same file (open("/proc/self/fd/N", O_RDONLY | O_CLOEXEC)):
/// whoever receives it cannot map it writable (mmap(PROT_WRITE, MAP_SHARED) fails with EACCES).
UniqueFd reopen_readonly(int fd);

/// One mmap'ed region; unmaps on destruction. Move-only.
class Mapping {
 public:
  Mapping() noexcept = default;
  /// mmap(MAP_SHARED) of `size` bytes of fd at `offset`, PROT_READ and, if writable, PROT_WRITE. Throws Error;
  /// Error(Protocol) when fd is a file shorter than offset + size (touching past its end would raise SIGBUS).
  static Mapping map(int fd, std::size_t size, bool writable, std::size_t offset = 0);
  /// Anonymous private read-write memory (MAP_PRIVATE | MAP_ANONYMOUS).
  static Mapping anonymous(std::size_t size);
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  ~Mapping();

  void* data() const noexcept { return m_data; }
  std::size_t size() const noexcept { return m_size; }
  explicit operator bool() const noexcept { return m_data != nullptr; }

 private:
  Mapping(void* data, std::size_t size) noexcept : m_data(data), m_size(size) {}
  void* m_data = nullptr;
  std::size_t m_size = 0;
};

/// Frees the pages of [addr, addr + size) of a writable shared memfd mapping (madvise MADV_REMOVE: a hole is
/// punched in the file, for every process that maps it). The range stays mapped: reads then see zeros, and a write
/// allocates a fresh page. `addr` and `size` must be page-aligned. Throws Error naming the range.
void discard_pages(void* addr, std::size_t size);

/// The system page size.
std::size_t page_size() noexcept;

/// Whether `ptr` lies in a readable mapping of this process (/proc/self/maps): ordinary host memory. Address space
/// a GPU driver only reserves (PROT_NONE) and unmapped addresses are not. For error messages; never throws.
bool host_readable(const void* ptr) noexcept;

}  // namespace gpuipc::os
