// Bit-level encoding and decoding of the narrow floating-point formats torch stores:
// float16, bfloat16 and the float8 family (e4m3fn, e5m2, e4m3fnuz, e5m2fnuz, e8m0fnu).
//
// Decoding is exact (every value of these formats is a float). Encoding from float follows
// PyTorch's c10 conversions:
// - float16, e5m2: round to nearest even; overflow gives infinity; NaN gives a quiet NaN with the
//   input's sign (0x7E00 | sign for float16, 0x7F | sign for e5m2).
// - bfloat16: round to nearest even on the float bits; NaN gives 0x7FC0 (sign dropped, as c10).
// - e4m3fn (no infinity): round to nearest even; a result above 448 (including infinity) or NaN
//   gives NaN 0x7F | sign.
// - e4m3fnuz, e5m2fnuz (no infinity, no negative zero, NaN is 0x80): round to nearest even; a
//   result above the largest finite value (240, 57344), infinity or NaN gives 0x80; a result of
//   zero is +0.
// - e8m0fnu (unsigned powers of two 2^-127 .. 2^127, 0xFF is NaN): the sign is ignored; the
//   exponent rounds up when the mantissa is above 0.5, or exactly 0.5 for a normal float;
//   infinity, NaN and rounding past 2^127 give NaN.
// All functions are pure and thread-safe.
#ifndef SHARDPOINT_GEOMETRY_FLOAT_FORMATS_H_
#define SHARDPOINT_GEOMETRY_FLOAT_FORMATS_H_

#include <bit>
#include <cstdint>
#include <limits>

namespace sp {
namespace float_format_internal {

// A sign-magnitude binary format with `kMantissaBits`, exponent bias `kBias`, the largest finite
// magnitude code `kMaxCode`, and what it uses for infinity and NaN.
struct Float16Format {
  static constexpr int kMantissaBits = 10, kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7BFF, kSignBit = 0x8000;
  static constexpr bool kHasInf = true;
  static constexpr uint32_t kInfCode = 0x7C00, kNaNCode = 0x7E00;
};
struct E4M3FNFormat {
  static constexpr int kMantissaBits = 3, kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7E, kSignBit = 0x80;
  static constexpr bool kHasInf = false;
  static constexpr uint32_t kInfCode = 0, kNaNCode = 0x7F;
};
struct E5M2Format {
  static constexpr int kMantissaBits = 2, kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7B, kSignBit = 0x80;
  static constexpr bool kHasInf = true;
  static constexpr uint32_t kInfCode = 0x7C, kNaNCode = 0x7F;
};
// In the fnuz formats the NaN code is the sign bit alone, so "NaN | sign" is 0x80 either way.
struct E4M3FNUZFormat {
  static constexpr int kMantissaBits = 3, kBias = 8;
  static constexpr uint32_t kMaxCode = 0x7F, kSignBit = 0x80;
  static constexpr bool kHasInf = false;
  static constexpr uint32_t kInfCode = 0, kNaNCode = 0x80;
};
struct E5M2FNUZFormat {
  static constexpr int kMantissaBits = 2, kBias = 16;
  static constexpr uint32_t kMaxCode = 0x7F, kSignBit = 0x80;
  static constexpr bool kHasInf = false;
  static constexpr uint32_t kInfCode = 0, kNaNCode = 0x80;
};

inline float Pow2(int exponent) {  // exponent in the normal float range
  return std::bit_cast<float>(static_cast<uint32_t>(exponent + 127) << 23);
}

// Rounds a positive finite float magnitude (bits, sign cleared) to the format's magnitude code,
// to nearest even, on an exponent range unbounded above. Codes above kMaxCode mean overflow.
template <typename F>
uint32_t RoundMagnitude(uint32_t magnitude_bits) {
  constexpr int kM = F::kMantissaBits;
  constexpr int kMinExponent = 1 - F::kBias;
  const int float_exponent = static_cast<int>(magnitude_bits >> 23);
  // Float subnormals are far below half the smallest subnormal of every format here.
  if (float_exponent == 0) return 0;
  const uint32_t significand = (magnitude_bits & 0x7FFFFF) | 0x800000;
  const int exponent = float_exponent - 127;
  const int shift = 23 - kM + (exponent < kMinExponent ? kMinExponent - exponent : 0);
  if (shift >= 25) return 0;  // below half of the smallest subnormal
  uint32_t rounded = significand >> shift;
  const uint32_t remainder = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (remainder > half || (remainder == half && (rounded & 1))) ++rounded;
  if (exponent < kMinExponent) return rounded;  // subnormal; 1 << kM carries into the min normal
  return (static_cast<uint32_t>(exponent + F::kBias - 1) << kM) + rounded;
}

template <typename F>
uint32_t EncodeFromFloat(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 31) ? F::kSignBit : 0;
  const uint32_t magnitude = bits & 0x7FFFFFFF;
  if (magnitude > 0x7F800000) return F::kNaNCode | sign;
  const uint32_t overflow = F::kHasInf ? (F::kInfCode | sign) : (F::kNaNCode | sign);
  if (magnitude == 0x7F800000) return overflow;
  const uint32_t code = RoundMagnitude<F>(magnitude);
  if (code > F::kMaxCode) return overflow;
  if (code == 0 && F::kNaNCode == F::kSignBit) return 0;  // fnuz: no negative zero
  return code | sign;
}

template <typename F>
float DecodeToFloat(uint32_t code) {
  constexpr int kM = F::kMantissaBits;
  constexpr uint32_t kMantissaMask = (1u << kM) - 1;
  const uint32_t sign = code & F::kSignBit;
  const uint32_t magnitude = code & ~F::kSignBit;
  if (F::kNaNCode == F::kSignBit && code == F::kNaNCode) {
    return std::numeric_limits<float>::quiet_NaN();
  }
  if (magnitude > F::kMaxCode) {  // infinity or NaN; NaN payload kept in the high mantissa bits
    const uint32_t payload = (magnitude & kMantissaMask) << (23 - kM);
    const uint32_t bits = (sign ? 0x80000000u : 0u) | 0x7F800000u | payload;
    return std::bit_cast<float>(bits);
  }
  const uint32_t exponent_field = magnitude >> kM;
  const uint32_t mantissa = magnitude & kMantissaMask;
  const float value =
      exponent_field == 0
          ? static_cast<float>(mantissa) * Pow2(1 - F::kBias - kM)
          : static_cast<float>(mantissa | (1u << kM)) *
                Pow2(static_cast<int>(exponent_field) - F::kBias - kM);
  return sign ? -value : value;
}

}  // namespace float_format_internal

