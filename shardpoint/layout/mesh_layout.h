// Device-mesh layouts with placements: the chunk each rank of a torch DTensor holds.
//
// A MeshLayout is a device mesh (its shape; ranks laid out row-major, or in the order of
// rank_list) and one placement per mesh dimension, with torch DTensor semantics
// (compute_local_shape_and_global_offset):
// - placements are applied left to right over the mesh dims; each splits the index set that the
//   previous ones left on its tensor dim, so several mesh dims sharding one tensor dim compose;
// - Shard(d) on a mesh dim of size n gives coordinate c the c-th piece of torch.chunk: pieces of
//   ceil(L / n) elements, the trailing ones short or empty (10 over 4 -> 3,3,3,1; 5 over 4 ->
//   2,2,1,0);
// - Replicate() does nothing (the ranks along that mesh dim hold the same chunk);
// - StridedShard(d, split_factor) (torch's _StridedShard, FSDP2 + TP): the current index set is
//   split by torch.chunk into split_factor pieces, each piece into n pieces, and coordinate c takes
//   the c-th piece of every one, concatenated. The index sets are tracked exactly; the final set of
//   each tensor dim must be contiguous (as it is when a Shard on the same dim follows), otherwise
//   the chunk is not a box and kInvalidArgument names the tensor dim.
// An empty chunk has size 0 and offset equal to the global size on that dim (as newest torch).
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_LAYOUT_MESH_LAYOUT_H_
#define SHARDPOINT_LAYOUT_MESH_LAYOUT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/geometry/box.h"

namespace sp {

struct Placement {
  enum class Kind { kReplicate, kShard, kStridedShard };
  Kind kind = Kind::kReplicate;
  int dim = 0;           // tensor dim (kShard, kStridedShard)
  int split_factor = 1;  // kStridedShard only

  static Placement Replicate() { return Placement{Kind::kReplicate, 0, 1}; }
  static Placement Shard(int dim) { return Placement{Kind::kShard, dim, 1}; }
  static Placement StridedShard(int dim, int split_factor) {
    return Placement{Kind::kStridedShard, dim, split_factor};
  }

  // "R", "S(0)", "_S(0, 2)" (torch's short forms).
  std::string ToString() const;
  friend bool operator==(const Placement&, const Placement&) = default;
};

struct MeshLayout {
  Shape mesh_shape;
  std::vector<Placement> placements;  // one per mesh dim
  // Global rank at each mesh position (row-major); empty means position i is rank i.
  std::vector<int64_t> rank_list;

  friend bool operator==(const MeshLayout&, const MeshLayout&) = default;
};

// "mesh [2, 4] placements (S(0), R)", for messages.
std::string LayoutToString(const MeshLayout& layout);

// Row-major coordinate of position `index` in a mesh of shape `mesh_shape` (index must be in
// [0, volume)).
std::vector<int64_t> UnravelMeshIndex(const Shape& mesh_shape, int64_t index);

// The chunk of the mesh position with `coordinate`. Errors (kInvalidArgument): a malformed layout
// (placement count, tensor dim, split factor, non-positive mesh size), a coordinate out of the
// mesh, a negative global size, or a non-contiguous strided index set (naming the tensor dim).
Result<Box> MeshChunk(const Shape& global_shape, const MeshLayout& layout,
                      const std::vector<int64_t>& coordinate);

// The chunk held by global rank `rank`, or nullopt when the rank is not part of the mesh.
Result<std::optional<Box>> MeshChunkForRank(const Shape& global_shape, const MeshLayout& layout,
                                            int64_t rank);

// The chunks of every mesh position in row-major order: entry i belongs to rank i, or to
// rank_list[i] when a rank list is given. Errors as MeshChunk, and for a rank list whose size is
// not the mesh volume or that holds a rank twice.
Result<std::vector<Box>> MeshChunksPerRank(const Shape& global_shape, const MeshLayout& layout);

}  // namespace sp

#endif  // SHARDPOINT_LAYOUT_MESH_LAYOUT_H_
