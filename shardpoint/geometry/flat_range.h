// Flat ranges: contiguous ranges of the row-major flattening of a box.
//
// Megatron's distributed optimizer stores a shard of a tensor as a `flattened_range`: elements
// [flat_begin, flat_end) of the row-major flattening of a box. To place such a shard in the
// tensor's coordinates, the range is decomposed into boxes. Each box has the form "fixed indices
// on dims < k, a range on dim k, the full extent of `box` on dims > k", so its own row-major order
// is exactly the flat order, and concatenating the boxes' contents in order yields the range.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_GEOMETRY_FLAT_RANGE_H_
#define SHARDPOINT_GEOMETRY_FLAT_RANGE_H_

#include <cstdint>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/geometry/box.h"

namespace sp {

// The boxes (in the same, global coordinates as `box`) whose row-major contents, concatenated in
// order, are exactly elements [flat_begin, flat_end) of the row-major flattening of `box`.
// Returns at most 2 * rank - 1 boxes (1 for rank 0), none empty; an empty range gives no boxes.
// A rank-0 box has volume 1: the range [0, 1) gives the box itself.
// Errors: kInvalidArgument (with the numbers and the box) when flat_begin < 0, flat_begin >
// flat_end, flat_end > box.volume(), or the box has a negative size.
Result<std::vector<Box>> DecomposeFlatRange(const Box& box, int64_t flat_begin, int64_t flat_end);

}  // namespace sp

#endif  // SHARDPOINT_GEOMETRY_FLAT_RANGE_H_
