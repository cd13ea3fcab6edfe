#include "shardpoint/exec/shared_memory.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>

#ifdef __linux__
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#endif

namespace sp {

bool SharedMemory::ValidName(const std::string& name) {
  if (name.size() < 2 || name.size() > 201 || name[0] != '/') return false;
  return std::all_of(name.begin() + 1, name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           c == '.' || c == '_' || c == '-';
  });
}

#ifdef __linux__

namespace {

Status CheckArguments(const std::string& name, uint64_t bytes) {
  if (!SharedMemory::ValidName(name)) {
    return InvalidArgumentError("shared memory name '" + name +
                                "' is not '/' followed by 1 to 200 of [A-Za-z0-9._-]");
  }
  if (bytes == 0 || bytes > static_cast<uint64_t>(INT64_MAX)) {
    return InvalidArgumentError("shared memory '" + name + "': size " + std::to_string(bytes) +
                                " is out of range");
  }
  return OkStatus();
}

Status Errno(const std::string& call, const std::string& name, int err) {
  return InternalError(call + " of shared memory '" + name + "' failed: " + std::strerror(err));
}

// posix_fallocate of bytes [offset, offset + bytes) of `fd`: 0 or the error number.
int Fallocate(int fd, uint64_t offset, uint64_t bytes) {
  if (bytes == 0) return 0;
  int err = posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  while (err == EINTR) {
    err = posix_fallocate(fd, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  }
  return err;
}

Status ReserveError(const std::string& name, uint64_t offset, uint64_t bytes, int err) {
  if (err == ENOSPC || err == EFBIG || err == ENOMEM) {
    return ResourceExhaustedError("reserving " + std::to_string(bytes) + " bytes at " +
                                  std::to_string(offset) + " of shared memory '" + name +
                                  "' failed: " + std::strerror(err));
  }
  return Errno("reserving", name, err);
}

}  // namespace

Result<SharedMemory> SharedMemory::Create(const std::string& name, uint64_t bytes,
                                          std::optional<uint64_t> reserved) {
  SP_RETURN_IF_ERROR(CheckArguments(name, bytes));
  const uint64_t reserve = std::min(bytes, reserved.value_or(bytes));
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return AlreadyExistsError("shared memory '" + name + "' already exists");
    return Errno("shm_open", name, errno);
  }
  int err = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (err == 0) err = Fallocate(fd, 0, reserve);
  if (err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    return ReserveError(name, 0, reserve, err);
  }
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  err = errno;
  if (at == MAP_FAILED) {
    close(fd);
    shm_unlink(name.c_str());
    return Errno("mmap", name, err);
  }
  return SharedMemory(static_cast<std::byte*>(at), bytes, fd, name);
}

Status SharedMemory::Reserve(uint64_t offset, uint64_t bytes) const {
  if (offset > size_ || bytes > size_ - offset) {
    return InvalidArgumentError("reserving " + std::to_string(bytes) + " bytes at " +
                                std::to_string(offset) + " of shared memory '" + name_ +
                                "' of " + std::to_string(size_) + " bytes");
  }
  const int err = Fallocate(fd_, offset, bytes);
  return err == 0 ? OkStatus() : ReserveError(name_, offset, bytes, err);
}

Result<uint64_t> SharedMemory::AvailableBytes() const {
  struct statvfs fs;
  if (fstatvfs(fd_, &fs) != 0) return Errno("fstatvfs", name_, errno);
  return static_cast<uint64_t>(fs.f_bavail) * fs.f_frsize;
}

Result<SharedMemory> SharedMemory::Open(const std::string& name, uint64_t bytes,
                                        double wait_seconds, std::optional<uint64_t> reserved) {
  SP_RETURN_IF_ERROR(CheckArguments(name, bytes));
  const uint64_t expected = std::min(bytes, reserved.value_or(bytes));
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == ENOENT) return NotFoundError("shared memory '" + name + "' does not exist");
    return Errno("shm_open", name, errno);
  }
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      return Errno("fstat", name, err);
    }
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    const uint64_t held = static_cast<uint64_t>(st.st_blocks) * 512;
    if (size == bytes && held >= expected) break;
    const std::string holds =
        "holds " + std::to_string(size) + " bytes (" + std::to_string(held) + " reserved)";
    // Another size than the creator's first (empty) one is another object, at once.
    if ((size != 0 && size != bytes) || wait_seconds <= 0) {
      close(fd);
      return FailedPreconditionError("shared memory '" + name + "' " + holds + ", expected " +
                                     std::to_string(bytes) + " with " + std::to_string(expected) +
                                     " reserved");
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
        wait_seconds) {
      close(fd);
      return DeadlineExceededError("shared memory '" + name + "' was not sized within " +
                                   std::to_string(wait_seconds) + " s (it " + holds +
                                   ", expected " + std::to_string(bytes) + " with " +
                                   std::to_string(expected) + " reserved)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  if (at == MAP_FAILED) {
    close(fd);
    return Errno("mmap", name, err);
  }
  return SharedMemory(static_cast<std::byte*>(at), bytes, fd, name);
}

void SharedMemory::Unlink(const std::string& name) {
  if (SharedMemory::ValidName(name)) shm_unlink(name.c_str());
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

#else  // !__linux__

Result<SharedMemory> SharedMemory::Create(const std::string& name, uint64_t,
                                          std::optional<uint64_t>) {
  return UnimplementedError("shared memory '" + name + "': needs Linux (shm_open)");
}
Result<SharedMemory> SharedMemory::Open(const std::string& name, uint64_t, double,
                                        std::optional<uint64_t>) {
  return UnimplementedError("shared memory '" + name + "': needs Linux (shm_open)");
}
Status SharedMemory::Reserve(uint64_t, uint64_t) const {
  return UnimplementedError("shared memory '" + name_ + "': needs Linux (posix_fallocate)");
}
Result<uint64_t> SharedMemory::AvailableBytes() const {
  return UnimplementedError("shared memory '" + name_ + "': needs Linux (fstatvfs)");
}
void SharedMemory::Unlink(const std::string&) {}
SharedMemory::~SharedMemory() = default;

#endif  // __linux__

SharedMemory::SharedMemory(SharedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)),
      name_(std::move(other.name_)) {}

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    SharedMemory gone(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
    name_ = std::move(other.name_);
  }
  return *this;
}

}  // namespace sp
