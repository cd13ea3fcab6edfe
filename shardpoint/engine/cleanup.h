// Removal of files that no committed metadata names.
#ifndef SHARDPOINT_ENGINE_CLEANUP_H_
#define SHARDPOINT_ENGINE_CLEANUP_H_

#include <string_view>

#include "shardpoint/format/metadata.h"
#include "shardpoint/store/store.h"

namespace sp {

// Best effort, after a commit: removes the data files ("d-*.safetensors", their ".tmp" names) and
// the metadata temporaries ("shardpoint.metadata.tmp-*") in `path` that `metadata` does not name (left by an earlier checkpoint
// at this path or by a failed save). Files of other kinds are never touched.
void RemoveUnreferencedFiles(Store& store, std::string_view path,
                             const CheckpointMetadata& metadata);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_CLEANUP_H_
