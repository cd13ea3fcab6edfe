#include "shardpoint/engine/mapped_metadata.h"

#include <algorithm>
#include <optional>
#include <utility>

namespace sp {
namespace {

// For each dim of `sizes`, the dim of `stored` it is (or -1 for an inserted size-1 dim), when
// `sizes` is `stored` with size-1 dims inserted. Matching each stored dim to the first target dim
// of its size is enough: where both are 1 either choice lifts every chunk to the same box (a
// chunk spans offset 0, size 1 of any size-1 dim).
std::optional<std::vector<int>> MatchDims(const Shape& stored, const Shape& sizes) {
  std::vector<int> of(sizes.size(), -1);
  size_t next = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (next < stored.size() && sizes[d] == stored[next]) {
      of[d] = static_cast<int>(next++);
    } else if (sizes[d] != 1) {
      return std::nullopt;
    }
  }
  if (next != stored.size()) return std::nullopt;
  return of;
}

Box Lift(const Box& chunk, const std::vector<int>& of, const SourcePlacement& placement) {
  Box out(placement.offsets, Shape(of.size(), 1));
  for (size_t d = 0; d < of.size(); ++d) {
    if (of[d] < 0) continue;
    out.offsets[d] += chunk.offsets[static_cast<size_t>(of[d])];
    out.sizes[d] = chunk.sizes[static_cast<size_t>(of[d])];
  }
  return out;
}

std::string Quoted(const std::string& name) { return "'" + name + "'"; }

std::string TargetLabel(const TensorPlacement& p) {
  return "target " + Quoted(p.target) + " of shape " + ShapeToString(p.shape);
}

Box PlacedBox(const SourcePlacement& s) { return Box(s.offsets, s.sizes); }

// Checks one source of a placement against the stored tensor and the target; returns its dims.
Result<std::vector<int>> CheckSource(const TensorPlacement& p, const SourcePlacement& s,
                                     const TensorMetadata* stored) {
  if (stored == nullptr) {
    return NotFoundError(TargetLabel(p) + ": stored tensor " + Quoted(s.source) +
                         " is missing from the checkpoint");
  }
  if (s.offsets.size() != p.shape.size() || s.sizes.size() != p.shape.size()) {
    return InvalidArgumentError(TargetLabel(p) + ": stored tensor " + Quoted(s.source) +
                                " is placed with " + std::to_string(s.offsets.size()) +
                                " offsets and " + std::to_string(s.sizes.size()) +
                                " sizes, expected " + std::to_string(p.shape.size()) + " of each");
  }
  std::optional<std::vector<int>> of = MatchDims(stored->shape, s.sizes);
  if (!of) {
    return InvalidArgumentError(TargetLabel(p) + ": stored tensor " + Quoted(s.source) +
                                " has shape " + ShapeToString(stored->shape) +
                                ", which does not give its placement's sizes " +
                                ShapeToString(s.sizes) + " by inserting dims of size 1");
  }
  if (stored->dtype != p.dtype) {
    return InvalidArgumentError(TargetLabel(p) + " has dtype " + std::string(DTypeName(p.dtype)) +
                                ", stored tensor " + Quoted(s.source) + " has dtype " +
                                std::string(DTypeName(stored->dtype)));
  }
  if (!WithinShape(PlacedBox(s), p.shape)) {
    return InvalidArgumentError(TargetLabel(p) + ": stored tensor " + Quoted(s.source) +
                                " placed at " + PlacedBox(s).ToString() + " lies outside it");
  }
  return *std::move(of);
}

// The sources, all inside the target, must neither overlap nor leave a gap. Sorted by their
// first offset, a source can only overlap those that start before its end along dim 0, so a
// stack along dim 0 compares each source with its few neighbours only.
Status CheckTiling(const TensorPlacement& p) {
  std::vector<const SourcePlacement*> order;
  int64_t covered = 0;
  for (const SourcePlacement& s : p.sources) {
    if (ShapeVolume(s.sizes) == 0) continue;
    order.push_back(&s);
    covered += ShapeVolume(s.sizes);
  }
  const bool scalar = p.shape.empty();
  std::stable_sort(
      order.begin(), order.end(),
      [](const SourcePlacement* a, const SourcePlacement* b) { return a->offsets < b->offsets; });
  for (size_t i = 0; i < order.size(); ++i) {
    const Box a = PlacedBox(*order[i]);
    for (size_t j = i + 1; j < order.size(); ++j) {
      const Box b = PlacedBox(*order[j]);
      if (!scalar && b.offsets[0] >= a.exclusive_max(0)) break;
      if (scalar || Intersect(a, b)) {
        return InvalidArgumentError(TargetLabel(p) + ": stored tensors " +
                                    Quoted(order[i]->source) + " at " + a.ToString() + " and " +
                                    Quoted(order[j]->source) + " at " + b.ToString() + " overlap");
      }
    }
  }
  if (covered != ShapeVolume(p.shape)) {
    std::string names;
    for (size_t i = 0; i < p.sources.size() && i < 4; ++i) {
      names += (i ? ", " : "") + Quoted(p.sources[i].source);
    }
    if (p.sources.size() > 4) names += ", ... (" + std::to_string(p.sources.size()) + " in all)";
    return InvalidArgumentError(TargetLabel(p) + ": its stored tensors [" + names + "] cover " +
                                std::to_string(covered) + " of its " +
                                std::to_string(ShapeVolume(p.shape)) + " elements");
  }
  return OkStatus();
}

Result<TensorMetadata> MapPlacement(const CheckpointMetadata& source, const TensorPlacement& p) {
  if (std::any_of(p.shape.begin(), p.shape.end(), [](int64_t s) { return s < 0; })) {
    return InvalidArgumentError(TargetLabel(p) + " has a negative size");
  }
  TensorMetadata out{p.target, p.dtype, p.shape, {}};
  for (const SourcePlacement& s : p.sources) {
    const TensorMetadata* stored = source.FindTensor(s.source);
    SP_ASSIGN_OR_RETURN(std::vector<int> of, CheckSource(p, s, stored));
    for (const StoredChunk& chunk : stored->chunks) {
      StoredChunk& lifted = out.chunks.emplace_back(chunk);
      lifted.box = Lift(chunk.box, of, s);
    }
  }
  SP_RETURN_IF_ERROR(CheckTiling(p));
  return out;
}

}  // namespace

