// Parsing of the Python-side state (tensor entries, object entries) into the engine's SaveState
// and LoadState, zero-copy.
//
// A tensor entry is (name, dtype, global_shape, pieces) with pieces a list of
// (offsets, sizes, array). `dtype` is a torch dtype name ("bfloat16", "float8_e4m3fn"); `array`
// is any C-contiguous CPU array that exports DLPack or the buffer protocol (numpy arrays, torch
// tensors of any dtype). The array's own dtype is not looked at: the piece is the array's bytes,
// which must number prod(sizes) * itemsize(dtype). In a save, `array` may be None: the piece has
// no memory here and SaveOptions.fill gives its bytes when it is written. Views of the arrays' memory go into the state;
// the arrays themselves are kept referenced by HeldArrays, which must outlive every use of the
// state and be destroyed with the GIL held.
//
// An object entry is (name, encoding, payload) with encoding "json", "pickle" or "bytes".
//
// Errors are raised as Python exceptions (the caller holds the GIL): TypeError for an entry of
// the wrong structure, ValueError for a bad dtype or encoding, or an array that is not
// C-contiguous, not on the CPU, read-only where it is written to, or of the wrong byte size; each
// message names the tensor and says what was expected and what was found.
#ifndef SHARDPOINT_PYTHON_CORE_ARRAYS_H_
#define SHARDPOINT_PYTHON_CORE_ARRAYS_H_

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <string>
#include <vector>

#include "shardpoint/checkpoint.h"

namespace sp::python {

struct HeldArrays {
  std::vector<nanobind::ndarray<nanobind::ro>> read_only;
  std::vector<nanobind::ndarray<>> writable;
};

SaveState ParseSaveState(nanobind::handle tensors, nanobind::handle objects, HeldArrays* held);

LoadState ParseLoadState(nanobind::handle tensors, nanobind::handle object_names,
                         HeldArrays* held);

// "json" | "pickle" | "bytes" and back. ParseEncoding raises ValueError naming the object.
ObjectEncoding ParseEncoding(const std::string& encoding, const std::string& object_name);
const char* EncodingName(ObjectEncoding encoding);

// (name, encoding, payload: bytes)
nanobind::tuple ObjectToPython(const ObjectEntry& object);

// The bytes of a bytes-like object (bytes, bytearray, memoryview, ...); raises TypeError.
std::string BytesFromPython(nanobind::handle obj);

}  // namespace sp::python

#endif  // SHARDPOINT_PYTHON_CORE_ARRAYS_H_
