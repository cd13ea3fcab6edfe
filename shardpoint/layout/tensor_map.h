// MindSpore / hyper_parallel tensor_map layouts: the slice of a tensor each rank holds.
//
// Convention (hyper_parallel's infer_slice_area_by_rank, as called by its standard planner):
// - `mesh_shape` is the device matrix; inner rank r (the position of a global rank in rank_list)
//   has the row-major coordinate of r in it.
// - `tensor_map` has one entry per tensor dim: a list of mesh dims, each counted from the RIGHT of
//   mesh_shape (m names mesh dim mesh_shape.size() - 1 - m, as MindSpore's alias names map), with
//   -1 (or an empty list) meaning "not sharded". A tensor dim sharded by several mesh dims is split
//   by the first listed one, then each piece by the next, and so on (the first is the outermost).
//   A mesh dim may appear at most once in the whole map; mesh dims that appear nowhere replicate.
// - Each split is balanced: of L elements over n devices, the first L % n get floor(L / n) + 1
//   and the rest floor(L / n). Mesh dims listed in `uneven_mesh_dims` (counted from the LEFT, as
//   hyper_parallel's uneven_shard_mesh_dims) split like torch.chunk instead (ceil pieces, trailing
//   ones short or empty). For evenly divisible sizes both give L / n each.
// - Ranks not in rank_list hold nothing.
// Worked example: mesh_shape (2, 4), tensor_map {{1}, {0}} on an [8, 8] tensor: tensor dim 0 is
// split by mesh dim 0 (size 2), tensor dim 1 by mesh dim 1 (size 4); inner rank 6 has coordinate
// (1, 2) and holds rows 4..7, columns 4..5.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_LAYOUT_TENSOR_MAP_H_
#define SHARDPOINT_LAYOUT_TENSOR_MAP_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/geometry/box.h"

namespace sp {

struct TensorMapLayout {
  Shape mesh_shape;
  std::vector<std::vector<int>> tensor_map;  // per tensor dim; see the convention above
  std::vector<int64_t> rank_list;            // global rank of each inner rank; empty: 0..N-1
  std::vector<int> uneven_mesh_dims;         // mesh dims (from the left) split like torch.chunk
};

// The slice of inner rank `inner_rank` (balanced splits). Errors (kInvalidArgument): tensor_map
// size differs from the tensor rank, a mesh dim index outside [-1, mesh rank) or used twice, a
// non-positive mesh size, a negative tensor size, or inner_rank outside [0, mesh volume).
Result<Box> TensorMapChunk(const Shape& global_shape, const Shape& mesh_shape,
                           const std::vector<std::vector<int>>& tensor_map, int64_t inner_rank);

// The same with the full layout (uneven mesh dims honoured; rank_list not consulted).
Result<Box> TensorMapChunk(const Shape& global_shape, const TensorMapLayout& layout,
                           int64_t inner_rank);

// The slice of global rank `rank`: that of its position in rank_list (or of inner rank `rank`
// when rank_list is empty), or nullopt when the rank is not part of the mesh. Errors as
// TensorMapChunk, and when rank_list's size is not the mesh volume or it holds a rank twice.
Result<std::optional<Box>> TensorMapChunkForRank(const Shape& global_shape,
                                                 const TensorMapLayout& layout, int64_t rank);

// The slice of every global rank in [0, world_size): nullopt for ranks not in rank_list. Errors as
// above, and when rank_list's size is not the mesh volume, it holds a rank twice, or a rank
// outside [0, world_size).
Result<std::vector<std::optional<Box>>> TensorMapChunksPerRank(const Shape& global_shape,
                                                               const TensorMapLayout& layout,
                                                               int64_t world_size);

}  // namespace sp

#endif  // SHARDPOINT_LAYOUT_TENSOR_MAP_H_
