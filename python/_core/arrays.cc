#include "python/_core/arrays.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string_view>
#include <utility>

namespace nb = nanobind;

namespace sp::python {
namespace {

constexpr int kDeviceCpu = nb::device::cpu::value;
constexpr int kDeviceCudaHost = nb::device::cuda_host::value;

[[noreturn]] void TypeError(const std::string& message) { throw nb::type_error(message.c_str()); }
[[noreturn]] void ValueError(const std::string& message) { throw nb::value_error(message.c_str()); }

std::string TypeNameOf(nb::handle obj) { return nb::type_name(obj.type()).c_str(); }

// The items of a sequence of exactly `count` elements; raises TypeError naming `what`.
std::vector<nb::handle> Items(nb::handle obj, size_t count, const std::string& what) {
  if (!PySequence_Check(obj.ptr()) || PyUnicode_Check(obj.ptr()) ||
      nb::len(obj) != count) {
    std::string found = TypeNameOf(obj);
    if (PySequence_Check(obj.ptr())) found += " of " + std::to_string(nb::len(obj)) + " items";
    TypeError(what + ": expected a tuple of " + std::to_string(count) + " items, found " + found);
  }
  std::vector<nb::handle> items;
  for (nb::handle item : obj) items.push_back(item);
  return items;
}

std::string ToStr(nb::handle obj, const std::string& what) {
  std::string out;
  if (!nb::try_cast(obj, out)) TypeError(what + " must be a str, found " + TypeNameOf(obj));
  return out;
}

std::vector<int64_t> ToInts(nb::handle obj, const std::string& what) {
  std::vector<int64_t> out;
  if (!nb::try_cast(obj, out)) {
    TypeError(what + " must be a tuple of ints, found " + TypeNameOf(obj));
  }
  return out;
}

DType ToDType(nb::handle obj, const std::string& tensor) {
  const std::string name = ToStr(obj, "dtype of tensor '" + tensor + "'");
  Result<DType> dtype = ParseDType(name);
  if (!dtype.ok()) ValueError("tensor '" + tensor + "': " + dtype.status().message());
  return *dtype;
}

std::string DeviceName(int device_type) {
  switch (device_type) {
    case nb::device::cuda::value: return "cuda";
    case nb::device::cuda_managed::value: return "cuda (managed)";
    case nb::device::rocm::value: return "rocm";
    case nb::device::metal::value: return "metal";
    case nb::device::oneapi::value: return "oneapi";
    default: return "device type " + std::to_string(device_type);
  }
}

// Checks the array against the piece it describes: CPU memory, C-contiguous, exact byte size.
template <typename Array>
void CheckPieceArray(const Array& a, const std::string& where, const Box& box, DType dtype) {
  if (a.device_type() != kDeviceCpu && a.device_type() != kDeviceCudaHost) {
    ValueError(where + ": the array is on " + DeviceName(a.device_type()) +
               ", expected a CPU array");
  }
  int64_t expected_stride = 1;
  bool contiguous = true;
  for (size_t d = a.ndim(); d-- > 0;) {
    if (a.shape(d) != 1 && a.stride_ptr() != nullptr && a.stride(d) != expected_stride) {
      contiguous = false;
    }
    expected_stride *= static_cast<int64_t>(a.shape(d));
  }
  if (!contiguous && a.size() > 1) {
    ValueError(where + ": the array is not C-contiguous, expected a C-contiguous array");
  }
  const uint64_t expected = static_cast<uint64_t>(box.volume()) * DTypeSize(dtype);
  if (a.nbytes() != expected) {
    ValueError(where + ": the array holds " + std::to_string(a.nbytes()) + " bytes, expected " +
               std::to_string(expected) + " (" + std::to_string(box.volume()) + " elements of " +
               std::string(DTypeName(dtype)) + ")");
  }
}

// Why `obj` could not be taken as an array: the exporter's own complaint where there is one.
std::string WhyNotAnArray(nb::handle obj) {
  std::string why = "expected an array exporting DLPack or the buffer protocol, found " +
                    TypeNameOf(obj);
  if (nb::hasattr(obj, "__dlpack__")) {
    try {
      obj.attr("__dlpack__")();
    } catch (nb::python_error& e) {
      why += " (__dlpack__ failed: " + std::string(nb::str(e.value()).c_str()) + ")";
    }
  }
  return why;
}

template <typename View, typename Array>
View ParsePiece(nb::handle piece, const std::string& tensor, const Shape& shape, DType dtype,
                std::vector<Array>* held, bool allow_none = false) {
  const std::vector<nb::handle> items = Items(piece, 3, "piece of tensor '" + tensor + "'");
  Box box(ToInts(items[0], "offsets of a piece of tensor '" + tensor + "'"),
          ToInts(items[1], "sizes of a piece of tensor '" + tensor + "'"));
  const std::string where = "tensor '" + tensor + "' piece " + box.ToString();
  if (box.offsets.size() != shape.size() || box.sizes.size() != shape.size()) {
    ValueError(where + ": offsets and sizes have " + std::to_string(box.offsets.size()) + " and " +
               std::to_string(box.sizes.size()) + " dimensions, expected " +
               std::to_string(shape.size()) + " (the rank of shape " + ShapeToString(shape) + ")");
  }
  if (allow_none && items[2].is_none()) return View{std::move(box), nullptr};  // filled later
  Array array;
  if (!nb::try_cast(items[2], array, /*convert=*/false)) {
    nb::ndarray<nb::ro> read_only;
    if (!Array::ReadOnly && nb::try_cast(items[2], read_only, /*convert=*/false)) {
      ValueError(where + ": the array is read-only, expected a writable array to load into");
    }
    ValueError(where + ": " + WhyNotAnArray(items[2]));
  }
  CheckPieceArray(array, where, box, dtype);
  View view{std::move(box), nullptr};
  view.data = static_cast<std::byte*>(const_cast<void*>(static_cast<const void*>(array.data())));
  held->push_back(std::move(array));
  return view;
}

// (name, dtype, shape, pieces[, layout]) -> the parts, parsed; `pieces` and `layout` stay
// handles (a layout only where `with_layout`).
struct EntryHead {
  std::string name;
  DType dtype;
  Shape shape;
  nb::handle pieces;
  nb::handle layout;  // invalid when the entry has none
};

// (mesh shape, ((kind, dim, split_factor), ...), rank list) -> the rule (SaveTensor::layout);
// kind 0 Replicate, 1 Shard, 2 _StridedShard; an empty rank list is 0..n-1.
MeshLayout ParseLayout(nb::handle obj, const std::string& tensor) {
  const std::string what = "layout of tensor '" + tensor + "'";
  const std::vector<nb::handle> items = Items(obj, 3, what);
  MeshLayout layout;
  layout.mesh_shape = ToInts(items[0], "mesh shape of " + what);
  if (!PySequence_Check(items[1].ptr())) {
    TypeError("placements of " + what + " must be a sequence, found " + TypeNameOf(items[1]));
  }
  for (nb::handle item : items[1]) {
    const std::vector<int64_t> p = ToInts(item, "a placement of " + what);
    if (p.size() != 3 || p[0] < 0 || p[0] > 2 || p[1] < 0 || p[1] > INT32_MAX || p[2] < 1 ||
        p[2] > INT32_MAX) {
      ValueError("a placement of " + what + " must be (kind 0-2, dim >= 0, split factor >= 1)");
    }
    layout.placements.push_back(Placement{static_cast<Placement::Kind>(p[0]),
                                          static_cast<int>(p[1]), static_cast<int>(p[2])});
  }
  layout.rank_list = ToInts(items[2], "ranks of " + what);
  return layout;
}

EntryHead ParseEntryHead(nb::handle entry, bool with_layout = false) {
  const bool has_layout = with_layout && PySequence_Check(entry.ptr()) &&
                          !PyUnicode_Check(entry.ptr()) && nb::len(entry) == 5;
  const std::vector<nb::handle> items = Items(entry, has_layout ? 5 : 4, "tensor entry");
  EntryHead head;
  if (has_layout) head.layout = items[4];
  head.name = ToStr(items[0], "tensor name");
  head.dtype = ToDType(items[1], head.name);
  head.shape = ToInts(items[2], "shape of tensor '" + head.name + "'");
  head.pieces = items[3];
  if (!PySequence_Check(head.pieces.ptr())) {
    TypeError("pieces of tensor '" + head.name + "' must be a list, found " +
              TypeNameOf(head.pieces));
  }
  return head;
}

}  // namespace

std::string BytesFromPython(nb::handle obj) {
  if (PyBytes_Check(obj.ptr())) {
    return std::string(PyBytes_AS_STRING(obj.ptr()), PyBytes_GET_SIZE(obj.ptr()));
  }
  // A contiguous buffer (a numpy array received from a peer) is copied once, not first into a
  // bytes object.
  if (PyObject_CheckBuffer(obj.ptr())) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_C_CONTIGUOUS) == 0) {
      std::string out(static_cast<const char*>(view.buf), static_cast<size_t>(view.len));
      PyBuffer_Release(&view);
      return out;
    }
    PyErr_Clear();
  }
  nb::object converted = nb::steal(PyBytes_FromObject(obj.ptr()));
  if (!converted.is_valid()) throw nb::python_error();
  return std::string(PyBytes_AS_STRING(converted.ptr()), PyBytes_GET_SIZE(converted.ptr()));
}

