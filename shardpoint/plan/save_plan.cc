#include "shardpoint/plan/save_plan.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <queue>
#include <tuple>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "shardpoint/exec/task_group.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/plan/box_set.h"
#include "shardpoint/plan/gathered_plans.h"

namespace sp {
namespace {

constexpr size_t kMaxListedRanks = 8;
constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

// A rank's claim to one non-empty box of a tensor.
struct Holding {
  uint64_t key;  // where the box's offsets, then sizes, are in GatheredPlans::values()
  uint32_t rank;
  uint32_t local_tensor;
  uint32_t local_box;
};

// The holders of every chunk of one rule over one shape, for the tensors that every rank of its
// mesh lists through one part (GatheredPlans::Part): each mesh position's non-empty box as a
// holding (local_tensor and local_box 0), grouped as GroupReplicas groups holdings. Found once
// for all the tensors of that rule and shape, and so is their tiling.
struct RulePattern {
  std::vector<Holding> holdings;
  std::vector<uint32_t> chunk_begin;
  // The first of its tensors in name order, which proves that the chunks tile the shape (and
  // finds `grid`, when they are one) for all of them; kNone until chosen.
  uint32_t prover = kNone;
  std::optional<ChunkGrid> grid;
};

// One global tensor while it is being planned.
struct TensorEntry {
  const std::string* name = nullptr;
  const Shape* shape = nullptr;
  DType dtype = DType::kFloat32;
  uint32_t shape_id = 0;
  uint32_t first_rank = 0;        // the lowest rank that lists it
  uint32_t last_rank = 0;         // latest rank seen listing it (detects duplicates)
  const int64_t* values = nullptr;  // GatheredPlans::values()
  // Listed through a part by its rule (GatheredPlans::RuledTensor `part_tensor` of part `part`)
  // by every rank so far, and by no rank otherwise: its holders are the rule's, `pattern` once
  // found, and `holdings` stay empty. kNone once a rank lists it otherwise.
  uint32_t part = kNone;
  uint32_t part_tensor = 0;
  RulePattern* pattern = nullptr;
  uint32_t pattern_local = 0;  // with a pattern: the tensor's index in its ranks' lists
  std::vector<Holding> holdings;  // after grouping: sorted by (box, rank, local_box)
  // Its chunks go first in their files (MarkLeadingTensors).
  bool leads_files = false;
  std::vector<uint32_t> chunk_begin;  // chunk c's holders: holdings[chunk_begin[c], [c+1])
  std::vector<uint32_t> owner;        // per chunk: the index into holdings of its writer
  // Per chunk, once owners are chosen: its writer's holding without the box (KeepOnlyWriters),
  // when holdings, chunk_begin and owner are gone; a write's `index` is its place in the rank's
  // list once the files are laid out, and a plan that defers its writes takes them as they are
  // (SavePlanOptions::defer_writes).
  GlobalSavePlan::DeferredTensor writers;
};

size_t KeyWidth(const TensorEntry& entry) { return 2 * entry.shape->size(); }

const std::vector<Holding>& Holdings(const TensorEntry& entry) {
  return entry.pattern ? entry.pattern->holdings : entry.holdings;
}
const std::vector<uint32_t>& ChunkBegin(const TensorEntry& entry) {
  return entry.pattern ? entry.pattern->chunk_begin : entry.chunk_begin;
}

const int64_t* KeyOf(const TensorEntry& entry, const Holding& holding) {
  return entry.values + holding.key;
}

// A chunk in its owner's list. Kept to 16 bytes: at 65,536 ranks x 1,000 tensors the list is
// 39 million of them, in memory the process touches for the first time, and faulting in fresh
// pages is most of what laying out the files costs there (docs/PERFORMANCE.md).
struct OwnedChunk {
  uint32_t tensor;
  uint32_t chunk;
  uint64_t bytes;
};

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

// "rank 3" or "ranks 0, 1, 2 and 5 more" for the distinct ranks among `holdings`.
std::string DescribeHolders(std::span<const Holding> holdings) {
  std::vector<uint32_t> ranks;
  for (const Holding& h : holdings) {
    if (ranks.empty() || ranks.back() != h.rank) ranks.push_back(h.rank);
  }
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kMaxListedRanks; ++i) {
    if (i) out += ", ";
    out += std::to_string(ranks[i]);
  }
  if (ranks.size() > kMaxListedRanks) {
    out += " and " + std::to_string(ranks.size() - kMaxListedRanks) + " more";
  }
  return out;
}

Status ValidateOptions(size_t world_size, const SavePlanOptions& options) {
  if (options.files_per_rank < 1) {
    return InvalidArgumentError("save plan: files_per_rank must be at least 1, got " +
                                std::to_string(options.files_per_rank));
  }
  if (options.checksum_block_bytes == 0) {
    return InvalidArgumentError("save plan: checksum_block_bytes must be positive, got 0");
  }
  for (const std::string& prefix : options.separate_key_prefixes) {
    if (prefix.empty()) {
      return InvalidArgumentError("save plan: a separation prefix is empty (it would match every key)");
    }
  }
  if (world_size > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgumentError("save plan: " + std::to_string(world_size) +
                                " local plans exceed the largest world size");
  }
  return OkStatus();
}

// Checks that the shape is non-negative and that its byte size fits in an int64.
Status ValidateShape(uint32_t rank, std::string_view name, DType dtype, const Shape& shape) {
  int64_t elements = 1;
  bool overflow = false;
  for (int64_t d : shape) {
    if (d < 0) {
      return InvalidArgumentError("tensor " + Quote(name) + ": rank " + std::to_string(rank) +
                                  " has invalid shape " + ShapeToString(shape) +
                                  " (negative dimension)");
    }
    overflow = overflow || __builtin_mul_overflow(elements, d, &elements);
  }
  int64_t bytes = 0;
  overflow = overflow ||
             __builtin_mul_overflow(elements, static_cast<int64_t>(DTypeSize(dtype)), &bytes);
  if (overflow) {
    return InvalidArgumentError("tensor " + Quote(name) + ": rank " + std::to_string(rank) +
                                " has shape " + ShapeToString(shape) + ", whose byte size overflows");
  }
  return OkStatus();
}

Status CheckAgreement(const TensorEntry& entry, uint32_t rank, const GatheredPlans& plans,
                      DType dtype, uint32_t shape) {
  const bool same_dtype = entry.dtype == dtype;
  if (same_dtype && entry.shape_id == shape) return OkStatus();
  std::string prefix =
      "tensor " + Quote(*entry.name) + ": rank " + std::to_string(entry.first_rank) + " has ";
  std::string other = " but rank " + std::to_string(rank) + " has ";
  if (!same_dtype) {
    return InvalidArgumentError(prefix + "dtype " + std::string(DTypeName(entry.dtype)) + other +
                                std::string(DTypeName(dtype)));
  }
  return InvalidArgumentError(prefix + "shape " + ShapeToString(*entry.shape) + other +
                              ShapeToString(plans.shape(shape)));
}

void AddHoldings(uint32_t rank, const GatheredPlans& plans, const GatheredPlans::Tensor& tensor,
                 TensorEntry* entry) {
  const size_t dims = entry->shape->size();
  for (uint32_t b = 0; b < tensor.box_count; ++b) {
    const int64_t* values = plans.box_values(tensor, b);
    if (std::any_of(values + dims, values + 2 * dims, [](int64_t size) { return size == 0; })) {
      continue;  // empty
    }
    entry->holdings.push_back(
        {static_cast<uint64_t>(values - plans.values()), rank, tensor.local, b});
  }
}

// A later rank lists a known tensor: it must do so once and agree on dtype and shape.
Status Revisit(uint32_t rank, const GatheredPlans& plans, DType dtype, uint32_t shape,
               TensorEntry* entry) {
  if (entry->last_rank == rank) {
    return InvalidArgumentError("tensor " + Quote(*entry->name) + ": rank " +
                                std::to_string(rank) + " lists it twice");
  }
  entry->last_rank = rank;
  return CheckAgreement(*entry, rank, plans, dtype, shape);
}

// Adds `rank`'s chunk of a tensor it lists through its part by the rule, unless it is empty.
Status AddRuledHolding(uint32_t rank, const GatheredPlans& plans, const GatheredPlans::Part& part,
                       const GatheredPlans::RuledTensor& tensor, TensorEntry* entry) {
  const int64_t position = part.rules[tensor.rule].PositionOf(rank);
  if (position < 0) {  // SharedPlans::Expand refuses such a rank
    return InternalError("tensor " + Quote(*entry->name) + ": rank " + std::to_string(rank) +
                         " lists it by a rule whose mesh does not hold it");
  }
  const size_t width = KeyWidth(*entry);
  const uint64_t key = tensor.chunks + static_cast<uint64_t>(position) * width;
  const int64_t* sizes = plans.values() + key + width / 2;
  if (std::any_of(sizes, sizes + width / 2, [](int64_t size) { return size == 0; })) {
    return OkStatus();  // empty
  }
  entry->holdings.push_back({key, rank, tensor.local, 0});
  return OkStatus();
}

// A tensor listed through a part by its rule so far is then listed otherwise: the part's ranks
// that listed it (those up to last_rank) become holdings, as if each had listed its box.
Status ExpandRuled(const GatheredPlans& plans, TensorEntry* entry) {
  const GatheredPlans::Part& part = plans.part(entry->part);
  const GatheredPlans::RuledTensor& tensor = part.tensors[entry->part_tensor];
  entry->part = kNone;
  for (uint32_t rank : part.ranks) {
    if (rank > entry->last_rank) break;
    SP_RETURN_IF_ERROR(AddRuledHolding(rank, plans, part, tensor, entry));
  }
  return OkStatus();
}

// Sorts holdings that arrive in (rank, local_box) order so that identical boxes (replicas) are
// adjacent; each run is one chunk.
void GroupByBox(const int64_t* values, size_t width, std::vector<Holding>* holdings,
                std::vector<uint32_t>* chunk_begin) {
  auto key = [&](const Holding& h) { return values + h.key; };
  auto by_box = [&](const Holding& a, const Holding& b) {
    return std::lexicographical_compare(key(a), key(a) + width, key(b), key(b) + width);
  };
  // A stable sort by box alone is enough; for row-sharded and replicated tensors they are
  // already in box order.
  if (!std::is_sorted(holdings->begin(), holdings->end(), by_box)) {
    std::stable_sort(holdings->begin(), holdings->end(), by_box);
  }
  chunk_begin->clear();
  for (uint32_t i = 0; i < holdings->size(); ++i) {
    if (i == 0 || !std::equal(key((*holdings)[i]), key((*holdings)[i]) + width,
                              key((*holdings)[i - 1]))) {
      chunk_begin->push_back(i);
    }
  }
  chunk_begin->push_back(static_cast<uint32_t>(holdings->size()));
}

// By part, rule and shape (not by where the chunks are: a rank-0 tensor's take no values, so the
// next rule's chunks start at the same place).
using RulePatterns = std::map<std::tuple<uint32_t, uint32_t, uint32_t>, RulePattern>;

// The pattern of a tensor every rank of whose mesh lists it through its part.
RulePattern* PatternOf(const GatheredPlans& plans, const TensorEntry& entry,
                       RulePatterns* patterns) {
  const GatheredPlans::Part& part = plans.part(entry.part);
  const GatheredPlans::RuledTensor& tensor = part.tensors[entry.part_tensor];
  auto [it, added] = patterns->try_emplace(std::tuple{entry.part, tensor.rule, tensor.shape});
  RulePattern& pattern = it->second;
  if (!added) return &pattern;
  const size_t width = KeyWidth(entry);
  for (const auto& [rank, position] : part.rules[tensor.rule].by_rank) {
    const uint64_t key = tensor.chunks + static_cast<uint64_t>(position) * width;
    const int64_t* sizes = plans.values() + key + width / 2;
    if (std::any_of(sizes, sizes + width / 2, [](int64_t size) { return size == 0; })) continue;
    pattern.holdings.push_back({key, static_cast<uint32_t>(rank), 0, 0});
  }
  GroupByBox(plans.values(), width, &pattern.holdings, &pattern.chunk_begin);
  return &pattern;
}

// A new entry for a tensor first listed by `rank`.
Result<TensorEntry> NewEntry(uint32_t rank, const GatheredPlans& plans, uint32_t name_id,
                             DType dtype, uint32_t shape_id) {
  const std::string& name = plans.name(name_id);
  SP_RETURN_IF_ERROR(ValidateShape(rank, name, dtype, plans.shape(shape_id)));
  TensorEntry entry;
  entry.name = &name;
  entry.shape = &plans.shape(shape_id);
  entry.shape_id = shape_id;
  entry.dtype = dtype;
  entry.first_rank = entry.last_rank = rank;
  entry.values = plans.values();
  return entry;
}

// Gathers every tensor named by any rank, validated, sorted by name. A tensor that every rank of
// its mesh lists through one part by its rule, and no other rank lists, is given the rule's
// pattern (from `patterns`) instead of holdings.
Result<std::vector<TensorEntry>> CollectTensors(const GatheredPlans& plans,
                                                RulePatterns* patterns) {
  std::vector<uint32_t> entry_of_name(plans.name_count(), kNone);
  std::vector<TensorEntry> entries;
  for (uint32_t rank = 0; rank < plans.world_size(); ++rank) {
    for (const GatheredPlans::Tensor& tensor : plans.tensors(rank)) {
      uint32_t& e = entry_of_name[tensor.name];
      if (e == kNone) {
        SP_ASSIGN_OR_RETURN(TensorEntry entry,
                            NewEntry(rank, plans, tensor.name, tensor.dtype, tensor.shape));
        e = static_cast<uint32_t>(entries.size());
        entries.push_back(std::move(entry));
      } else {
        if (entries[e].part != kNone) SP_RETURN_IF_ERROR(ExpandRuled(plans, &entries[e]));
        SP_RETURN_IF_ERROR(Revisit(rank, plans, tensor.dtype, tensor.shape, &entries[e]));
      }
      if (tensor.error != GatheredPlans::kNoError) return plans.error(tensor.error);
      AddHoldings(rank, plans, tensor, &entries[e]);
    }
    const uint32_t part_id = plans.part_of(rank);
    if (part_id == GatheredPlans::kNoPart) continue;
    const GatheredPlans::Part& part = plans.part(part_id);
    for (uint32_t i = 0; i < part.tensors.size(); ++i) {
      const GatheredPlans::RuledTensor& tensor = part.tensors[i];
      uint32_t& e = entry_of_name[tensor.name];
      if (e == kNone) {
        SP_ASSIGN_OR_RETURN(TensorEntry entry,
                            NewEntry(rank, plans, tensor.name, tensor.dtype, tensor.shape));
        entry.part = part_id;
        entry.part_tensor = i;
        e = static_cast<uint32_t>(entries.size());
        entries.push_back(std::move(entry));
        continue;
      }
      TensorEntry& entry = entries[e];
      if (entry.part == part_id && entry.part_tensor == i) {  // the next rank of the part
        entry.last_rank = rank;
        continue;
      }
      if (entry.part != kNone) SP_RETURN_IF_ERROR(ExpandRuled(plans, &entry));
      SP_RETURN_IF_ERROR(Revisit(rank, plans, tensor.dtype, tensor.shape, &entry));
      SP_RETURN_IF_ERROR(AddRuledHolding(rank, plans, part, tensor, &entry));
    }
  }
  for (TensorEntry& entry : entries) {
    if (entry.part == kNone) continue;
    const GatheredPlans::Part& part = plans.part(entry.part);
    const GatheredPlans::RuledTensor& tensor = part.tensors[entry.part_tensor];
    // Every position of the mesh is a rank of the part (each of which is in the mesh), or the
    // tensor is planned from its holdings.
    if (part.ranks.size() != part.rules[tensor.rule].rank_at.size()) {
      SP_RETURN_IF_ERROR(ExpandRuled(plans, &entry));
      continue;
    }
    entry.pattern = PatternOf(plans, entry, patterns);
    entry.pattern_local = tensor.local;
  }
  std::sort(entries.begin(), entries.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return *a.name < *b.name;
  });
  return entries;
}

