// SharedMemory: a POSIX shared-memory object mapped into this process.
//
// The processes of one machine that share the reads of a load (engine/shared_load.h) hand each
// other the regions they read through one such object: one process creates it, the others open it
// by name once the creator has told them (through the communicator) that it exists, and the
// creator removes the name as soon as every process has it mapped, so that nothing stays in
// /dev/shm even when a process dies later. The object lives until its last mapping goes.
//
// Every page is reserved (posix_fallocate) before anyone touches it: on a full /dev/shm (a
// container's 64 MiB, filled by data loaders) a sparse object would raise SIGBUS at the first
// write of a missing page; reserved, it is an error at Create or Reserve. By default the creator
// reserves every page; a creator may reserve only the first pages, and the processes then reserve
// the rest piece by piece (Reserve) before they write there, each its own, so that the kernel's
// zeroing of the pages runs in all of them at once and when each piece is first needed rather
// than all of it up front in one process (about 0.5 ms per MiB).
//
// Linux only; elsewhere every call that can fail returns kUnimplemented. A SharedMemory is
// move-only and unmaps (and closes its descriptor) on destruction; the bytes may be used from any
// thread.
#ifndef SHARDPOINT_EXEC_SHARED_MEMORY_H_
#define SHARDPOINT_EXEC_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "shardpoint/base/result.h"

namespace sp {

class SharedMemory {
 public:
  // Creates the object `name` (one '/' then 1 to 200 of [A-Za-z0-9._-]) of `bytes` (> 0) bytes,
  // zero-filled, with its first `reserved` bytes reserved (at most `bytes`; every byte when
  // unset), and maps it. Errors: kInvalidArgument for a bad name or size, kAlreadyExists when an
  // object of that name exists, kResourceExhausted when the pages cannot be reserved (the object
  // is removed again), kInternal naming the call and errno for any other failure.
  static Result<SharedMemory> Create(const std::string& name, uint64_t bytes,
                                     std::optional<uint64_t> reserved = std::nullopt);

  // Opens and maps the object `name` that another process created with `bytes` bytes, of which
  // the creator reserved the first `reserved` (every byte when unset). Errors: kNotFound when
  // there is none, kFailedPrecondition when it holds another size or fewer reserved bytes
  // (naming both), kInternal as above. With `wait_seconds` > 0, an object that is still empty
  // or not yet reserved (its creator between shm_open and posix_fallocate, for processes that
  // race to create it rather than being told it exists) is waited for that long, and then
  // refused with kDeadlineExceeded; its pages are never touched before they are there.
  static Result<SharedMemory> Open(const std::string& name, uint64_t bytes,
                                   double wait_seconds = 0,
                                   std::optional<uint64_t> reserved = std::nullopt);

  // Whether `name` is a name Create and Open take.
  static bool ValidName(const std::string& name);

  // Removes the name (the mappings stay valid); no error when it is already gone.
  static void Unlink(const std::string& name);

  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

  // Reserves bytes [offset, offset + bytes) of the object (they must lie in it), which may then be
  // written. kResourceExhausted, naming the object and the bytes, when the file system holding
  // it is full; kInternal for any other failure.
  Status Reserve(uint64_t offset, uint64_t bytes) const;

  // Bytes still free on the file system that holds the object (/dev/shm).
  Result<uint64_t> AvailableBytes() const;

 private:
  SharedMemory(std::byte* data, uint64_t size, int fd, std::string name)
      : data_(data), size_(size), fd_(fd), name_(std::move(name)) {}

  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;  // kept for Reserve and AvailableBytes
  std::string name_;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_SHARED_MEMORY_H_