inline uint16_t FloatToFloat16Bits(float value) {
  return static_cast<uint16_t>(
      float_format_internal::EncodeFromFloat<float_format_internal::Float16Format>(value));
}
inline float Float16BitsToFloat(uint16_t bits) {
  return float_format_internal::DecodeToFloat<float_format_internal::Float16Format>(bits);
}

inline uint16_t FloatToBFloat16Bits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7FFFFFFF) > 0x7F800000) return 0x7FC0;
  const uint32_t rounding_bias = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}
inline float BFloat16BitsToFloat(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

inline uint8_t FloatToFloat8E4M3FNBits(float value) {
  return static_cast<uint8_t>(
      float_format_internal::EncodeFromFloat<float_format_internal::E4M3FNFormat>(value));
}
inline float Float8E4M3FNBitsToFloat(uint8_t bits) {
  return float_format_internal::DecodeToFloat<float_format_internal::E4M3FNFormat>(bits);
}
inline uint8_t FloatToFloat8E5M2Bits(float value) {
  return static_cast<uint8_t>(
      float_format_internal::EncodeFromFloat<float_format_internal::E5M2Format>(value));
}
inline float Float8E5M2BitsToFloat(uint8_t bits) {
  return float_format_internal::DecodeToFloat<float_format_internal::E5M2Format>(bits);
}
inline uint8_t FloatToFloat8E4M3FNUZBits(float value) {
  return static_cast<uint8_t>(
      float_format_internal::EncodeFromFloat<float_format_internal::E4M3FNUZFormat>(value));
}
inline float Float8E4M3FNUZBitsToFloat(uint8_t bits) {
  return float_format_internal::DecodeToFloat<float_format_internal::E4M3FNUZFormat>(bits);
}
inline uint8_t FloatToFloat8E5M2FNUZBits(float value) {
  return static_cast<uint8_t>(
      float_format_internal::EncodeFromFloat<float_format_internal::E5M2FNUZFormat>(value));
}
inline float Float8E5M2FNUZBitsToFloat(uint8_t bits) {
  return float_format_internal::DecodeToFloat<float_format_internal::E5M2FNUZFormat>(bits);
}

inline uint8_t FloatToFloat8E8M0FNUBits(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  uint32_t exponent = (bits >> 23) & 0xFF;
  if (exponent == 0xFF) return 0xFF;
  const bool guard = bits & 0x400000;
  const bool round_or_sticky = bits & 0x3FFFFF;
  const bool normal = exponent > 0;
  if (guard && (round_or_sticky || normal)) {
    if (exponent == 0xFE) return 0xFF;
    ++exponent;
  }
  return static_cast<uint8_t>(exponent);
}
inline float Float8E8M0FNUBitsToFloat(uint8_t bits) {
  if (bits == 0xFF) return std::numeric_limits<float>::quiet_NaN();
  if (bits == 0) return std::bit_cast<float>(0x00400000u);  // 2^-127, a float subnormal
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 23);
}

}  // namespace sp

#endif  // SHARDPOINT_GEOMETRY_FLOAT_FORMATS_H_