ObjectEncoding ParseEncoding(const std::string& encoding, const std::string& object_name) {
  if (encoding == "json") return ObjectEncoding::kJson;
  if (encoding == "pickle") return ObjectEncoding::kPickle;
  if (encoding == "bytes") return ObjectEncoding::kBytes;
  if (encoding == "torch-save") return ObjectEncoding::kTorchSave;
  if (encoding == "plain") return ObjectEncoding::kPlain;
  ValueError("object '" + object_name + "': unknown encoding '" + encoding +
             "', expected 'json', 'plain', 'pickle', 'bytes' or 'torch-save'");
}

const char* EncodingName(ObjectEncoding encoding) {
  switch (encoding) {
    case ObjectEncoding::kJson: return "json";
    case ObjectEncoding::kPickle: return "pickle";
    case ObjectEncoding::kBytes: return "bytes";
    case ObjectEncoding::kTorchSave: return "torch-save";
    case ObjectEncoding::kPlain: return "plain";
  }
  return "unknown";
}

nb::tuple ObjectToPython(const ObjectEntry& object) {
  return nb::make_tuple(object.name, EncodingName(object.encoding),
                        nb::bytes(object.payload.data(), object.payload.size()));
}

SaveState ParseSaveState(nb::handle tensors, nb::handle objects, HeldArrays* held) {
  SaveState state;
  for (nb::handle entry : tensors) {
    EntryHead head = ParseEntryHead(entry, /*with_layout=*/true);
    SaveTensor tensor{head.name, head.dtype, head.shape};
    if (head.layout.is_valid() && !head.layout.is_none()) {
      tensor.layout = ParseLayout(head.layout, head.name);
    }
    for (nb::handle piece : head.pieces) {
      tensor.pieces.push_back(ParsePiece<ConstPieceView>(piece, head.name, head.shape,
                                                         head.dtype, &held->read_only,
                                                         /*allow_none=*/true));
    }
    state.tensors.push_back(std::move(tensor));
  }
  for (nb::handle entry : objects) {
    const std::vector<nb::handle> items = Items(entry, 3, "object entry");
    ObjectEntry object;
    object.name = ToStr(items[0], "object name");
    object.encoding = ParseEncoding(ToStr(items[1], "encoding of object '" + object.name + "'"),
                                    object.name);
    object.payload = BytesFromPython(items[2]);
    state.objects.push_back(std::move(object));
  }
  return state;
}

LoadState ParseLoadState(nb::handle tensors, nb::handle object_names, HeldArrays* held) {
  LoadState state;
  for (nb::handle entry : tensors) {
    EntryHead head = ParseEntryHead(entry);
    LoadTensor tensor{head.name, head.dtype, head.shape, {}};
    for (nb::handle piece : head.pieces) {
      tensor.pieces.push_back(
          ParsePiece<PieceView>(piece, head.name, head.shape, head.dtype, &held->writable));
    }
    state.tensors.push_back(std::move(tensor));
  }
  for (nb::handle name : object_names) state.objects.push_back(ToStr(name, "object name"));
  return state;
}

}  // namespace sp::python
