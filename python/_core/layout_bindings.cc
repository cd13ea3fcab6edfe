// The layout functions of shardpoint/layout/tensor_map.h, shardpoint/layout/pieces.h and
// shardpoint/geometry/flat_range.h over plain Python values, so that the Python package computes
// no layout of its own.
//
// Shapes, offsets and sizes cross as sequences of ints; a box comes back as the tuple
// (offsets, sizes) of two tuples of ints. A tensor_map crosses as one list of mesh dims per tensor
// dim (the Python front turns a bare int entry into a one-element list). A failed Status raises
// StatusError (errors.h) with the C++ message; arguments of the wrong type raise TypeError. The
// functions are pure and quick, so they run with the GIL held.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <vector>

#include "python/_core/bindings.h"
#include "python/_core/errors.h"
#include "shardpoint/geometry/flat_range.h"
#include "shardpoint/layout/pieces.h"
#include "shardpoint/layout/tensor_map.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace sp::python {
namespace {

using TensorMap = std::vector<std::vector<int>>;

nb::tuple IntsToTuple(std::span<const int64_t> values) {
  nb::list list;
  for (int64_t v : values) list.append(v);
  return nb::tuple(list);
}

nb::tuple BoxToPython(const Box& box) {
  return nb::make_tuple(IntsToTuple(box.offsets), IntsToTuple(box.sizes));
}

nb::object OptionalBoxToPython(const std::optional<Box>& box) {
  return box.has_value() ? nb::object(BoxToPython(*box)) : nb::none();
}

// offsets and sizes of different lengths are not a box: ValueError rather than a C++ assertion.
Box MakeBox(std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
  if (offsets.size() != sizes.size()) {
    throw nb::value_error(("box offsets " + ShapeToString(offsets) + " and sizes " +
                           ShapeToString(sizes) + " differ in rank")
                              .c_str());
  }
  return Box(std::move(offsets), std::move(sizes));
}

TensorMapLayout MakeTensorMapLayout(Shape mesh_shape, TensorMap tensor_map,
                                    std::vector<int64_t> rank_list,
                                    std::vector<int> uneven_mesh_dims) {
  return TensorMapLayout{std::move(mesh_shape), std::move(tensor_map), std::move(rank_list),
                         std::move(uneven_mesh_dims)};
}

void DefineTensorMapFunctions(nb::module_& m) {
  m.def(
      "tensor_map_chunk",
      [](const Shape& global_shape, const Shape& mesh_shape, const TensorMap& tensor_map,
         int64_t inner_rank, const std::vector<int>& uneven_mesh_dims) {
        const TensorMapLayout layout =
            MakeTensorMapLayout(mesh_shape, tensor_map, {}, uneven_mesh_dims);
        return BoxToPython(ValueOrThrow(TensorMapChunk(global_shape, layout, inner_rank)));
      },
      "global_shape"_a, "mesh_shape"_a, "tensor_map"_a, "inner_rank"_a,
      "uneven_mesh_dims"_a = std::vector<int>(),
      "The box (offsets, sizes) of inner rank `inner_rank` under a tensor_map layout "
      "(shardpoint/layout/tensor_map.h). StatusError(INVALID_ARGUMENT) for a malformed layout.");
  m.def(
      "tensor_map_chunk_for_rank",
      [](const Shape& global_shape, const Shape& mesh_shape, const TensorMap& tensor_map,
         int64_t rank, const std::vector<int64_t>& rank_list,
         const std::vector<int>& uneven_mesh_dims) {
        const TensorMapLayout layout =
            MakeTensorMapLayout(mesh_shape, tensor_map, rank_list, uneven_mesh_dims);
        return OptionalBoxToPython(
            ValueOrThrow(TensorMapChunkForRank(global_shape, layout, rank)));
      },
      "global_shape"_a, "mesh_shape"_a, "tensor_map"_a, "rank"_a,
      "rank_list"_a = std::vector<int64_t>(), "uneven_mesh_dims"_a = std::vector<int>(),
      "The box of global rank `rank` (its position in rank_list; empty: rank itself), or None "
      "when the rank is not in the mesh. StatusError(INVALID_ARGUMENT) for a malformed layout "
      "or rank_list.");
  m.def(
      "tensor_map_chunks_per_rank",
      [](const Shape& global_shape, const Shape& mesh_shape, const TensorMap& tensor_map,
         int64_t world_size, const std::vector<int64_t>& rank_list,
         const std::vector<int>& uneven_mesh_dims) {
        const TensorMapLayout layout =
            MakeTensorMapLayout(mesh_shape, tensor_map, rank_list, uneven_mesh_dims);
        nb::list out;
        for (const std::optional<Box>& box :
             ValueOrThrow(TensorMapChunksPerRank(global_shape, layout, world_size))) {
          out.append(OptionalBoxToPython(box));
        }
        return out;
      },
      "global_shape"_a, "mesh_shape"_a, "tensor_map"_a, "world_size"_a,
      "rank_list"_a = std::vector<int64_t>(), "uneven_mesh_dims"_a = std::vector<int>(),
      "The box of every global rank in [0, world_size), None for ranks not in the mesh.");
}

void DefineFlatRangeFunctions(nb::module_& m) {
  m.def(
      "decompose_flat_range",
      [](std::vector<int64_t> offsets, std::vector<int64_t> sizes, int64_t flat_begin,
         int64_t flat_end) {
        const Box box = MakeBox(std::move(offsets), std::move(sizes));
        nb::list out;
        for (const Box& piece : ValueOrThrow(DecomposeFlatRange(box, flat_begin, flat_end))) {
          out.append(BoxToPython(piece));
        }
        return out;
      },
      "offsets"_a, "sizes"_a, "flat_begin"_a, "flat_end"_a,
      "The boxes whose row-major contents, concatenated, are elements [flat_begin, flat_end) of "
      "the box (shardpoint/geometry/flat_range.h). StatusError(INVALID_ARGUMENT) for a range "
      "outside the box.");
  m.def(
      "flat_range_pieces",
      [](const Shape& global_shape, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
         int64_t flat_begin, int64_t flat_end) {
        const Box box = MakeBox(std::move(offsets), std::move(sizes));
        nb::list out;
        for (const Piece& piece :
             ValueOrThrow(FlatRangePieces(global_shape, box, flat_begin, flat_end))) {
          out.append(nb::make_tuple(BoxToPython(piece.box), piece.element_offset));
        }
        return out;
      },
      "global_shape"_a, "offsets"_a, "sizes"_a, "flat_begin"_a, "flat_end"_a,
      "The boxes of decompose_flat_range, each as (box, element_offset) with the running offset "
      "into a buffer holding the range (shardpoint/layout/pieces.h). StatusError(INVALID_ARGUMENT) "
      "for a box outside global_shape or a range outside the box.");
}

}  // namespace

void DefineLayoutFunctions(nb::module_& m) {
  DefineTensorMapFunctions(m);
  DefineFlatRangeFunctions(m);
}

}  // namespace sp::python
