#include "shardpoint/base/dtype.h"

#include <array>
#include <string>

namespace sp {
namespace {

struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view torch_name;
  std::string_view safetensors_name;
};

constexpr std::array<DTypeInfo, 20> kInfos = {{
    {DType::kBool, 1, "bool", "BOOL"},
    {DType::kUInt8, 1, "uint8", "U8"},
    {DType::kInt8, 1, "int8", "I8"},
    {DType::kInt16, 2, "int16", "I16"},
    {DType::kInt32, 4, "int32", "I32"},
    {DType::kInt64, 8, "int64", "I64"},
    {DType::kUInt16, 2, "uint16", "U16"},
    {DType::kUInt32, 4, "uint32", "U32"},
    {DType::kUInt64, 8, "uint64", "U64"},
    {DType::kFloat16, 2, "float16", "F16"},
    {DType::kBFloat16, 2, "bfloat16", "BF16"},
    {DType::kFloat32, 4, "float32", "F32"},
    {DType::kFloat64, 8, "float64", "F64"},
    {DType::kComplex64, 8, "complex64", "C64"},
    {DType::kComplex128, 16, "complex128", "C128"},
    {DType::kFloat8E4M3FN, 1, "float8_e4m3fn", "F8_E4M3"},
    {DType::kFloat8E5M2, 1, "float8_e5m2", "F8_E5M2"},
    {DType::kFloat8E4M3FNUZ, 1, "float8_e4m3fnuz", "F8_E4M3FNUZ"},
    {DType::kFloat8E5M2FNUZ, 1, "float8_e5m2fnuz", "F8_E5M2FNUZ"},
    {DType::kFloat8E8M0FNU, 1, "float8_e8m0fnu", "F8_E8M0"},
}};

constexpr std::array<DType, 20> MakeAll() {
  std::array<DType, 20> all{};
  for (size_t i = 0; i < kInfos.size(); ++i) all[i] = kInfos[i].dtype;
  return all;
}
constexpr std::array<DType, 20> kAll = MakeAll();

const DTypeInfo& Info(DType dtype) {
  return kInfos[static_cast<size_t>(dtype) - 1];
}

struct Alias {
  std::string_view name;
  DType dtype;
};
constexpr std::array<Alias, 10> kAliases = {{
    {"float", DType::kFloat32},
    {"half", DType::kFloat16},
    {"double", DType::kFloat64},
    {"long", DType::kInt64},
    {"int", DType::kInt32},
    {"short", DType::kInt16},
    {"cfloat", DType::kComplex64},
    {"cdouble", DType::kComplex128},
    {"bf16", DType::kBFloat16},
    {"fp32", DType::kFloat32},
}};

}  // namespace

std::span<const DType> AllDTypes() { return kAll; }
size_t DTypeSize(DType dtype) { return Info(dtype).size; }
std::string_view DTypeName(DType dtype) { return Info(dtype).torch_name; }
std::string_view DTypeSafetensorsName(DType dtype) { return Info(dtype).safetensors_name; }

Result<DType> DTypeFromSafetensorsName(std::string_view name) {
  for (const DTypeInfo& info : kInfos) {
    if (info.safetensors_name == name) return info.dtype;
  }
  return InvalidArgumentError("unknown safetensors dtype \"" + std::string(name) + "\"");
}

Result<DType> ParseDType(std::string_view name) {
  std::string_view bare = name;
  if (bare.starts_with("torch.")) bare.remove_prefix(6);
  for (const DTypeInfo& info : kInfos) {
    if (info.torch_name == bare || info.safetensors_name == bare) return info.dtype;
  }
  for (const Alias& alias : kAliases) {
    if (alias.name == bare) return alias.dtype;
  }
  return InvalidArgumentError("unknown dtype \"" + std::string(name) + "\"");
}

Result<DType> DTypeFromCode(uint32_t code) {
  if (code >= 1 && code <= kInfos.size()) return static_cast<DType>(code);
  return DataLossError("unknown dtype code " + std::to_string(code));
}

}  // namespace sp
