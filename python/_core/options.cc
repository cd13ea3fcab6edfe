#include "python/_core/options.h"

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "python/_core/errors.h"
#include "shardpoint/checkpoint.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

// Constructs *self from keywords: each names a field (a property of the class) and is assigned
// through that property's setter, onto a default-constructed object; anything else raises
// TypeError naming the keyword.
template <typename Py>
void InitFromKeywords(Py* self, const nb::kwargs& kwargs) {
  if (kwargs.size() == 0) {
    new (self) Py();
    return;
  }
  nb::handle type = nb::type<Py>();
  nb::object staged = type();  // the C++ defaults
  for (auto [key, value] : kwargs) {
    nb::str name = nb::borrow<nb::str>(key);
    nb::object field = nb::getattr(type, name, nb::none());
    if (!PyObject_IsInstance(field.ptr(), reinterpret_cast<PyObject*>(&PyProperty_Type))) {
      throw nb::type_error((std::string(nb::type_name(type).c_str()) +
                            "() got an unexpected keyword argument '" + name.c_str() + "'")
                               .c_str());
    }
    try {
      nb::setattr(staged, name, value);
    } catch (nb::python_error& e) {
      if (!e.matches(PyExc_TypeError)) throw;
      throw nb::type_error((std::string(nb::type_name(type).c_str()) + " keyword '" + name.c_str() +
                            "' does not take a " + nb::type_name(value.type()).c_str() + ": " +
                            nb::str(e.value()).c_str())
                               .c_str());
    }
  }
  new (self) Py(nb::cast<const Py&>(staged));
}

// For a setter that takes None.
const auto kNoneAllowed = nb::for_setter(nb::arg("value").none());

// A read-write property `name` for the field `member` of Py::options.
template <typename Py, typename Options, typename T>
void Field(nb::class_<Py>& cls, const char* name, T Options::*member, const char* doc) {
  cls.def_prop_rw(
      name, [member](const Py& self) -> T { return self.options.*member; },
      [member](Py& self, T value) { self.options.*member = std::move(value); }, doc);
}

// "native", "torch-dcp" or "megatron" (torch-dcp with Megatron-Core's files).
std::string SaveFormatName(const SaveOptions& options) {
  return options.megatron ? "megatron" : std::string(CheckpointFormatName(options.format));
}

void SetSaveFormat(SaveOptions& options, const std::string& name) {
  const bool megatron = name == "megatron";
  Result<CheckpointFormat> format = ParseCheckpointFormat(megatron ? "torch-dcp" : name);
  if (!format.ok()) throw nb::value_error(format.status().message().c_str());
  options.format = *format;
  options.megatron = megatron;
}

std::string ConsolidateFormatName(ConsolidateFormat format) {
  return format == ConsolidateFormat::kTorch ? "torch" : "safetensors";
}

ConsolidateFormat ParseConsolidateFormat(const std::string& name) {
  if (name == "safetensors") return ConsolidateFormat::kSafetensors;
  if (name == "torch") return ConsolidateFormat::kTorch;
  throw nb::value_error(("format must be 'safetensors' or 'torch', not '" + name + "'").c_str());
}

// One placement as Python passes it: (target, dtype name, shape, [(source, offsets, sizes)]).
using SourceTuple = std::tuple<std::string, std::vector<int64_t>, std::vector<int64_t>>;
using PlacementTuple =
    std::tuple<std::string, std::string, std::vector<int64_t>, std::vector<SourceTuple>>;

std::vector<PlacementTuple> PlacementsToPython(const MetadataMapping& mapping) {
  std::vector<PlacementTuple> out;
  for (const TensorPlacement& p : mapping.placements) {
    std::vector<SourceTuple> sources;
    for (const auto& s : p.sources) sources.emplace_back(s.source, s.offsets, s.sizes);
    out.emplace_back(p.target, std::string(DTypeName(p.dtype)), p.shape, std::move(sources));
  }
  return out;
}

std::vector<TensorPlacement> PlacementsFromPython(const std::vector<PlacementTuple>& placements) {
  std::vector<TensorPlacement> out;
  for (const auto& [target, dtype, shape, sources] : placements) {
    TensorPlacement& p = out.emplace_back();
    p.target = target;
    p.dtype = ValueOrThrow(ParseDType(dtype));
    p.shape = shape;
    for (const auto& [source, offsets, sizes] : sources) {
      p.sources.push_back({source, offsets, sizes});
    }
  }
  return out;
}

