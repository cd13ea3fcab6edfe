#include "shardpoint/plan/load_plan.h"

#include <algorithm>
#include <functional>
#include <string_view>

#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/plan/box_set.h"

namespace sp {
namespace {

constexpr size_t kMaxListedKeys = 10;

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string MissingKeysMessage(const std::vector<std::string>& missing) {
  std::string out = std::to_string(missing.size()) +
                    (missing.size() == 1 ? " key is" : " keys are") +
                    " missing from the checkpoint: ";
  for (size_t i = 0; i < missing.size() && i < kMaxListedKeys; ++i) {
    if (i) out += ", ";
    out += Quote(missing[i]);
  }
  if (missing.size() > kMaxListedKeys) {
    out += " and " + std::to_string(missing.size() - kMaxListedKeys) + " more";
  }
  return out;
}

Status CheckCompatible(const LocalTensor& target, const TensorMetadata& stored,
                       const LoadPlanOptions& options) {
  auto prefix = [&] { return "tensor " + Quote(target.name) + ": checkpoint has "; };
  if (stored.shape != target.shape) {
    return InvalidArgumentError(prefix() + "shape " + ShapeToString(stored.shape) +
                                ", destination has " + ShapeToString(target.shape));
  }
  if (stored.dtype != target.dtype && !options.allow_cast) {
    return InvalidArgumentError(prefix() + "dtype " + std::string(DTypeName(stored.dtype)) +
                                ", destination has " + std::string(DTypeName(target.dtype)) +
                                "; pass cast=True to convert");
  }
  for (const Box& box : target.boxes) {
    if (box.offsets.size() != box.sizes.size() || !WithinShape(box, target.shape)) {
      std::string shown = box.offsets.size() == box.sizes.size()
                              ? box.ToString()
                              : "with " + std::to_string(box.offsets.size()) + " offsets and " +
                                    std::to_string(box.sizes.size()) + " sizes";
      return InvalidArgumentError("tensor " + Quote(target.name) + ": destination box " + shown +
                                  " is not within shape " + ShapeToString(target.shape));
    }
  }
  return OkStatus();
}

// Checks that the regions read into one target box tile it exactly.
Status CheckBoxCovered(const LocalTensor& target, const Box& box,
                       const std::vector<ReadItem>& items, size_t first_item,
                       const TensorMetadata& stored) {
  std::vector<const Box*> regions;
  regions.reserve(items.size() - first_item);
  for (size_t i = first_item; i < items.size(); ++i) regions.push_back(&items[i].region);
  if (auto pair = FindOverlappingPair(regions)) {
    const ReadItem& a = items[first_item + pair->first];
    const ReadItem& b = items[first_item + pair->second];
    return DataLossError("tensor " + Quote(target.name) + ": stored chunks " +
                         stored.chunks[a.stored_chunk].box.ToString() + " and " +
                         stored.chunks[b.stored_chunk].box.ToString() +
                         " overlap inside destination box " + box.ToString() +
                         "; the checkpoint metadata is inconsistent");
  }
  int64_t covered = 0;  // disjoint regions inside the box: the sum cannot overflow
  for (const Box* region : regions) covered += region->volume();
  if (covered != box.volume()) {
    return DataLossError("tensor " + Quote(target.name) + ": the checkpoint's chunks cover " +
                         std::to_string(covered) + " of the " + std::to_string(box.volume()) +
                         " elements of destination box " + box.ToString() + "; " +
                         std::to_string(box.volume() - covered) + " elements are missing");
  }
  return OkStatus();
}

// Appends the reads that fill every box of one target from a tensor whose chunks form a grid:
// the grid proves that they tile the shape, so each box is covered exactly once. A grid the
// metadata carried (TensorMetadata::grid) is checked against every chunk it yields: false, with
// nothing appended, when one of them is not its cell (a grid left stale by a change of chunks).
bool PlanTargetOnGrid(uint32_t target_index, const LocalTensor& target,
                      const TensorMetadata& stored, const ChunkGrid& grid,
                      std::vector<ReadItem>* items) {
  const size_t first_item = items->size();
  std::vector<uint32_t> hits;
  for (uint32_t b = 0; b < target.boxes.size(); ++b) {
    const Box& box = target.boxes[b];
    hits.clear();
    GridChunksIntersecting(grid, box, &hits);
    for (uint32_t chunk : hits) {
      const Box& stored_box = stored.chunks[chunk].box;
      if (stored_box != GridCellBox(grid, chunk)) {
        items->resize(first_item);
        return false;
      }
      std::optional<Box> region = Intersect(box, stored_box);
      items->push_back(ReadItem{target_index, b, chunk, std::move(*region)});
    }
  }
  return true;
}

// Whether `grid` can index `stored`: its rank, its cut points (increasing from 0 to the shape),
// its strides, and as many cells as chunks.
bool GridFits(const ChunkGrid& grid, const TensorMetadata& stored) {
  const size_t rank = stored.shape.size();
  if (grid.bounds.size() != rank || grid.strides.size() != rank) return false;
  uint64_t stride = 1;
  for (size_t d = rank; d-- > 0;) {
    const std::vector<int64_t>& bounds = grid.bounds[d];
    if (bounds.size() < 2 || bounds.front() != 0 || bounds.back() != stored.shape[d] ||
        !std::is_sorted(bounds.begin(), bounds.end(), std::less_equal<>()) ||
        grid.strides[d] != stride) {
      return false;
    }
    if (__builtin_mul_overflow(stride, bounds.size() - 1, &stride)) return false;
  }
  return stride == stored.chunks.size();
}

// Appends the reads that fill every box of one target, checking each box is covered.
Status PlanTarget(uint32_t target_index, const LocalTensor& target, const TensorMetadata& stored,
                  const LoadPlanOptions& options, std::vector<ReadItem>* items) {
  if (options.chunk_grids) {
    if (stored.grid && GridFits(*stored.grid, stored) &&
        PlanTargetOnGrid(target_index, target, stored, *stored.grid, items)) {
      return OkStatus();
    }
    // A tensor that was indexed was found not to be a grid: no need to look again.
    if (!stored.index) {
      if (std::optional<ChunkGrid> grid = FindChunkGrid(stored.chunks, stored.shape)) {
        PlanTargetOnGrid(target_index, target, stored, *grid, items);
        return OkStatus();
      }
    }
  }
  std::vector<const Box*> wanted(target.boxes.size());
  for (size_t i = 0; i < wanted.size(); ++i) wanted[i] = &target.boxes[i];
  // The chunks to pair with the boxes: those an index finds under them, else all of them.
  std::vector<uint32_t> numbers;
  bool indexed = options.chunk_grids && stored.index;
  for (size_t b = 0; indexed && b < target.boxes.size(); ++b) {
    indexed = IndexedChunksIntersecting(*stored.index, stored.chunks, target.boxes[b], &numbers);
  }
  if (indexed) {
    std::sort(numbers.begin(), numbers.end());
    numbers.erase(std::unique(numbers.begin(), numbers.end()), numbers.end());
  } else {
    numbers.resize(stored.chunks.size());
    for (uint32_t i = 0; i < numbers.size(); ++i) numbers[i] = i;
  }
  std::vector<const Box*> chunks(numbers.size());
  for (size_t k = 0; k < chunks.size(); ++k) {
    const size_t i = numbers[k];
    const Box& chunk = stored.chunks[i].box;
    if (chunk.offsets.size() != chunk.sizes.size() || !WithinShape(chunk, stored.shape)) {
      return DataLossError("tensor " + Quote(stored.name) + ": stored chunk " + std::to_string(i) +
                           " is not a box within shape " + ShapeToString(stored.shape) +
                           "; the checkpoint metadata is corrupt");
    }
    chunks[k] = &chunk;
  }
  std::vector<std::pair<uint32_t, uint32_t>> pairs = IntersectingPairs(wanted, chunks);
  std::sort(pairs.begin(), pairs.end());  // group by target box
  size_t next = 0;
  for (uint32_t b = 0; b < target.boxes.size(); ++b) {
    const Box& box = target.boxes[b];
    if (box.empty()) continue;
    const size_t first_item = items->size();
    for (; next < pairs.size() && pairs[next].first == b; ++next) {
      const uint32_t chunk = numbers[pairs[next].second];
      std::optional<Box> region = Intersect(box, stored.chunks[chunk].box);
      items->push_back(ReadItem{target_index, b, chunk, std::move(*region)});
    }
    SP_RETURN_IF_ERROR(CheckBoxCovered(target, box, *items, first_item, stored));
  }
  return OkStatus();
}

void SortItems(const std::vector<const TensorMetadata*>& stored, std::vector<ReadItem>* items) {
  struct Key {
    uint32_t file;
    uint64_t data_offset;
    uint32_t item;
  };
  std::vector<Key> keys(items->size());
  for (uint32_t i = 0; i < keys.size(); ++i) {
    const ReadItem& item = (*items)[i];
    const StoredChunk& chunk = stored[item.target]->chunks[item.stored_chunk];
    keys[i] = Key{chunk.file, chunk.data_offset, i};
  }
  std::sort(keys.begin(), keys.end(), [&](const Key& a, const Key& b) {
    if (a.file != b.file) return a.file < b.file;
    if (a.data_offset != b.data_offset) return a.data_offset < b.data_offset;
    const ReadItem& x = (*items)[a.item];
    const ReadItem& y = (*items)[b.item];
    if (auto c = x.region <=> y.region; c != 0) return c < 0;
    if (x.target != y.target) return x.target < y.target;
    return x.target_box < y.target_box;
  });
  std::vector<ReadItem> sorted;
  sorted.reserve(items->size());
  for (const Key& key : keys) sorted.push_back(std::move((*items)[key.item]));
  *items = std::move(sorted);
}

}  // namespace

Result<LoadPlan> PlanLoad(std::span<const LocalTensor> targets, const CheckpointMetadata& metadata,
                          const LoadPlanOptions& options) {
  LoadPlan plan;
  plan.stored.resize(targets.size(), nullptr);
  std::vector<bool> requested(metadata.tensors.size(), false);
  std::vector<std::string> missing;
  for (size_t i = 0; i < targets.size(); ++i) {
    const TensorMetadata* stored = metadata.FindTensor(targets[i].name);
    if (stored == nullptr) {
      missing.push_back(targets[i].name);
      continue;
    }
    plan.stored[i] = stored;
    requested[stored - metadata.tensors.data()] = true;
  }
  if (!missing.empty() && options.strict) return NotFoundError(MissingKeysMessage(missing));
  plan.missing_keys = std::move(missing);
  for (size_t i = 0; i < targets.size(); ++i) {
    if (plan.stored[i] != nullptr) {
      SP_RETURN_IF_ERROR(CheckCompatible(targets[i], *plan.stored[i], options));
    }
  }
  for (uint32_t i = 0; i < targets.size(); ++i) {
    if (plan.stored[i] != nullptr) {
      SP_RETURN_IF_ERROR(PlanTarget(i, targets[i], *plan.stored[i], options, &plan.items));
    }
  }
  for (size_t t = 0; t < metadata.tensors.size(); ++t) {
    if (!requested[t]) plan.unexpected_keys.push_back(metadata.tensors[t].name);
  }
  SortItems(plan.stored, &plan.items);
  return plan;
}

}  // namespace sp
