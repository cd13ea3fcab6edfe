#include "shardpoint/engine/direct_write.h"

#include <algorithm>
#include <cstring>

namespace sp {

DirectWriteFile::DirectWriteFile(std::unique_ptr<WritableFile> base, BufferPool& staging,
                                 uint64_t min_bytes, uint64_t piece_bytes)
    : base_(std::move(base)),
      staging_(staging),
      min_bytes_(min_bytes),
      piece_bytes_(std::max<uint64_t>(1, piece_bytes)) {}

Status DirectWriteFile::WriteAt(uint64_t offset, ByteView data) {
  const uint64_t a = data.size() >= min_bytes_ ? base_->direct_io_alignment() : 0;
  if (a == 0) return base_->WriteAt(offset, data);
  const uint64_t end = offset + data.size();
  const uint64_t begin_aligned = (offset + a - 1) / a * a;
  const uint64_t end_aligned = end / a * a;
  if (begin_aligned >= end_aligned) return base_->WriteAt(offset, data);
  // The partial blocks at either end, through the page cache.
  SP_RETURN_IF_ERROR(base_->WriteAt(offset, data.subspan(0, begin_aligned - offset)));
  SP_RETURN_IF_ERROR(
      base_->WriteAt(end_aligned, data.subspan(static_cast<size_t>(end_aligned - offset))));
  // The whole blocks, staged in aligned memory a piece at a time.
  const uint64_t piece = std::max<uint64_t>(a, piece_bytes_ / a * a);
  AlignedBuffer buffer = staging_.Acquire(
      static_cast<size_t>(std::min<uint64_t>(piece, end_aligned - begin_aligned)),
      static_cast<size_t>(a));
  Status status = OkStatus();
  for (uint64_t at = begin_aligned; at < end_aligned && status.ok(); at += piece) {
    const uint64_t n = std::min(piece, end_aligned - at);
    std::memcpy(buffer.data(), data.data() + (at - offset), static_cast<size_t>(n));
    status = base_->WriteDirectAt(at, ByteView(buffer.data(), static_cast<size_t>(n)));
    if (status.ok()) direct_bytes_ += n;
  }
  staging_.Release(std::move(buffer));
  return status;
}

}  // namespace sp
