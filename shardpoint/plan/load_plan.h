// Load planning: which regions of which stored chunks fill each destination box.
//
// A rank describes what it wants as LocalTensors (name, dtype, global shape and the boxes it
// holds in global coordinates, like the save side). PlanLoad matches each against the
// checkpoint metadata and produces one ReadItem per (destination box, stored chunk) pair that
// intersect, with the intersection in global coordinates. This is the resharding step: the
// stored chunks may be laid out in any way (another world size, another parallel layout).
// Stored chunks that form a regular grid (the usual case: rows, columns or both cut by a rule)
// are found by a binary search per dimension; others by a sweep over the tensor's chunks.
//
// The plan proves that every destination element is covered exactly once before any byte is
// read. Items are sorted by file and byte offset so the reader can coalesce them.
//
// Planning is pure: values in, values out, no I/O, no threads. PlanLoad is thread-safe. A
// LoadPlan borrows from the metadata it was planned against (LoadPlan::stored): keep that
// metadata alive and unchanged while the plan is in use.
#ifndef SHARDPOINT_PLAN_LOAD_PLAN_H_
#define SHARDPOINT_PLAN_LOAD_PLAN_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {

struct LoadPlanOptions {
  bool strict = true;       // a target missing from the checkpoint is an error
  bool allow_cast = false;  // a dtype mismatch is allowed (the reader converts)
  // The chunks of a tensor that form a regular grid are found by arithmetic (plan/chunk_grid.h):
  // the cost of a target is then that of its own reads. False plans every tensor with the sweeps
  // of plan/box_set.h; both give the same plan (tests and benchmarks compare them).
  bool chunk_grids = true;
};

struct ReadItem {
  uint32_t target = 0;        // index into the targets span
  uint32_t target_box = 0;    // index into targets[target].boxes
  uint32_t stored_chunk = 0;  // index into the stored TensorMetadata's chunks
  Box region;                 // global coordinates: the intersection

  friend bool operator==(const ReadItem&, const ReadItem&) = default;
};

struct LoadPlan {
  // Sorted by (file, data_offset of the chunk, region), then (target, target_box), so reads of
  // one file come in increasing offset order.
  std::vector<ReadItem> items;
  std::vector<std::string> missing_keys;      // targets absent from the checkpoint (non-strict
                                              // only), in target order
  std::vector<std::string> unexpected_keys;   // stored tensors nobody asked for (sorted)
  std::vector<const TensorMetadata*> stored;  // per target: its stored metadata (nullptr when
                                              // missing); points into the metadata
};

// Plans the reads that fill `targets` from the checkpoint described by `metadata`, whose
// tensors must be sorted by name (CheckpointMetadata's contract). Empty target boxes are ignored.
//
// Errors:
//   - kNotFound (strict only): targets absent from the checkpoint, naming up to 10 keys and
//     then "and N more";
//   - kInvalidArgument: a shape mismatch naming the tensor and both shapes; a dtype mismatch
//     naming both dtypes (unless allow_cast); a target box of the wrong rank or outside the
//     shape;
//   - kDataLoss: stored chunks that do not cover a target box (naming the tensor, the box and
//     the missing element count) or that overlap inside it.
Result<LoadPlan> PlanLoad(std::span<const LocalTensor> targets, const CheckpointMetadata& metadata,
                          const LoadPlanOptions& options);

}  // namespace sp

#endif  // SHARDPOINT_PLAN_LOAD_PLAN_H_
