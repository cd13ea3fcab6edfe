// The parts of the module shardpoint._core, each defined by its own file, and the argument
// handling that save and AsyncSaver.start share.
#ifndef SHARDPOINT_PYTHON_CORE_BINDINGS_H_
#define SHARDPOINT_PYTHON_CORE_BINDINGS_H_

#include <nanobind/nanobind.h>

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "python/_core/arrays.h"
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

// The keyword arguments of save() and AsyncSaver.start().
struct SaveKeywords {
  nanobind::handle comm;
  bool overwrite = false;
  int threads = 0;
  int files_per_rank = 1;
  bool dedup_to_lowest_rank = false;
  std::optional<std::map<std::string, std::string>> attributes;
  std::string format = "native";                    // "native", "torch-dcp" or "megatron"
  std::vector<std::string> separate_key_prefixes;  // Megatron's separation_hint
};

// One save's arguments, parsed (GIL held). `options.comm` points into `comm` and the state into
// the arrays of `held`; destroy it with the GIL held.
struct PreparedSave {
  SaveState state;
  HeldArrays held;
  std::unique_ptr<PyCommunicator> comm;
  SaveOptions options;
};

// Raises TypeError / ValueError for malformed arguments (see arrays.h, py_comm.h).
std::unique_ptr<PreparedSave> PrepareSave(nanobind::handle tensors, nanobind::handle objects,
                                          const SaveKeywords& keywords);

}  // namespace sp::python

#endif  // SHARDPOINT_PYTHON_CORE_BINDINGS_H_
