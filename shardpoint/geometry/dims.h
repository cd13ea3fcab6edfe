// Dims: the per-dimension values of a box (its offsets or its sizes).
//
// A checkpoint of a large job holds millions of boxes (one per stored chunk and per local piece),
// and as two std::vectors each box cost two heap allocations. Dims keeps up to four values in
// the box itself, which covers tensors of rank 4 and below, and moves to the heap only beyond
// (base/inline_vector.h). It converts to and from std::vector<int64_t> (a Shape) and compares
// with either.
#ifndef SHARDPOINT_GEOMETRY_DIMS_H_
#define SHARDPOINT_GEOMETRY_DIMS_H_

#include <cstdint>

#include "shardpoint/base/inline_vector.h"

namespace sp {

using Dims = InlineVector<int64_t, 4>;

}  // namespace sp

#endif  // SHARDPOINT_GEOMETRY_DIMS_H_
