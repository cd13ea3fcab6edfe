// shardpoint._core: the nanobind extension under the Python package.
//
// It exposes the engine's entry points over plain Python values (lists of tensor entries and
// object entries, a communicator object), option objects (options.h) and read-only metadata
// objects, the layout functions (tensor_map, flat ranges), and nothing framework-specific: the torch and numpy adapters are pure Python in the
// shardpoint package. Tensors cross zero-copy
// through DLPack or the buffer protocol, and the GIL is released during planning and I/O.
#include <nanobind/nanobind.h>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"

NB_MODULE(_core, m) {
  m.doc() = "shardpoint's C++ engine: save, load, read_metadata, read_objects, verify, AsyncSaver";
  sp::python::DefineStatusError(m);
  sp::python::DefineOptionClasses(m);
  sp::python::DefineMetadataClasses(m);
  sp::python::DefineCheckpointFunctions(m);
  sp::python::DefineAsyncSaver(m);
  sp::python::DefineRetentionFunctions(m);
  sp::python::DefineConsolidateFunctions(m);
  sp::python::DefineLayoutFunctions(m);
}
