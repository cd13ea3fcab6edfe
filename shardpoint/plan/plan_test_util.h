// Shared test code for the planners: device-mesh layouts (torch.chunk semantics), row-major element
// walks and small constructors. Used only by the plan tests.
#ifndef SHARDPOINT_PLAN_PLAN_TEST_UTIL_H_
#define SHARDPOINT_PLAN_PLAN_TEST_UTIL_H_

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/plan/save_plan.h"

namespace sp::testing {

// `plan` with every tensor held as cells given its chunks (ExpandChunkCells), and the number
// of tensors that were held so in `cell_tensors`.
inline GlobalSavePlan WithCellsExpanded(GlobalSavePlan plan, int* cell_tensors) {
  for (TensorMetadata& t : plan.metadata.tensors) {
    *cell_tensors += t.cells ? 1 : 0;
    ExpandChunkCells(&t);
  }
  return plan;
}

// Takes every write `plan` defers (SavePlanOptions::defer_writes) in rounds of random sizes, as a
// coordinator sends its replies, and counts in `deferred` the plans that deferred any.
inline Status TakeDeferredInRounds(std::mt19937_64& rng, ThreadPool* pool, GlobalSavePlan* plan,
                                   int* deferred) {
  *deferred += plan->deferred.empty() ? 0 : 1;
  const uint32_t world = static_cast<uint32_t>(plan->ranks.size());
  for (uint32_t first = 0; first < world;) {
    const uint32_t end = first + 1 + static_cast<uint32_t>(rng() % 4);
    if (Status s = TakeDeferredWrites(plan, first, end, pool); !s.ok()) return s;
    first = end;
  }
  DropDeferredWrites(plan);
  return OkStatus();
}

// A placement per mesh dimension: kReplicate, or the tensor dimension that dimension shards.
inline constexpr int kReplicate = -1;

struct Mesh {
  std::vector<int64_t> sizes;   // mesh shape; rank = row-major coordinate
  std::vector<int> placements;  // per mesh dim: kReplicate or a tensor dim
  int64_t world_size() const { return ShapeVolume(sizes); }
};

// torch.chunk of [0, length) into `parts`: piece `index` as (offset, size); size may be 0.
inline std::pair<int64_t, int64_t> ChunkPiece(int64_t length, int64_t parts, int64_t index) {
  const int64_t full = (length + parts - 1) / parts;
  const int64_t start = full * index;
  if (start >= length) return {length, 0};
  return {start, std::min(length, start + full) - start};
}

// The box that `rank` holds of a tensor of `shape` under `mesh` (mesh dims applied in order;
// nested shardings of one tensor dim compose).
inline Box MeshBox(const Shape& shape, const Mesh& mesh, int64_t rank) {
  Box box = Box::Whole(shape);
  std::vector<int64_t> coord(mesh.sizes.size());
  for (size_t m = mesh.sizes.size(); m-- > 0;) {
    coord[m] = rank % mesh.sizes[m];
    rank /= mesh.sizes[m];
  }
  for (size_t m = 0; m < mesh.sizes.size(); ++m) {
    if (mesh.placements[m] == kReplicate) continue;
    const size_t d = static_cast<size_t>(mesh.placements[m]);
    auto [offset, size] = ChunkPiece(box.sizes[d], mesh.sizes[m], coord[m]);
    box.offsets[d] += offset;
    box.sizes[d] = size;
  }
  return box;
}

// A random mesh of at most `max_world` ranks placing tensors of rank `tensor_rank`.
inline Mesh RandomMesh(std::mt19937_64& rng, size_t tensor_rank, int64_t max_world) {
  Mesh mesh;
  const int dims = 1 + static_cast<int>(rng() % 3);
  int64_t world = 1;
  for (int m = 0; m < dims; ++m) {
    const int64_t size = 1 + static_cast<int64_t>(rng() % 4);
    if (world * size > max_world) break;
    world *= size;
    mesh.sizes.push_back(size);
    const bool shard = tensor_rank > 0 && rng() % 3 != 0;
    mesh.placements.push_back(shard ? static_cast<int>(rng() % tensor_rank) : kReplicate);
  }
  if (mesh.sizes.empty()) {
    mesh.sizes.push_back(1);
    mesh.placements.push_back(kReplicate);
  }
  return mesh;
}

// Calls fn(global_point, position_in_box) for every element of `box` in row-major order.
inline void ForEachElement(const Box& box,
                           const std::function<void(const std::vector<int64_t>&, int64_t)>& fn) {
  if (box.empty()) return;
  std::vector<int64_t> point(box.offsets);
  for (int64_t position = 0;; ++position) {
    fn(point, position);
    size_t d = box.rank();
    while (d > 0) {
      --d;
      if (++point[d] < box.exclusive_max(d)) break;
      point[d] = box.offsets[d];
      if (d == 0) return;
    }
    if (box.rank() == 0) return;
  }
}

// Row-major index of `point` inside a region with the given origin and sizes.
inline int64_t LinearIndex(std::span<const int64_t> point, std::span<const int64_t> origin,
                           std::span<const int64_t> sizes) {
  int64_t index = 0;
  for (size_t d = 0; d < point.size(); ++d) index = index * sizes[d] + (point[d] - origin[d]);
  return index;
}

inline LocalTensor Tensor(std::string name, DType dtype, Shape shape, std::vector<Box> boxes) {
  return LocalTensor{std::move(name), dtype, std::move(shape), std::move(boxes)};
}

}  // namespace sp::testing

#endif  // SHARDPOINT_PLAN_PLAN_TEST_UTIL_H_
