// SavePlanCache: a rank's memory of the plan of its group's last save, so that a later save
// whose layout has not changed skips planning (docs/DESIGN.md, "Cached save plans").
//
// A save plans in three steps: every rank sends its local plan (each tensor's name, dtype, shape
// and boxes) to the coordinator, the coordinator computes the global plan (replicas, ownership,
// files; O(ranks x tensors)), and sends every rank its writes. A training job saves the same
// layout every few minutes, so after the first save each rank with a cache sends only a token
// (the plan id, 8 bytes) and its plain objects, and the coordinator, when every rank sent the id
// of the plan it holds, takes its cached plan instead of planning, lays out the new save's
// files and sends each rank its files only (names and headers); the rank writes with its cached
// writes.
//
// Never stale: a rank sends the token only when its layout is byte for byte the layout it sent
// for that plan: the same tensors in the same order with the same names, dtypes, shapes and
// boxes, the same world size, rank, coordinator and planning options (files_per_rank,
// dedup_to_lowest_rank, checksum_block_bytes, separate_key_prefixes). Anything else (a tensor
// added, a dtype changed, a box moved) sends the full local plan, and the coordinator plans
// afresh unless every rank sent the token of the plan it holds; a rank that sent the token in a
// save that needs a full plan is asked for its local plan in one more exchange. Object values and
// names may change freely: they travel with every save.
//
// One cache per rank and group (or one shared by the in-process ranks of a group: each rank keeps
// its part), used by one save at a time (an AsyncSaver runs one save at a time). It holds this
// rank's local layout, writes and file headers (O(its chunks)), and on the coordinator also one
// copy of the global plan with the names of the files of its last layout. The coordinator's copy
// keeps every rank's writes only where the ranks do not rename their files (torch-dcp); a save
// that must lay out a plan kept without them plans afresh. Between saves, a native plan is kept
// as the metadata file last committed from it (about half of its cells' memory), and the next
// save from it decodes the chunks back, as cells, while the ranks write (for plans above a size
// the cache is made with). A cache used with another group or another state plans afresh,
// correctly, and then caches that plan instead.
#ifndef SHARDPOINT_ENGINE_SAVE_PLAN_CACHE_H_
#define SHARDPOINT_ENGINE_SAVE_PLAN_CACHE_H_

#include <cstdint>
#include <memory>
#include <mutex>

namespace sp {

struct SavePlanCacheState;  // engine/save.cc

class SavePlanCache {
 public:
  // The default of keep_file_above_bytes: 64 MiB of chunk lists, about 5.6 million chunks held as
  // the cells of grids (12 bytes each), 1.5 million of two-dimensional lists (44 bytes each).
  static constexpr uint64_t kDefaultKeepFileAboveBytes = uint64_t{64} << 20;

  // Between saves, the coordinator keeps a native plan whose chunk lists take more than
  // `keep_file_above_bytes` as the metadata file last committed from it (unless that file is
  // larger than the chunks by more than 64 KiB: it holds the objects' values too), and the next
  // save from the plan decodes the chunks back while the ranks write; a smaller plan is kept
  // whole, which that save does not decode. 0 keeps the file for every plan.
  explicit SavePlanCache(uint64_t keep_file_above_bytes = kDefaultKeepFileAboveBytes);
  ~SavePlanCache();
  SavePlanCache(const SavePlanCache&) = delete;
  SavePlanCache& operator=(const SavePlanCache&) = delete;

  // Saves through this cache whose plan came from it (hits), and that planned afresh (misses),
  // counted per rank: a save by four in-process ranks sharing the cache counts four.
  uint64_t hits() const;
  uint64_t misses() const;
  // Forgets the cached plan: the next save through this cache plans afresh.
  void Clear();
  // The bytes the coordinator's part holds between saves: its plan's chunk lists and every rank's
  // writes it keeps, or, for a native plan whose files the ranks rename, the metadata file last
  // committed from the plan, kept instead of its chunks. 0 on a cache no coordinator used.
  uint64_t plan_bytes() const;

 private:
  friend class SavePlanCacheAccess;
  const uint64_t keep_file_above_bytes_;
  mutable std::mutex mu_;
  std::unique_ptr<SavePlanCacheState> state_;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_SAVE_PLAN_CACHE_H_
