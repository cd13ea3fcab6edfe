// The data files of a committed checkpoint, opened for reading.
//
// Every reader of stored chunk bytes (load, verify, convert, consolidate, prune) opens the files
// that the checkpoint's metadata names the same way: through Store::OpenInDirectory (so a link
// out of the checkpoint directory is refused unless the store allows it, docs/FORMAT.md
// "Symbolic links"), and each file's size checked against the metadata's. The metadata is
// committed, so a file it names that is missing or of another size is damage (kDataLoss), never
// an absent checkpoint (kNotFound).
#ifndef SHARDPOINT_ENGINE_OPENED_CHECKPOINT_H_
#define SHARDPOINT_ENGINE_OPENED_CHECKPOINT_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "shardpoint/base/result.h"
#include "shardpoint/engine/read_executor.h"
#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp {

// Open data files indexed like metadata.files; null where a file was not asked for.
using DataFiles = std::vector<std::unique_ptr<ReadableFile>>;

// The outcome of trying to open one data file, for callers that report a defect instead of
// failing: `file` is set when the store opened it (whatever its size), `open_error` is the
// store's error from OpenInDirectory otherwise, and `size_matches` says whether the opened file
// has the size the metadata records.
struct DataFileAttempt {
  std::unique_ptr<ReadableFile> file;
  Status open_error;
  bool size_matches = false;
};

// Opens data file `f` of `metadata` in directory `dir` and checks its size. Never fails.
DataFileAttempt TryOpenDataFile(Store& store, std::string_view dir,
                                const CheckpointMetadata& metadata, uint32_t f);

// Opens data file `f` of `metadata` in directory `dir`. Errors:
//  - kDataLoss "data file DIR/NAME named by the committed metadata is missing: <store's message>"
//    when the store has no such file;
//  - kDataLoss "data file PATH has N bytes, expected M (truncated or replaced)", PATH being the
//    opened file's path();
//  - any other error of OpenInDirectory as it is (e.g. kFailedPrecondition for a link out).
Result<std::unique_ptr<ReadableFile>> OpenDataFile(Store& store, std::string_view dir,
                                                   const CheckpointMetadata& metadata, uint32_t f);

// Opens the data files that `needed` marks (indexed like metadata.files, same size), in file
// order; the others stay null. The first failure is returned, with OpenDataFile's errors.
Result<DataFiles> OpenDataFiles(Store& store, std::string_view dir,
                                const CheckpointMetadata& metadata,
                                const std::vector<bool>& needed);

// Every data file the metadata names.
std::vector<bool> AllDataFiles(const CheckpointMetadata& metadata);

// The data files that `requests` read (their destinations are not looked at).
std::vector<bool> DataFilesRead(std::span<const ReadRequest> requests,
                                const CheckpointMetadata& metadata);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_OPENED_CHECKPOINT_H_
