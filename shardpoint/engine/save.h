// Save: writes the sharded state of every rank as one checkpoint (implemented in save.cc).
//
// A checkpoint is a directory of data files plus one metadata file; it exists only once the
// metadata is committed. Every rank calls the same function with its own state; ranks exchange
// plans through a Communicator (null: one rank in this process). Errors: a Status or Result;
// inside a collective call, if any rank fails every rank returns the same error (docs/DESIGN.md
// decision 5). Thread-safety: one call per rank at a time.
//
// The state is made of views of the caller's memory: nothing is copied beyond what the storage
// layer needs. The views must stay valid and unchanged until the call returns. A failed save
// never damages a committed checkpoint, at the same path or elsewhere.
#ifndef SHARDPOINT_ENGINE_SAVE_H_
#define SHARDPOINT_ENGINE_SAVE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/layout/mesh_layout.h"
#include "shardpoint/store/store.h"
#include "shardpoint/engine/budget.h"
#include "shardpoint/engine/save_plan_cache.h"

namespace sp {

// A box of a global tensor whose elements lie row-major and contiguous at `data`.
struct ConstPieceView {
  Box box;
  const std::byte* data = nullptr;
};
// What one rank holds of one tensor (save). Pieces of one tensor on one rank must not overlap.
struct SaveTensor {
  SaveTensor() = default;
  SaveTensor(std::string name, DType dtype, Shape shape, std::vector<ConstPieceView> pieces = {},
             std::optional<MeshLayout> layout = std::nullopt)
      : name(std::move(name)),
        dtype(dtype),
        shape(std::move(shape)),
        pieces(std::move(pieces)),
        layout(std::move(layout)) {}

  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;  // global
  std::vector<ConstPieceView> pieces;
  // The device-mesh rule the tensor is laid out by (a torch DTensor's mesh and placements), when
  // it has one: `pieces` must then be the one chunk the rule gives this rank (or none where that
  // chunk is empty), and the save sends the rule instead of the box, so that the ranks of one
  // layout send the coordinator their tensors' names, shapes and rules once between them
  // (docs/DESIGN.md, save step 2). Optional: without it the boxes travel.
  std::optional<MeshLayout> layout;
};

struct SaveState {
  std::vector<SaveTensor> tensors;
  std::vector<ObjectEntry> objects;  // plain data (JSON) or opaque bytes; same name on many ranks: lowest rank's wins
};

// Where the time of one rank's save went (seconds, wall clock), and what it wrote.
struct SaveStats {
  double plan_seconds = 0;    // local plan, gather, global plan (coordinator), scatter: from the
                              // call to the start of writing
  bool plan_cached = false;   // the writes came from options.plan_cache (no global plan computed)
  int plan_exchanges = 0;     // gather + scatter rounds to the plan: 1, or 2-3 when the
                              // coordinator asked for plans or shared parts (engine/save.cc)
  double write_seconds = 0;   // checksumming and writing this rank's data files
  double sync_seconds = 0;    // fsync, close and rename of this rank's data files
  double commit_seconds = 0;  // report, metadata write and commit (coordinator), agreement
  uint64_t bytes_written = 0; // data bytes this rank wrote (headers excluded)
  uint32_t files_written = 0;
};

struct SaveOptions {
  Communicator* comm = nullptr;   // null: this process is the only rank
  Store* store = nullptr;         // null: the POSIX file system
  ThreadPool* pool = nullptr;     // null: a pool of `threads` threads for the duration of the call
  int threads = 0;                // 0: DefaultIoThreads(), max(4, cores)
  int coordinator = 0;            // the rank that plans and commits
  int files_per_rank = 1;
  bool overwrite = false;         // replace a committed checkpoint at the same path
  bool dedup_to_lowest_rank = false;
  uint64_t checksum_block_bytes = kDefaultChecksumBlockBytes;
  std::map<std::string, std::string> attributes;  // stored in the metadata (coordinator's copy)
  // Megatron's separation_hint: chunks of tensors whose names start with one of these prefixes
  // are written to data files of their own on each rank (see SavePlanOptions).
  std::vector<std::string> separate_key_prefixes;
  // kNative (docs/FORMAT.md) or kTorchDcp (a checkpoint torch.distributed.checkpoint.load reads,
  // without checksums); kSafetensors is not a save format (see consolidation).
  CheckpointFormat format = CheckpointFormat::kNative;
  // With kTorchDcp: a Megatron-Core torch_dist checkpoint. The objects go to common.pt (at their
  // nested paths) instead of BYTE_IO items, and metadata.json is written, both before `.metadata`
  // commits; megatron.core.dist_checkpointing.load reads it (docs/TORCH_DCP.md §6).
  bool megatron = false;
  // Streaming saves: pieces whose data is null get their bytes just before they are written, from
  // one of these two (tensor and piece index in this rank's SaveState; called from I/O threads):
  //  - fill_piece, the whole piece at once, with at most max(fill_budget_bytes, the largest such
  //    piece) bytes held (conversion: a piece is read from another checkpoint as one box);
  //  - fill_range, bytes [offset, offset + out.size()) of the piece, for ranges of at most
  //    kWriteTaskBytes (or one checksum block, when larger) that the write tasks fetch
  //    themselves, with at most max(fill_budget_bytes, one range) bytes held: a large piece is
  //    filled and written by every I/O thread at once (device state; docs/GPU.md).
  // fill_range is used when both are set.
  std::function<Status(size_t tensor, size_t piece, MutableByteView out)> fill_piece;
  std::function<Status(size_t tensor, size_t piece, uint64_t offset, MutableByteView out)>
      fill_range;
  uint64_t fill_budget_bytes = kDefaultMemoryBudgetBytes;
  bool fills() const { return fill_piece != nullptr || fill_range != nullptr; }
  // Called from I/O threads with the bytes of each chunk once written (for progress reports).
  std::function<void(uint64_t bytes)> on_chunk_written;
  SaveStats* stats = nullptr;     // when set, filled with this rank's figures
  // When set (one per rank, or one shared by the in-process ranks of a group, kept across saves):
  // a save whose layout is unchanged since the previous save through it skips planning
  // (engine/save_plan_cache.h). Null: every save plans.
  SavePlanCache* plan_cache = nullptr;
  // Direct I/O: writes of at least direct_io_min_bytes bypass the page cache (O_DIRECT) for their
  // whole aligned blocks, staged through aligned buffers (engine/direct_write.h), where the store
  // and the file system allow it; the rest, and files that cannot be written directly, go through
  // the page cache. For large saves whose files are not read back soon.
  bool direct_io = false;
  uint64_t direct_io_min_bytes = uint64_t{1} << 20;
};

// Saves `state` as a checkpoint at `path` (a directory). Collective over options.comm.
// Errors: kAlreadyExists when a committed checkpoint is at `path` and !overwrite; kInvalidArgument
// for inconsistent state (names the tensor, ranks and values); storage errors name the file.
Status Save(const SaveState& state, std::string_view path, const SaveOptions& options = {});

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_SAVE_H_