// Groups a tensor's holdings into chunks (one with a pattern is grouped already).
void GroupReplicas(TensorEntry* entry) {
  if (entry->pattern == nullptr) {
    GroupByBox(entry->values, KeyWidth(*entry), &entry->holdings, &entry->chunk_begin);
  }
}

std::span<const Holding> HoldersOf(const TensorEntry& entry, size_t chunk) {
  const std::vector<uint32_t>& begin = ChunkBegin(entry);
  return std::span<const Holding>(Holdings(entry)).subspan(begin[chunk],
                                                           begin[chunk + 1] - begin[chunk]);
}

// Proves the distinct chunks of a tensor tile its shape: no overlap, no hole. Chunks sorted by box
// that form a grid (the usual layouts) are proved in one pass, and the grid is kept as the
// tensor's index (TensorMetadata::grid); the others are proved by the sweeps.
Status ProveTiling(const TensorEntry& entry, TensorMetadata& md) {
  const Shape& shape = *entry.shape;
  md.grid = FindChunkGrid(md.chunks, shape);
  if (md.grid) return OkStatus();
  std::vector<const Box*> boxes(md.chunks.size());
  for (size_t c = 0; c < boxes.size(); ++c) boxes[c] = &md.chunks[c].box;
  if (auto pair = FindOverlappingPair(boxes)) {
    return InvalidArgumentError("tensor " + Quote(*entry.name) + ": chunk " +
                                boxes[pair->first]->ToString() + " held by " +
                                DescribeHolders(HoldersOf(entry, pair->first)) +
                                " overlaps chunk " + boxes[pair->second]->ToString() + " held by " +
                                DescribeHolders(HoldersOf(entry, pair->second)));
  }
  int64_t covered = 0;  // disjoint boxes within the shape: the sum cannot overflow
  for (const Box* box : boxes) covered += box->volume();
  const int64_t volume = ShapeVolume(shape);
  if (covered == volume) return OkStatus();
  std::string message = "tensor " + Quote(*entry.name) + " of shape " +
                        ShapeToString(shape) + ": no rank holds " +
                        std::to_string(volume - covered) + " of its " + std::to_string(volume) +
                        " elements";
  if (auto point = FindUncoveredPoint(boxes, shape)) {
    message += " (for example the element at " + PointToString(*point) + ")";
  }
  return InvalidArgumentError(message);
}

