// consolidate and parse_byte_size over the consolidation library (shardpoint/manage/consolidate.h);
// its options, key mapping included, are a ConsolidateOptions (options.h).
// The work runs with the GIL released; a progress callable is called with the GIL taken back,
// from the engine's threads, one call at a time. Returns a read-only ConsolidateResult; failures
// raise StatusError.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"
#include "shardpoint/manage.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

// Wraps a Python callable so the engine's threads can call it. A Python exception in the callable
// is reported once on stderr (as an unraisable exception) and the callable is not called again.
std::function<void(uint64_t, uint64_t)> ProgressCallback(nb::object callable) {
  if (callable.is_none()) return nullptr;
  auto holder = std::make_shared<nb::object>(std::move(callable));
  auto failed = std::make_shared<bool>(false);
  return [holder, failed](uint64_t done, uint64_t total) {
    nb::gil_scoped_acquire gil;
    if (*failed) return;
    try {
      (*holder)(done, total);
    } catch (nb::python_error& e) {
      *failed = true;
      e.discard_as_unraisable("shardpoint consolidate progress callback");
    }
  };
}

ConsolidateResult Consolidate(const std::string& path, const std::string& out_dir,
                     const PyConsolidateOptions& py_options) {
  ConsolidateOptions options = py_options.options;
  // The source's store, which also writes the output; allow_external_links lets the source's
  // files be reached through links out of its directory (docs/FORMAT.md §1.1).
  std::unique_ptr<Store> store = ValueOrThrow(OpenStore(
      path, PosixStoreOptions{.allow_external_links = py_options.allow_external_links}));
  options.store = store.get();
  options.progress = ProgressCallback(py_options.progress);
  Result<ConsolidateResult> result = InternalError("consolidate did not run");
  {
    nb::gil_scoped_release release;
    result = sp::Consolidate(path, out_dir, options);
  }
  // The callback (holding a Python object) must be destroyed with the GIL held: it is, here.
  options.progress = nullptr;
  return ValueOrThrow(std::move(result));
}

}  // namespace

void DefineConsolidateFunctions(nb::module_& m) {
  nb::class_<ConsolidateResult>(m, "ConsolidateResult", "What consolidate() wrote (read-only).")
      .def_ro("files", &ConsolidateResult::files, "The data files, in shard order.")
      .def_prop_ro(
          "index_file",
          [](const ConsolidateResult& r) -> std::optional<std::string> {
            if (r.index_file.empty()) return std::nullopt;
            return r.index_file;
          },
          "None when there is one data file.")
      .def_ro("tensors", &ConsolidateResult::tensors)
      .def_ro("total_bytes", &ConsolidateResult::total_bytes, "Tensor bytes written.")
      .def_ro("bytes_read", &ConsolidateResult::bytes_read, "Bytes read from the source.")
      .def_ro("selection", &ConsolidateResult::selection,
              "What was exported and what was left out.");
  m.def("consolidate", &Consolidate, "path"_a, "out_dir"_a,
        "options"_a = PyConsolidateOptions(),
        "Writes the checkpoint at `path` as whole tensors into `out_dir` (Hugging Face shards), as\n"
        "a ConsolidateOptions says; its key mapping, when set, applies first.");
  m.def(
      "parse_byte_size", [](const std::string& text) { return ValueOrThrow(ParseByteSize(text)); },
      "text"_a, "Bytes in a size such as '5GB', '500MB', '2GiB' or '1000'.");
}

}  // namespace sp::python
