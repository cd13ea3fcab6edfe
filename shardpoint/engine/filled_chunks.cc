#include "shardpoint/engine/chunk_writes.h"

#include <sys/mman.h>

#include "shardpoint/base/crc32c.h"
#include "shardpoint/format/torch_dcp/dcp_writer.h"
#include "shardpoint/format/torch_save/zip.h"

namespace sp {
namespace {

// Writes are issued in pieces of at most this many bytes (a multiple of the checksum block), so
// that one large tensor spreads over every I/O thread.
constexpr uint64_t kWriteTaskBytes = uint64_t{16} << 20;
// Bytes checksummed then written together, small enough to stay in the CPU cache in between.
constexpr uint64_t kWriteGroupBytes = uint64_t{1} << 20;

// Writes one piece [begin, end) of a chunk, checksumming each block it holds. Blocks are
// checksummed and written in groups of about 1 MiB so each group is still in cache when written,
// and writeback of the piece starts at once so the device works while the CPU goes on.
Status WritePiece(WritableFile& file, uint64_t file_offset, const std::byte* data,
                  uint64_t begin, uint64_t end, uint64_t block_bytes, uint32_t* crcs) {
  const uint64_t group = std::max<uint64_t>(1, kWriteGroupBytes / block_bytes) * block_bytes;
  for (uint64_t lo = begin; lo < end; lo += group) {
    const uint64_t hi = std::min(lo + group, end);
    for (uint64_t b = lo; b < hi; b += block_bytes) {
      crcs[b / block_bytes] = Crc32c(data + b, std::min(b + block_bytes, hi) - b);
    }
    SP_RETURN_IF_ERROR(file.WriteAt(file_offset + lo, ByteView(data + lo, hi - lo)));
  }
  file.StartWriteback(file_offset + begin, end - begin);
  return OkStatus();
}

// Writes [begin, end) of a DCP item's storage bytes, computing their CRC-32 on the way.
Status WriteDcpPiece(WritableFile& file, uint64_t file_offset, const std::byte* data,
                     uint64_t begin, uint64_t end, uint32_t* crc32) {
  uint32_t crc = 0;
  for (uint64_t lo = begin; lo < end; lo += kWriteGroupBytes) {
    const uint64_t hi = std::min(lo + kWriteGroupBytes, end);
    crc = Crc32(crc, data + lo, hi - lo);
    SP_RETURN_IF_ERROR(file.WriteAt(file_offset + lo, ByteView(data + lo, hi - lo)));
  }
  *crc32 = crc;
  file.StartWriteback(file_offset + begin, end - begin);
  return OkStatus();
}

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

void QueueNativeChunk(const ChunkWrite& write, const std::byte* data, OpenFile& file,
                      uint64_t block_bytes, const WrittenCallback* written, TaskGroup& group,
                      ChunkReport* report) {
  report->block_crc32c.resize((write.byte_length + block_bytes - 1) / block_bytes);
  const uint64_t step = std::max<uint64_t>(block_bytes, kWriteTaskBytes / block_bytes * block_bytes);
  const uint64_t offset = file.order->header.size() + write.data_offset;
  WritableFile* out = file.file.get();
  uint32_t* crcs = report->block_crc32c.data();
  for (uint64_t lo = 0; lo < write.byte_length; lo += step) {
    const uint64_t hi = std::min(lo + step, write.byte_length);
    group.Run([=] {
      SP_RETURN_IF_ERROR(WritePiece(*out, offset, data, lo, hi, block_bytes, crcs));
      if (*written) (*written)(hi - lo);
      return OkStatus();
    });
  }
}

Status QueueDcpItem(const ChunkWrite& write, DType dtype, const ConstPieceView& piece,
                    OpenFile& file, const WrittenCallback* written, TaskGroup& group,
                    DcpItem* item) {
  SP_ASSIGN_OR_RETURN(item->layout, torch_dcp::ChunkItemLayout(dtype, piece.box));
  if (item->layout->data_bytes(0) != write.byte_length ||
      item->layout->data_offset(0) > write.data_offset) {
    return InternalError("DCP item layout disagrees with the save plan for a chunk of " +
                         std::to_string(write.byte_length) + " bytes");
  }
  item->file = file.file.get();
  item->data_offset = write.data_offset;
  const uint64_t item_start = write.data_offset - item->layout->data_offset(0);
  SP_RETURN_IF_ERROR(item->file->WriteAt(item_start, AsBytes(item->layout->Head())));
  const size_t pieces = static_cast<size_t>((write.byte_length + kWriteTaskBytes - 1) / kWriteTaskBytes);
  item->piece_bytes.resize(pieces);
  item->piece_crc32.resize(pieces);
  for (size_t i = 0; i < pieces; ++i) {
    const uint64_t lo = i * kWriteTaskBytes;
    const uint64_t hi = std::min(lo + kWriteTaskBytes, write.byte_length);
    item->piece_bytes[i] = hi - lo;
    WritableFile* out = item->file;
    uint32_t* crc = &item->piece_crc32[i];
    const std::byte* data = piece.data;
    const uint64_t at = write.data_offset;
    group.Run([=] {
      SP_RETURN_IF_ERROR(WriteDcpPiece(*out, at, data, lo, hi, crc));
      if (*written) (*written)(hi - lo);
      return OkStatus();
    });
  }
  return OkStatus();
}

Status WriteFilledChunk(const ChunkWrite& write, const SaveTensor& tensor, const SaveOptions& options,
                        CheckpointFormat format, OpenFile& file, ByteBudget& budget,
                        ChunkReport* report, DcpItem* item) {
  const uint64_t charged = budget.Acquire(write.byte_length);
  Status status = [&]() -> Status {
    PieceBuffer buffer(write.byte_length);  // byte_length > 0: empty pieces are not filled
    if (buffer.data() == nullptr) {
      return ResourceExhaustedError("cannot allocate " + std::to_string(write.byte_length) +
                                    " bytes for a chunk of tensor '" + tensor.name + "'");
    }
    SP_RETURN_IF_ERROR(options.fill_piece(write.local_tensor, write.local_box,
                                          MutableByteView(buffer.data(), write.byte_length)));
    const ConstPieceView view{tensor.pieces[write.local_box].box, buffer.data()};
    TaskGroup inline_group(nullptr);
    if (format == CheckpointFormat::kTorchDcp) {
      SP_RETURN_IF_ERROR(
          QueueDcpItem(write, tensor.dtype, view, file, &options.on_chunk_written, inline_group, item));
    } else {
      QueueNativeChunk(write, buffer.data(), file, options.checksum_block_bytes,
                       &options.on_chunk_written, inline_group, report);
    }
    return inline_group.Wait();
  }();
  budget.Release(charged);
  return status;
}

Status DcpItem::WriteTail() const {
  uint32_t crc = 0;
  for (size_t i = 0; i < piece_crc32.size(); ++i) {
    crc = Crc32Combine(crc, piece_crc32[i], piece_bytes[i]);
  }
  const std::string tail = layout->Tail(std::span<const uint32_t>(&crc, 1));
  return file->WriteAt(data_offset + layout->data_bytes(0), AsBytes(tail));
}

}  // namespace sp
