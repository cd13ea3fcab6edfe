// consolidate and parse_byte_size over the consolidation library (shardpoint/manage/consolidate.h),
// with a key mapping given as placements and renames (shardpoint/engine/mapped_metadata.h).
// The work runs with the GIL released; a progress callable is called with the GIL taken back,
// from the engine's threads, one call at a time. Failures raise StatusError.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"
#include "shardpoint/manage/consolidate.h"
#include "shardpoint/store/open_store.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

ConsolidateFormat FormatFromName(const std::string& name) {
  if (name == "safetensors") return ConsolidateFormat::kSafetensors;
  if (name == "torch") return ConsolidateFormat::kTorch;
  throw nb::value_error(("format must be 'safetensors' or 'torch', not '" + name + "'").c_str());
}

nb::dict ResultToPython(const ConsolidateResult& r) {
  nb::dict d;
  d["files"] = nb::cast(r.files);
  d["index_file"] = r.index_file.empty() ? nb::none() : nb::cast(r.index_file);
  d["tensors"] = r.tensors;
  d["total_bytes"] = r.total_bytes;
  d["bytes_read"] = r.bytes_read;
  d["selection"] = r.selection;
  return d;
}

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

// One placement as Python passes it: (target, dtype name, shape, [(source, offsets, sizes)]).
using PlacementTuple =
    std::tuple<std::string, std::string, std::vector<int64_t>,
               std::vector<std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>>>>;

MetadataMapping MappingFromPython(const std::vector<PlacementTuple>& placements,
                                  std::map<std::string, std::string> renames) {
  MetadataMapping mapping;
  for (const auto& [target, dtype, shape, sources] : placements) {
    TensorPlacement& p = mapping.placements.emplace_back();
    p.target = target;
    p.dtype = ValueOrThrow(ParseDType(dtype));
    p.shape = shape;
    for (const auto& [source, offsets, sizes] : sources) {
      p.sources.push_back({source, offsets, sizes});
    }
  }
  mapping.renames = std::move(renames);
  return mapping;
}

nb::dict Consolidate(const std::string& path, const std::string& out_dir,
                     uint64_t max_shard_bytes, std::optional<std::string> dtype,
                     std::vector<std::string> keys, std::vector<std::string> prefixes,
                     std::vector<std::pair<std::string, std::string>> rename,
                     const std::string& format, bool overwrite, int threads,
                     uint64_t memory_budget_bytes, nb::object progress, bool all_tensors,
                     const std::vector<PlacementTuple>& placements,
                     std::map<std::string, std::string> mapped_renames,
                     bool allow_external_links) {
  ConsolidateOptions options;
  // The source's store, which also writes the output; allow_external_links lets the source's
  // files be reached through links out of its directory (docs/FORMAT.md §1.1).
  std::unique_ptr<Store> store =
      ValueOrThrow(OpenStore(path, PosixStoreOptions{.allow_external_links = allow_external_links}));
  options.store = store.get();
  options.mapping = MappingFromPython(placements, std::move(mapped_renames));
  options.format = FormatFromName(format);
  options.max_shard_bytes = max_shard_bytes;
  if (dtype) options.dtype = ValueOrThrow(ParseConsolidateDType(*dtype));
  options.keys = std::move(keys);
  options.prefixes = std::move(prefixes);
  options.all_tensors = all_tensors;
  options.rename = std::move(rename);
  options.overwrite = overwrite;
  options.threads = threads;
  options.memory_budget_bytes = memory_budget_bytes;
  options.progress = ProgressCallback(std::move(progress));
  Result<ConsolidateResult> result = InternalError("consolidate did not run");
  {
    nb::gil_scoped_release release;
    result = sp::Consolidate(path, out_dir, options);
  }
  // The callback (holding a Python object) must be destroyed with the GIL held: it is, here.
  options.progress = nullptr;
  return ResultToPython(ValueOrThrow(std::move(result)));
}

}  // namespace

void DefineConsolidateFunctions(nb::module_& m) {
  m.def("consolidate", &Consolidate, "path"_a, "out_dir"_a, "max_shard_bytes"_a,
        "dtype"_a = nb::none(), "keys"_a = std::vector<std::string>{},
        "prefixes"_a = std::vector<std::string>{},
        "rename"_a = std::vector<std::pair<std::string, std::string>>{},
        "format"_a = "safetensors", "overwrite"_a = false, "threads"_a = 0,
        "memory_budget_bytes"_a = uint64_t{256} << 20, "progress"_a = nb::none(),
        "all_tensors"_a = false, "placements"_a = std::vector<PlacementTuple>{},
        "mapped_renames"_a = std::map<std::string, std::string>{},
        "allow_external_links"_a = false,
        "Writes the checkpoint at `path` as whole tensors into `out_dir` (Hugging Face shards); "
        "`placements` (target, dtype, shape, [(source, offsets, sizes)]) and `mapped_renames` "
        "(stored -> target name) apply a key mapping first (shardpoint/engine/mapped_metadata.h).");
  m.def(
      "parse_byte_size", [](const std::string& text) { return ValueOrThrow(ParseByteSize(text)); },
      "text"_a, "Bytes in a size such as '5GB', '500MB', '2GiB' or '1000'.");
}

}  // namespace sp::python
