#include "shardpoint/layout/tensor_map.h"

#include <algorithm>
#include <set>
#include <string>

#include "shardpoint/layout/index_set.h"
#include "shardpoint/layout/mesh_layout.h"

namespace sp {
namespace {

using layout_internal::BalancedRange;
using layout_internal::ChunkRange;

std::string TensorMapToString(const std::vector<std::vector<int>>& tensor_map) {
  std::string out = "(";
  for (size_t d = 0; d < tensor_map.size(); ++d) {
    if (d) out += ", ";
    if (tensor_map[d].size() == 1) {
      out += std::to_string(tensor_map[d][0]);
      continue;
    }
    out += "(";
    for (size_t k = 0; k < tensor_map[d].size(); ++k) {
      out += (k ? ", " : "") + std::to_string(tensor_map[d][k]);
    }
    out += ")";
  }
  return out + ")";
}

Status ValidateTensorMap(const Shape& global_shape, const TensorMapLayout& layout) {
  const std::string where = "tensor of shape " + ShapeToString(global_shape) + " with mesh_shape " +
                            ShapeToString(layout.mesh_shape) + " and tensor_map " +
                            TensorMapToString(layout.tensor_map);
  if (layout.tensor_map.size() != global_shape.size()) {
    return InvalidArgumentError(where + ": expected one tensor_map entry per tensor dim (" +
                                std::to_string(global_shape.size()) + "), found " +
                                std::to_string(layout.tensor_map.size()));
  }
  for (int64_t n : layout.mesh_shape) {
    if (n <= 0) return InvalidArgumentError(where + ": mesh sizes must be positive");
  }
  for (int64_t size : global_shape) {
    if (size < 0) return InvalidArgumentError(where + ": negative tensor size");
  }
  const int mesh_rank = static_cast<int>(layout.mesh_shape.size());
  std::vector<bool> used(layout.mesh_shape.size(), false);
  for (size_t d = 0; d < layout.tensor_map.size(); ++d) {
    for (int m : layout.tensor_map[d]) {
      if (m == -1) continue;
      if (m < -1 || m >= mesh_rank) {
        return InvalidArgumentError(where + ": tensor dim " + std::to_string(d) + " maps to " +
                                    std::to_string(m) + ", expected -1 or [0, " +
                                    std::to_string(mesh_rank) + ")");
      }
      if (used[mesh_rank - 1 - m]) {
        return InvalidArgumentError(where + ": mesh dim " + std::to_string(m) +
                                    " is used more than once");
      }
      used[mesh_rank - 1 - m] = true;
    }
  }
  for (int u : layout.uneven_mesh_dims) {
    if (u < 0 || u >= mesh_rank) {
      return InvalidArgumentError(where + ": uneven mesh dim " + std::to_string(u) +
                                  " is outside the mesh");
    }
  }
  return OkStatus();
}

// Assumes a validated layout and an in-range inner rank.
Box SliceOf(const Shape& global_shape, const TensorMapLayout& layout, int64_t inner_rank) {
  const std::vector<int64_t> coordinate = UnravelMeshIndex(layout.mesh_shape, inner_rank);
  const size_t mesh_rank = layout.mesh_shape.size();
  Box box;
  for (size_t d = 0; d < global_shape.size(); ++d) {
    int64_t begin = 0;
    int64_t end = global_shape[d];
    for (int m : layout.tensor_map[d]) {
      if (m == -1) continue;
      const size_t mesh_dim = mesh_rank - 1 - static_cast<size_t>(m);
      const bool uneven = std::find(layout.uneven_mesh_dims.begin(), layout.uneven_mesh_dims.end(),
                                    static_cast<int>(mesh_dim)) != layout.uneven_mesh_dims.end();
      int64_t piece_begin, piece_end;
      (uneven ? ChunkRange : BalancedRange)(end - begin, layout.mesh_shape[mesh_dim],
                                            coordinate[mesh_dim], &piece_begin, &piece_end);
      end = begin + piece_end;
      begin += piece_begin;
    }
    box.offsets.push_back(begin);
    box.sizes.push_back(end - begin);
  }
  return box;
}

// The global rank of each inner rank (0..N-1 when rank_list is empty); kInvalidArgument when
// rank_list's size is not the mesh volume.
Result<std::vector<int64_t>> InnerToGlobalRanks(const TensorMapLayout& layout) {
  const int64_t volume = ShapeVolume(layout.mesh_shape);
  std::vector<int64_t> ranks = layout.rank_list;
  if (ranks.empty()) {
    for (int64_t r = 0; r < volume; ++r) ranks.push_back(r);
  }
  if (static_cast<int64_t>(ranks.size()) != volume) {
    return InvalidArgumentError("rank_list has " + std::to_string(ranks.size()) +
                                " ranks, expected the mesh volume " + std::to_string(volume) +
                                " of mesh_shape " + ShapeToString(layout.mesh_shape));
  }
  return ranks;
}

}  // namespace

Result<Box> TensorMapChunk(const Shape& global_shape, const TensorMapLayout& layout,
                           int64_t inner_rank) {
  SP_RETURN_IF_ERROR(ValidateTensorMap(global_shape, layout));
  const int64_t volume = ShapeVolume(layout.mesh_shape);
  if (inner_rank < 0 || inner_rank >= volume) {
    return InvalidArgumentError("inner rank " + std::to_string(inner_rank) +
                                " is outside mesh_shape " + ShapeToString(layout.mesh_shape) +
                                " of " + std::to_string(volume) + " devices");
  }
  return SliceOf(global_shape, layout, inner_rank);
}

Result<Box> TensorMapChunk(const Shape& global_shape, const Shape& mesh_shape,
                           const std::vector<std::vector<int>>& tensor_map, int64_t inner_rank) {
  return TensorMapChunk(global_shape, TensorMapLayout{mesh_shape, tensor_map, {}, {}}, inner_rank);
}

Result<std::optional<Box>> TensorMapChunkForRank(const Shape& global_shape,
                                                 const TensorMapLayout& layout, int64_t rank) {
  SP_RETURN_IF_ERROR(ValidateTensorMap(global_shape, layout));
  SP_ASSIGN_OR_RETURN(const std::vector<int64_t> ranks, InnerToGlobalRanks(layout));
  std::set<int64_t> seen;
  int64_t inner = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!seen.insert(ranks[i]).second) {
      return InvalidArgumentError("rank_list holds rank " + std::to_string(ranks[i]) + " twice");
    }
    if (ranks[i] == rank) inner = static_cast<int64_t>(i);
  }
  if (inner < 0) return std::optional<Box>();
  return std::optional<Box>(SliceOf(global_shape, layout, inner));
}

Result<std::vector<std::optional<Box>>> TensorMapChunksPerRank(const Shape& global_shape,
                                                               const TensorMapLayout& layout,
                                                               int64_t world_size) {
  SP_RETURN_IF_ERROR(ValidateTensorMap(global_shape, layout));
  SP_ASSIGN_OR_RETURN(const std::vector<int64_t> ranks, InnerToGlobalRanks(layout));
  const int64_t volume = static_cast<int64_t>(ranks.size());
  std::vector<std::optional<Box>> out(world_size > 0 ? world_size : 0);
  for (int64_t inner = 0; inner < volume; ++inner) {
    const int64_t rank = ranks[inner];
    if (rank < 0 || rank >= world_size) {
      return InvalidArgumentError("rank_list holds rank " + std::to_string(rank) +
                                  ", outside the world of " + std::to_string(world_size));
    }
    if (out[rank].has_value()) {
      return InvalidArgumentError("rank_list holds rank " + std::to_string(rank) + " twice");
    }
    out[rank] = SliceOf(global_shape, layout, inner);
  }
  return out;
}

}  // namespace sp
