#include "shardpoint/engine/chunk_reader.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "shardpoint/base/crc32c.h"

namespace sp {

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

namespace {

Status Mismatch(const StoredChunkRef& ref, uint64_t block, uint32_t expected, uint32_t found) {
  uint64_t lo = block * ref.block_bytes;
  uint64_t hi = std::min(lo + ref.block_bytes, ref.chunk->byte_length);
  return DataLossError("checksum mismatch in tensor '" + ref.tensor->name + "' chunk " +
                       ref.chunk->box.ToString() + " (file " + ref.file->path() + ", chunk bytes " +
                       std::to_string(lo) + ".." + std::to_string(hi) + "): expected crc32c " +
                       Hex32(expected) + ", found " + Hex32(found));
}

Status CheckCount(const StoredChunkRef& ref) {
  const uint64_t expected = ChecksumBlockCount(ref.chunk->byte_length, ref.block_bytes);
  if (ref.crcs.size() != expected) {
    return DataLossError("tensor '" + ref.tensor->name + "' chunk " + ref.chunk->box.ToString() +
                         " has " + std::to_string(ref.crcs.size()) +
                         " checksums, expected " + std::to_string(expected));
  }
  return OkStatus();
}

}  // namespace

Status CheckBlockCrc(const StoredChunkRef& ref, uint64_t block, uint32_t found) {
  SP_RETURN_IF_ERROR(CheckCount(ref));
  if (found != ref.crcs[block]) {
    return Mismatch(ref, block, ref.crcs[block], found);
  }
  return OkStatus();
}

Status VerifyBlocks(const StoredChunkRef& ref, uint64_t first_block, uint64_t end_block,
                    const std::byte* data) {
  SP_RETURN_IF_ERROR(CheckCount(ref));
  const uint64_t bs = ref.block_bytes;
  for (uint64_t block = first_block; block < end_block; ++block) {
    const uint64_t lo = block * bs;
    const uint64_t hi = std::min(lo + bs, ref.chunk->byte_length);
    SP_RETURN_IF_ERROR(CheckBlockCrc(ref, block, Crc32c(data + (lo - first_block * bs), hi - lo)));
  }
  return OkStatus();
}

Status ReadChunkBytes(const StoredChunkRef& ref, uint64_t begin, uint64_t end, std::byte* out,
                      bool verify, std::atomic<uint64_t>* bytes_read) {
  const StoredChunk& chunk = *ref.chunk;
  if (begin > end || end > chunk.byte_length) {
    return InternalError("read of bytes " + std::to_string(begin) + ".." + std::to_string(end) +
                         " outside chunk of " + std::to_string(chunk.byte_length) + " bytes");
  }
  if (begin == end) return OkStatus();
  SP_RETURN_IF_ERROR(ref.file->ReadAt(ref.file_offset + begin, MutableByteView(out, end - begin)));
  uint64_t read = end - begin;
  if (verify && ref.block_bytes > 0) {
    const uint64_t bs = ref.block_bytes;
    const uint64_t first_block = begin / bs;
    const uint64_t last_block = (end - 1) / bs;
    SP_RETURN_IF_ERROR(CheckCount(ref));
    std::vector<std::byte> edge;
    for (uint64_t block = first_block; block <= last_block; ++block) {
      const uint64_t lo = block * bs;
      const uint64_t hi = std::min(lo + bs, chunk.byte_length);
      uint32_t crc = 0;
      if (lo < begin) {  // the block starts before the range: read its head
        edge.resize(begin - lo);
        SP_RETURN_IF_ERROR(ref.file->ReadAt(ref.file_offset + lo, MutableByteView(edge)));
        read += edge.size();
        crc = Crc32cExtend(crc, edge.data(), edge.size());
      }
      const uint64_t in_lo = std::max(lo, begin);
      const uint64_t in_hi = std::min(hi, end);
      crc = Crc32cExtend(crc, out + (in_lo - begin), in_hi - in_lo);
      if (hi > end) {  // the block ends after the range: read its tail
        edge.resize(hi - end);
        SP_RETURN_IF_ERROR(ref.file->ReadAt(ref.file_offset + end, MutableByteView(edge)));
        read += edge.size();
        crc = Crc32cExtend(crc, edge.data(), edge.size());
      }
      if (crc != ref.crcs[block]) {
        return Mismatch(ref, block, ref.crcs[block], crc);
      }
    }
  }
  if (bytes_read != nullptr) bytes_read->fetch_add(read, std::memory_order_relaxed);
  return OkStatus();
}

}  // namespace sp
