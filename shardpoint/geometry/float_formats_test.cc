#include "shardpoint/geometry/float_formats.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

// An independent description of each sign-magnitude format, decoded with ldexp.
struct FormatSpec {
  const char* name;
  int exponent_bits;
  int mantissa_bits;
  int bias;
  bool ieee_specials;  // all-ones exponent is Inf/NaN (float16, bfloat16, e5m2)
  bool fn;             // only S.1111.111 is NaN (e4m3fn)
  bool fnuz;           // 0x80 is NaN, no negative zero, no infinity
  std::function<uint32_t(float)> encode;
  std::function<float(uint32_t)> decode;
};

double ReferenceDecode(const FormatSpec& f, uint32_t bits) {
  const int total = 1 + f.exponent_bits + f.mantissa_bits;
  const uint32_t sign = bits >> (total - 1);
  const uint32_t exponent = (bits >> f.mantissa_bits) & ((1u << f.exponent_bits) - 1);
  const uint32_t mantissa = bits & ((1u << f.mantissa_bits) - 1);
  const uint32_t all_ones = (1u << f.exponent_bits) - 1;
  if (f.fnuz && bits == (1u << (total - 1))) return std::nan("");
  if (f.ieee_specials && exponent == all_ones) {
    return mantissa == 0 ? (sign ? -INFINITY : INFINITY) : std::nan("");
  }
  if (f.fn && exponent == all_ones && mantissa == (1u << f.mantissa_bits) - 1) return std::nan("");
  const double magnitude =
      exponent == 0 ? std::ldexp(static_cast<double>(mantissa), 1 - f.bias - f.mantissa_bits)
                    : std::ldexp(static_cast<double>(mantissa | (1u << f.mantissa_bits)),
                                 static_cast<int>(exponent) - f.bias - f.mantissa_bits);
  return sign ? -magnitude : magnitude;
}

std::vector<FormatSpec> Formats() {
  return {
      {"float16", 5, 10, 15, true, false, false,
       [](float x) { return uint32_t{FloatToFloat16Bits(x)}; },
       [](uint32_t b) { return Float16BitsToFloat(static_cast<uint16_t>(b)); }},
      {"bfloat16", 8, 7, 127, true, false, false,
       [](float x) { return uint32_t{FloatToBFloat16Bits(x)}; },
       [](uint32_t b) { return BFloat16BitsToFloat(static_cast<uint16_t>(b)); }},
      {"e4m3fn", 4, 3, 7, false, true, false,
       [](float x) { return uint32_t{FloatToFloat8E4M3FNBits(x)}; },
       [](uint32_t b) { return Float8E4M3FNBitsToFloat(static_cast<uint8_t>(b)); }},
      {"e5m2", 5, 2, 15, true, false, false,
       [](float x) { return uint32_t{FloatToFloat8E5M2Bits(x)}; },
       [](uint32_t b) { return Float8E5M2BitsToFloat(static_cast<uint8_t>(b)); }},
      {"e4m3fnuz", 4, 3, 8, false, false, true,
       [](float x) { return uint32_t{FloatToFloat8E4M3FNUZBits(x)}; },
       [](uint32_t b) { return Float8E4M3FNUZBitsToFloat(static_cast<uint8_t>(b)); }},
      {"e5m2fnuz", 5, 2, 16, false, false, true,
       [](float x) { return uint32_t{FloatToFloat8E5M2FNUZBits(x)}; },
       [](uint32_t b) { return Float8E5M2FNUZBitsToFloat(static_cast<uint8_t>(b)); }},
  };
}

uint32_t NumPatterns(const FormatSpec& f) { return 1u << (1 + f.exponent_bits + f.mantissa_bits); }

// Every bit pattern decodes to the reference value and encodes back to itself, except NaNs, which
// stay NaN (the canonical NaN of the format).
TEST(FloatFormatsTest, ExhaustiveDecodeAndRoundTrip) {
  for (const FormatSpec& f : Formats()) {
    for (uint32_t bits = 0; bits < NumPatterns(f); ++bits) {
      const double expected = ReferenceDecode(f, bits);
      const float decoded = f.decode(bits);
      if (std::isnan(expected)) {
        ASSERT_TRUE(std::isnan(decoded)) << f.name << " " << bits;
        EXPECT_TRUE(std::isnan(f.decode(f.encode(decoded)))) << f.name << " " << bits;
        continue;
      }
      ASSERT_EQ(static_cast<double>(decoded), expected) << f.name << " " << bits;
      ASSERT_EQ(std::signbit(decoded), std::signbit(expected)) << f.name << " " << bits;
      ASSERT_EQ(f.encode(decoded), bits) << f.name << " " << bits;
    }
  }
}

struct Candidate {
  double value;
  uint32_t code;  // magnitude code; kOverflow marks the value one step past the largest finite
};