TensorMetadata MakeTensorMetadata(const TensorEntry& entry) {
  TensorMetadata md;
  md.name = *entry.name;
  md.dtype = entry.dtype;
  md.shape = *entry.shape;
  const std::vector<uint32_t>& chunk_begin = ChunkBegin(entry);
  const size_t num_chunks = chunk_begin.size() - 1;
  // Each chunk is built in place, once: millions of them are fresh memory in a large save.
  md.chunks.reserve(num_chunks);
  const uint64_t element_bytes = DTypeSize(md.dtype);
  const size_t rank = md.shape.size();
  for (size_t c = 0; c < num_chunks; ++c) {
    const int64_t* key = KeyOf(entry, Holdings(entry)[chunk_begin[c]]);
    StoredChunk& chunk = md.chunks.emplace_back();
    chunk.box.offsets.assign(key, key + rank);
    chunk.box.sizes.assign(key + rank, key + 2 * rank);
    chunk.byte_length = static_cast<uint64_t>(chunk.box.volume()) * element_bytes;
  }
  return md;
}

// A tensor whose chunks were proved a grid, held as its cells (SavePlanOptions::chunk_cells)
// without a chunk being built, not yet placed.
void HoldAsCells(TensorMetadata* md) {
  const uint64_t cells = md->grid->cell_count();
  md->cells = ChunkCells{std::vector<uint32_t>(cells, 0), std::vector<uint64_t>(cells, 0), {}};
  md->chunks = ChunkList();
}

