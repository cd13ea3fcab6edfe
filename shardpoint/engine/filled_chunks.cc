#include "shardpoint/engine/filled_chunks.h"

#include <sys/mman.h>

#include <string>

namespace sp {
namespace {

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

}  // namespace sp
