// Removal of files that no committed metadata names.
#ifndef SHARDPOINT_ENGINE_CLEANUP_H_
#define SHARDPOINT_ENGINE_CLEANUP_H_

#include <string_view>

#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp {

// Best effort, after a commit: removes the files in `path` that `metadata` does not name and that
// the writer of some save format claims (CheckpointWriter::OwnsFile, format/writer.h: data files,
// their temporaries, metadata temporaries), left by an earlier checkpoint at this path or by a
// failed save. Directories and files no writer claims are never touched.
void RemoveUnreferencedFiles(Store& store, std::string_view path,
                             const CheckpointMetadata& metadata);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_CLEANUP_H_