// Reference rounding: nearest of all finite magnitudes plus one virtual step past the largest,
// ties to the even code; the virtual step means overflow.
struct ReferenceRounder {
  std::vector<Candidate> candidates;
  uint32_t sign_bit = 0;
  uint32_t max_code = 0;

  explicit ReferenceRounder(const FormatSpec& f) {
    sign_bit = NumPatterns(f) / 2;
    for (uint32_t code = 0; code < sign_bit; ++code) {
      const double v = ReferenceDecode(f, code);
      if (std::isfinite(v)) {
        candidates.push_back({v, code});
        max_code = code;
      }
    }
    const double ulp = candidates.back().value - candidates[candidates.size() - 2].value;
    // The first value of the next binade is one top-binade step past the largest finite value.
    candidates.push_back({candidates.back().value + ulp, max_code + 1});
  }

  // Returns the magnitude code (max_code + 1 means overflow).
  uint32_t Round(double magnitude) const {
    auto it = std::lower_bound(candidates.begin(), candidates.end(), magnitude,
                               [](const Candidate& c, double v) { return c.value < v; });
    if (it == candidates.end()) return max_code + 1;
    if (it->value == magnitude || it == candidates.begin()) return it->code;
    const Candidate& hi = *it;
    const Candidate& lo = *(it - 1);
    const double d_lo = magnitude - lo.value;
    const double d_hi = hi.value - magnitude;
    if (d_lo < d_hi) return lo.code;
    if (d_hi < d_lo) return hi.code;
    return (lo.code & 1) ? hi.code : lo.code;
  }
};

// Expected encoding of finite or infinite x (not NaN) by torch's rules for `f`.
uint32_t ExpectedEncode(const FormatSpec& f, const ReferenceRounder& r, float x) {
  const uint32_t sign = std::signbit(x) ? r.sign_bit : 0;
  const uint32_t nan_code = f.fnuz ? r.sign_bit : (f.fn ? (r.sign_bit - 1) | sign : 0);
  const uint32_t inf_code = r.max_code + 1;  // ieee formats: the all-ones exponent, mantissa 0
  const uint32_t code = std::isinf(x) ? r.max_code + 1 : r.Round(std::fabs(static_cast<double>(x)));
  if (code > r.max_code) return f.ieee_specials ? (inf_code | sign) : nan_code;
  if (f.fnuz && code == 0) return 0;
  return code | sign;
}

std::vector<float> InterestingFloats(const FormatSpec& f, std::mt19937_64& rng) {
  std::vector<float> out;
  const uint32_t n = NumPatterns(f);
  std::vector<double> finite;
  for (uint32_t b = 0; b < n; ++b) {
    const double v = ReferenceDecode(f, b);
    if (std::isfinite(v)) finite.push_back(v);
  }
  std::sort(finite.begin(), finite.end());
  for (size_t i = 0; i < finite.size(); ++i) {
    out.push_back(static_cast<float>(finite[i]));
    if (i + 1 < finite.size()) {
      const double mid = (finite[i] + finite[i + 1]) / 2;  // exact: few significant bits
      out.push_back(static_cast<float>(mid));
      out.push_back(std::nextafter(static_cast<float>(mid), INFINITY));
      out.push_back(std::nextafter(static_cast<float>(mid), -INFINITY));
    }
  }
  const double top = finite.back();
  const double ulp = top - finite[finite.size() - 2];
  for (double k : {0.25, 0.5, 0.75, 1.0, 1.5, 4.0}) {
    out.push_back(static_cast<float>(top + k * ulp));
    out.push_back(static_cast<float>(-(top + k * ulp)));
  }
  out.push_back(std::nextafter(static_cast<float>(top + ulp / 2), INFINITY));
  out.push_back(std::nextafter(static_cast<float>(top + ulp / 2), -INFINITY));
  out.push_back(INFINITY);
  out.push_back(-INFINITY);
  out.push_back(std::numeric_limits<float>::denorm_min());
  out.push_back(-std::numeric_limits<float>::min());
  for (int i = 0; i < 20000; ++i) out.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  return out;
}

TEST(FloatFormatsTest, EncodeRoundsToNearestEvenWithEachFormatsOverflowRule) {
  std::mt19937_64 rng(11);
  for (const FormatSpec& f : Formats()) {
    const ReferenceRounder rounder(f);
    for (float x : InterestingFloats(f, rng)) {
      const uint32_t got = f.encode(x);
      if (std::isnan(x)) {
        EXPECT_TRUE(std::isnan(f.decode(got))) << f.name;
        continue;
      }
      ASSERT_EQ(got, ExpectedEncode(f, rounder, x))
          << f.name << " x=" << x << " bits=" << std::bit_cast<uint32_t>(x);
    }
  }
}

