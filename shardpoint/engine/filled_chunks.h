// The chunks of a streaming save: pieces without memory whose bytes are fetched into buffers just
// before they are written, with the bytes held at once bounded by a budget. Whole pieces
// (SaveOptions::fill_piece, conversion) are fetched then written by one task each; ranges
// (SaveOptions::fill_range, device state) are fetched by each write task for the range it writes
// (FilledChunkSource). Used by save.cc on every rank.
#ifndef SHARDPOINT_ENGINE_FILLED_CHUNKS_H_
#define SHARDPOINT_ENGINE_FILLED_CHUNKS_H_

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
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

// Buffers for the ranges of filled chunks, within `budget` bytes counting the buffers kept for
// reuse: anonymous mappings made as needed, kept for the next ranges, and given back to the system
// when this goes (every buffer must be back by then). A range larger than the budget waits until
// no other buffer is in use. Thread-safe.
class RangeBuffers {
 public:
  explicit RangeBuffers(uint64_t budget) : budget_(std::max<uint64_t>(1, budget)) {}
  ~RangeBuffers();
  RangeBuffers(const RangeBuffers&) = delete;
  RangeBuffers& operator=(const RangeBuffers&) = delete;

  struct Buffer {
    std::byte* data = nullptr;
    uint64_t size = 0;  // at least the size asked for
  };
  // Blocks until a buffer of at least `size` bytes fits in the budget; kResourceExhausted when
  // the system refuses the memory.
  Result<Buffer> Take(uint64_t size);
  void Give(Buffer buffer);
  uint64_t mapped_bytes() const;  // of every buffer, in use or kept

 private:
  const uint64_t budget_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t mapped_ = 0;
  std::vector<Buffer> free_;
};

// The bytes of piece `piece` of tensor `tensor` (this rank's SaveState) fetched range by range
// through options.fill_range into buffers of `buffers`, each given back once its range is written.
class FilledChunkSource : public ChunkSource {
 public:
  FilledChunkSource(const SaveOptions& options, const SaveTensor& tensor, size_t tensor_index,
                    size_t piece, RangeBuffers& buffers)
      : options_(options), tensor_(tensor), tensor_index_(tensor_index), piece_(piece),
        buffers_(buffers) {}
  Result<ChunkRange> Fetch(uint64_t lo, uint64_t hi) override;

 private:
  const SaveOptions& options_;
  const SaveTensor& tensor_;
  const size_t tensor_index_;
  const size_t piece_;
  RangeBuffers& buffers_;
};

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_FILLED_CHUNKS_H_
