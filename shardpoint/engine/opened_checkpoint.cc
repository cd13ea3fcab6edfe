#include "shardpoint/engine/opened_checkpoint.h"

#include <string>
#include <utility>

namespace sp {

DataFileAttempt TryOpenDataFile(Store& store, std::string_view dir,
                                const CheckpointMetadata& metadata, uint32_t f) {
  DataFileAttempt attempt;
  Result<std::unique_ptr<ReadableFile>> opened =
      store.OpenInDirectory(dir, metadata.files[f].name);
  if (!opened.ok()) {
    attempt.open_error = opened.status();
    return attempt;
  }
  attempt.file = std::move(opened).value();
  attempt.size_matches = attempt.file->size() == metadata.files[f].size;
  return attempt;
}

Result<std::unique_ptr<ReadableFile>> OpenDataFile(Store& store, std::string_view dir,
                                                   const CheckpointMetadata& metadata, uint32_t f) {
  const DataFile& file = metadata.files[f];
  DataFileAttempt attempt = TryOpenDataFile(store, dir, metadata, f);
  if (attempt.file == nullptr) {
    if (attempt.open_error.code() != StatusCode::kNotFound) return attempt.open_error;
    return DataLossError("data file " + JoinPath(dir, file.name) +
                         " named by the committed metadata is missing: " +
                         attempt.open_error.message());
  }
  if (!attempt.size_matches) {
    return DataLossError("data file " + attempt.file->path() + " has " +
                         std::to_string(attempt.file->size()) + " bytes, expected " +
                         std::to_string(file.size) + " (truncated or replaced)");
  }
  return std::move(attempt.file);
}

Result<DataFiles> OpenDataFiles(Store& store, std::string_view dir,
                                const CheckpointMetadata& metadata,
                                const std::vector<bool>& needed) {
  if (needed.size() != metadata.files.size()) {
    return InternalError("OpenDataFiles: " + std::to_string(needed.size()) +
                         " flags for " + std::to_string(metadata.files.size()) + " data files");
  }
  DataFiles files(metadata.files.size());
  for (uint32_t f = 0; f < files.size(); ++f) {
    if (!needed[f]) continue;
    SP_ASSIGN_OR_RETURN(files[f], OpenDataFile(store, dir, metadata, f));
  }
  return files;
}

std::vector<bool> AllDataFiles(const CheckpointMetadata& metadata) {
  return std::vector<bool>(metadata.files.size(), true);
}

std::vector<bool> DataFilesRead(std::span<const ReadRequest> requests,
                                const CheckpointMetadata& metadata) {
  std::vector<bool> needed(metadata.files.size(), false);
  for (const ReadRequest& r : requests) needed[r.chunk->file] = true;
  return needed;
}

}  // namespace sp
