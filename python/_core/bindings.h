// The parts of the module shardpoint._core, each defined by its own file, and the argument
// handling that save and AsyncSaver.start share (their options: options.h).
#ifndef SHARDPOINT_PYTHON_CORE_BINDINGS_H_
#define SHARDPOINT_PYTHON_CORE_BINDINGS_H_

#include <nanobind/nanobind.h>

#include <memory>
#include <string>

#include "python/_core/arrays.h"
#include "python/_core/options.h"
#include "python/_core/py_comm.h"
#include "shardpoint/checkpoint.h"

namespace sp::python {

// save, load, read_metadata, read_objects, verify (checkpoint_bindings.cc).
void DefineCheckpointFunctions(nanobind::module_& m);

// AsyncSaver (async_bindings.cc).
void DefineAsyncSaver(nanobind::module_& m);

// list_checkpoints, plan_gc, gc, delete_checkpoint (retention_bindings.cc).
void DefineRetentionFunctions(nanobind::module_& m);

// consolidate, parse_byte_size (consolidate_bindings.cc).
void DefineConsolidateFunctions(nanobind::module_& m);

// tensor_map_chunk, tensor_map_chunk_for_rank, tensor_map_chunks_per_rank, decompose_flat_range,
// flat_range_pieces (layout_bindings.cc).
void DefineLayoutFunctions(nanobind::module_& m);

// CheckpointMetadata and the types it holds, read-only (metadata_bindings.cc).
void DefineMetadataClasses(nanobind::module_& m);

// One save's arguments, parsed (GIL held): a copy of the caller's options whose `comm` points into
// `comm`, and the state, which points into the arrays of `held`; destroy it with the GIL held.
struct PreparedSave {
  SaveState state;
  HeldArrays held;
  std::unique_ptr<PyCommunicator> comm;
  SaveOptions options;
};

// Raises TypeError / ValueError for malformed arguments (see arrays.h, py_comm.h). With
// options.fill set, the prepared options call it (a borrowed reference: the caller keeps `fill`
// alive while the save runs).
std::unique_ptr<PreparedSave> PrepareSave(nanobind::handle tensors, nanobind::handle objects,
                                          const PySaveOptions& options);

}  // namespace sp::python

#endif  // SHARDPOINT_PYTHON_CORE_BINDINGS_H_
