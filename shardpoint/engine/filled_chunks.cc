#include "shardpoint/engine/filled_chunks.h"

#include <sys/mman.h>

#include <algorithm>
#include <string>

namespace sp {
namespace {

// Range buffers are mapped in multiples of this, so that the short last range of a piece reuses
// the buffer of a full one.
constexpr uint64_t kRangeBufferGrain = uint64_t{1} << 20;

// The buffer of one filled piece: an anonymous mapping, given back to the system as soon as the
// piece is written. (Freed heap blocks of chunk size stay in the allocator's per-thread arenas,
// so the resident memory would grow to one chunk per I/O thread whatever the budget.)
class PieceBuffer {
 public:
  explicit PieceBuffer(uint64_t size) : size_(size) {
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
  }
  ~PieceBuffer() {
    if (data_ != nullptr) munmap(data_, size_);
  }
  PieceBuffer(const PieceBuffer&) = delete;
  PieceBuffer& operator=(const PieceBuffer&) = delete;
  std::byte* data() const { return data_; }

 private:
  uint64_t size_;
  std::byte* data_ = nullptr;
};

}  // namespace

Status WriteFilledChunk(const ChunkWrite& write, const SaveTensor& tensor,
                        const SaveOptions& options, ChunkWriter& writer, size_t slot,
                        ChunkBytes chunk, WritableFile& file, ByteBudget& budget,
                        std::vector<uint32_t>* block_crc32c) {
  const uint64_t charged = budget.Acquire(write.byte_length);
  Status status = [&]() -> Status {
    PieceBuffer buffer(write.byte_length);  // byte_length > 0: empty pieces are not filled
    if (buffer.data() == nullptr) {
      return ResourceExhaustedError("cannot allocate " + std::to_string(write.byte_length) +
                                    " bytes for a chunk of tensor '" + tensor.name + "'");
    }
    SP_RETURN_IF_ERROR(options.fill_piece(write.local_tensor, write.local_box,
                                          MutableByteView(buffer.data(), write.byte_length)));
    chunk.data = buffer.data();
    TaskGroup inline_group(nullptr);
    SP_RETURN_IF_ERROR(writer.QueueChunk(slot, chunk, file, inline_group,
                                         &options.on_chunk_written, block_crc32c));
    return inline_group.Wait();
  }();
  budget.Release(charged);
  return status;
}

RangeBuffers::~RangeBuffers() {
  for (const Buffer& b : free_) munmap(b.data, b.size);
}

Result<RangeBuffers::Buffer> RangeBuffers::Take(uint64_t size) {
  const uint64_t want = std::max<uint64_t>(1, (size + kRangeBufferGrain - 1) / kRangeBufferGrain) *
                        kRangeBufferGrain;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    // The smallest kept buffer that holds the range.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->size >= size && (best == free_.end() || it->size < best->size)) best = it;
    }
    if (best != free_.end()) {
      const Buffer b = *best;
      free_.erase(best);
      return b;
    }
    // Kept buffers too small for it give way to a new one.
    while (mapped_ + want > budget_ && !free_.empty()) {
      munmap(free_.back().data, free_.back().size);
      mapped_ -= free_.back().size;
      free_.pop_back();
    }
    if (mapped_ + want <= budget_ || mapped_ == 0) break;
    cv_.wait(lock);
  }
  mapped_ += want;
  lock.unlock();
  void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::lock_guard<std::mutex> relock(mu_);
    mapped_ -= want;
    cv_.notify_all();
    return ResourceExhaustedError("cannot map " + std::to_string(want) +
                                  " bytes for the range of a filled chunk");
  }
  return Buffer{static_cast<std::byte*>(p), want};
}

void RangeBuffers::Give(Buffer buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(buffer);
  cv_.notify_all();
}

uint64_t RangeBuffers::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mapped_;
}

Result<ChunkRange> FilledChunkSource::Fetch(uint64_t lo, uint64_t hi) {
  Result<RangeBuffers::Buffer> taken = buffers_.Take(hi - lo);
  if (!taken.ok()) {
    return ResourceExhaustedError(std::string(taken.status().message()) + " of tensor '" +
                                  tensor_.name + "'");
  }
  const RangeBuffers::Buffer buffer = *taken;
  Status filled = options_.fill_range(tensor_index_, piece_, lo,
                                      MutableByteView(buffer.data, hi - lo));
  if (!filled.ok()) {
    buffers_.Give(buffer);
    return filled;
  }
  RangeBuffers* buffers = &buffers_;
  return ChunkRange(buffer.data, [buffers, buffer] { buffers->Give(buffer); });
}

}  // namespace sp