// The metadata of every tensor, in the entries' order: its chunks (GroupReplicas,
// MakeTensorMetadata) and the proof that they tile its shape (ProveTiling), tensor by tensor on
// `pool`. A rule pattern's tiling is proved by its first tensor and holds for the others. With
// `chunk_cells`, every tensor is held as cells once proved, and the other tensors of a pattern
// proved a grid get their cells without their chunks being built. Returns the error of the first
// tensor that has one, as planning them one after the other would.
Status BuildTensors(std::vector<TensorEntry>* entries, bool chunk_cells, ThreadPool* pool,
                    std::vector<TensorMetadata>* tensors) {
  for (uint32_t t = 0; t < entries->size(); ++t) {
    RulePattern* pattern = (*entries)[t].pattern;
    if (pattern != nullptr && pattern->prover == kNone) pattern->prover = t;
  }
  tensors->resize(entries->size());
  const int64_t count = static_cast<int64_t>(entries->size());
  const auto follows = [&](int64_t t) {
    const RulePattern* pattern = (*entries)[t].pattern;
    return pattern != nullptr && pattern->prover != t;
  };
  SP_RETURN_IF_ERROR(ParallelForInOrder(pool, count, [&](int64_t t) {
    TensorEntry& entry = (*entries)[t];
    GroupReplicas(&entry);
    if (chunk_cells && follows(t)) return OkStatus();  // after the loop, from its prover's grid
    TensorMetadata& md = (*tensors)[t] = MakeTensorMetadata(entry);
    if (follows(t)) return OkStatus();
    SP_RETURN_IF_ERROR(ProveTiling(entry, md));
    if (entry.pattern != nullptr) entry.pattern->grid = md.grid;  // read after the loop
    if (chunk_cells) CompactChunkCells(&md);
    return OkStatus();
  }));
  return ParallelFor(pool, count, [&](int64_t t) {
    if (!follows(t)) return OkStatus();
    const TensorEntry& entry = (*entries)[t];
    TensorMetadata& md = (*tensors)[t];
    if (!chunk_cells) {
      md.grid = entry.pattern->grid;
    } else if (entry.pattern->grid) {
      md.name = *entry.name;
      md.dtype = entry.dtype;
      md.shape = *entry.shape;
      md.grid = entry.pattern->grid;
      HoldAsCells(&md);
    } else {
      md = MakeTensorMetadata(entry);
      CompactChunkCells(&md);
    }
    return OkStatus();
  });
}

// The blocks of consecutive tensors that a pass over every chunk splits into on `pool`: one per
// thread (one without a pool), each [tensor_begin(b), tensor_begin(b + 1)).
struct TensorBlocks {
  TensorBlocks(size_t tensors, ThreadPool* pool)
      : tensors(tensors),
        count(std::max<size_t>(1, std::min<size_t>(tensors, pool ? pool->size() : 1))) {}
  uint32_t tensor_begin(size_t b) const { return static_cast<uint32_t>(tensors * b / count); }

  size_t tensors;
  size_t count;
};

// Picks the writer of every chunk: sole holders first, then replica groups largest first, each
// to the holder with the fewest bytes so far (or always the lowest holder). The sole holders'
// bytes are summed and the groups found in blocks of tensors on `pool`; sums and the sorted
// groups do not depend on the blocks.
Status AssignOwners(const std::vector<TensorMetadata>& tensors, size_t world_size,
                    bool lowest_rank, ThreadPool* pool, std::vector<TensorEntry>* entries) {
  struct Group {
    uint64_t bytes;
    uint32_t tensor;
    uint32_t chunk;
  };
  const TensorBlocks blocks(entries->size(), pool);
  std::vector<std::vector<uint64_t>> block_assigned(blocks.count);
  std::vector<std::vector<Group>> block_groups(blocks.count);
  SP_RETURN_IF_ERROR(ParallelFor(pool, static_cast<int64_t>(blocks.count), [&](int64_t b) {
    std::vector<uint64_t>& assigned = block_assigned[b];
    assigned.assign(world_size, 0);
    std::vector<uint64_t> lengths;
    for (uint32_t t = blocks.tensor_begin(b); t < blocks.tensor_begin(b + 1); ++t) {
      TensorEntry& entry = (*entries)[t];
      const std::vector<uint32_t>& chunk_begin = ChunkBegin(entry);
      entry.owner.resize(chunk_begin.size() - 1);
      ChunkByteLengths(tensors[t], &lengths);
      for (uint32_t c = 0; c < entry.owner.size(); ++c) {
        std::span<const Holding> holders = HoldersOf(entry, c);
        entry.owner[c] = chunk_begin[c];  // the lowest holder
        if (holders.front().rank == holders.back().rank) {
          assigned[holders.front().rank] += lengths[c];
        } else if (!lowest_rank) {
          block_groups[b].push_back({lengths[c], t, c});
        }
      }
    }
    return OkStatus();
  }));
  std::vector<uint64_t> assigned = std::move(block_assigned[0]);
  std::vector<Group> groups = std::move(block_groups[0]);
  for (size_t b = 1; b < blocks.count; ++b) {
    for (size_t r = 0; r < world_size; ++r) assigned[r] += block_assigned[b][r];
    groups.insert(groups.end(), block_groups[b].begin(), block_groups[b].end());
  }
  std::sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    return a.tensor != b.tensor ? a.tensor < b.tensor : a.chunk < b.chunk;
  });
  for (const Group& group : groups) {
    TensorEntry& entry = (*entries)[group.tensor];
    const std::vector<Holding>& holdings = Holdings(entry);
    const std::vector<uint32_t>& chunk_begin = ChunkBegin(entry);
    uint32_t best = chunk_begin[group.chunk];
    for (uint32_t h = best + 1; h < chunk_begin[group.chunk + 1]; ++h) {
      if (assigned[holdings[h].rank] < assigned[holdings[best].rank]) best = h;
    }
    entry.owner[group.chunk] = best;
    assigned[holdings[best].rank] += group.bytes;
  }
  return OkStatus();
}

