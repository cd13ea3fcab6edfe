#include "shardpoint/base/coding.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

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

// Expects kDataLoss with a message that holds `fragment`.
void ExpectDataLoss(const Status& s, std::string_view fragment) {
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s;
}

TEST(CodingTest, VarintsRoundTripWithTheirLengthsAndZigZagsOrder) {
  const struct {
    uint64_t value;
    size_t bytes;
  } cases[] = {{0, 1},         {1, 1},           {127, 1},          {128, 2},
               {16383, 2},     {16384, 3},       {1ull << 35, 6},   {(1ull << 63) - 1, 9},
               {1ull << 63, 10}, {UINT64_MAX, 10}};
  for (const auto& c : cases) {
    std::string buf;
    ByteWriter w(&buf);
    w.PutVarint(c.value);
    EXPECT_EQ(buf.size(), c.bytes) << c.value;
    ByteReader r(buf, "v");
    EXPECT_EQ(*r.ReadVarint(), c.value);
    EXPECT_TRUE(r.done());
  }
  // Zigzag: 0, -1, 1, -2, 2 ... as 0, 1, 2, 3, 4 ...
  const int64_t order[] = {0, -1, 1, -2, 2};
  for (uint64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(ZigZag(order[i]), i);
    EXPECT_EQ(UnZigZag(i), order[i]);
  }
  EXPECT_EQ(ZigZag(INT64_MIN), UINT64_MAX);
  EXPECT_EQ(ZigZag(INT64_MAX), UINT64_MAX - 1);
  // Random values of every magnitude, one after another in one buffer.
  std::mt19937_64 rng(7);
  std::vector<int64_t> values;
  std::string buf;
  ByteWriter w(&buf);
  for (int i = 0; i < 2000; ++i) {
    const int64_t v = static_cast<int64_t>(rng() >> (rng() % 64));
    values.push_back(i % 2 == 0 ? v : -v);
    w.PutSignedVarint(values.back());
  }
  ByteReader r(buf, "v");
  for (int64_t v : values) EXPECT_EQ(*r.ReadSignedVarint(), v);
  EXPECT_TRUE(r.done());
}

TEST(CodingTest, BadVarintsAreDataLossNamingThePlace) {
  auto read = [](std::string_view bytes) {
    ByteReader r(bytes, "tensor \"w\"");
    return r.ReadVarint().status();
  };
  // Cut off, past 64 bits in the tenth byte, and eleven bytes long.
  ExpectDataLoss(read(std::string("\x80\x80", 2)),
                 "tensor \"w\": varint at byte 0 is cut off by the end of the input");
  ExpectDataLoss(read(std::string(9, '\xff') + "\x02"),
                 "tensor \"w\": varint at byte 0 does not fit in 64 bits");
  ExpectDataLoss(read(std::string(10, '\x80') + "\x01"), "does not fit in 64 bits");
  const std::string widest = std::string(9, '\xff') + "\x01";
  ByteReader widest_reader(widest, "x");
  EXPECT_EQ(*widest_reader.ReadVarint(), UINT64_MAX);
  // A count is checked against the bytes left, and against 32 bits.
  std::string buf;
  ByteWriter w(&buf);
  w.PutVarint(3);
  w.PutRaw("abcdef");
  ByteReader fits(buf, "x");
  EXPECT_EQ(*fits.ReadVarintCount(2), 3u);
  ByteReader too_many(buf, "list");
  ExpectDataLoss(too_many.ReadVarintCount(3).status(),
                 "list: count 3 at byte 0 cannot fit in the 6 remaining bytes");
  std::string big;
  ByteWriter(&big).PutVarint(1ull << 32);
  ByteReader wide(big, "x");
  EXPECT_EQ(wide.ReadVarintCount(0).status().code(), StatusCode::kDataLoss);
}

// Indices as steps from the one before: a rising list takes a byte each, any 32-bit values
// round-trip, and a step that leaves [0, 2^32) names the field, the sum and the byte.
TEST(CodingTest, IndexStepsRoundTripAndRefuseIndicesOutside32Bits) {
  const std::vector<uint32_t> rising = {0, 1, 2, 5, 5, 6, 40, 41};
  std::string buf;
  ByteWriter w(&buf);
  int64_t previous = 0;
  for (uint32_t index : rising) w.PutIndexStep(index, &previous);
  EXPECT_EQ(buf.size(), rising.size());
  const std::vector<uint32_t> edges = {UINT32_MAX, 0, UINT32_MAX, UINT32_MAX - 1, 1u << 31, 7};
  for (uint32_t index : edges) w.PutIndexStep(index, &previous);
  ByteReader r(buf, "x");
  previous = 0;
  for (uint32_t index : rising) EXPECT_EQ(*r.ReadIndexStep("file", &previous), index);
  for (uint32_t index : edges) EXPECT_EQ(*r.ReadIndexStep("file", &previous), index);
  EXPECT_TRUE(r.done());
  std::string bad;
  ByteWriter b(&bad);
  b.PutSignedVarint(3);
  b.PutSignedVarint(-4);
  b.PutSignedVarint(INT64_MAX);
  ByteReader below(bad, "report");
  previous = 0;
  EXPECT_EQ(*below.ReadIndexStep("chunk", &previous), 3u);
  ExpectDataLoss(below.ReadIndexStep("chunk", &previous).status(),
                 "report: chunk 3 + -4 out of range at byte 1");
  ByteReader above(bad, "report");
  previous = 5;
  EXPECT_EQ(*above.ReadIndexStep("chunk", &previous), 8u);
  EXPECT_EQ(*above.ReadIndexStep("chunk", &previous), 4u);
  ExpectDataLoss(above.ReadIndexStep("chunk", &previous).status(),
                 "report: chunk 4 + 9223372036854775807 out of range at byte 2");
}

}  // namespace
}  // namespace sp
