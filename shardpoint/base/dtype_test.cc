#include "shardpoint/base/dtype.h"

#include <set>

#include <gtest/gtest.h>

namespace sp {
namespace {

TEST(DTypeTest, EveryDTypeRoundTripsThroughItsNames) {
  EXPECT_EQ(AllDTypes().size(), 20u);
  std::set<std::string_view> st_names;
  for (DType d : AllDTypes()) {
    EXPECT_EQ(*ParseDType(DTypeName(d)), d) << DTypeName(d);
    EXPECT_EQ(*ParseDType("torch." + std::string(DTypeName(d))), d);
    EXPECT_EQ(*DTypeFromSafetensorsName(DTypeSafetensorsName(d)), d);
    EXPECT_EQ(*DTypeFromCode(DTypeCode(d)), d);
    EXPECT_TRUE(st_names.insert(DTypeSafetensorsName(d)).second);
  }
}

TEST(DTypeTest, SizesMatchTorch) {
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kComplex64), 8u);
  EXPECT_EQ(DTypeSize(DType::kComplex128), 16u);
  EXPECT_EQ(DTypeSize(DType::kFloat8E8M0FNU), 1u);
  EXPECT_EQ(DTypeSize(DType::kUInt64), 8u);
}

TEST(DTypeTest, AliasesAndErrors) {
  EXPECT_EQ(*ParseDType("float"), DType::kFloat32);
  EXPECT_EQ(*ParseDType("half"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBFloat16);
  Result<DType> bad = ParseDType("float7");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "unknown dtype \"float7\"");
  EXPECT_EQ(DTypeFromCode(0).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(DTypeFromCode(21).status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace sp
