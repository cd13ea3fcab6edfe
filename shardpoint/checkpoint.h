// shardpoint: the public entry points of the library, in one header.
//
// Save (engine/save.h), Load, ReadCheckpointMetadata and ReadCheckpointObjects (engine/load.h),
// Verify (engine/verify.h) and AsyncSaver (engine/async_save.h), with what a caller needs around
// them: stores by path (store/open_store.h), format names and detection
// (format/open_checkpoint.h) and the Communicator interface (comm/communicator.h; implementations
// in comm/). Checkpoint management (retention, prune, diff, convert, consolidate) is in
// shardpoint/manage.h. docs/DESIGN.md describes the layers and the data flow.
#ifndef SHARDPOINT_CHECKPOINT_H_
#define SHARDPOINT_CHECKPOINT_H_

#include "shardpoint/comm/communicator.h"
#include "shardpoint/engine/async_save.h"
#include "shardpoint/engine/budget.h"
#include "shardpoint/engine/load.h"
#include "shardpoint/engine/save.h"
#include "shardpoint/engine/verify.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/store/open_store.h"

#endif  // SHARDPOINT_CHECKPOINT_H_
