// Metadata as a save plan leaves it, for the tests of the format writers (writer.h).
#ifndef SHARDPOINT_FORMAT_WRITER_TEST_UTIL_H_
#define SHARDPOINT_FORMAT_WRITER_TEST_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "shardpoint/format/metadata.h"

namespace sp::testing {

// Save id "s7", checksum blocks of 16 bytes, one unnamed file per entry of `file_ranks` (the
// writer rank; a rank's files in the order of k), and float32 tensor "w" of shape
// [2 * files, 4] with one 2x4 chunk at offset 0 of each file.
inline CheckpointMetadata PlannedMetadata(const std::vector<int32_t>& file_ranks) {
  CheckpointMetadata md;
  md.save_id = "s7";
  md.checksum_block_bytes = 16;
  TensorMetadata w;
  w.name = "w";
  w.dtype = DType::kFloat32;
  w.shape = {2 * static_cast<int64_t>(file_ranks.size()), 4};
  for (size_t f = 0; f < file_ranks.size(); ++f) {
    md.files.push_back(DataFile{"", 0, 0, file_ranks[f]});
    md.world_size = std::max(md.world_size, file_ranks[f] + 1);
    StoredChunk c;
    c.box = Box({2 * static_cast<int64_t>(f), 0}, {2, 4});
    c.file = static_cast<uint32_t>(f);
    c.byte_length = 32;
    w.chunks.push_back(c);
  }
  md.tensors.push_back(w);
  return md;
}

}  // namespace sp::testing

#endif  // SHARDPOINT_FORMAT_WRITER_TEST_UTIL_H_
