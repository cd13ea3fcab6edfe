#include "shardpoint/geometry/convert.h"

#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

#include "shardpoint/geometry/float_formats.h"

namespace sp {
namespace {

// The real dtypes, in the order of the conversion table.
constexpr std::array<DType, 18> kRealDTypes = {
    DType::kBool,         DType::kUInt8,          DType::kInt8,           DType::kInt16,
    DType::kInt32,        DType::kInt64,          DType::kUInt16,         DType::kUInt32,
    DType::kUInt64,       DType::kFloat16,        DType::kBFloat16,       DType::kFloat32,
    DType::kFloat64,      DType::kFloat8E4M3FN,   DType::kFloat8E5M2,     DType::kFloat8E4M3FNUZ,
    DType::kFloat8E5M2FNUZ, DType::kFloat8E8M0FNU,
};

int RealIndex(DType dtype) {
  for (size_t i = 0; i < kRealDTypes.size(); ++i) {
    if (kRealDTypes[i] == dtype) return static_cast<int>(i);
  }
  return -1;
}

bool IsComplex(DType dtype) { return dtype == DType::kComplex64 || dtype == DType::kComplex128; }

// Storage type of each real dtype.
template <DType D> struct StorageOf { using type = uint8_t; };
template <> struct StorageOf<DType::kInt8> { using type = int8_t; };
template <> struct StorageOf<DType::kInt16> { using type = int16_t; };
template <> struct StorageOf<DType::kInt32> { using type = int32_t; };
template <> struct StorageOf<DType::kInt64> { using type = int64_t; };
template <> struct StorageOf<DType::kUInt16> { using type = uint16_t; };
template <> struct StorageOf<DType::kUInt32> { using type = uint32_t; };
template <> struct StorageOf<DType::kUInt64> { using type = uint64_t; };
template <> struct StorageOf<DType::kFloat16> { using type = uint16_t; };
template <> struct StorageOf<DType::kBFloat16> { using type = uint16_t; };
template <> struct StorageOf<DType::kFloat32> { using type = float; };
template <> struct StorageOf<DType::kFloat64> { using type = double; };
template <DType D> using Storage = typename StorageOf<D>::type;

constexpr bool IsNarrowFloat(DType d) {
  return d == DType::kFloat16 || d == DType::kBFloat16 || d == DType::kFloat8E4M3FN ||
         d == DType::kFloat8E5M2 || d == DType::kFloat8E4M3FNUZ || d == DType::kFloat8E5M2FNUZ ||
         d == DType::kFloat8E8M0FNU;
}

// Reads one element as its canonical value: bool, int64_t, uint64_t, float or double.
template <DType D>
auto Load(const std::byte* p) {
  Storage<D> s;
  std::memcpy(&s, p, sizeof(s));
  if constexpr (D == DType::kBool) return s != 0;
  else if constexpr (D == DType::kFloat16) return Float16BitsToFloat(s);
  else if constexpr (D == DType::kBFloat16) return BFloat16BitsToFloat(s);
  else if constexpr (D == DType::kFloat8E4M3FN) return Float8E4M3FNBitsToFloat(s);
  else if constexpr (D == DType::kFloat8E5M2) return Float8E5M2BitsToFloat(s);
  else if constexpr (D == DType::kFloat8E4M3FNUZ) return Float8E4M3FNUZBitsToFloat(s);
  else if constexpr (D == DType::kFloat8E5M2FNUZ) return Float8E5M2FNUZBitsToFloat(s);
  else if constexpr (D == DType::kFloat8E8M0FNU) return Float8E8M0FNUBitsToFloat(s);
  else if constexpr (std::is_floating_point_v<Storage<D>>) return s;
  else if constexpr (std::is_signed_v<Storage<D>>) return static_cast<int64_t>(s);
  else return static_cast<uint64_t>(s);
}

// float/double -> integer: see the contract in convert.h.
template <typename I, typename V>
I FloatToInteger(V value) {
  const double x = static_cast<double>(value);
  if (std::isnan(x)) return 0;
  const double t = std::trunc(x);
  constexpr double kTwo63 = 9223372036854775808.0;
  if constexpr (std::is_same_v<I, uint64_t>) {
    if (t >= 2 * kTwo63) return ~uint64_t{0};
    if (t >= kTwo63) return static_cast<uint64_t>(t);
  }
  int64_t wide;
  if (t >= kTwo63) {
    wide = INT64_MAX;
  } else if (t < -kTwo63) {
    wide = INT64_MIN;
  } else {
    wide = static_cast<int64_t>(t);
  }
  return static_cast<I>(wide);
}

template <typename V>
float ToFloat(V value) {
  if constexpr (std::is_same_v<V, bool>) return value ? 1.0f : 0.0f;
  else return static_cast<float>(value);
}

template <DType D>
auto EncodeNarrow(float f) {
  if constexpr (D == DType::kFloat16) return FloatToFloat16Bits(f);
  else if constexpr (D == DType::kBFloat16) return FloatToBFloat16Bits(f);
  else if constexpr (D == DType::kFloat8E4M3FN) return FloatToFloat8E4M3FNBits(f);
  else if constexpr (D == DType::kFloat8E5M2) return FloatToFloat8E5M2Bits(f);
  else if constexpr (D == DType::kFloat8E4M3FNUZ) return FloatToFloat8E4M3FNUZBits(f);
  else if constexpr (D == DType::kFloat8E5M2FNUZ) return FloatToFloat8E5M2FNUZBits(f);
  else return FloatToFloat8E8M0FNUBits(f);
}

// Writes one canonical value as dtype D.
template <DType D, typename V>
void Store(std::byte* p, V value) {
  using S = Storage<D>;
  S s;
  if constexpr (D == DType::kBool) {
    s = (value != 0) ? 1 : 0;
  } else if constexpr (IsNarrowFloat(D)) {
    s = EncodeNarrow<D>(ToFloat(value));
  } else if constexpr (std::is_floating_point_v<S>) {
    s = std::is_same_v<V, bool> ? S(value ? 1 : 0) : static_cast<S>(value);
  } else if constexpr (std::is_floating_point_v<V>) {
    s = FloatToInteger<S>(value);
  } else {
    s = static_cast<S>(value);
  }
  std::memcpy(p, &s, sizeof(s));
}

template <DType From, DType To>
void ConvertLoop(const std::byte* src, std::byte* dst, int64_t count) {
  constexpr size_t kFromSize = sizeof(Storage<From>);
  constexpr size_t kToSize = sizeof(Storage<To>);
  for (int64_t i = 0; i < count; ++i) {
    Store<To>(dst + i * kToSize, Load<From>(src + i * kFromSize));
  }
}

using ConvertFn = void (*)(const std::byte*, std::byte*, int64_t);
constexpr size_t kNumReal = kRealDTypes.size();

template <size_t... I>
constexpr std::array<ConvertFn, sizeof...(I)> MakeTable(std::index_sequence<I...>) {
  return {&ConvertLoop<kRealDTypes[I / kNumReal], kRealDTypes[I % kNumReal]>...};
}
constexpr std::array<ConvertFn, kNumReal * kNumReal> kConvertTable =
    MakeTable(std::make_index_sequence<kNumReal * kNumReal>());

template <typename From, typename To>
void ConvertComplex(const void* src, void* dst, int64_t count) {
  const auto* in = static_cast<const std::byte*>(src);
  auto* out = static_cast<std::byte*>(dst);
  for (int64_t i = 0; i < 2 * count; ++i) {
    From part;
    std::memcpy(&part, in + i * sizeof(From), sizeof(From));
    const To converted = static_cast<To>(part);
    std::memcpy(out + i * sizeof(To), &converted, sizeof(To));
  }
}

}  // namespace

bool CanConvert(DType from, DType to) { return IsComplex(from) == IsComplex(to); }

Status ConvertElements(DType from, const void* src, DType to, void* dst, int64_t count) {
  if (count < 0) {
    return InvalidArgumentError("cannot convert a negative count " + std::to_string(count) +
                                " of " + std::string(DTypeName(from)) + " elements");
  }
  if (!CanConvert(from, to)) {
    return InvalidArgumentError("cannot cast " + std::string(DTypeName(from)) + " to " +
                                std::string(DTypeName(to)));
  }
  if (count == 0) return OkStatus();
  if (src == nullptr || dst == nullptr) {
    return InvalidArgumentError("cannot convert " + std::to_string(count) + " " +
                                std::string(DTypeName(from)) + " elements: null buffer");
  }
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(count) * DTypeSize(from));
    return OkStatus();
  }
  if (IsComplex(from)) {
    if (from == DType::kComplex64) {
      ConvertComplex<float, double>(src, dst, count);
    } else {
      ConvertComplex<double, float>(src, dst, count);
    }
    return OkStatus();
  }
  const ConvertFn fn = kConvertTable[RealIndex(from) * kNumReal + RealIndex(to)];
  fn(static_cast<const std::byte*>(src), static_cast<std::byte*>(dst), count);
  return OkStatus();
}

}  // namespace sp