void DefineSavePlanCache(nb::module_& m) {
  nb::class_<SavePlanCache>(
      m, "SavePlanCache",
      "A rank's memory of its group's last save plan: a save through it whose layout (names,\n"
      "dtypes, shapes, boxes, planning options) is unchanged since the previous one skips the\n"
      "gather of local plans and the global planning (shardpoint/engine/save_plan_cache.h).\n"
      "One per rank and group, used by one save at a time.")
      .def(nb::init<uint64_t>(), nb::arg("keep_file_above_bytes") =
                                     SavePlanCache::kDefaultKeepFileAboveBytes,
           "keep_file_above_bytes: between saves, the coordinator keeps a native plan whose\n"
           "chunk lists take more than this as the metadata file last committed from it (the\n"
           "next save from it decodes them back while the ranks write); 0: every plan.")
      .def_prop_ro("hits", &SavePlanCache::hits, "Saves of this rank that took the cached plan.")
      .def_prop_ro("plan_bytes", &SavePlanCache::plan_bytes,
                   "Bytes of the plan this cache holds between saves on the coordinator (0 on\n"
                   "the other ranks).")
      .def_prop_ro("misses", &SavePlanCache::misses, "Saves of this rank that planned afresh.")
      .def("clear", &SavePlanCache::Clear, "Forgets the plan: the next save plans afresh.");
}

void DefineSaveOptions(nb::module_& m) {
  nb::class_<PySaveOptions> cls(
      m, "SaveOptions",
      "Options of save() and AsyncSaver.start(), from keywords naming its attributes; a keyword\n"
      "left out keeps the engine's default (shardpoint/checkpoint.h SaveOptions).");
  cls.def("__init__", &InitFromKeywords<PySaveOptions>);
  cls.def_rw("comm", &PySaveOptions::comm, kNoneAllowed,
             "The communicator object (None: one rank).");
  cls.def_rw("fill", &PySaveOptions::fill, kNoneAllowed,
             "fill(tensor, piece, offset, out): writes bytes [offset, offset + len(out)) of the\n"
             "piece given as None (indices in the tensor entries) into `out`, a writable\n"
             "memoryview, as that range is written (ranges of at most 16 MiB, several at once);\n"
             "called from I/O threads. None: every piece has an array.");
  cls.def_prop_rw(
      "plan_cache", [](const PySaveOptions& self) { return self.plan_cache; },
      [](PySaveOptions& self, nb::object cache) {
        if (!cache.is_none() && !nb::isinstance<SavePlanCache>(cache)) {
          throw nb::type_error("plan_cache must be a SavePlanCache or None");
        }
        self.plan_cache = std::move(cache);
      },
      kNoneAllowed, "A SavePlanCache kept across saves (None: every save plans).");
  Field(cls, "fill_budget_bytes", &SaveOptions::fill_budget_bytes,
        "Bytes of filled ranges held at once (at least one range).");
  Field(cls, "overwrite", &SaveOptions::overwrite, "Replace a committed checkpoint at the path.");
  Field(cls, "threads", &SaveOptions::threads, "I/O threads (0: the engine's default).");
  Field(cls, "files_per_rank", &SaveOptions::files_per_rank, "Data files each rank writes.");
  Field(cls, "dedup_to_lowest_rank", &SaveOptions::dedup_to_lowest_rank,
        "A chunk several ranks hold is written by the lowest of them.");
  Field(cls, "attributes", &SaveOptions::attributes, "String pairs stored in the metadata.");
  Field(cls, "separate_key_prefixes", &SaveOptions::separate_key_prefixes,
        "Megatron's separation_hint: these tensors' chunks go to data files of their own.");
  Field(cls, "direct_io", &SaveOptions::direct_io,
        "Writes of at least direct_io_min_bytes bypass the page cache (O_DIRECT) for their whole\n"
        "aligned blocks where the file system allows it.");
  Field(cls, "direct_io_min_bytes", &SaveOptions::direct_io_min_bytes,
        "The smallest write that direct_io sends past the page cache.");
  cls.def_prop_rw(
      "format", [](const PySaveOptions& self) { return SaveFormatName(self.options); },
      [](PySaveOptions& self, const std::string& name) { SetSaveFormat(self.options, name); },
      "\"native\", \"torch-dcp\" or \"megatron\".");
}

