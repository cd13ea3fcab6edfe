// Verified reads of stored chunk bytes.
//
// A stored chunk has one CRC32C per checksum block of its bytes. ReadChunkBytes reads any byte
// range of a chunk straight into the caller's buffer and verifies every block the range touches:
// where the range starts or ends inside a block, only the missing edge bytes of that block are
// read (into a small buffer) so the block's checksum can be completed. Thread-safe.
#ifndef SHARDPOINT_ENGINE_CHUNK_READER_H_
#define SHARDPOINT_ENGINE_CHUNK_READER_H_

#include <atomic>
#include <cstdint>
#include <span>
#include <string>

#include "shardpoint/base/status.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp {

// "0x0000abcd": how messages about checksums write a CRC32C.
std::string Hex32(uint32_t v);

struct StoredChunkRef {
  const ReadableFile* file = nullptr;
  const TensorMetadata* tensor = nullptr;
  const StoredChunk* chunk = nullptr;
  uint64_t file_offset = 0;   // absolute offset of the chunk's first byte in the file
  uint64_t block_bytes = 0;   // checksum block size
  // The chunk's block checksums: its own (StoredChunk::block_crc32c), or those of its data file's
  // header where the metadata holds none (engine/header_checksums.h).
  std::span<const uint32_t> crcs;
};

// A chunk's own checksums, for a StoredChunkRef.
inline std::span<const uint32_t> OwnChecksums(const StoredChunk& chunk) {
  return std::span<const uint32_t>(chunk.block_crc32c.data(), chunk.block_crc32c.size());
}

// Reads bytes [begin, end) of the chunk into `out` (end - begin bytes). With `verify`, every
// checksum block overlapping the range is checked; a mismatch is kDataLoss naming the tensor,
// the chunk box, the file and the block. Adds the bytes read from storage to *bytes_read.
Status ReadChunkBytes(const StoredChunkRef& ref, uint64_t begin, uint64_t end, std::byte* out,
                      bool verify, std::atomic<uint64_t>* bytes_read);

// Checks that `found` is the CRC32C stored for `block` of the chunk (and that the chunk has one
// checksum per block); a mismatch is kDataLoss as above.
Status CheckBlockCrc(const StoredChunkRef& ref, uint64_t block, uint32_t found);

// Checks blocks [first_block, end_block) of the chunk against its checksums, given the chunk's
// bytes from the start of first_block at `data` (already read by the caller).
Status VerifyBlocks(const StoredChunkRef& ref, uint64_t first_block, uint64_t end_block,
                    const std::byte* data);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_CHUNK_READER_H_
