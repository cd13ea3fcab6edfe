// Save planning: from what every rank holds to who writes which chunk into which file.
//
// Each rank describes what it holds in a LocalSavePlan (tensors with the boxes it has in global
// coordinates, plus plain objects). The coordinator gathers them, one per rank, and PlanSave
// turns them into a GlobalSavePlan: the checkpoint metadata (tensors, chunks, data files,
// objects) and, for every rank, the exact list of writes it performs.
//
// Replicas (the same box of a tensor held by several ranks) are written once. Ownership is
// deterministic and balanced by bytes: it depends only on the local plans, so a later save with
// the same layout reproduces it without a gather. Before any byte is written the plan proves
// that the distinct chunks of every tensor tile its shape exactly (no overlap, no hole).
//
// Planning is pure: values in, values out, no I/O. It starts no threads of its own; a caller may
// lend it a pool (SavePlanOptions::pool), and the plan is the same with or without one. All
// functions are thread-safe.
#ifndef SHARDPOINT_PLAN_SAVE_PLAN_H_
#define SHARDPOINT_PLAN_SAVE_PLAN_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/layout/mesh_layout.h"

namespace sp {

class ThreadPool;  // exec/thread_pool.h

// What one rank holds (save) or wants (load) of one tensor.
struct LocalTensor {
  LocalTensor() = default;
  LocalTensor(std::string name, DType dtype, Shape shape, std::vector<Box> boxes = {})
      : name(std::move(name)), dtype(dtype), shape(std::move(shape)), boxes(std::move(boxes)) {}

  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<Box> boxes;  // global coordinates; may include empty boxes (ignored)
  // Save only: the device-mesh rule the tensor is laid out by, when it has one. `boxes` is then
  // exactly this rank's chunk under the rule (CheckRuledBoxes, plan/ruled_plan.h), and the plan
  // travels to the coordinator as the rule instead of the box (EncodeRuledLocalPlan).
  std::optional<MeshLayout> layout;
};

// Everything one rank contributes to a save.
struct LocalSavePlan {
  std::vector<LocalTensor> tensors;
  std::vector<ObjectEntry> objects;
};

struct SavePlanOptions {
  int files_per_rank = 1;             // each rank's owned chunks are bin-packed by bytes into
                                      // at most this many files (>= 1)
  bool dedup_to_lowest_rank = false;  // DCP's dedup_save_to_lowest_rank; default: balanced by bytes
  std::string save_id;                // goes into the metadata (and the writer's file names)
  uint64_t checksum_block_bytes = kDefaultChecksumBlockBytes;  // > 0
  // Megatron's separation_hint: the chunks of tensors whose names start with one of these
  // prefixes go into files of their own (per rank and per prefix, the first matching prefix
  // wins), apart from the rank's other chunks. Each non-empty group of a rank gets
  // min(files_per_rank, its chunks) files. Prefixes must not be empty.
  std::vector<std::string> separate_key_prefixes;
  // Holds every tensor as cells (TensorMetadata::cells): a tensor whose chunks form a grid in 12
  // bytes a chunk, any other with its boxes listed, where a StoredChunk takes 128; and builds no
  // chunk for the tensors of a rule pattern that another tensor proved a grid. ExpandChunkCells
  // on each tensor gives the plan made without it. For the writers that place chunks by their
  // cells (the native format's).
  bool chunk_cells = false;
  // Leaves every rank's writes out of the plan where the files are laid out in one pass (one file
  // per rank, nothing to separate): the plan keeps, per chunk, the rank that writes it, from which
  // of its boxes and at which place of its list (GlobalSavePlan::deferred, 8 bytes a chunk of a
  // tensor laid out by a rule, where the writes take 40), and TakeDeferredWrites builds the writes
  // of some ranks at a time. For a coordinator that sends each rank its writes and keeps none.
  bool defer_writes = false;
  // Where the planning of independent tensors and ranks runs (building each tensor's chunks and
  // proving their tiling; laying out each rank's files), or inline when null. Not part of the
  // plan: any pool gives the same plan and the same error.
  ThreadPool* pool = nullptr;
};

// One write a rank performs: the bytes of one of its local boxes into one file.
struct ChunkWrite {
  uint32_t local_tensor = 0;  // index into that rank's LocalSavePlan::tensors
  uint32_t local_box = 0;     // index into that LocalTensor's boxes
  uint32_t file = 0;          // index into GlobalSavePlan::metadata.files
  uint32_t tensor = 0;        // index into metadata.tensors
  uint32_t chunk = 0;         // index into metadata.tensors[tensor].chunks
  uint64_t data_offset = 0;   // = that chunk's data_offset (relative to the file's data section)
  uint64_t byte_length = 0;

  friend bool operator==(const ChunkWrite&, const ChunkWrite&) = default;
};

// What one rank writes: its files (indices into metadata.files, in order) and its writes,
// ordered by file and then by data_offset.
struct RankSavePlan {
  std::vector<uint32_t> files;
  std::vector<ChunkWrite> writes;