void DefineLoadOptions(nb::module_& m) {
  nb::class_<PyLoadOptions> cls(
      m, "LoadOptions",
      "Options of load(), from keywords naming its attributes; a keyword left out keeps the\n"
      "engine's default (shardpoint/checkpoint.h LoadOptions).");
  cls.def("__init__", &InitFromKeywords<PyLoadOptions>);
  cls.def_rw("comm", &PyLoadOptions::comm, kNoneAllowed,
             "The communicator object (None: one rank).");
  Field(cls, "strict", &LoadOptions::strict, "Wanted tensors the checkpoint lacks are an error.");
  Field(cls, "allow_cast", &LoadOptions::allow_cast, "Convert stored dtypes to the destination's.");
  Field(cls, "threads", &LoadOptions::threads, "I/O threads (0: the engine's default).");
  Field(cls, "verify_checksums", &LoadOptions::verify_checksums, "Check the stored checksums.");
  Field(cls, "memory_budget_bytes", &LoadOptions::memory_budget_bytes,
        "Staging memory beyond the destination arrays.");
  Field(cls, "share_reads", &LoadOptions::share_reads,
        "A chunk several ranks need is read by one and handed to the others (through shared\n"
        "memory between the processes of one machine); None: on object storage, across\n"
        "machines, between threads and between the processes of one machine.");
  Field(cls, "direct_io", &LoadOptions::direct_io,
        "Reads of at least direct_io_min_bytes bypass the page cache (O_DIRECT) where the file\n"
        "system allows it; None: only in files whose bytes to read are mostly not cached.");
  Field(cls, "direct_io_min_bytes", &LoadOptions::direct_io_min_bytes,
        "The smallest read that direct_io sends past the page cache.");
  Field(cls, "io_depth", &LoadOptions::io_depth,
        "Reads in flight at once; 0: tuned from the measured throughput as the load runs.");
  Field(cls, "machine_read_gate", &LoadOptions::machine_read_gate,
        "With io_depth 0, ranks in separate processes of one machine (comm.machine_ranks())\n"
        "read through one gate in shared memory, tuned from all their reads.");
  cls.def_rw("allow_external_links", &PyLoadOptions::allow_external_links,
             "Read files that symbolic links lead out of the checkpoint (docs/FORMAT.md §1.1).");
}

void DefineConsolidateOptions(nb::module_& m) {
  nb::class_<PyConsolidateOptions> cls(
      m, "ConsolidateOptions",
      "Options of consolidate(), from keywords naming its attributes; a keyword left out keeps\n"
      "the library's default (shardpoint/manage/consolidate.h ConsolidateOptions).");
  cls.def("__init__", &InitFromKeywords<PyConsolidateOptions>);
  cls.def_prop_rw(
      "format",
      [](const PyConsolidateOptions& self) { return ConsolidateFormatName(self.options.format); },
      [](PyConsolidateOptions& self, const std::string& name) {
        self.options.format = ParseConsolidateFormat(name);
      },
      "\"safetensors\" or \"torch\".");
  Field(cls, "max_shard_bytes", &ConsolidateOptions::max_shard_bytes, "Bytes per output shard.");
  cls.def_prop_rw(
      "dtype",
      [](const PyConsolidateOptions& self) -> std::optional<std::string> {
        if (!self.options.dtype) return std::nullopt;
        return std::string(DTypeName(*self.options.dtype));
      },
      [](PyConsolidateOptions& self, std::optional<std::string> name) {
        self.options.dtype = name ? std::optional<DType>(ValueOrThrow(ParseConsolidateDType(*name)))
                                  : std::nullopt;
      },
      "Convert floating-point tensors to this dtype (None: keep theirs).");
  Field(cls, "keys", &ConsolidateOptions::keys, "Names selecting a tensor and those under it.");
  Field(cls, "prefixes", &ConsolidateOptions::prefixes, "Name prefixes selecting tensors.");
  Field(cls, "all_tensors", &ConsolidateOptions::all_tensors, "Export every tensor.");
  Field(cls, "rename", &ConsolidateOptions::rename, "(old prefix, new prefix); first match wins.");
  Field(cls, "overwrite", &ConsolidateOptions::overwrite, "Replace outputs of this format.");
  Field(cls, "threads", &ConsolidateOptions::threads, "I/O threads (0: the engine's default).");
  Field(cls, "memory_budget_bytes", &ConsolidateOptions::memory_budget_bytes,
        "Memory for tensor data in flight.");
  cls.def_rw("progress", &PyConsolidateOptions::progress, kNoneAllowed,
             "Called with (bytes written, total bytes); None: no reports.");
  cls.def_rw("allow_external_links", &PyConsolidateOptions::allow_external_links,
             "Read source files that symbolic links lead out of it (docs/FORMAT.md §1.1).");
  cls.def_prop_rw(
      "placements",
      [](const PyConsolidateOptions& self) { return PlacementsToPython(self.options.mapping); },
      [](PyConsolidateOptions& self, const std::vector<PlacementTuple>& placements) {
        self.options.mapping.placements = PlacementsFromPython(placements);
      },
      "Key mapping: (target, dtype, shape, [(source, offsets, sizes)]) per mapped target\n"
      "(shardpoint/engine/mapped_metadata.h).");
  cls.def_prop_rw(
      "mapped_renames",
      [](const PyConsolidateOptions& self) { return self.options.mapping.renames; },
      [](PyConsolidateOptions& self, std::map<std::string, std::string> renames) {
        self.options.mapping.renames = std::move(renames);
      },
      "Key mapping: stored name -> target name.");
}

}  // namespace

void DefineOptionClasses(nb::module_& m) {
  DefineSavePlanCache(m);
  DefineSaveOptions(m);
  DefineLoadOptions(m);
  DefineConsolidateOptions(m);
}

}  // namespace sp::python
