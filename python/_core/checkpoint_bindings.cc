// save, load, read_metadata, read_objects and verify, and the read-only VerifyReport. Each parses
// its arguments with the GIL held, runs the engine with the GIL released (a Python communicator
// takes it back for each collective), and raises StatusError on failure.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <functional>
#include <utility>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"
#include "shardpoint/checkpoint.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

// The store `path` is read with: links out of the checkpoint are opened only when allowed
// (docs/FORMAT.md §1.1).
std::unique_ptr<Store> ReadStore(const std::string& path, bool allow_external_links) {
  return ValueOrThrow(OpenStore(path, PosixStoreOptions{.allow_external_links = allow_external_links}));
}

void Save(const std::string& path, nb::handle tensors, nb::handle objects,
          const PySaveOptions& options) {
  std::unique_ptr<PreparedSave> prepared = PrepareSave(tensors, objects, options);
  Status status;
  {
    nb::gil_scoped_release release;
    status = sp::Save(prepared->state, path, prepared->options);
  }
  ThrowIfError(status);
}

nb::tuple Load(const std::string& path, nb::handle tensors, nb::handle object_names,
               const PyLoadOptions& py_options) {
  HeldArrays held;
  std::unique_ptr<Store> store = ReadStore(path, py_options.allow_external_links);
  LoadState state = ParseLoadState(tensors, object_names, &held);
  std::unique_ptr<PyCommunicator> communicator = MaybeCommunicator(py_options.comm);
  LoadOptions options = py_options.options;
  options.comm = communicator.get();
  options.store = store.get();
  Result<LoadResult> result = InternalError("load did not run");
  {
    nb::gil_scoped_release release;
    result = sp::Load(state, path, options);
  }
  LoadResult loaded = ValueOrThrow(std::move(result));
  nb::list found;
  for (const ObjectEntry& object : loaded.objects) found.append(ObjectToPython(object));
  return nb::make_tuple(nb::cast(loaded.missing_keys), nb::cast(loaded.unexpected_keys), found,
                        loaded.bytes_read, loaded.read_gate_ranks, loaded.metadata_chunks);
}

CheckpointMetadata ReadMetadataReleased(const std::string& path, bool allow_external_links) {
  std::unique_ptr<Store> store = ReadStore(path, allow_external_links);
  Result<CheckpointMetadata> md = InternalError("read_metadata did not run");
  {
    nb::gil_scoped_release release;
    md = ReadCheckpointMetadata(path, store.get());
  }
  return ValueOrThrow(std::move(md));
}

nb::list ReadObjects(const std::string& path, const std::vector<std::string>& names,
                     bool allow_external_links) {
  std::unique_ptr<Store> store = ReadStore(path, allow_external_links);
  Result<std::vector<ObjectEntry>> objects = InternalError("read_objects did not run");
  {
    nb::gil_scoped_release release;
    objects = ReadCheckpointObjects(path, names, store.get());
  }
  nb::list out;
  for (const ObjectEntry& object : ValueOrThrow(std::move(objects))) out.append(ObjectToPython(object));
  return out;
}

VerifyReport VerifyCheckpoint(const std::string& path, int threads, bool allow_external_links) {
  std::unique_ptr<Store> store = ReadStore(path, allow_external_links);
  Result<VerifyReport> report = InternalError("verify did not run");
  {
    nb::gil_scoped_release release;
    std::unique_ptr<ThreadPool> pool;
    if (threads > 0) pool = std::make_unique<ThreadPool>(threads);
    report = Verify(path, store.get(), pool.get());
  }
  return ValueOrThrow(std::move(report));
}

}  // namespace

std::function<Status(size_t, size_t, uint64_t, MutableByteView)> FillFromPython(PyObject* fill) {
  return [fill](size_t tensor, size_t piece, uint64_t offset, MutableByteView out) -> Status {
    nb::gil_scoped_acquire gil;
    try {
      nb::object view = nb::steal(PyMemoryView_FromMemory(reinterpret_cast<char*>(out.data()),
                                                          static_cast<Py_ssize_t>(out.size()),
                                                          PyBUF_WRITE));
      if (!view.is_valid()) throw nb::python_error();
      const nb::handle fn(fill);
      fn(tensor, piece, offset, view);
      view.attr("release")();  // the memory is the engine's: no view of it outlives the call
      return OkStatus();
    } catch (nb::python_error& e) {
      return InternalError("filling bytes [" + std::to_string(offset) + ", " +
                           std::to_string(offset + out.size()) + ") of piece " +
                           std::to_string(piece) + " of tensor entry " + std::to_string(tensor) +
                           " failed: " + DescribePythonError(e));
    }
  };
}

std::unique_ptr<PreparedSave> PrepareSave(nb::handle tensors, nb::handle objects,
                                          const PySaveOptions& options) {
  auto prepared = std::make_unique<PreparedSave>();
  prepared->state = ParseSaveState(tensors, objects, &prepared->held);
  prepared->comm = MaybeCommunicator(options.comm);
  prepared->options = options.options;
  prepared->options.comm = prepared->comm.get();
  if (!options.fill.is_none()) prepared->options.fill_range = FillFromPython(options.fill.ptr());
  if (!options.plan_cache.is_none()) {
    prepared->options.plan_cache = nb::cast<SavePlanCache*>(options.plan_cache);
  }
  return prepared;
}

void DefineCheckpointFunctions(nb::module_& m) {
  m.def("save", &Save, "path"_a, "tensors"_a, "objects"_a, "options"_a = PySaveOptions(),
        "Saves tensor entries (name, dtype, shape, [(offsets, sizes, array)]) and object entries\n"
        "(name, encoding, payload) as a checkpoint at `path` (a SaveOptions says how). Collective\n"
        "over options.comm.");
  m.def("load", &Load, "path"_a, "tensors"_a, "object_names"_a, "options"_a = PyLoadOptions(),
        "Loads the checkpoint at `path` into the pieces' arrays, in place (a LoadOptions says\n"
        "how). Returns (missing_keys, unexpected_keys, objects, bytes_read, read_gate_ranks,\n"
        "metadata_chunks). Collective over options.comm.");
  m.def(
      "read_metadata",
      &ReadMetadataReleased, "path"_a, nb::kw_only(), "allow_external_links"_a = false,
      "The committed metadata of the checkpoint at `path`, a read-only CheckpointMetadata.");
  m.def("read_objects", &ReadObjects, "path"_a, "names"_a, nb::kw_only(),
        "allow_external_links"_a = false,
        "The stored objects among `names` as (name, encoding, payload); missing names are "
        "skipped.");
  nb::class_<VerifyReport>(m, "VerifyReport", "What verify() found (read-only).")
      .def_prop_ro("ok", &VerifyReport::ok, "No defects.")
      .def_ro("defects", &VerifyReport::defects)
      .def_ro("notes", &VerifyReport::notes, "Remarks that are not defects (symbolic links).")
      .def_ro("files_checked", &VerifyReport::files_checked)
      .def_ro("chunks_checked", &VerifyReport::chunks_checked)
      .def_ro("bytes_checked", &VerifyReport::bytes_checked)
      .def_ro("has_checksums", &VerifyReport::has_checksums,
              "False for formats without checksums.");
  m.def("verify", &VerifyCheckpoint, "path"_a, nb::kw_only(), "threads"_a = 0,
        "allow_external_links"_a = false,
        "Checks every file, checksum block and tensor coverage of the checkpoint at `path`;\n"
        "returns a VerifyReport.");
}

}  // namespace sp::python