  friend bool operator==(const RankSavePlan&, const RankSavePlan&) = default;
};

struct GlobalSavePlan {
  // Tensors sorted by name; chunks sorted by box (as cells with SavePlanOptions::chunk_cells);
  // files named and ordered by (rank, file number); every chunk's file/data_offset/byte_length
  // set; block_crc32c EMPTY (the writers compute them); DataFile::data_start and size are 0 (the
  // engine fills them after building each file's header); objects: one per name, from the
  // lowest rank that has it.
  CheckpointMetadata metadata;
  std::vector<RankSavePlan> ranks;  // indexed by rank

  // With SavePlanOptions::defer_writes, the writes not yet in `ranks`, per tensor: each chunk's
  // write's rank and index in the rank's writes, and the local tensor and box it is written
  // from, one for all its chunks unless they differ (a tensor laid out by a rule is at one place
  // of every rank's list: 8 bytes a chunk); and per rank the count of its writes. Empty when none
  // are deferred.
  struct DeferredWrite {
    uint32_t rank = 0;
    uint32_t index = 0;
  };
  struct LocalBox {
    uint32_t tensor = 0;  // index into the writing rank's LocalSavePlan::tensors
    uint32_t box = 0;     // index into that LocalTensor's boxes
    friend bool operator==(const LocalBox&, const LocalBox&) = default;
  };
  struct DeferredTensor {
    std::vector<DeferredWrite> writes;  // per chunk
    LocalBox local;                     // every chunk's, when `locals` is empty
    std::vector<LocalBox> locals;       // per chunk, where they differ
    LocalBox LocalOf(size_t chunk) const { return locals.empty() ? local : locals[chunk]; }
  };
  std::vector<DeferredTensor> deferred;
  std::vector<uint32_t> deferred_counts;
};

// Builds the writes of ranks [first, end) that `plan` defers (SavePlanOptions::defer_writes):
// each such rank's `writes` become exactly what PlanSave without defer_writes gives it, from the
// places of the chunks in the plan's metadata. One pass over the plan's chunks, in blocks of
// tensors on `pool` (null: on the calling thread). Nothing when no write is deferred.
// kInternal when a rank of the range already holds writes.
Status TakeDeferredWrites(GlobalSavePlan* plan, uint32_t first, uint32_t end,
                          ThreadPool* pool = nullptr);

// The end of a round of ranks from `first` (< the world size) whose deferred writes to take at
// once: the ranks up to the one whose writes bring the round to `round_writes` or more, or the
// last; every rank when `plan` defers nothing.
uint32_t DeferredRoundEnd(const GlobalSavePlan& plan, uint32_t first, uint64_t round_writes);

// Forgets the writes `plan` defers.
void DropDeferredWrites(GlobalSavePlan* plan);

// Plans a save from `locals` (indexed by rank; world size = locals.size()).
//
// Ownership: a chunk held by one rank is written by it. Replica groups (boxes held by several
// ranks) are taken largest first (ties: tensor name, then box) and each is given to the holder
// with the fewest bytes assigned so far (ties: lowest rank); with dedup_to_lowest_rank the
// lowest holder always writes. Each rank's owned chunks are bin-packed, largest first into the
// lightest file, into min(files_per_rank, chunks owned) files k = 0, 1, ..., packed back to back:
// first the chunks of the tensors that lead the files (with two ranks or more, those of which
// every rank writes one chunk of a length that is a multiple of kDataAlignmentBytes), then the
// other chunks of such lengths, then the rest, each in (tensor name, box) order (docs/FORMAT.md
// §2). The plan leaves file names empty: the save format's writer names
// the files (format/writer.h; the native writer's d-<save_id>-r<rank:05>-f<k:03>.safetensors),
// and a rank's files appear in metadata.files in the order of k.
// With separate_key_prefixes, a rank's chunks are first grouped (the others, then one group per
// prefix in the order given) and each group is packed into its own files as above; k counts on
// across the groups.
//
// Errors (kInvalidArgument, each naming the tensor or object, the ranks and the values):
//   - options out of range (files_per_rank < 1, checksum_block_bytes == 0, too many ranks, an
//     empty separation prefix);
//   - a shape with a negative dimension, or whose byte size overflows;
//   - the same tensor with different dtypes or shapes on two ranks;
//   - a box of the wrong rank or outside the shape;
//   - a tensor or object listed twice by one rank, or a name that is a tensor on one rank and
//     an object on another;
//   - two distinct chunks of a tensor that overlap, or chunks that leave elements of the tensor
//     uncovered (the message gives the count and, when found cheaply, one uncovered point).
Result<GlobalSavePlan> PlanSave(std::span<const LocalSavePlan> locals,
                                const SavePlanOptions& options);

}  // namespace sp

#endif  // SHARDPOINT_PLAN_SAVE_PLAN_H_
