// save, load, read_metadata, read_objects and verify. Each parses its arguments with the GIL held,
// runs the engine with the GIL released (a Python communicator takes it back for each
// collective), and raises StatusError on failure.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <set>
#include <utility>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/store/open_store.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

// The store `path` is read with: links out of the checkpoint are opened only when allowed
// (docs/FORMAT.md §1.1).
std::unique_ptr<Store> ReadStore(const std::string& path, bool allow_external_links) {
  return ValueOrThrow(OpenStore(path, PosixStoreOptions{.allow_external_links = allow_external_links}));
}

nb::tuple IntTuple(const std::vector<int64_t>& values) {
  nb::list list;
  for (int64_t v : values) list.append(v);
  return nb::tuple(list);
}

nb::dict TensorToPython(const TensorMetadata& t) {
  nb::list chunks;
  for (const StoredChunk& chunk : t.chunks) {
    chunks.append(nb::make_tuple(IntTuple(chunk.box.offsets), IntTuple(chunk.box.sizes)));
  }
  nb::dict d;
  d["dtype"] = std::string(DTypeName(t.dtype));
  d["shape"] = IntTuple(t.shape);
  d["chunks"] = chunks;
  d["bytes"] = t.total_bytes();
  return d;
}

nb::dict MetadataToPython(const CheckpointMetadata& md) {
  nb::dict tensors;
  uint64_t total_bytes = 0;
  for (const TensorMetadata& t : md.tensors) {
    tensors[nb::str(t.name.data(), t.name.size())] = TensorToPython(t);
    total_bytes += t.total_bytes();
  }
  nb::dict objects;
  for (const ObjectEntry& o : md.objects) {
    nb::dict d;
    d["encoding"] = EncodingName(o.encoding);
    d["bytes"] = o.size_bytes();  // the stored item's size while the payload is not read
    objects[nb::str(o.name.data(), o.name.size())] = d;
  }
  nb::list files;
  for (const DataFile& f : md.files) {
    nb::dict d;
    d["name"] = f.name;
    d["bytes"] = f.size;
    d["writer_rank"] = f.writer_rank;
    files.append(d);
  }
  nb::dict out;
  out["version"] = std::to_string(md.version_major) + "." + std::to_string(md.version_minor);
  out["save_id"] = md.save_id;
  out["world_size"] = md.world_size;
  out["total_bytes"] = total_bytes;
  out["checksum_block_bytes"] = md.checksum_block_bytes;
  out["tensors"] = tensors;
  out["objects"] = objects;
  out["files"] = files;
  out["attributes"] = nb::cast(md.attributes);
  return out;
}

void Save(nb::handle tensors, nb::handle objects, const std::string& path,
          const SaveKeywords& keywords) {
  std::unique_ptr<PreparedSave> prepared = PrepareSave(tensors, objects, keywords);
  Status status;
  {
    nb::gil_scoped_release release;
    status = sp::Save(prepared->state, path, prepared->options);
  }
  ThrowIfError(status);
}

nb::tuple Load(const std::string& path, nb::handle tensors, nb::handle object_names,
               nb::handle comm, bool strict, bool allow_cast, int threads,
               bool verify_checksums, bool share_reads, bool allow_external_links) {
  HeldArrays held;
  std::unique_ptr<Store> store = ReadStore(path, allow_external_links);
  LoadState state = ParseLoadState(tensors, object_names, &held);
  std::unique_ptr<PyCommunicator> communicator = MaybeCommunicator(comm);
  LoadOptions options;
  options.comm = communicator.get();
  options.store = store.get();
  options.strict = strict;
  options.allow_cast = allow_cast;
  options.threads = threads;
  options.verify_checksums = verify_checksums;
  options.share_reads = share_reads;
  Result<LoadResult> result = InternalError("load did not run");
  {
    nb::gil_scoped_release release;
    result = sp::Load(state, path, options);
  }
  LoadResult loaded = ValueOrThrow(std::move(result));
  nb::list found;
  for (const ObjectEntry& object : loaded.objects) found.append(ObjectToPython(object));
  return nb::make_tuple(nb::cast(loaded.missing_keys), nb::cast(loaded.unexpected_keys), found,
                        loaded.bytes_read);
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

nb::dict VerifyCheckpoint(const std::string& path, int threads, bool allow_external_links) {
  std::unique_ptr<Store> store = ReadStore(path, allow_external_links);
  Result<VerifyReport> report = InternalError("verify did not run");
  {
    nb::gil_scoped_release release;
    std::unique_ptr<ThreadPool> pool;
    if (threads > 0) pool = std::make_unique<ThreadPool>(threads);
    report = Verify(path, store.get(), pool.get());
  }
  VerifyReport r = ValueOrThrow(std::move(report));
  nb::dict out;
  out["ok"] = r.ok();
  out["defects"] = nb::cast(r.defects);
  out["notes"] = nb::cast(r.notes);
  out["files_checked"] = r.files_checked;
  out["chunks_checked"] = r.chunks_checked;
  out["bytes_checked"] = r.bytes_checked;
  return out;
}

}  // namespace

