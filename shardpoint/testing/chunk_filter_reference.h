// A plain reference for ChunkFilter (format/metadata.h) in tests: the chunks of a tensor that one
// of a filter's boxes reaches, found by trying every box against every chunk.
#ifndef SHARDPOINT_TESTING_CHUNK_FILTER_REFERENCE_H_
#define SHARDPOINT_TESTING_CHUNK_FILTER_REFERENCE_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
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

// Checks that `part` is what a filter with `boxes` keeps of `whole` (a whole copy of the same
// tensor): `whole` itself, grid included, when the boxes reach every chunk; otherwise exactly
// the reached chunks in order under their stored numbers (TensorMetadata::kept), without a grid
// or an index. Returns how many chunks the boxes reach.
inline size_t ExpectPartOf(const TensorMetadata& whole, const TensorMetadata& part,
                           const std::vector<Box>* boxes) {
  const std::vector<uint32_t> reached = ReachedChunks(whole, boxes);
  EXPECT_EQ(part.name, whole.name);
  EXPECT_EQ(part.dtype, whole.dtype);
  EXPECT_EQ(part.shape, whole.shape);
  if (reached.size() == whole.chunks.size()) {
    EXPECT_TRUE(part == whole);
    EXPECT_FALSE(part.kept.has_value());
    EXPECT_EQ(part.grid, whole.grid);
    return reached.size();
  }
  EXPECT_EQ(part.kept, std::optional<std::vector<uint32_t>>(reached));
  EXPECT_FALSE(part.grid.has_value());
  EXPECT_FALSE(part.index.has_value());
  EXPECT_EQ(part.chunks.size(), reached.size());
  for (size_t k = 0; k < reached.size() && k < part.chunks.size(); ++k) {
    EXPECT_EQ(part.chunks[k], whole.chunks[reached[k]]);  // box, file, bytes and checksums
    EXPECT_EQ(ChunkNumber(part, k), reached[k]);
    EXPECT_EQ(ChunkIndexOfNumber(part, reached[k]), std::optional<uint32_t>(k));
  }
  for (uint32_t c = 0; c <= whole.chunks.size(); ++c) {
    if (!std::binary_search(reached.begin(), reached.end(), c)) {
      EXPECT_EQ(ChunkIndexOfNumber(part, c), std::nullopt) << "chunk " << c;
    }
  }
  return reached.size();
}

}  // namespace sp::testing

#endif  // SHARDPOINT_TESTING_CHUNK_FILTER_REFERENCE_H_
