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

}  // namespace

Result<SharedMemory> SharedMemory::Create(const std::string& name, uint64_t bytes) {
  SP_RETURN_IF_ERROR(CheckArguments(name, bytes));
  const int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return AlreadyExistsError("shared memory '" + name + "' already exists");
    return Errno("shm_open", name, errno);
  }
  int err = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (err == 0) {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    while (err == EINTR) err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  }
  if (err != 0) {
    close(fd);
    shm_unlink(name.c_str());
    if (err == ENOSPC || err == EFBIG || err == ENOMEM) {
      return ResourceExhaustedError("reserving " + std::to_string(bytes) +
                                    " bytes of shared memory '" + name +
                                    "' failed: " + std::strerror(err));
    }
    return Errno("reserving", name, err);
  }
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  err = errno;
  close(fd);
  if (at == MAP_FAILED) {
    shm_unlink(name.c_str());
    return Errno("mmap", name, err);
  }
  return SharedMemory(static_cast<std::byte*>(at), bytes);
}

Result<SharedMemory> SharedMemory::Open(const std::string& name, uint64_t bytes,
                                        double wait_seconds) {
  SP_RETURN_IF_ERROR(CheckArguments(name, bytes));
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
    const uint64_t reserved = static_cast<uint64_t>(st.st_blocks) * 512;
    if (size == bytes && reserved >= bytes) break;
    const std::string holds = "holds " + std::to_string(size) + " bytes (" +
                              std::to_string(reserved) + " reserved)";
    // Another size than the creator's first (empty) one is another object, at once.
    if ((size != 0 && size != bytes) || wait_seconds <= 0) {
      close(fd);
      return FailedPreconditionError("shared memory '" + name + "' " + holds + ", expected " +
                                     std::to_string(bytes) + " reserved");
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >
        wait_seconds) {
      close(fd);
      return DeadlineExceededError("shared memory '" + name + "' was not sized within " +
                                   std::to_string(wait_seconds) + " s (it " + holds +
                                   ", expected " + std::to_string(bytes) + " reserved)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void* at = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (at == MAP_FAILED) return Errno("mmap", name, err);
  return SharedMemory(static_cast<std::byte*>(at), bytes);
}

void SharedMemory::Unlink(const std::string& name) {
  if (SharedMemory::ValidName(name)) shm_unlink(name.c_str());
}

SharedMemory::~SharedMemory() {
  if (data_ != nullptr) munmap(data_, size_);
}

#else  // !__linux__

Result<SharedMemory> SharedMemory::Create(const std::string& name, uint64_t) {
  return UnimplementedError("shared memory '" + name + "': needs Linux (shm_open)");
}
Result<SharedMemory> SharedMemory::Open(const std::string& name, uint64_t, double) {
  return UnimplementedError("shared memory '" + name + "': needs Linux (shm_open)");
}
void SharedMemory::Unlink(const std::string&) {}
SharedMemory::~SharedMemory() = default;

#endif  // __linux__

SharedMemory::SharedMemory(SharedMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

SharedMemory& SharedMemory::operator=(SharedMemory&& other) noexcept {
  if (this != &other) {
    SharedMemory gone(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace sp
