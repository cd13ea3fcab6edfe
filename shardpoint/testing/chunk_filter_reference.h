// A plain reference for ChunkFilter (format/metadata.h) in tests: the chunks of a tensor that one
// of a filter's boxes reaches, found by trying every box against every chunk.
#ifndef SHARDPOINT_TESTING_CHUNK_FILTER_REFERENCE_H_
#define SHARDPOINT_TESTING_CHUNK_FILTER_REFERENCE_H_

#include <cstdint>
#include <vector>

#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"

namespace sp::testing {

// The numbers of the chunks of `tensor` (a whole copy) that share a point with one of `boxes`
// of the tensor's rank, not empty and inside its shape; none when `boxes` is null (a tensor the
// filter does not name).
inline std::vector<uint32_t> ReachedChunks(const TensorMetadata& tensor,
                                           const std::vector<Box>* boxes) {
  std::vector<uint32_t> reached;
  for (uint32_t c = 0; boxes != nullptr && c < tensor.chunks.size(); ++c) {
    for (const Box& box : *boxes) {
      if (box.rank() == tensor.shape.size() && !box.empty() && WithinShape(box, tensor.shape) &&
          Intersect(box, tensor.chunks[c].box).has_value()) {
        reached.push_back(c);
        break;
      }
    }
  }
  return reached;
}

}  // namespace sp::testing

#endif  // SHARDPOINT_TESTING_CHUNK_FILTER_REFERENCE_H_