// Keeps of every tensor's holdings only each chunk's writer: a holding per rank and tensor is
// 24 bytes (200 MiB at 8,192 ranks x 1,000 tensors), a writer 8 bytes per chunk (16 where the
// chunks of a tensor are written from different local boxes), and they are freed before the
// writes are laid out. On one thread: the writers then take the memory the
// freed holdings leave in the same allocator arena (on the pool's threads, the coordinator's
// peak at 8,192 x 1,000 was 40 MiB higher, for 0.02 s saved).
void KeepOnlyWriters(std::vector<TensorEntry>* entries) {
  for (TensorEntry& entry : *entries) {
    GlobalSavePlan::DeferredTensor& writers = entry.writers;
    writers.writes.resize(entry.owner.size());
    if (entry.pattern != nullptr) {
      writers.local = {entry.pattern_local, 0};
    } else {
      writers.locals.reserve(entry.owner.size());
    }
    for (size_t c = 0; c < entry.owner.size(); ++c) {
      const Holding& h = Holdings(entry)[entry.owner[c]];
      writers.writes[c] = {h.rank, 0};
      if (entry.pattern == nullptr) writers.locals.push_back({h.local_tensor, h.local_box});
    }
    // One local tensor and box for every chunk (each rank lists the tensor at one place): kept
    // once.
    if (!writers.locals.empty() &&
        std::all_of(writers.locals.begin(), writers.locals.end(),
                    [&](const auto& l) { return l == writers.locals.front(); })) {
      writers.local = writers.locals.front();
      std::vector<GlobalSavePlan::LocalBox>().swap(writers.locals);
    }
    entry.pattern = nullptr;
    std::vector<Holding>().swap(entry.holdings);
    std::vector<uint32_t>().swap(entry.chunk_begin);
    std::vector<uint32_t>().swap(entry.owner);
  }
}

// Bin-packs `owned` (in (tensor, chunk) order) into `num_files` lists: largest first into the
// lightest file (ties: lowest file). Each list keeps (tensor, chunk) order.
std::vector<std::vector<OwnedChunk>> PackFiles(std::span<const OwnedChunk> owned,
                                               size_t num_files) {
  std::vector<uint32_t> order(owned.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return owned[a].bytes > owned[b].bytes; });
  using Load = std::pair<uint64_t, uint32_t>;  // (bytes so far, file)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> lightest;
  for (uint32_t k = 0; k < num_files; ++k) lightest.push({0, k});
  std::vector<uint32_t> file_of(owned.size());
  for (uint32_t i : order) {
    Load load = lightest.top();
    lightest.pop();
    file_of[i] = load.second;
    lightest.push({load.first + owned[i].bytes, load.second});
  }
  std::vector<std::vector<OwnedChunk>> files(num_files);
  for (uint32_t i = 0; i < owned.size(); ++i) files[file_of[i]].push_back(owned[i]);
  return files;
}

// How many files a group of `chunks` chunks of one rank is packed into.
uint32_t FileCount(size_t chunks, const SavePlanOptions& options) {
  return static_cast<uint32_t>(std::min<size_t>(options.files_per_rank, chunks));
}

// Lays out one group of a rank's chunks in the files from `first_file` on (metadata.files
// indices; the rank's files first_k, first_k + 1, ...), recording the writes. Returns the number
// of files used (FileCount).
Result<uint32_t> LayOutGroup(uint32_t rank, std::span<const OwnedChunk> owned, uint32_t first_file,
                             uint32_t first_k, const std::vector<TensorEntry>& entries,
                             const SavePlanOptions& options, GlobalSavePlan* plan) {
  const uint32_t num_files = FileCount(owned.size(), options);
  std::vector<std::vector<OwnedChunk>> packed;
  if (num_files > 1) packed = PackFiles(owned, num_files);
  RankSavePlan& rank_plan = plan->ranks[rank];
  for (uint32_t k = 0; k < num_files; ++k) {
    const uint32_t file = first_file + k;
    // The chunks of the tensors that lead the files first (MarkLeadingTensors), then the other
    // chunks whose length is a multiple of kDataAlignmentBytes, then the rest, each in (tensor,
    // chunk) order: the data section starts aligned (the native writer pads its header), so the
    // large chunks start aligned too, and the small ones do not cut the long runs of large ones
    // that a load reads.
    std::span<const OwnedChunk> chunks = num_files == 1 ? owned : packed[k];
    std::vector<OwnedChunk> in_file(chunks.begin(), chunks.end());
    std::stable_partition(in_file.begin(), in_file.end(), [](const OwnedChunk& oc) {
      return oc.bytes % kDataAlignmentBytes == 0;
    });
    std::stable_partition(in_file.begin(), in_file.end(), [&](const OwnedChunk& oc) {
      return entries[oc.tensor].leads_files;
    });
    uint64_t offset = 0;
    for (const OwnedChunk& oc : in_file) {
      PlaceChunk(plan->metadata.tensors[oc.tensor], oc.chunk, file, offset);
      const GlobalSavePlan::LocalBox local = entries[oc.tensor].writers.LocalOf(oc.chunk);
      rank_plan.writes.push_back(
          ChunkWrite{local.tensor, local.box, file, oc.tensor, oc.chunk, offset, oc.bytes});
      if (__builtin_add_overflow(offset, oc.bytes, &offset)) {
        return InvalidArgumentError("save plan: data file " + std::to_string(first_k + k) +
                                    " of rank " + std::to_string(rank) +
                                    " would exceed 2^64 bytes");
      }
    }
  }
  return num_files;
}

// The separation group of a tensor: the index of the first prefix its name starts with, plus
// one; 0 for the others.
size_t GroupOf(std::string_view name, const std::vector<std::string>& prefixes) {
  for (size_t i = 0; i < prefixes.size(); ++i) {
    if (name.starts_with(prefixes[i])) return i + 1;
  }
  return 0;
}

// A rank's chunks by separation group: with separation prefixes, the others and then one group
// per prefix, each laid out in files of its own.
std::vector<std::vector<OwnedChunk>> SeparationGroups(std::span<const OwnedChunk> owned,
                                                      const std::vector<std::string>& prefixes,
                                                      const GlobalSavePlan& plan) {
  std::vector<std::vector<OwnedChunk>> groups(prefixes.size() + 1);
  for (const OwnedChunk& oc : owned) {
    groups[GroupOf(plan.metadata.tensors[oc.tensor].name, prefixes)].push_back(oc);
  }
  return groups;
}

// How many files one rank's chunks are laid out in.
uint32_t RankFileCount(std::span<const OwnedChunk> owned, const SavePlanOptions& options,
                       const GlobalSavePlan& plan) {
  const std::vector<std::string>& prefixes = options.separate_key_prefixes;
  if (prefixes.empty()) return FileCount(owned.size(), options);
  std::vector<size_t> sizes(prefixes.size() + 1, 0);
  for (const OwnedChunk& oc : owned) {
    ++sizes[GroupOf(plan.metadata.tensors[oc.tensor].name, prefixes)];
  }
  uint32_t files = 0;
  for (size_t size : sizes) files += FileCount(size, options);
  return files;
}

