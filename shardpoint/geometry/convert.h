// Element type conversion for cast-on-load.
//
// Converts arrays between any two dtypes with PyTorch's semantics (what `tensor.to(dtype)` gives
// on CPU):
// - Between real types (bool, integers, float16, bfloat16, float32, float64, float8): values go
//   through float32 when the destination is float16, bfloat16 or a float8 format, exactly as c10's
//   constructors of those types take a float (so float64 and int64 sources are rounded to float32
//   first); narrowing float conversions round to nearest even, with each format's overflow and NaN
//   rules (see float_formats.h).
// - float -> integer truncates toward zero like a C cast for in-range values. Where C leaves the
//   result undefined it is defined here as: NaN gives 0; otherwise truncate, saturate to the int64
//   range, and wrap to the destination width (how c10 casts negative floats to uint8); uint64
//   destinations take values in [2^63, 2^64) directly and saturate above.
// - integer -> integer wraps (two's complement); integer -> float rounds to nearest even.
// - bool -> 0 or 1; anything -> bool is (x != 0), so NaN gives true.
// - complex64 <-> complex128 converts each part; complex to or from a real type is an error.
// Thread-safe; the arrays are borrowed and must not overlap.
#ifndef SHARDPOINT_GEOMETRY_CONVERT_H_
#define SHARDPOINT_GEOMETRY_CONVERT_H_

#include <cstdint>

#include "shardpoint/base/dtype.h"
#include "shardpoint/base/status.h"

namespace sp {

// Converts `count` elements of dtype `from` at `src` to dtype `to` at `dst`. Same dtypes copy
// bytes unchanged. Errors (kInvalidArgument): count < 0; a null pointer with count > 0; a complex
// type to or from a real one ("cannot cast complex64 to float32").
Status ConvertElements(DType from, const void* src, DType to, void* dst, int64_t count);

// True when ConvertElements supports the pair (every pair except complex <-> real).
bool CanConvert(DType from, DType to);

}  // namespace sp

#endif  // SHARDPOINT_GEOMETRY_CONVERT_H_
