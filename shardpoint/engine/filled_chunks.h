// The writes of one chunk in a save: the native format's checksummed chunks, PyTorch DCP items
// (a torch.save archive framed around the chunk's bytes), and chunks of a streaming save whose
// bytes are fetched just before they are written. Used by save.cc on every rank; each Queue*
// function runs its work on `group` (inline with a TaskGroup without a pool).
#ifndef SHARDPOINT_ENGINE_CHUNK_WRITES_H_
#define SHARDPOINT_ENGINE_CHUNK_WRITES_H_

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shardpoint/engine/save.h"
#include "shardpoint/engine/save_messages.h"
#include "shardpoint/exec/task_group.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp {

// One data file being written by this rank.
struct OpenFile {
  const FileOrder* order = nullptr;
  std::string final_path;
  std::string temp_path;
  std::unique_ptr<WritableFile> file;
};

// Called with the bytes of each piece once written (progress reports); may be empty.
using WrittenCallback = std::function<void(uint64_t)>;

// Queues the checksummed writes of one native chunk in pieces spread over `group`; the CRC32C of
// each checksum block goes to report->block_crc32c.
void QueueNativeChunk(const ChunkWrite& write, const std::byte* data, OpenFile& file,
                      uint64_t block_bytes, const WrittenCallback* written, TaskGroup& group,
                      ChunkReport* report);

// One chunk written as a PyTorch DCP item: a torch.save archive whose storage bytes are the
// chunk's, written from the caller's memory in pieces, each piece's CRC-32 computed as it goes;
// the archive's tail (which holds the CRC-32) is written once every piece is done.
struct DcpItem {
  std::optional<torch_save::TorchSaveLayout> layout;
  WritableFile* file = nullptr;
  uint64_t data_offset = 0;
  std::vector<uint64_t> piece_bytes;
  std::vector<uint32_t> piece_crc32;

  // Writes the archive's tail once every piece is written.
  Status WriteTail() const;
};

// Writes the item's head and queues the writes of the chunk's bytes (from `piece`), each piece's
// CRC-32 computed as it is written; call item->WriteTail() once `group` is done.
Status QueueDcpItem(const ChunkWrite& write, DType dtype, const ConstPieceView& piece,
                    OpenFile& file, const WrittenCallback* written, TaskGroup& group,
                    DcpItem* item);

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

// A piece without memory (a streaming save): its bytes are fetched with options.fill_piece into
// a buffer charged to `budget`, then written like any other chunk, all on the calling thread.
Status WriteFilledChunk(const ChunkWrite& write, const SaveTensor& tensor, const SaveOptions& options,
                        CheckpointFormat format, OpenFile& file, ByteBudget& budget,
                        ChunkReport* report, DcpItem* item);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_CHUNK_WRITES_H_