// Lays out one rank's chunks in its files, from `first_file` on: one group without separation
// prefixes, else each separation group in files of its own.
Status LayOutRank(uint32_t rank, std::span<const OwnedChunk> owned, uint32_t first_file,
                  const std::vector<TensorEntry>& entries, const SavePlanOptions& options,
                  GlobalSavePlan* plan) {
  plan->ranks[rank].writes.reserve(owned.size());
  const std::vector<std::string>& prefixes = options.separate_key_prefixes;
  if (prefixes.empty()) {
    return LayOutGroup(rank, owned, first_file, 0, entries, options, plan).status();
  }
  uint32_t next_k = 0;
  for (const std::vector<OwnedChunk>& group : SeparationGroups(owned, prefixes, *plan)) {
    SP_ASSIGN_OR_RETURN(uint32_t made, LayOutGroup(rank, group, first_file + next_k, next_k,
                                                   entries, options, plan));
    next_k += made;
  }
  return OkStatus();
}

// Lays out the files when every rank's chunks go into one file with nothing to separate (the
// default): the layout LayOutGroup makes then, found in two passes over the tensors in their
// order instead of one pass per rank over its chunks. The chunks of a tensor are read and placed
// together, and each write goes straight to its place in its rank's list; the pass per rank
// needs every rank's list of owned chunks built first (16 bytes a chunk) and reaches the chunks
// and their writers through it, out of the order they lie in memory (docs/PERFORMANCE.md,
// "Laying out the files tensor by tensor"). Within a rank, the chunks of the tensors that lead
// the files come first, then the others whose length is a multiple of kDataAlignmentBytes, then
// the rest, and each kind keeps (tensor, chunk) order, as LayOutGroup places them: the first
// pass counts each kind per block of tensors and rank, the second places each block's chunks
// from where the blocks before it end. With SavePlanOptions::defer_writes
// the second pass writes no ChunkWrite: it notes each writer's index and moves a tensor's writers
// into the plan (GlobalSavePlan::deferred). Returns false, having changed nothing, when a rank's
// bytes would exceed 2^64: the pass per rank then reports which file.
Result<bool> AssignOneFilePerRank(std::vector<TensorEntry>& entries,
                                  const SavePlanOptions& options, GlobalSavePlan* plan) {
  const size_t world_size = plan->ranks.size();
  const TensorBlocks blocks(entries.size(), options.pool);
  // Per block b and rank r, at [b * world_size + r]: the counts and bytes of its chunks of each
  // kind, then where the block's chunks of each kind start in the rank's writes and file.
  struct Kinds {
    uint32_t lead_count = 0;  // of the tensors that lead the files (MarkLeadingTensors)
    uint32_t aligned_count = 0;
    uint32_t other_count = 0;
    uint64_t lead_bytes = 0;
    uint64_t aligned_bytes = 0;
    uint64_t other_bytes = 0;
  };
  std::vector<Kinds> at(blocks.count * world_size);
  std::vector<uint8_t> wrapped(blocks.count, 0);  // a block's bytes of some rank passed 2^64
  const std::vector<TensorMetadata>& tensors = plan->metadata.tensors;
  SP_RETURN_IF_ERROR(ParallelFor(options.pool, static_cast<int64_t>(blocks.count), [&](int64_t b) {
    Kinds* kinds = at.data() + b * world_size;
    bool wraps = false;
    std::vector<uint64_t> lengths;
    for (uint32_t t = blocks.tensor_begin(b); t < blocks.tensor_begin(b + 1); ++t) {
      ChunkByteLengths(tensors[t], &lengths);
      const std::vector<GlobalSavePlan::DeferredWrite>& writers = entries[t].writers.writes;
      const bool leads = entries[t].leads_files;
      for (size_t c = 0; c < writers.size(); ++c) {
        Kinds& k = kinds[writers[c].rank];
        const uint64_t bytes = lengths[c];
        if (leads) {
          ++k.lead_count;
          wraps |= __builtin_add_overflow(k.lead_bytes, bytes, &k.lead_bytes);
        } else if (bytes % kDataAlignmentBytes == 0) {
          ++k.aligned_count;
          wraps |= __builtin_add_overflow(k.aligned_bytes, bytes, &k.aligned_bytes);
        } else {
          ++k.other_count;
          wraps |= __builtin_add_overflow(k.other_bytes, bytes, &k.other_bytes);
        }
      }
    }
    wrapped[b] = wraps;
    return OkStatus();
  }));
  if (std::find(wrapped.begin(), wrapped.end(), 1) != wrapped.end()) return false;
  // Turn the counts into starts, rank by rank: the leading chunks from 0, the other aligned ones
  // after every leading chunk of the rank, the rest after every aligned one.
  std::vector<uint32_t> first_file(world_size + 1, 0);
  std::vector<uint32_t> write_count(world_size, 0);
  for (size_t r = 0; r < world_size; ++r) {
    uint64_t lead_count = 0, lead_bytes = 0, aligned_count = 0, aligned_bytes = 0;
    for (size_t b = 0; b < blocks.count; ++b) {
      const Kinds& k = at[b * world_size + r];
      lead_count += k.lead_count;
      aligned_count += k.aligned_count;
      if (__builtin_add_overflow(lead_bytes, k.lead_bytes, &lead_bytes) ||
          __builtin_add_overflow(aligned_bytes, k.aligned_bytes, &aligned_bytes)) {
        return false;
      }
    }
    uint64_t next_aligned_count = lead_count, next_aligned_bytes = lead_bytes;
    uint64_t count = lead_count + aligned_count, bytes;
    if (__builtin_add_overflow(lead_bytes, aligned_bytes, &bytes)) return false;
    uint64_t next_lead_count = 0, next_lead_bytes = 0;
    for (size_t b = 0; b < blocks.count; ++b) {
      Kinds& k = at[b * world_size + r];
      const Kinds start{static_cast<uint32_t>(next_lead_count),
                        static_cast<uint32_t>(next_aligned_count),
                        static_cast<uint32_t>(count),
                        next_lead_bytes,
                        next_aligned_bytes,
                        bytes};
      next_lead_count += k.lead_count;
      next_lead_bytes += k.lead_bytes;
      next_aligned_count += k.aligned_count;
      next_aligned_bytes += k.aligned_bytes;
      count += k.other_count;
      if (__builtin_add_overflow(bytes, k.other_bytes, &bytes)) return false;
      k = start;
    }
    write_count[r] = static_cast<uint32_t>(count);
    first_file[r + 1] = first_file[r] + (count > 0 ? 1 : 0);
  }
  plan->metadata.files.resize(first_file[world_size]);
  for (uint32_t rank = 0; rank < world_size; ++rank) {
    if (first_file[rank + 1] == first_file[rank]) continue;
    plan->metadata.files[first_file[rank]].writer_rank = static_cast<int32_t>(rank);
    plan->ranks[rank].files.push_back(first_file[rank]);
  }
  const bool defer = options.defer_writes;
  if (defer) {
    plan->deferred.resize(entries.size());
    plan->deferred_counts = write_count;
  } else {
    SP_RETURN_IF_ERROR(ParallelFor(options.pool, static_cast<int64_t>(world_size), [&](int64_t r) {
      plan->ranks[r].writes.resize(write_count[r]);
      return OkStatus();
    }));
  }
  std::vector<TensorMetadata>& placed = plan->metadata.tensors;
  SP_RETURN_IF_ERROR(ParallelFor(options.pool, static_cast<int64_t>(blocks.count), [&](int64_t b) {
    Kinds* next = at.data() + b * world_size;
    std::vector<uint64_t> lengths;
    for (uint32_t t = blocks.tensor_begin(b); t < blocks.tensor_begin(b + 1); ++t) {
      ChunkByteLengths(placed[t], &lengths);
      std::vector<GlobalSavePlan::DeferredWrite>& writers = entries[t].writers.writes;
      const bool leads = entries[t].leads_files;
      for (uint32_t c = 0; c < writers.size(); ++c) {
        GlobalSavePlan::DeferredWrite& writer = writers[c];
        Kinds& k = next[writer.rank];
        const uint64_t bytes = lengths[c];
        uint32_t index;
        uint64_t offset;
        if (leads) {
          index = k.lead_count++;
          offset = k.lead_bytes;
          k.lead_bytes += bytes;
        } else if (bytes % kDataAlignmentBytes == 0) {
          index = k.aligned_count++;
          offset = k.aligned_bytes;
          k.aligned_bytes += bytes;
        } else {
          index = k.other_count++;
          offset = k.other_bytes;
          k.other_bytes += bytes;
        }
        const uint32_t file = first_file[writer.rank];
        PlaceChunk(placed[t], c, file, offset);
        if (defer) {
          writer.index = index;
        } else {
          const GlobalSavePlan::LocalBox local = entries[t].writers.LocalOf(c);
          plan->ranks[writer.rank].writes[index] =
              ChunkWrite{local.tensor, local.box, file, t, c, offset, bytes};
        }
      }
      // Deferred, the writers with their places are what the plan keeps: moved, not copied.
      if (defer) plan->deferred[t] = std::move(entries[t].writers);
    }
    return OkStatus();
  }));
  return true;
}

