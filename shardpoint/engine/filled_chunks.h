// The chunks of a streaming save (SaveOptions::fill_piece, used by conversion): pieces without
// memory whose bytes are fetched into a buffer just before they are written, with the bytes held
// at once bounded by a budget. Used by save.cc on every rank.
#ifndef SHARDPOINT_ENGINE_FILLED_CHUNKS_H_
#define SHARDPOINT_ENGINE_FILLED_CHUNKS_H_

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "shardpoint/engine/save.h"
#include "shardpoint/format/writer.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

// Bytes of streamed pieces held at once: Acquire blocks until `n` (at most the capacity) are free.
class ByteBudget {
 public:
  explicit ByteBudget(uint64_t capacity) : capacity_(std::max<uint64_t>(1, capacity)), free_(capacity_) {}
  uint64_t Acquire(uint64_t n) {
    n = std::min(n, capacity_);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return free_ >= n; });
    free_ -= n;
    return n;
  }
  void Release(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    free_ += n;
    cv_.notify_all();
  }

 private:
  const uint64_t capacity_;
  uint64_t free_;
  std::mutex mu_;
  std::condition_variable cv_;
};

// Chunk `slot` of `writer` whose bytes come from options.fill_piece: fetched into a buffer charged
// to `budget` (`chunk.data` is ignored), then written through `writer` like any other chunk, all
// on the calling thread. The buffer is released before returning.
Status WriteFilledChunk(const ChunkWrite& write, const SaveTensor& tensor,
                        const SaveOptions& options, ChunkWriter& writer, size_t slot,
                        ChunkBytes chunk, WritableFile& file, ByteBudget& budget,
                        std::vector<uint32_t>* block_crc32c);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_FILLED_CHUNKS_H_