Result<Box> LiftChunkBox(const Box& chunk, const Shape& stored_shape,
                         const SourcePlacement& placement) {
  std::optional<std::vector<int>> of = MatchDims(stored_shape, placement.sizes);
  if (!of || placement.offsets.size() != placement.sizes.size() ||
      chunk.rank() != stored_shape.size()) {
    return InvalidArgumentError("stored tensor " + Quoted(placement.source) + " of shape " +
                                ShapeToString(stored_shape) + " (chunk " + chunk.ToString() +
                                ") cannot be placed with sizes " + ShapeToString(placement.sizes) +
                                " and " + std::to_string(placement.offsets.size()) + " offsets");
  }
  return Lift(chunk, *of, placement);
}

Result<CheckpointMetadata> MapCheckpointMetadata(const CheckpointMetadata& source,
                                                 const MetadataMapping& mapping) {
  CheckpointMetadata out = source;
  out.tensors.clear();
  std::map<std::string, std::string> made_by;  // output name -> what makes it, for collisions
  std::map<std::string, std::string> placed;   // stored name -> a target it is placed in
  auto claim = [&](const std::string& name, std::string what) -> Status {
    auto [it, fresh] = made_by.emplace(name, what);
    if (fresh) return OkStatus();
    return InvalidArgumentError("both " + it->second + " and " + what + " are named " +
                                Quoted(name));
  };
  for (const TensorPlacement& p : mapping.placements) {
    SP_ASSIGN_OR_RETURN(TensorMetadata t, MapPlacement(source, p));
    SP_RETURN_IF_ERROR(claim(p.target, "fused target " + Quoted(p.target)));
    for (const SourcePlacement& s : p.sources) placed.emplace(s.source, p.target);
    out.tensors.push_back(std::move(t));
  }
  for (const auto& [from, to] : mapping.renames) {
    if (source.FindTensor(from) == nullptr) {
      return NotFoundError("stored tensor " + Quoted(from) + " renamed to " + Quoted(to) +
                           " is missing from the checkpoint");
    }
    if (auto it = placed.find(from); it != placed.end()) {
      return InvalidArgumentError("stored tensor " + Quoted(from) + " is renamed to " + Quoted(to) +
                                  " but also placed in target " + Quoted(it->second));
    }
  }
  for (const TensorMetadata& t : source.tensors) {
    if (placed.count(t.name)) continue;
    auto renamed = mapping.renames.find(t.name);
    TensorMetadata& copy = out.tensors.emplace_back(t);
    if (renamed != mapping.renames.end()) copy.name = renamed->second;
    SP_RETURN_IF_ERROR(
        claim(copy.name, "stored tensor " + Quoted(t.name) +
                             (renamed != mapping.renames.end() ? " (renamed)" : "")));
  }
  std::sort(out.tensors.begin(), out.tensors.end(),
            [](const TensorMetadata& a, const TensorMetadata& b) { return a.name < b.name; });
  return out;
}

}  // namespace sp