std::unique_ptr<PreparedSave> PrepareSave(nb::handle tensors, nb::handle objects,
                                          const SaveKeywords& keywords) {
  auto prepared = std::make_unique<PreparedSave>();
  prepared->state = ParseSaveState(tensors, objects, &prepared->held);
  prepared->comm = MaybeCommunicator(keywords.comm);
  SaveOptions& options = prepared->options;
  options.comm = prepared->comm.get();
  options.overwrite = keywords.overwrite;
  options.threads = keywords.threads;
  options.files_per_rank = keywords.files_per_rank;
  options.dedup_to_lowest_rank = keywords.dedup_to_lowest_rank;
  if (keywords.attributes) options.attributes = *keywords.attributes;
  options.separate_key_prefixes = keywords.separate_key_prefixes;
  // "megatron": a torch-dcp checkpoint plus Megatron-Core's metadata.json and common.pt.
  options.megatron = keywords.format == "megatron";
  Result<CheckpointFormat> format =
      ParseCheckpointFormat(options.megatron ? "torch-dcp" : keywords.format);
  if (!format.ok()) throw nb::value_error(format.status().message().c_str());
  options.format = *format;
  return prepared;
}

void DefineCheckpointFunctions(nb::module_& m) {
  m.def(
      "save",
      [](const std::string& path, nb::handle tensors, nb::handle objects, nb::handle comm,
         bool overwrite, int threads, int files_per_rank, bool dedup_to_lowest_rank,
         std::optional<std::map<std::string, std::string>> attributes, std::string format,
         std::vector<std::string> separate_key_prefixes) {
        Save(tensors, objects, path,
             SaveKeywords{comm, overwrite, threads, files_per_rank, dedup_to_lowest_rank,
                          std::move(attributes), std::move(format),
                          std::move(separate_key_prefixes)});
      },
      "path"_a, "tensors"_a, "objects"_a, nb::kw_only(), "comm"_a = nb::none(),
      "overwrite"_a = false, "threads"_a = 0, "files_per_rank"_a = 1,
      "dedup_to_lowest_rank"_a = false, "attributes"_a = nb::none(), "format"_a = "native",
      "separate_key_prefixes"_a = std::vector<std::string>(),
      "Saves tensor entries (name, dtype, shape, [(offsets, sizes, array)]) and object entries\n"
      "(name, encoding, payload) as a checkpoint at `path` in `format` (\"native\", \"megatron\" or\n"
      "\"torch-dcp\"). Collective over `comm`.");
  m.def("load", &Load, "path"_a, "tensors"_a, "object_names"_a, nb::kw_only(),
        "comm"_a = nb::none(), "strict"_a = true, "allow_cast"_a = false, "threads"_a = 0,
        "verify_checksums"_a = true, "share_reads"_a = false, "allow_external_links"_a = false,
        "Loads the checkpoint at `path` into the pieces' arrays, in place. With `share_reads`, a\n"
        "stored chunk several ranks need is read by one and sent to the others. Returns\n"
        "(missing_keys, unexpected_keys, objects, bytes_read). Collective over `comm`.");
  m.def(
      "read_metadata",
      [](const std::string& path, bool allow_external_links) {
        return MetadataToPython(ReadMetadataReleased(path, allow_external_links));
      },
      "path"_a, nb::kw_only(), "allow_external_links"_a = false,
      "The committed metadata of the checkpoint at `path`, as a dict.");
  m.def("read_objects", &ReadObjects, "path"_a, "names"_a, nb::kw_only(),
        "allow_external_links"_a = false,
        "The stored objects among `names` as (name, encoding, payload); missing names are "
        "skipped.");
  m.def("verify", &VerifyCheckpoint, "path"_a, nb::kw_only(), "threads"_a = 0,
        "allow_external_links"_a = false,
        "Checks every file, checksum block and tensor coverage of the checkpoint at `path`.");
}

}  // namespace sp::python
