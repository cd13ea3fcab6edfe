// DType: the element types of every torch dtype that a checkpoint can hold.
//
// Each dtype has a fixed element size, a stable numeric code used on disk by the native format
// (never renumber: append only), the torch name ("bfloat16") and the safetensors name ("BF16").
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_BASE_DTYPE_H_
#define SHARDPOINT_BASE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "shardpoint/base/result.h"

namespace sp {

// Values are the on-disk codes of format/native. Append only.
enum class DType : uint8_t {
  kBool = 1,
  kUInt8 = 2,
  kInt8 = 3,
  kInt16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kUInt16 = 7,
  kUInt32 = 8,
  kUInt64 = 9,
  kFloat16 = 10,
  kBFloat16 = 11,
  kFloat32 = 12,
  kFloat64 = 13,
  kComplex64 = 14,
  kComplex128 = 15,
  kFloat8E4M3FN = 16,
  kFloat8E5M2 = 17,
  kFloat8E4M3FNUZ = 18,
  kFloat8E5M2FNUZ = 19,
  kFloat8E8M0FNU = 20,
};

// Every dtype, in code order.
std::span<const DType> AllDTypes();

// Bytes per element (1 for bool and float8, 16 for complex128).
size_t DTypeSize(DType dtype);

// torch name without the "torch." prefix: "bfloat16", "float8_e4m3fn", "complex64", "bool".
std::string_view DTypeName(DType dtype);

// safetensors header name: "BF16", "F8_E4M3", "C64", "BOOL". complex128 has no safetensors name
// in the upstream format; shardpoint writes "C128" for it (see docs/FORMAT.md).
std::string_view DTypeSafetensorsName(DType dtype);

// Parses a torch name (with or without "torch."), a common alias ("float", "half", "double",
// "long", "int", "short", "cfloat", "cdouble") or a safetensors name. kInvalidArgument names the
// unknown string.
Result<DType> ParseDType(std::string_view name);

// Parses only a safetensors header dtype name.
Result<DType> DTypeFromSafetensorsName(std::string_view name);

// Parses the on-disk numeric code; kDataLoss for an unknown code.
Result<DType> DTypeFromCode(uint32_t code);

inline uint8_t DTypeCode(DType dtype) { return static_cast<uint8_t>(dtype); }

}  // namespace sp

#endif  // SHARDPOINT_BASE_DTYPE_H_
