// Retention: the step checkpoints of a training run's directory, and garbage collection of old
// ones.
//
// A training run saves into one directory, one checkpoint per step: `run/step_000100`,
// `run/step_000200`, ... ListCheckpoints finds them and says which are committed; PlanGc decides,
// from a keep-last / keep-every policy, which committed ones may go; ExecuteGc deletes them.
//
// Step directories. A subdirectory of the run directory is a step checkpoint when its name ends in
// a decimal number, which is its step: the longest run of trailing digits (at most 18 of them, so
// that it fits an int64), with leading zeros ignored. `step_000100`, `step-100`, `global_step100`,
// `iter_0000100`, `ckpt.100` and `100` all have step 100. Names starting with '.' are never step
// checkpoints (temporary and hidden directories); neither is a name without trailing digits.
// Plain files are ignored.
//
// Committed. A step checkpoint is committed when its commit point is there: a native
// `shardpoint.metadata` that passes validation of its header, summary and indexes
// (docs/FORMAT.md §3), or a PyTorch DCP `.metadata` file (for that format presence is enough).
// A directory with neither, or with native metadata that fails validation, is uncommitted: it may
// be a save in progress, a failed one, or a half-deleted one.
//
// Safety rules of garbage collection (both hold whatever the policy says):
//   1. the newest committed checkpoint (the highest step; on equal steps the greatest name) is
//      never deleted, so there is always something to resume from;
//   2. an uncommitted checkpoint is never deleted: it may be being written by a save that has not
//      committed yet. A half-deleted checkpoint (see below) therefore stays until removed by hand.
// Deletion order: the commit point first (the metadata file, then a directory sync, so that a
// half-deleted checkpoint never looks committed), then every other file and subdirectory, then the
// directory itself, then a sync of the run directory.
//
// Thread-safety: the functions hold no state; concurrent calls on one directory race as file
// system operations do (run garbage collection from one process).
#ifndef SHARDPOINT_MANAGE_RETENTION_H_
#define SHARDPOINT_MANAGE_RETENTION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/store/store.h"

namespace sp {

// The step of a directory name by the rule above; nullopt when the name is not a step name.
std::optional<int64_t> StepOfName(std::string_view name);

struct StepCheckpoint {
  int64_t step = 0;
  std::string name;    // the directory's name in the run directory
  std::string path;    // run directory + "/" + name
  uint64_t bytes = 0;  // sum of the sizes of every file under it
  bool committed = false;
  std::string format;   // "native", "torch-dcp", or "" when uncommitted
  std::string problem;  // why native metadata was refused (uncommitted only), else ""
};

struct CheckpointListing {
  std::string directory;
  std::vector<StepCheckpoint> checkpoints;  // by step ascending, then by name
  // Index into checkpoints of the newest committed one.
  std::optional<size_t> latest;

  const StepCheckpoint* latest_checkpoint() const {
    return latest ? &checkpoints[*latest] : nullptr;
  }
};

// Lists the step checkpoints in `directory` (store null: POSIX). kNotFound when `directory` does
// not exist; store errors name the path. A checkpoint whose files cannot be listed is an error.
Result<CheckpointListing> ListCheckpoints(std::string_view directory, Store* store = nullptr);

struct RetentionPolicy {
  int64_t keep_last = 1;   // keep the newest keep_last committed checkpoints (>= 1)
  int64_t keep_every = 0;  // also keep every committed checkpoint whose step is a multiple; 0: none
};

struct GcDecision {
  StepCheckpoint checkpoint;
  bool remove = false;
  std::string reason;  // "latest", "keep-last", "keep-every", "uncommitted", or "expired"
};

struct GcPlan {
  std::vector<GcDecision> decisions;  // one per listed checkpoint, in listing order
  size_t removals() const;
  uint64_t bytes_to_remove() const;
};

// Decides, for every checkpoint of `listing`, whether it stays. Pure. kInvalidArgument when
// keep_last < 1 or keep_every < 0.
Result<GcPlan> PlanGc(const CheckpointListing& listing, const RetentionPolicy& policy);

// Deletes one checkpoint directory in the order above (store null: POSIX). Errors name the file.
// A checkpoint deleted in part is left uncommitted.
Status DeleteCheckpoint(std::string_view path, Store* store = nullptr);

// Deletes the checkpoints that `plan` marks for removal, oldest first, stopping at the first
// error (which names the checkpoint). Returns the paths removed.
Result<std::vector<std::string>> ExecuteGc(const GcPlan& plan, Store* store = nullptr);

}  // namespace sp

#endif  // SHARDPOINT_MANAGE_RETENTION_H_