// Marks the tensors whose chunks lead the files they are in (TensorEntry::leads_files): in a
// save of two ranks or more, those of which every rank writes exactly one chunk, of a length that
// is a multiple of kDataAlignmentBytes (a weight sharded over every rank, as FSDP shards it). They
// go first in each file, in tensor order, so that with one file per rank each such chunk lies at
// the same offset of every file where the ranks' chunks before it have the same lengths: the
// metadata then stores the tensor's cells as two runs whatever the number of ranks, and a few
// more where the last ranks hold shorter pieces (torch.chunk) (docs/FORMAT.md, sections 2 and
// 3.5). Being aligned, they keep the aligned chunks after them aligned.
Status MarkLeadingTensors(std::vector<TensorEntry>& entries, const GlobalSavePlan& plan,
                          ThreadPool* pool) {
  const size_t world_size = plan.ranks.size();
  if (world_size < 2) return OkStatus();
  const TensorBlocks blocks(entries.size(), pool);
  return ParallelFor(pool, static_cast<int64_t>(blocks.count), [&](int64_t b) {
    std::vector<uint8_t> seen;
    std::vector<uint64_t> lengths;
    for (uint32_t t = blocks.tensor_begin(b); t < blocks.tensor_begin(b + 1); ++t) {
      const std::vector<GlobalSavePlan::DeferredWrite>& writers = entries[t].writers.writes;
      if (writers.size() != world_size) continue;
      ChunkByteLengths(plan.metadata.tensors[t], &lengths);
      if (std::any_of(lengths.begin(), lengths.end(), [](uint64_t l) {
            return l == 0 || l % kDataAlignmentBytes != 0;
          })) {
        continue;
      }
      seen.assign(world_size, 0);
      bool once = true;
      for (const GlobalSavePlan::DeferredWrite& w : writers) {
        once = once && seen[w.rank] == 0;
        seen[w.rank] = 1;
      }
      entries[t].leads_files = once;
    }
    return OkStatus();
  });
}

// Creates every rank's files, in rank order, and lays out the ranks' chunks in them, rank by
// rank on `options.pool` (each rank's writes and its chunks' places are its own). Returns the
// error of the first rank that has one.
Status AssignFiles(std::vector<TensorEntry>& entries, const SavePlanOptions& options,
                   GlobalSavePlan* plan) {
  SP_RETURN_IF_ERROR(MarkLeadingTensors(entries, *plan, options.pool));
  if (options.files_per_rank == 1 && options.separate_key_prefixes.empty()) {
    SP_ASSIGN_OR_RETURN(bool laid_out, AssignOneFilePerRank(entries, options, plan));
    if (laid_out) return OkStatus();
  }
  // Counting sort of the chunks by owner, keeping (tensor, chunk) order within each rank: each
  // block of tensors counts its chunks per rank, and then writes them from where the blocks
  // before it end in that rank's list.
  const size_t world_size = plan->ranks.size();
  const TensorBlocks blocks(entries.size(), options.pool);
  std::vector<uint32_t> at(blocks.count * world_size, 0);  // block b, rank r: at[b * world + r]
  SP_RETURN_IF_ERROR(ParallelFor(options.pool, static_cast<int64_t>(blocks.count), [&](int64_t b) {
    uint32_t* count = at.data() + b * world_size;
    for (uint32_t t = blocks.tensor_begin(b); t < blocks.tensor_begin(b + 1); ++t) {
      for (const GlobalSavePlan::DeferredWrite& w : entries[t].writers.writes) ++count[w.rank];
    }
    return OkStatus();
  }));
  std::vector<uint32_t> begin(world_size + 1, 0);
  uint32_t total = 0;
  for (size_t r = 0; r < world_size; ++r) {
    begin[r] = total;
    for (size_t b = 0; b < blocks.count; ++b) {
      const uint32_t count = at[b * world_size + r];
      at[b * world_size + r] = total;
      total += count;
    }
  }
  begin[world_size] = total;
  // Every slot is written below: no need to fill them first.
  const std::unique_ptr<OwnedChunk[]> owned = std::make_unique_for_overwrite<OwnedChunk[]>(total);
  SP_RETURN_IF_ERROR(ParallelFor(options.pool, static_cast<int64_t>(blocks.count), [&](int64_t b) {
    uint32_t* next = at.data() + b * world_size;
    std::vector<uint64_t> lengths;
    for (uint32_t t = blocks.tensor_begin(b); t < blocks.tensor_begin(b + 1); ++t) {
      ChunkByteLengths(plan->metadata.tensors[t], &lengths);
      const std::vector<GlobalSavePlan::DeferredWrite>& writers = entries[t].writers.writes;
      for (uint32_t c = 0; c < writers.size(); ++c) {
        owned[next[writers[c].rank]++] = {t, c, lengths[c]};
      }
    }
    return OkStatus();
  }));
  auto mine = [&](uint32_t rank) {
    return std::span<const OwnedChunk>(owned.get() + begin[rank], begin[rank + 1] - begin[rank]);
  };
  // Named by the format's writer (format/writer.h): the files of a rank are in order of k.
  std::vector<uint32_t> first_file(world_size + 1, 0);
  for (uint32_t rank = 0; rank < world_size; ++rank) {
    first_file[rank + 1] = first_file[rank] + RankFileCount(mine(rank), options, *plan);
  }
  plan->metadata.files.resize(first_file[world_size]);
  for (uint32_t rank = 0; rank < world_size; ++rank) {
    for (uint32_t file = first_file[rank]; file < first_file[rank + 1]; ++file) {
      plan->metadata.files[file].writer_rank = static_cast<int32_t>(rank);
      plan->ranks[rank].files.push_back(file);
    }
  }
  return ParallelForInOrder(options.pool, static_cast<int64_t>(world_size), [&](int64_t r) {
    const uint32_t rank = static_cast<uint32_t>(r);
    return LayOutRank(rank, mine(rank), first_file[rank], entries, options, plan);
  });
}

