// Engine-internal entry points of Save.
#ifndef SHARDPOINT_ENGINE_SAVE_INTERNAL_H_
#define SHARDPOINT_ENGINE_SAVE_INTERNAL_H_

#include <string_view>

#include "shardpoint/engine/save.h"

namespace sp {

// Save(state, path, options), except that when `local_failure` is not OK this rank takes part in
// the save's collectives with that error instead of a plan: every rank of the group returns it
// (prefixed with this rank's number) and nothing is written. For a rank that failed before it
// could join a save its peers have already started.
Status SaveWithLocalStatus(const SaveState& state, std::string_view path,
                           const SaveOptions& options, const Status& local_failure);

}  // namespace sp

#endif  // SHARDPOINT_ENGINE_SAVE_INTERNAL_H_