TEST(FloatFormatsTest, KnownValues) {
  EXPECT_EQ(Float8E4M3FNBitsToFloat(0x7E), 448.0f);
  EXPECT_EQ(Float8E4M3FNBitsToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(FloatToFloat8E4M3FNBits(464.0f), 0x7E);  // tie to even 448
  EXPECT_EQ(FloatToFloat8E4M3FNBits(465.0f), 0x7F);  // NaN: no infinity
  EXPECT_EQ(FloatToFloat8E4M3FNBits(INFINITY), 0x7F);
  EXPECT_EQ(FloatToFloat8E4M3FNBits(-INFINITY), 0xFF);
  EXPECT_EQ(FloatToFloat8E4M3FNBits(-1e9f), 0xFF);
  EXPECT_EQ(FloatToFloat8E4M3FNBits(-0.0f), 0x80);
  EXPECT_EQ(Float8E5M2BitsToFloat(0x7B), 57344.0f);
  EXPECT_EQ(FloatToFloat8E5M2Bits(61439.0f), 0x7B);
  EXPECT_EQ(FloatToFloat8E5M2Bits(61440.0f), 0x7C);  // tie rounds to even = infinity
  EXPECT_EQ(FloatToFloat8E5M2Bits(-1e30f), 0xFC);
  EXPECT_EQ(FloatToFloat8E5M2Bits(-std::nanf("")), 0xFF);
  EXPECT_EQ(Float8E4M3FNUZBitsToFloat(0x7F), 240.0f);
  EXPECT_EQ(Float8E4M3FNUZBitsToFloat(0x01), std::ldexp(1.0f, -10));
  EXPECT_EQ(FloatToFloat8E4M3FNUZBits(247.0f), 0x7F);
  EXPECT_EQ(FloatToFloat8E4M3FNUZBits(248.0f), 0x80);
  EXPECT_EQ(FloatToFloat8E4M3FNUZBits(-0.0f), 0x00);
  EXPECT_EQ(FloatToFloat8E4M3FNUZBits(-1e-10f), 0x00);
  EXPECT_EQ(FloatToFloat8E4M3FNUZBits(-INFINITY), 0x80);
  EXPECT_EQ(Float8E5M2FNUZBitsToFloat(0x7F), 57344.0f);
  EXPECT_EQ(Float8E5M2FNUZBitsToFloat(0x01), std::ldexp(1.0f, -17));
  EXPECT_EQ(FloatToFloat16Bits(65519.0f), 0x7BFF);
  EXPECT_EQ(FloatToFloat16Bits(65520.0f), 0x7C00);
  EXPECT_EQ(FloatToFloat16Bits(-std::nanf("")), 0xFE00);
  EXPECT_EQ(FloatToFloat16Bits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even zero
  EXPECT_EQ(FloatToFloat16Bits(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(FloatToBFloat16Bits(-std::nanf("")), 0x7FC0);
  EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(0x3F808000u)), 0x3F80);  // tie: even
  EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(0x3F818000u)), 0x3F82);  // tie: up to even
  EXPECT_EQ(FloatToBFloat16Bits(std::bit_cast<float>(0x7F7FFFFFu)), 0x7F80);  // overflow: inf
}

TEST(FloatFormatsTest, E8M0) {
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(1.0f), 0x7F);
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(1.49f), 0x7F);
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(1.5f), 0x80);  // tie rounds up for a normal float
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(1.75f), 0x80);
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(-4.0f), 0x81);  // sign ignored
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(0.0f), 0x00);
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(std::bit_cast<float>(0x00400000u)), 0x00);  // 2^-127 tie
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(std::bit_cast<float>(0x00600000u)), 0x01);
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(std::ldexp(1.5f, 127)), 0xFF);  // rounds past 2^127
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(INFINITY), 0xFF);
  EXPECT_EQ(FloatToFloat8E8M0FNUBits(std::nanf("")), 0xFF);
  EXPECT_EQ(Float8E8M0FNUBitsToFloat(0x00), std::ldexp(1.0f, -127));
  EXPECT_EQ(Float8E8M0FNUBitsToFloat(0x7F), 1.0f);
  EXPECT_EQ(Float8E8M0FNUBitsToFloat(0xFE), std::ldexp(1.0f, 127));
  EXPECT_TRUE(std::isnan(Float8E8M0FNUBitsToFloat(0xFF)));
  for (int bits = 0; bits < 256; ++bits) {
    const float v = Float8E8M0FNUBitsToFloat(static_cast<uint8_t>(bits));
    if (bits == 0xFF) continue;
    EXPECT_EQ(v, std::ldexp(1.0f, bits - 127)) << bits;
    EXPECT_EQ(FloatToFloat8E8M0FNUBits(v), bits) << bits;
  }
}

}  // namespace
}  // namespace sp
