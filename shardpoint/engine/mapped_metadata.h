// Mapped metadata: a checkpoint's metadata seen through a key mapping, as the metadata of its
// target tensors, so that the read engine serves fused and renamed targets with no staging copy.
//
// A key mapping (python/shardpoint/_mapping.py) makes a target tensor from stored tensors by
// stacking (a new dim) and concatenating (an existing dim). Each stored tensor then covers one box
// of its target: its own shape with size-1 dims inserted where stacks put it, at an offset (its
// stack index, its concatenation offset). Inserting size-1 dims does not change a tensor's
// row-major bytes, so a stored chunk whose box is *lifted* into the target's coordinates (its
// offsets and sizes placed in the source's dims, offset 0 and size 1 in the inserted dims, then
// shifted by the placement's offsets) holds exactly the bytes of that box of the target, in the
// target's row-major order. The target is therefore a tensor like any other whose chunks are its
// sources' chunks with lifted boxes: same file, byte range, encoding and checksum blocks (which
// work in the chunk's byte space and do not depend on its box).
//
// Pure: values in, values out, no I/O. Thread-safe.
#ifndef SHARDPOINT_ENGINE_MAPPED_METADATA_H_
#define SHARDPOINT_ENGINE_MAPPED_METADATA_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"

namespace sp {

// Where one stored tensor lies in its target, in the target's coordinates: `sizes` is the stored
// shape with size-1 dims inserted (the target's rank).
struct SourcePlacement {
  std::string source;
  std::vector<int64_t> offsets;
  Shape sizes;

  friend bool operator==(const SourcePlacement&, const SourcePlacement&) = default;
};

// A target tensor made of stored tensors that tile it exactly.
struct TensorPlacement {
  std::string target;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<SourcePlacement> sources;

  friend bool operator==(const TensorPlacement&, const TensorPlacement&) = default;
};

// A key mapping as the engine applies it: fused targets, and renames (stored name -> target name)
// of stored tensors that no placement uses.
struct MetadataMapping {
  std::vector<TensorPlacement> placements;
  std::map<std::string, std::string> renames;

  bool empty() const { return placements.empty() && renames.empty(); }
};

// The metadata of the targets of `mapping` over `source`: each placement's target (chunks lifted
// from its sources' chunks, in placement order), and every stored tensor that no placement uses,
// under its renamed name (its own when not renamed). Files, objects, attributes, format and
// checksum settings are the source's. Tensors are sorted by name. A stored tensor may be placed in
// more than one target.
//
// Errors, each naming the target and the stored tensors concerned, expected versus found:
//   kNotFound: a placed or renamed stored tensor missing from `source`;
//   kInvalidArgument: a placement whose offsets or sizes are not of the target's rank; a stored
//     shape that does not give the placement's sizes by inserting size-1 dims; a stored dtype
//     other than the target's; a placement outside the target; two placements that overlap;
//     placements that leave part of the target uncovered; a rename of a placed tensor; two
//     tensors (targets or renamed) under one name.
Result<CheckpointMetadata> MapCheckpointMetadata(const CheckpointMetadata& source,
                                                 const MetadataMapping& mapping);

// The box of a stored chunk in its target's coordinates: the stored dims of `chunk` are the dims
// of `placement.sizes` matched in order (see MapCheckpointMetadata), the others get offset 0 and
// size 1; then every dim is shifted by `placement.offsets`. `stored_shape` must give the sizes
// by inserting size-1 dims (kInvalidArgument otherwise).
Result<Box> LiftChunkBox(const Box& chunk, const Shape& stored_shape,
                         const SourcePlacement& placement);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_MAPPED_METADATA_H_
