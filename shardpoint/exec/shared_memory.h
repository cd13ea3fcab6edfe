// SharedMemory: a POSIX shared-memory object mapped into this process.
//
// The processes of one machine that share the reads of a load (engine/shared_load.h) hand each
// other the regions they read through one such object: one process creates it, the others open it
// by name once the creator has told them (through the communicator) that it exists, and the
// creator removes the name as soon as every process has it mapped, so that nothing stays in
// /dev/shm even when a process dies later. The object lives until its last mapping goes.
//
// The creator reserves every page (posix_fallocate) before anyone touches one: on a full /dev/shm
// (a container's 64 MiB, filled by data loaders) a sparse object would raise SIGBUS at the first
// write of a missing page; reserved, it is an error at Create, and the caller reads another way.
//
// Linux only; elsewhere Create and Open return kUnimplemented. A SharedMemory is move-only and
// unmaps on destruction; the bytes may be used from any thread.
#ifndef SHARDPOINT_EXEC_SHARED_MEMORY_H_
#define SHARDPOINT_EXEC_SHARED_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "shardpoint/base/result.h"

namespace sp {

class SharedMemory {
 public:
  // Creates the object `name` (one '/' then 1 to 200 of [A-Za-z0-9._-]) of `bytes` (> 0) bytes,
  // zero-filled, with every page reserved, and maps it. Errors: kInvalidArgument for a bad name
  // or size, kAlreadyExists when an object of that name exists, kResourceExhausted when the pages
  // cannot be reserved (the object is removed again), kInternal naming the call and errno for
  // any other failure.
  static Result<SharedMemory> Create(const std::string& name, uint64_t bytes);

  // Opens and maps the object `name` that another process created with `bytes` bytes. Errors:
  // kNotFound when there is none, kFailedPrecondition when it holds another size or not every
  // page is reserved (naming both), kInternal as above. With `wait_seconds` > 0, an object that is
  // still empty or not wholly reserved (its creator between shm_open and posix_fallocate, for
  // processes that race to create it rather than being told it exists) is waited for that long,
  // and then refused with kDeadlineExceeded; its pages are never touched before they are there.
  static Result<SharedMemory> Open(const std::string& name, uint64_t bytes,
                                   double wait_seconds = 0);

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

 private:
  SharedMemory(std::byte* data, uint64_t size) : data_(data), size_(size) {}

  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_SHARED_MEMORY_H_
