// shardpoint: the public entry points. Save, Load, ReadCheckpointMetadata and Verify.
//
// A checkpoint is a directory of data files plus one metadata file; it exists only once the
// metadata is committed. Every rank of a save or load calls the same function with its own
// state; ranks exchange plans through a Communicator (null: one rank in this process). The
// state is made of views of the caller's memory: nothing is copied on save beyond what the
// storage layer needs, and loads write straight into the caller's buffers.
//
// Errors: every function returns a Status or Result. Inside a collective save or load, if any rank
// fails every rank returns the same error (docs/DESIGN.md decision 5). A failed save never damages
// a committed checkpoint, at the same path or elsewhere.
//
// Thread-safety: one call per rank at a time; the views must stay valid and (on save) unchanged
// until the call returns.
#ifndef SHARDPOINT_CHECKPOINT_H_
#define SHARDPOINT_CHECKPOINT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/comm/communicator.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/store/store.h"

namespace sp {

// A box of a global tensor whose elements lie row-major and contiguous at `data`.
struct ConstPieceView {
  Box box;
  const std::byte* data = nullptr;
};
struct PieceView {
  Box box;
  std::byte* data = nullptr;
};

// What one rank holds of one tensor (save). Pieces of one tensor on one rank must not overlap.
struct SaveTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;  // global
  std::vector<ConstPieceView> pieces;
};

struct SaveState {
  std::vector<SaveTensor> tensors;
  std::vector<ObjectEntry> objects;  // plain data (JSON) or opaque bytes; same name on many ranks: lowest rank's wins
};

// What one rank wants of one tensor (load).
struct LoadTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;  // global; must equal the stored shape
  std::vector<PieceView> pieces;
};

struct LoadState {
  std::vector<LoadTensor> tensors;
  std::vector<std::string> objects;  // names of the objects wanted
};

// The default bound on the memory a call holds beyond the caller's buffers: a load's staging, a
// streaming save's filled pieces, a consolidation's tensor data in flight.
inline constexpr uint64_t kDefaultMemoryBudgetBytes = uint64_t{256} << 20;

// Where the time of one rank's save went (seconds, wall clock), and what it wrote.
struct SaveStats {
  double plan_seconds = 0;    // local plan, gather, global plan (coordinator), scatter
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
  // Streaming saves (conversion): pieces whose data is null get their bytes from fill_piece
  // (tensor and piece index in this rank's SaveState) just before they are written, with at most
  // max(fill_budget_bytes, the largest such piece) bytes held at once. Called from I/O threads.
  std::function<Status(size_t tensor, size_t piece, MutableByteView out)> fill_piece;
  uint64_t fill_budget_bytes = kDefaultMemoryBudgetBytes;
  // Called from I/O threads with the bytes of each chunk once written (for progress reports).
  std::function<void(uint64_t bytes)> on_chunk_written;
  SaveStats* stats = nullptr;     // when set, filled with this rank's figures
};

struct LoadOptions {
  Communicator* comm = nullptr;
  Store* store = nullptr;
  ThreadPool* pool = nullptr;
  int threads = 0;                  // 0: DefaultIoThreads(), max(4, cores)
  int coordinator = 0;              // the rank that reads the metadata and broadcasts it
  bool strict = true;               // missing keys are an error
  bool allow_cast = false;          // convert stored dtypes to the destination's dtype
  bool verify_checksums = true;
  uint64_t memory_budget_bytes = kDefaultMemoryBudgetBytes;  // staging beyond the caller's buffers
  // A stored chunk that several ranks need is read by one of them, which sends the others their
  // regions through the communicator (each stored byte read once); false: every rank reads for
  // itself. Unset: shared when comm->spans_machines() (ranks on one machine share its page cache,
  // where reading again costs less than exchanging).
  std::optional<bool> share_reads;
};

struct LoadResult {
  std::vector<std::string> missing_keys;     // wanted but not in the checkpoint (non-strict)
  std::vector<std::string> unexpected_keys;  // in the checkpoint but not wanted
  std::vector<ObjectEntry> objects;          // the wanted objects that were found
  uint64_t bytes_read = 0;                   // bytes this rank read from storage
};

// Saves `state` as a checkpoint at `path` (a directory). Collective over options.comm.
// Errors: kAlreadyExists when a committed checkpoint is at `path` and !overwrite; kInvalidArgument
// for inconsistent state (names the tensor, ranks and values); storage errors name the file.
Status Save(const SaveState& state, std::string_view path, const SaveOptions& options = {});

// Loads the checkpoint at `path` into the pieces of `state`. Collective over options.comm.
Result<LoadResult> Load(const LoadState& state, std::string_view path,
                        const LoadOptions& options = {});

// Reads and checks the committed metadata of the checkpoint at `path` (store null: POSIX).
// kNotFound when no committed checkpoint is there.
Result<CheckpointMetadata> ReadCheckpointMetadata(std::string_view path, Store* store = nullptr);

// The objects named `names` of the checkpoint at `path`, with their payloads (ReadObjectPayloads
// in format/open_checkpoint.h, default limits); names the checkpoint does not hold are skipped.
// Errors as ReadCheckpointMetadata's and ReadObjectPayloads'.
Result<std::vector<ObjectEntry>> ReadCheckpointObjects(std::string_view path,
                                                       std::span<const std::string> names,
                                                       Store* store = nullptr);

struct VerifyReport {
  std::vector<std::string> defects;  // empty when the checkpoint is sound
  // Remarks that are not defects: symbolic links that stay inside the checkpoint directory, and
  // links out of it when the store allows them (docs/FORMAT.md, "Symbolic links").
  std::vector<std::string> notes;
  uint64_t files_checked = 0;
  uint64_t chunks_checked = 0;
  uint64_t bytes_checked = 0;
  // False for formats that store no checksums (torch-dcp, safetensors): only the presence and
  // size of each file, the structure the driver parsed, and coverage were checked.
  bool has_checksums = true;
  bool ok() const { return defects.empty(); }
};

// Checks every file's presence, size and header (a native data file's entries and its
// "__metadata__" block), every checksum block, every chunk a driver must decode (compressed or
// strided DCP items, decoded exactly as a load decodes them), and the coverage of every tensor
// (counted with checked arithmetic), and reports every symbolic link below the checkpoint
// directory (a link out of it is a defect unless the store allows external links). Defects are
// reported, not returned as errors; an error means the checkpoint could not be examined at all
// (no metadata, unreadable metadata, or sizes past the limits every reader applies:
// format/metadata.h ValidateCheckpointSizes), which load refuses too.
Result<VerifyReport> Verify(std::string_view path, Store* store = nullptr, ThreadPool* pool = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_CHECKPOINT_H_
