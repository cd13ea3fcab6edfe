// Pieces: where a rank's local buffer places the boxes of a tensor it saves.
//
// The engine saves, per rank and tensor, a list of pieces: a box of the global tensor plus the
// element offset at which the box's contiguous row-major data starts in the rank's local buffer.
// This file holds the explicit-box and flat-range layouts; mesh_layout.h and tensor_map.h give
// the one-chunk-per-rank layouts. All functions are pure and thread-safe.
#ifndef SHARDPOINT_LAYOUT_PIECES_H_
#define SHARDPOINT_LAYOUT_PIECES_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/base/status.h"
#include "shardpoint/geometry/box.h"

namespace sp {

// `box` (global coordinates), stored row-major at `element_offset` of the local buffer.
struct Piece {
  Box box;
  int64_t element_offset = 0;

  friend bool operator==(const Piece&, const Piece&) = default;
};

// Checks explicit boxes against the tensor's shape: each must have the shape's rank and lie in
// [0, shape) with non-negative offsets and sizes. kInvalidArgument naming the tensor, the box
// (and its index) and the shape otherwise.
Status ValidateBoxes(const std::string& tensor, const Shape& shape, std::span<const Box> boxes);

// A flat range [flat_begin, flat_end) of the row-major flattening of `box` (Megatron's
// flattened_range), held contiguously in a local buffer: the boxes of DecomposeFlatRange with
// element_offset the running offset into that buffer (the first piece at 0). Errors
// (kInvalidArgument): `box` outside `global_shape`, or the range as DecomposeFlatRange.
Result<std::vector<Piece>> FlatRangePieces(const Shape& global_shape, const Box& box,
                                           int64_t flat_begin, int64_t flat_end);

}  // namespace sp

#endif  // SHARDPOINT_LAYOUT_PIECES_H_
