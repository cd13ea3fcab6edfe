// BufferPool: staging buffers reused by the callers of one ThreadPool.
//
// A reader stages at most one buffer per running task, and tasks of every caller of a pool run on
// its threads, so the callers sharing a pool (in-process ranks loading at once) need no more
// buffers than it has threads. Allocating them afresh per call costs page faults (the kernel
// zeroes every page on first touch) and address-space locking that the reading threads then
// contend on; the pool keeps up to `capacity` free buffers of at most `max_keep_bytes` each while
// any caller is inside (Enter/Leave, or a BufferPool::Stay), and frees them when the last one
// leaves, so no memory stays held between loads. Thread-safe.
#ifndef SHARDPOINT_EXEC_BUFFER_POOL_H_
#define SHARDPOINT_EXEC_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "shardpoint/base/bytes.h"

namespace sp {

class BufferPool {
 public:
  BufferPool(size_t capacity, size_t max_keep_bytes);

  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `size` bytes whose address is a multiple of `alignment` (a power of
  // two): the smallest free one that fits, else a new one.
  AlignedBuffer Acquire(size_t size, size_t alignment = 4096);
  // Gives a buffer back: kept for reuse while a caller is inside and there is room, else freed.
  void Release(AlignedBuffer buffer);

  void Enter();
  void Leave();  // the last caller out frees every kept buffer

  // Enter for the lifetime of the object.
  class Stay {
   public:
    explicit Stay(BufferPool& pool) : pool_(pool) { pool_.Enter(); }
    ~Stay() { pool_.Leave(); }
    Stay(const Stay&) = delete;
    Stay& operator=(const Stay&) = delete;

   private:
    BufferPool& pool_;
  };

  size_t kept() const;        // free buffers held now
  uint64_t allocated() const;  // buffers allocated since construction
  uint64_t largest_asked() const;  // the largest size asked of Acquire since construction

 private:
  const size_t capacity_;
  const size_t max_keep_bytes_;
  mutable std::mutex mu_;
  std::vector<AlignedBuffer> free_;
  int callers_ = 0;
  uint64_t allocated_ = 0;
  uint64_t largest_asked_ = 0;
};

}  // namespace sp

#endif  // SHARDPOINT_EXEC_BUFFER_POOL_H_
