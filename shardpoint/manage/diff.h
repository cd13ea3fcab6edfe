// Diff: compares two checkpoints key by key and value by value, in bounded memory.
//
// Keys: the tensors and objects only in A, only in B, and the tensors in both whose dtype or global
// shape differ. Values: for every tensor in both with the same dtype and shape, the elements that
// differ and the largest absolute difference. Floating types (float16, bfloat16, float32,
// float64, float8 formats) are compared in float64: an element differs when |a - b| > atol; two
// NaNs are equal, a NaN against a number differs with difference +inf, equal infinities are equal.
// Complex types compare real and imaginary parts the same way. Integers and bool are compared
// exactly (atol does not apply); their reported difference is computed in float64, so it is exact
// below 2^53. Objects are equal when their encodings and payloads are equal byte for byte.
//
// Reading. Values are read through the public Load, so any format that ReadCheckpointMetadata and
// Load understand can be compared. The regions read are A's stored chunks; a chunk bigger than
// `slab_bytes` is split along its outermost dimensions into slabs of at most that size. Slabs
// are batched up to `slab_bytes` per side and each batch is loaded from both checkpoints into two
// buffers, so memory stays near 2 x slab_bytes plus Load's own staging budget.
//
// Thread-safety: one call reads both checkpoints; they must not change during it.
#ifndef SHARDPOINT_MANAGE_DIFF_H_
#define SHARDPOINT_MANAGE_DIFF_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/result.h"
#include "shardpoint/geometry/box.h"
#include "shardpoint/store/store.h"

namespace sp {

struct DiffOptions {
  Store* store_a = nullptr;  // null: the POSIX file system
  Store* store_b = nullptr;
  double atol = 0;                           // >= 0; floating types only
  uint64_t slab_bytes = uint64_t{64} << 20;  // bounded memory per side (>= 1)
  int threads = 0;                           // I/O threads of each Load; 0: the engine's default
};

struct TensorMismatch {  // same name, different dtype or shape
  std::string name;
  DType dtype_a = DType::kFloat32;
  DType dtype_b = DType::kFloat32;
  Shape shape_a;
  Shape shape_b;
};

struct TensorValueDiff {
  std::string name;
  DType dtype = DType::kFloat32;
  uint64_t elements_differing = 0;
  double max_abs_diff = 0;           // over the differing elements
  std::vector<int64_t> first_index;  // global index of one differing element (the first met)
};

struct DiffReport {
  std::vector<std::string> tensors_only_in_a;  // sorted
  std::vector<std::string> tensors_only_in_b;
  std::vector<std::string> objects_only_in_a;
  std::vector<std::string> objects_only_in_b;
  std::vector<TensorMismatch> mismatched;      // dtype or shape
  std::vector<TensorValueDiff> values_differ;  // sorted by name
  std::vector<std::string> objects_differ;     // encoding or payload
  uint64_t tensors_compared = 0;               // tensors whose values were compared
  uint64_t elements_compared = 0;
  bool equal() const;
};

// Compares the checkpoints at `a` and `b`. Errors: kInvalidArgument for a negative or NaN atol or
// a zero slab_bytes; kNotFound when either has no committed checkpoint; read errors and checksum
// mismatches as Load returns them (naming the file and tensor).
Result<DiffReport> Diff(std::string_view a, std::string_view b, const DiffOptions& options = {});

// Splits `box` (elements of `item_bytes` bytes) into boxes of at most max_bytes each, tiling it in
// row-major order: the outermost dimensions are cut first, and a dimension is cut only when one
// index of it is still too big. Pure. An empty box gives no boxes.
std::vector<Box> SplitIntoSlabs(const Box& box, uint64_t item_bytes, uint64_t max_bytes);

}  // namespace sp

#endif  // SHARDPOINT_MANAGE_DIFF_H_
