#include "shardpoint/base/coding.h"

#include <gtest/gtest.h>

namespace sp {
namespace {

TEST(CodingTest, RoundTrip) {
  std::string buf;
  ByteWriter w(&buf);
  w.PutU8(7);
  w.PutU32(0xDEADBEEF);
  w.PutU64(0x0123456789ABCDEFull);
  w.PutI64(-5);
  w.PutString("model.layers.0.w");
  ByteReader r(buf, "test");
  EXPECT_EQ(*r.ReadU8(), 7);
  EXPECT_EQ(*r.ReadU32(), 0xDEADBEEFu);
  EXPECT_EQ(*r.ReadU64(), 0x0123456789ABCDEFull);
  EXPECT_EQ(*r.ReadI64(), -5);
  EXPECT_EQ(*r.ReadString(), "model.layers.0.w");
  EXPECT_TRUE(r.done());
}

TEST(CodingTest, TruncatedInputIsDataLossNamingTheInput) {
  std::string buf("\x05\x00\x00\x00" "ab", 6);
  ByteReader r(buf, "metadata of /ckpt");
  Result<std::string_view> s = r.ReadString();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(s.status().message().find("metadata of /ckpt: truncated"), std::string::npos);
}

TEST(CodingTest, AbsurdCountsAreRejectedBeforeAllocation) {
  std::string buf("\xff\xff\xff\x7f", 4);
  ByteReader r(buf, "x");
  EXPECT_EQ(r.ReadCount(8).status().code(), StatusCode::kDataLoss);
  ByteReader r2(buf, "x");
  EXPECT_EQ(r2.ReadString(100).status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace sp
