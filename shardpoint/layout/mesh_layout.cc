#include "shardpoint/layout/mesh_layout.h"

#include <set>

#include "shardpoint/layout/index_set.h"

namespace sp {
namespace {

using layout_internal::ChunkRange;
using layout_internal::IndexSet;

std::string CoordinateToString(const std::vector<int64_t>& coordinate) {
  return ShapeToString(coordinate);
}

Status ValidateLayout(const Shape& global_shape, const MeshLayout& layout) {
  // The message's prefix is built only for an error: this runs for every rank's box of every
  // tensor a save plans from its rules.
  auto where = [&] {
    return "tensor of shape " + ShapeToString(global_shape) + " on " + LayoutToString(layout);
  };
  if (layout.placements.size() != layout.mesh_shape.size()) {
    return InvalidArgumentError(where() + ": expected one placement per mesh dim (" +
                                std::to_string(layout.mesh_shape.size()) + "), found " +
                                std::to_string(layout.placements.size()));
  }
  for (int64_t n : layout.mesh_shape) {
    if (n <= 0) return InvalidArgumentError(where() + ": mesh sizes must be positive");
  }
  for (int64_t size : global_shape) {
    if (size < 0) return InvalidArgumentError(where() + ": negative tensor size");
  }
  for (const Placement& p : layout.placements) {
    if (p.kind == Placement::Kind::kReplicate) continue;
    if (p.dim < 0 || static_cast<size_t>(p.dim) >= global_shape.size()) {
      return InvalidArgumentError(where() + ": placement " + p.ToString() +
                                  " names a tensor dim outside rank " +
                                  std::to_string(global_shape.size()));
    }
    if (p.split_factor < 1) {
      return InvalidArgumentError(where() + ": placement " + p.ToString() +
                                  " needs a split factor >= 1");
    }
  }
  return OkStatus();
}

// _StridedShard: split `set` by torch.chunk into split_factor pieces, each into n pieces; take
// piece c of each, concatenated.
IndexSet StridedShard(const IndexSet& set, int64_t split_factor, int64_t n, int64_t c) {
  IndexSet out(0);
  const int64_t length = set.size();
  for (int64_t j = 0; j < split_factor; ++j) {
    int64_t piece_begin, piece_end;
    ChunkRange(length, split_factor, j, &piece_begin, &piece_end);
    int64_t begin, end;
    ChunkRange(piece_end - piece_begin, n, c, &begin, &end);
    out.Append(set.Slice(piece_begin + begin, piece_begin + end));
  }
  return out;
}

}  // namespace

std::string LayoutToString(const MeshLayout& layout) {
  std::string out = "mesh " + ShapeToString(layout.mesh_shape) + " placements (";
  for (size_t i = 0; i < layout.placements.size(); ++i) {
    if (i) out += ", ";
    out += layout.placements[i].ToString();
  }
  return out + ")";
}

std::string Placement::ToString() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kShard: return "S(" + std::to_string(dim) + ")";
    case Kind::kStridedShard:
      return "_S(" + std::to_string(dim) + ", " + std::to_string(split_factor) + ")";
  }
  return "?";
}

std::vector<int64_t> UnravelMeshIndex(const Shape& mesh_shape, int64_t index) {
  std::vector<int64_t> coordinate(mesh_shape.size());
  for (size_t d = mesh_shape.size(); d-- > 0;) {
    coordinate[d] = index % mesh_shape[d];
    index /= mesh_shape[d];
  }
  return coordinate;
}

Result<Box> MeshChunk(const Shape& global_shape, const MeshLayout& layout,
                      const std::vector<int64_t>& coordinate) {
  SP_RETURN_IF_ERROR(ValidateLayout(global_shape, layout));
  bool in_mesh = coordinate.size() == layout.mesh_shape.size();
  for (size_t m = 0; in_mesh && m < coordinate.size(); ++m) {
    in_mesh = coordinate[m] >= 0 && coordinate[m] < layout.mesh_shape[m];
  }
  if (!in_mesh) {
    return InvalidArgumentError("coordinate " + CoordinateToString(coordinate) +
                                " is outside " + LayoutToString(layout));
  }
  std::vector<IndexSet> sets;
  for (int64_t size : global_shape) sets.emplace_back(size);
  for (size_t m = 0; m < layout.placements.size(); ++m) {
    const Placement& p = layout.placements[m];
    if (p.kind == Placement::Kind::kReplicate) continue;
    IndexSet& set = sets[p.dim];
    if (p.kind == Placement::Kind::kShard) {
      int64_t begin, end;
      ChunkRange(set.size(), layout.mesh_shape[m], coordinate[m], &begin, &end);
      set = set.Slice(begin, end);
    } else {
      set = StridedShard(set, p.split_factor, layout.mesh_shape[m], coordinate[m]);
    }
  }
  Box box;
  for (size_t d = 0; d < global_shape.size(); ++d) {
    int64_t begin, size;
    if (!sets[d].AsRange(&begin, &size)) {
      return InvalidArgumentError(
          "tensor dim " + std::to_string(d) + " of shape " + ShapeToString(global_shape) + " on " +
          LayoutToString(layout) + ": coordinate " + CoordinateToString(coordinate) +
          " holds the non-contiguous index set " + sets[d].ToString() + ", which is not a box");
    }
    box.offsets.push_back(size == 0 ? global_shape[d] : begin);
    box.sizes.push_back(size);
  }
  return box;
}

Result<std::optional<Box>> MeshChunkForRank(const Shape& global_shape, const MeshLayout& layout,
                                            int64_t rank) {
  int64_t position = -1;
  if (layout.rank_list.empty()) {
    if (rank >= 0 && rank < ShapeVolume(layout.mesh_shape)) position = rank;
  } else {
    for (size_t i = 0; i < layout.rank_list.size(); ++i) {
      if (layout.rank_list[i] == rank) position = static_cast<int64_t>(i);
    }
  }
  if (position < 0) return std::optional<Box>();
  SP_ASSIGN_OR_RETURN(Box box,
                      MeshChunk(global_shape, layout, UnravelMeshIndex(layout.mesh_shape, position)));
  return std::optional<Box>(std::move(box));
}

Result<std::vector<Box>> MeshChunksPerRank(const Shape& global_shape, const MeshLayout& layout) {
  SP_RETURN_IF_ERROR(ValidateLayout(global_shape, layout));
  const int64_t volume = ShapeVolume(layout.mesh_shape);
  if (!layout.rank_list.empty()) {
    if (static_cast<int64_t>(layout.rank_list.size()) != volume) {
      return InvalidArgumentError(LayoutToString(layout) + ": rank list has " +
                                  std::to_string(layout.rank_list.size()) +
                                  " ranks, expected the mesh volume " + std::to_string(volume));
    }
    std::set<int64_t> seen(layout.rank_list.begin(), layout.rank_list.end());
    if (seen.size() != layout.rank_list.size()) {
      return InvalidArgumentError(LayoutToString(layout) + ": rank list holds a rank twice");
    }
  }
  std::vector<Box> chunks;
  chunks.reserve(volume);
  for (int64_t i = 0; i < volume; ++i) {
    SP_ASSIGN_OR_RETURN(Box box,
                        MeshChunk(global_shape, layout, UnravelMeshIndex(layout.mesh_shape, i)));
    chunks.push_back(std::move(box));
  }
  return chunks;
}

}  // namespace sp
