// The committed metadata as read-only Python objects: CheckpointMetadata, TensorMetadata,
// StoredChunk, ObjectMetadata and DataFile over the structs of shardpoint/format/metadata.h.
//
// Python cannot construct them, and none of their attributes can be assigned (AttributeError).
// Sequences cross as fresh tuples or lists on each access; their elements are views of the C++
// objects that keep the CheckpointMetadata they come from alive. Enumerations and dtypes cross as
// their names ("float32", "json", "native").
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "python/_core/arrays.h"
#include "python/_core/bindings.h"
#include "shardpoint/checkpoint.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

nb::tuple IntTuple(std::span<const int64_t> values) {
  nb::list list;
  for (int64_t v : values) list.append(v);
  return nb::tuple(list);
}

constexpr auto kView = nb::rv_policy::reference_internal;

void DefineChunkAndFile(nb::module_& m) {
  nb::class_<StoredChunk>(m, "StoredChunk", "A stored chunk of a tensor, in global coordinates.")
      .def_prop_ro("offsets", [](const StoredChunk& c) { return IntTuple(c.box.offsets); })
      .def_prop_ro("sizes", [](const StoredChunk& c) { return IntTuple(c.box.sizes); })
      .def_ro("file", &StoredChunk::file, "Index of its data file in CheckpointMetadata.files.")
      .def_ro("byte_length", &StoredChunk::byte_length, "Its bytes once decoded.");
  nb::class_<DataFile>(m, "DataFile", "A data file of the checkpoint.")
      .def_ro("name", &DataFile::name, "Relative to the checkpoint directory.")
      .def_ro("size", &DataFile::size, "Bytes.")
      .def_ro("writer_rank", &DataFile::writer_rank);
}

void DefineTensorAndObject(nb::module_& m) {
  nb::class_<TensorMetadata>(m, "TensorMetadata", "A stored tensor.")
      .def_ro("name", &TensorMetadata::name)
      .def_prop_ro("dtype", [](const TensorMetadata& t) { return std::string(DTypeName(t.dtype)); })
      .def_prop_ro("shape", [](const TensorMetadata& t) { return IntTuple(t.shape); }, "Global.")
      .def_prop_ro("chunks", [](const TensorMetadata& t) -> const std::vector<StoredChunk>& {
        return t.chunks;
      }, kView)
      .def_prop_ro("nbytes", &TensorMetadata::total_bytes, "Bytes of the whole tensor.");
  nb::class_<ObjectEntry>(m, "ObjectMetadata", "A stored object, its payload not read.")
      .def_ro("name", &ObjectEntry::name)
      .def_prop_ro("encoding", [](const ObjectEntry& o) { return EncodingName(o.encoding); })
      .def_prop_ro("nbytes", &ObjectEntry::size_bytes, "Bytes of the stored item.");
}

void DefineCheckpointMetadata(nb::module_& m) {
  nb::class_<CheckpointMetadata>(m, "CheckpointMetadata", "The committed metadata of a checkpoint.")
      .def_prop_ro("version", [](const CheckpointMetadata& md) {
        return std::to_string(md.version_major) + "." + std::to_string(md.version_minor);
      }, "\"major.minor\".")
      .def_ro("save_id", &CheckpointMetadata::save_id)
      .def_ro("world_size", &CheckpointMetadata::world_size, "Ranks of the save.")
      .def_prop_ro("format", [](const CheckpointMetadata& md) {
        return std::string(CheckpointFormatName(md.format));
      }, "\"native\", \"torch-dcp\" or \"safetensors\".")
      .def_ro("checksum_block_bytes", &CheckpointMetadata::checksum_block_bytes)
      .def_prop_ro("files", [](const CheckpointMetadata& md) -> const std::vector<DataFile>& {
        return md.files;
      }, kView)
      .def_prop_ro(
          "tensors",
          [](const CheckpointMetadata& md) -> const std::vector<TensorMetadata>& {
            return md.tensors;
          },
          kView, "Sorted by name.")
      .def_prop_ro("objects", [](const CheckpointMetadata& md) -> const std::vector<ObjectEntry>& {
        return md.objects;
      }, kView, "Sorted by name.")
      .def_ro("attributes", &CheckpointMetadata::attributes, "A copy, as a dict.")
      .def_prop_ro("total_bytes", [](const CheckpointMetadata& md) {
        uint64_t total = 0;
        for (const TensorMetadata& t : md.tensors) total += t.total_bytes();
        return total;
      }, "Bytes of every tensor.")
      .def("tensor", [](const CheckpointMetadata& md, const std::string& name) {
        return md.FindTensor(name);
      }, "name"_a, kView, "The tensor `name`, or None.")
      .def("object", [](const CheckpointMetadata& md, const std::string& name) {
        return md.FindObject(name);
      }, "name"_a, kView, "The object `name`, or None.");
}

}  // namespace

void DefineMetadataClasses(nb::module_& m) {
  DefineChunkAndFile(m);
  DefineTensorAndObject(m);
  DefineCheckpointMetadata(m);
}

}  // namespace sp::python
