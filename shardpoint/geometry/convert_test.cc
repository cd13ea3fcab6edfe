#include "shardpoint/geometry/convert.h"

#include <bit>
#include <cmath>
#include <complex>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "shardpoint/geometry/float_formats.h"

namespace sp {
namespace {

bool IsComplexType(DType d) { return d == DType::kComplex64 || d == DType::kComplex128; }
bool IsIntegerType(DType d) {
  switch (d) {
    case DType::kUInt8: case DType::kInt8: case DType::kInt16: case DType::kInt32:
    case DType::kInt64: case DType::kUInt16: case DType::kUInt32: case DType::kUInt64:
      return true;
    default:
      return false;
  }
}
bool IsSignedType(DType d) {
  return d == DType::kInt8 || d == DType::kInt16 || d == DType::kInt32 || d == DType::kInt64;
}

// The exact value of one element (long double holds every int64, uint64 and double exactly).
long double ExactValue(DType d, const std::byte* p) {
  uint64_t raw = 0;
  std::memcpy(&raw, p, DTypeSize(d));
  const int bits = static_cast<int>(DTypeSize(d) * 8);
  switch (d) {
    case DType::kBool: return raw != 0;
    case DType::kFloat16: return Float16BitsToFloat(static_cast<uint16_t>(raw));
    case DType::kBFloat16: return BFloat16BitsToFloat(static_cast<uint16_t>(raw));
    case DType::kFloat8E4M3FN: return Float8E4M3FNBitsToFloat(static_cast<uint8_t>(raw));
    case DType::kFloat8E5M2: return Float8E5M2BitsToFloat(static_cast<uint8_t>(raw));
    case DType::kFloat8E4M3FNUZ: return Float8E4M3FNUZBitsToFloat(static_cast<uint8_t>(raw));
    case DType::kFloat8E5M2FNUZ: return Float8E5M2FNUZBitsToFloat(static_cast<uint8_t>(raw));
    case DType::kFloat8E8M0FNU: return Float8E8M0FNUBitsToFloat(static_cast<uint8_t>(raw));
    case DType::kFloat32: return std::bit_cast<float>(static_cast<uint32_t>(raw));
    case DType::kFloat64: return std::bit_cast<double>(raw);
    default: break;
  }
  if (IsSignedType(d) && bits < 64 && (raw >> (bits - 1)) & 1) {
    return static_cast<long double>(static_cast<int64_t>(raw | (~uint64_t{0} << bits)));
  }
  if (IsSignedType(d)) return static_cast<long double>(static_cast<int64_t>(raw));
  return static_cast<long double>(raw);
}

// Reference: the bytes torch's cast would produce for exact value x from a `from` element.
std::vector<std::byte> ReferenceCast(DType from, long double x, DType to) {
  std::vector<std::byte> out(DTypeSize(to));
  uint64_t raw = 0;
  if (to == DType::kBool) {
    raw = (x != 0) ? 1 : 0;
  } else if (IsIntegerType(to)) {
    __int128 wide;
    if (IsIntegerType(from) || from == DType::kBool) {
      wide = static_cast<__int128>(x);
    } else if (std::isnan(x)) {
      wide = 0;
    } else {
      const long double t = std::trunc(x);
      const long double two63 = 9223372036854775808.0L;
      if (to == DType::kUInt64 && t >= two63) {
        wide = t >= 2 * two63 ? static_cast<__int128>(~uint64_t{0}) : static_cast<__int128>(t);
      } else {
        wide = t >= two63 ? INT64_MAX : (t < -two63 ? INT64_MIN : static_cast<__int128>(t));
      }
    }
    raw = static_cast<uint64_t>(wide);  // wraps modulo 2^64; the store keeps the low bytes
  } else if (to == DType::kFloat64) {
    raw = std::bit_cast<uint64_t>(static_cast<double>(x));
  } else {
    const float f = static_cast<float>(x);  // one rounding from the exact value
    switch (to) {
      case DType::kFloat32: raw = std::bit_cast<uint32_t>(f); break;
      case DType::kFloat16: raw = FloatToFloat16Bits(f); break;
      case DType::kBFloat16: raw = FloatToBFloat16Bits(f); break;
      case DType::kFloat8E4M3FN: raw = FloatToFloat8E4M3FNBits(f); break;
      case DType::kFloat8E5M2: raw = FloatToFloat8E5M2Bits(f); break;
      case DType::kFloat8E4M3FNUZ: raw = FloatToFloat8E4M3FNUZBits(f); break;
      case DType::kFloat8E5M2FNUZ: raw = FloatToFloat8E5M2FNUZBits(f); break;
      case DType::kFloat8E8M0FNU: raw = FloatToFloat8E8M0FNUBits(f); break;
      default: ADD_FAILURE() << "unexpected dtype"; break;
    }
  }
  std::memcpy(out.data(), &raw, out.size());
  return out;
}

// Sample elements of `d`: edge values and random bit patterns.
std::vector<std::byte> Samples(DType d, std::mt19937_64& rng, int* count) {
  const size_t size = DTypeSize(d);
  std::vector<uint64_t> raws = {0, 1, ~uint64_t{0}, uint64_t{1} << (size * 8 - 1),
                                (uint64_t{1} << (size * 8 - 1)) - 1};
  if (d == DType::kFloat32) {
    for (float f : {1.5f, -2.75f, 0.3f, -0.0f, 3.9999f, -3.7f, 255.5f, 300.0f, -1.0f, 1e10f, 3e19f,
                    -1e20f, 65520.0f, INFINITY, -INFINITY, std::nanf("")}) {
      raws.push_back(std::bit_cast<uint32_t>(f));
    }
  }
  if (d == DType::kFloat64) {
    for (double f : {1.5, -2.75, 0.1, -0.0, 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40),
                     1.8e19, 9.3e18, -9.3e18, 1e300, -HUGE_VAL, std::nan("")}) {
      raws.push_back(std::bit_cast<uint64_t>(f));
    }
  }
  for (int i = 0; i < 300; ++i) raws.push_back(rng());
  if (d == DType::kBool) raws = {0, 1};
  std::vector<std::byte> out(raws.size() * size);
  for (size_t i = 0; i < raws.size(); ++i) std::memcpy(&out[i * size], &raws[i], size);
  *count = static_cast<int>(raws.size());
  return out;
}

TEST(ConvertTest, EveryRealPairMatchesReference) {
  std::mt19937_64 rng(17);
  for (DType from : AllDTypes()) {
    if (IsComplexType(from)) continue;
    int count = 0;
    const std::vector<std::byte> src = Samples(from, rng, &count);
    for (DType to : AllDTypes()) {
      if (IsComplexType(to)) continue;
      std::vector<std::byte> dst(count * DTypeSize(to));
      ASSERT_TRUE(ConvertElements(from, src.data(), to, dst.data(), count).ok());
      for (int i = 0; i < count; ++i) {
        const std::byte* element = &src[i * DTypeSize(from)];
        const long double x = ExactValue(from, element);
        std::vector<std::byte> expected =
            from == to ? std::vector<std::byte>(element, element + DTypeSize(to))
                       : ReferenceCast(from, x, to);
        const std::vector<std::byte> got(dst.begin() + i * DTypeSize(to),
                                         dst.begin() + (i + 1) * DTypeSize(to));
        if (to == DType::kFloat32 || to == DType::kFloat64) {
          // NaN payloads follow the hardware; compare NaN-ness there.
          const long double g = ExactValue(to, got.data());
          const long double e = ExactValue(to, expected.data());
          if (std::isnan(e)) {
            ASSERT_TRUE(std::isnan(g)) << DTypeName(from) << "->" << DTypeName(to);
            continue;
          }
        }
        ASSERT_EQ(got, expected) << DTypeName(from) << " -> " << DTypeName(to) << " element "
                                 << i << " value " << static_cast<double>(x);
      }
    }
  }
}

template <typename From, typename To>
To ConvertOne(DType from, From value, DType to) {
  To out{};
  Status status = ConvertElements(from, &value, to, &out, 1);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

TEST(ConvertTest, TorchSemanticsSpotChecks) {
  EXPECT_EQ((ConvertOne<float, int32_t>(DType::kFloat32, -3.7f, DType::kInt32)), -3);
  EXPECT_EQ((ConvertOne<float, int32_t>(DType::kFloat32, 3.99f, DType::kInt32)), 3);
  EXPECT_EQ((ConvertOne<float, uint8_t>(DType::kFloat32, -1.0f, DType::kUInt8)), 255);
  EXPECT_EQ((ConvertOne<float, uint8_t>(DType::kFloat32, 300.0f, DType::kUInt8)), 44);
  EXPECT_EQ((ConvertOne<float, int64_t>(DType::kFloat32, std::nanf(""), DType::kInt64)), 0);
  EXPECT_EQ((ConvertOne<float, int64_t>(DType::kFloat32, 1e20f, DType::kInt64)), INT64_MAX);
  EXPECT_EQ((ConvertOne<double, uint64_t>(DType::kFloat64, 1.8e19, DType::kUInt64)),
            18000000000000000000ull);
  EXPECT_EQ((ConvertOne<uint8_t, float>(DType::kBool, 1, DType::kFloat32)), 1.0f);
  EXPECT_EQ((ConvertOne<float, uint8_t>(DType::kFloat32, 0.5f, DType::kBool)), 1);
  EXPECT_EQ((ConvertOne<float, uint8_t>(DType::kFloat32, -0.0f, DType::kBool)), 0);
  EXPECT_EQ((ConvertOne<float, uint8_t>(DType::kFloat32, std::nanf(""), DType::kBool)), 1);
  EXPECT_EQ((ConvertOne<int32_t, int8_t>(DType::kInt32, 300, DType::kInt8)), 44);
  EXPECT_EQ((ConvertOne<int8_t, uint16_t>(DType::kInt8, -1, DType::kUInt16)), 0xFFFF);
  EXPECT_EQ((ConvertOne<int64_t, double>(DType::kInt64, (int64_t{1} << 53) + 1, DType::kFloat64)),
            9007199254740992.0);
  EXPECT_EQ((ConvertOne<uint16_t, float>(DType::kBFloat16, 0x3FC0, DType::kFloat32)), 1.5f);
  EXPECT_EQ((ConvertOne<float, uint8_t>(DType::kFloat32, 448.0f, DType::kFloat8E4M3FN)), 0x7E);
  EXPECT_EQ((ConvertOne<uint8_t, uint16_t>(DType::kFloat8E5M2, 0x3C, DType::kFloat16)), 0x3C00);
}

TEST(ConvertTest, Float64GoesThroughFloat32LikeC10) {
  // 1 + 2^-11 + 2^-40 rounds directly to float16 1 + 2^-10, but c10 first rounds to float32
  // (1 + 2^-11, a float16 tie) and then to even: 1.0.
  const double x = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  EXPECT_EQ((ConvertOne<double, uint16_t>(DType::kFloat64, x, DType::kFloat16)), 0x3C00);
}

TEST(ConvertTest, ExhaustiveHalfAndBFloat16ThroughFloat32) {
  for (DType half : {DType::kFloat16, DType::kBFloat16}) {
    std::vector<uint16_t> patterns(65536);
    for (uint32_t i = 0; i < 65536; ++i) patterns[i] = static_cast<uint16_t>(i);
    std::vector<float> wide(65536);
    std::vector<uint16_t> back(65536);
    ASSERT_TRUE(ConvertElements(half, patterns.data(), DType::kFloat32, wide.data(), 65536).ok());
    ASSERT_TRUE(ConvertElements(DType::kFloat32, wide.data(), half, back.data(), 65536).ok());
    for (uint32_t i = 0; i < 65536; ++i) {
      if (std::isnan(wide[i])) {
        ASSERT_TRUE(std::isnan(half == DType::kFloat16 ? Float16BitsToFloat(back[i])
                                                       : BFloat16BitsToFloat(back[i])));
        continue;
      }
      ASSERT_EQ(back[i], patterns[i]) << DTypeName(half) << " pattern " << i;
    }
  }
}

TEST(ConvertTest, ExhaustiveFloat8ThroughFloat32AndFloat64) {
  for (DType f8 : {DType::kFloat8E4M3FN, DType::kFloat8E5M2, DType::kFloat8E4M3FNUZ,
                   DType::kFloat8E5M2FNUZ, DType::kFloat8E8M0FNU}) {
    std::vector<uint8_t> patterns(256);
    for (int i = 0; i < 256; ++i) patterns[i] = static_cast<uint8_t>(i);
    std::vector<double> wide(256);
    std::vector<uint8_t> back(256);
    ASSERT_TRUE(ConvertElements(f8, patterns.data(), DType::kFloat64, wide.data(), 256).ok());
    ASSERT_TRUE(ConvertElements(DType::kFloat64, wide.data(), f8, back.data(), 256).ok());
    int nans = 0;
    for (int i = 0; i < 256; ++i) {
      if (std::isnan(wide[i])) {
        ++nans;
        std::vector<double> again(1);
        ASSERT_TRUE(ConvertElements(f8, &back[i], DType::kFloat64, again.data(), 1).ok());
        EXPECT_TRUE(std::isnan(again[0])) << DTypeName(f8) << " " << i;
        continue;
      }
      ASSERT_EQ(back[i], patterns[i]) << DTypeName(f8) << " pattern " << i;
    }
    const int expected_nans = f8 == DType::kFloat8E4M3FN ? 2 : f8 == DType::kFloat8E5M2 ? 6 : 1;
    EXPECT_EQ(nans, expected_nans) << DTypeName(f8);
  }
}

TEST(ConvertTest, Complex) {
  const std::complex<float> in[2] = {{1.5f, -2.0f}, {0.1f, 3e38f}};
  std::complex<double> wide[2];
  ASSERT_TRUE(ConvertElements(DType::kComplex64, in, DType::kComplex128, wide, 2).ok());
  EXPECT_EQ(wide[0], std::complex<double>(1.5, -2.0));
  EXPECT_EQ(wide[1], std::complex<double>(0.1f, 3e38f));
  const std::complex<double> narrow_in[1] = {{0.1, 1e300}};
  std::complex<float> narrow[1];
  ASSERT_TRUE(ConvertElements(DType::kComplex128, narrow_in, DType::kComplex64, narrow, 1).ok());
  EXPECT_EQ(narrow[0].real(), 0.1f);
  EXPECT_TRUE(std::isinf(narrow[0].imag()));

  float f = 0;
  Status status = ConvertElements(DType::kComplex64, in, DType::kFloat32, &f, 1);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "cannot cast complex64 to float32");
  status = ConvertElements(DType::kBool, &f, DType::kComplex128, wide, 1);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "cannot cast bool to complex128");
  EXPECT_FALSE(CanConvert(DType::kInt8, DType::kComplex64));
  EXPECT_TRUE(CanConvert(DType::kComplex128, DType::kComplex64));
  EXPECT_TRUE(CanConvert(DType::kFloat8E8M0FNU, DType::kBool));
}

TEST(ConvertTest, SameTypeCopiesBitsUnchanged) {
  const uint32_t nan_with_payload = 0x7FA12345;
  uint32_t out = 0;
  ASSERT_TRUE(ConvertElements(DType::kFloat32, &nan_with_payload, DType::kFloat32, &out, 1).ok());
  EXPECT_EQ(out, nan_with_payload);
}

TEST(ConvertTest, Errors) {
  float f = 0;
  Status status = ConvertElements(DType::kFloat32, &f, DType::kFloat16, &f, -1);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("-1"), std::string::npos);
  EXPECT_EQ(ConvertElements(DType::kFloat32, nullptr, DType::kFloat16, &f, 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(ConvertElements(DType::kFloat32, nullptr, DType::kFloat16, nullptr, 0).ok());
}

}  // namespace
}  // namespace sp