// One entry per object name, from the lowest rank that has it, sorted by name.
Result<std::vector<ObjectEntry>> MergeObjects(const GatheredPlans& plans,
                                              const std::vector<TensorEntry>& tensors) {
  std::map<std::string_view, const ObjectEntry*> merged;
  std::unordered_set<std::string_view> on_rank;
  for (uint32_t rank = 0; rank < plans.world_size(); ++rank) {
    on_rank.clear();
    for (const ObjectEntry& object : plans.objects(rank)) {
      if (!on_rank.insert(object.name).second) {
        return InvalidArgumentError("object " + Quote(object.name) + ": rank " +
                                    std::to_string(rank) + " lists it twice");
      }
      auto it = std::lower_bound(
          tensors.begin(), tensors.end(), object.name,
          [](const TensorEntry& t, std::string_view name) { return *t.name < name; });
      if (it != tensors.end() && *it->name == object.name) {
        return InvalidArgumentError("name " + Quote(object.name) + " is a tensor on rank " +
                                    std::to_string(it->first_rank) + " and an object on rank " +
                                    std::to_string(rank));
      }
      merged.try_emplace(object.name, &object);
    }
  }
  std::vector<ObjectEntry> objects;
  objects.reserve(merged.size());
  for (const auto& [name, object] : merged) objects.push_back(*object);
  return objects;
}

}  // namespace

Status TakeDeferredWrites(GlobalSavePlan* plan, uint32_t first, uint32_t end, ThreadPool* pool) {
  if (plan->deferred.empty()) return OkStatus();
  end = std::min<uint32_t>(end, static_cast<uint32_t>(plan->ranks.size()));
  for (uint32_t r = first; r < end; ++r) {
    if (!plan->ranks[r].writes.empty()) {
      return InternalError("save plan: rank " + std::to_string(r) +
                           " already holds its writes; they were taken before");
    }
    plan->ranks[r].writes.resize(plan->deferred_counts[r]);
  }
  const std::vector<TensorMetadata>& tensors = plan->metadata.tensors;
  const TensorBlocks blocks(tensors.size(), pool);
  return ParallelFor(pool, static_cast<int64_t>(blocks.count), [&](int64_t b) {
    std::vector<uint64_t> lengths;
    for (uint32_t t = blocks.tensor_begin(b); t < blocks.tensor_begin(b + 1); ++t) {
      const GlobalSavePlan::DeferredTensor& deferred = plan->deferred[t];
      bool any = false;
      for (const GlobalSavePlan::DeferredWrite& d : deferred.writes) {
        any = any || (d.rank >= first && d.rank < end);
      }
      if (!any) continue;
      ChunkByteLengths(tensors[t], &lengths);
      for (uint32_t c = 0; c < deferred.writes.size(); ++c) {
        const GlobalSavePlan::DeferredWrite& d = deferred.writes[c];
        if (d.rank < first || d.rank >= end) continue;
        const GlobalSavePlan::LocalBox local = deferred.LocalOf(c);
        // Distinct chunks have distinct places: no two threads write one element.
        plan->ranks[d.rank].writes[d.index] =
            ChunkWrite{local.tensor, local.box,        ChunkFile(tensors[t], c), t, c,
                       ChunkDataOffset(tensors[t], c), lengths[c]};
      }
    }
    return OkStatus();
  });
}

uint32_t DeferredRoundEnd(const GlobalSavePlan& plan, uint32_t first, uint64_t round_writes) {
  const uint32_t world = static_cast<uint32_t>(plan.ranks.size());
  if (plan.deferred.empty()) return world;
  uint32_t end = first;
  uint64_t writes = 0;
  while (end < world && writes < round_writes) writes += plan.deferred_counts[end++];
  return std::max(end, std::min(first + 1, world));
}

void DropDeferredWrites(GlobalSavePlan* plan) {
  std::vector<GlobalSavePlan::DeferredTensor>().swap(plan->deferred);
  std::vector<uint32_t>().swap(plan->deferred_counts);
}

Result<GlobalSavePlan> PlanSave(std::span<const LocalSavePlan> locals,
                                const SavePlanOptions& options) {
  SP_RETURN_IF_ERROR(ValidateOptions(locals.size(), options));
  GatheredPlans plans(locals.size());
  for (const LocalSavePlan& local : locals) plans.AddRank(local);
  return PlanSave(plans, options);
}

Result<GlobalSavePlan> PlanSave(const GatheredPlans& plans, const SavePlanOptions& options) {
  const size_t world_size = plans.world_size();
  SP_RETURN_IF_ERROR(ValidateOptions(world_size, options));
  RulePatterns patterns;
  SP_ASSIGN_OR_RETURN(std::vector<TensorEntry> entries, CollectTensors(plans, &patterns));
  GlobalSavePlan plan;
  plan.metadata.save_id = options.save_id;
  plan.metadata.world_size = static_cast<int32_t>(world_size);
  plan.metadata.checksum_block_bytes = options.checksum_block_bytes;
  SP_RETURN_IF_ERROR(
      BuildTensors(&entries, options.chunk_cells, options.pool, &plan.metadata.tensors));
  SP_ASSIGN_OR_RETURN(plan.metadata.objects, MergeObjects(plans, entries));
  SP_RETURN_IF_ERROR(AssignOwners(plan.metadata.tensors, world_size,
                                  options.dedup_to_lowest_rank, options.pool, &entries));
  KeepOnlyWriters(&entries);
  patterns.clear();
  plan.ranks.resize(world_size);
  SP_RETURN_IF_ERROR(AssignFiles(entries, options, &plan));
  return plan;
}

}  // namespace sp
