// The option objects of shardpoint._core: SaveOptions, LoadOptions and ConsolidateOptions, each
// the library's struct (shardpoint/checkpoint.h, shardpoint/manage/consolidate.h) plus what only
// Python holds (the communicator or progress callable as a Python object, the store's link
// policy).
//
// Python constructs them from keywords; a keyword left out keeps the default member initializer
// of the C++ struct, which is the only place each default is written. Every field is also a
// read-write attribute. Enumerations and dtypes cross as their names ("native", "safetensors",
// "bfloat16"); an unknown name raises ValueError naming it.
//
// The engine-side pointers (comm, store, pool, stats, callbacks) of the wrapped struct stay null
// here: each call fills a copy of the struct with the objects it builds for that call.
//
// Thread-safety: Python objects; use and destroy them with the GIL held.
#ifndef SHARDPOINT_PYTHON_CORE_OPTIONS_H_
#define SHARDPOINT_PYTHON_CORE_OPTIONS_H_

#include <nanobind/nanobind.h>

#include "shardpoint/manage.h"

namespace sp::python {

// save() and AsyncSaver.start(). The format "megatron" is options.format kTorchDcp with
// options.megatron set.
struct PySaveOptions {
  SaveOptions options;
  nanobind::object comm = nanobind::none();  // None: this process is the only rank
  // fill(tensor index, piece index, byte offset, out: a writable memoryview) writes bytes
  // [offset, offset + len(out)) of a piece given as None (SaveOptions::fill_range), called from
  // I/O threads with the GIL taken; None: no piece may be None.
  nanobind::object fill = nanobind::none();
  // A SavePlanCache (SaveOptions::plan_cache), or None; kept alive by the caller while the save
  // runs (an async saver holds it until its save is done).
  nanobind::object plan_cache = nanobind::none();
};

// load().
struct PyLoadOptions {
  LoadOptions options;
  nanobind::object comm = nanobind::none();
  bool allow_external_links = false;  // docs/FORMAT.md §1.1
};

// consolidate(). `progress` is called with (bytes written, total bytes); see ConsolidateOptions.
struct PyConsolidateOptions {
  ConsolidateOptions options;
  nanobind::object progress = nanobind::none();
  bool allow_external_links = false;
};

// Defines the three classes in `m`.
void DefineOptionClasses(nanobind::module_& m);

}  // namespace sp::python

#endif  // SHARDPOINT_PYTHON_CORE_OPTIONS_H_
