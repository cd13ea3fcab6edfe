#include "shardpoint/plan/plan_codec.h"

#include <gtest/gtest.h>

#include <random>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/plan/plan_test_util.h"

namespace sp {
namespace {

using ::sp::testing::Tensor;

void ExpectEqual(const LocalSavePlan& a, const LocalSavePlan& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
    EXPECT_EQ(a.tensors[i].dtype, b.tensors[i].dtype);
    EXPECT_EQ(a.tensors[i].shape, b.tensors[i].shape);
    EXPECT_EQ(a.tensors[i].boxes, b.tensors[i].boxes);
  }
  ASSERT_EQ(a.objects.size(), b.objects.size());
  for (size_t i = 0; i < a.objects.size(); ++i) {
    EXPECT_EQ(a.objects[i].name, b.objects[i].name);
    EXPECT_EQ(a.objects[i].encoding, b.objects[i].encoding);
    EXPECT_EQ(a.objects[i].payload, b.objects[i].payload);
  }
}

LocalSavePlan SampleLocalPlan() {
  LocalSavePlan plan;
  plan.tensors = {Tensor("model.layers.0.mlp.w1", DType::kBFloat16, {4096, 1024},
                         {Box({0, 0}, {2048, 1024}), Box({2048, 512}, {0, 0})}),
                  Tensor("optim.state.step", DType::kInt64, {}, {Box({}, {})}),
                  Tensor("", DType::kFloat8E8M0FNU, {0}, {}),
                  Tensor("odd", DType::kComplex128, {-3, int64_t{1} << 62}, {Box({1}, {2, 3})})};
  plan.objects = {{"optim.param_groups.0.lr", ObjectEncoding::kJson, "0.001"},
                  {"blob", ObjectEncoding::kBytes, std::string("\0\xff\x01", 3)},
                  {"obj", ObjectEncoding::kPickle, ""},
                  {"betas", ObjectEncoding::kPlain, std::string("\x80\x02G?\xe0\x00\x00\x00\x00\x00\x00\x85.", 14)}};
  return plan;
}

RankSavePlan SampleRankPlan() {
  RankSavePlan plan;
  plan.files = {3, 4, 9};
  plan.writes = {{0, 1, 3, 7, 2, 0, 4096},
                 {5, 0, 4, 8, 0, 4096, uint64_t{1} << 40},
                 {0xFFFFFFFF, 2, 9, 1, 0xFFFFFFFF, ~uint64_t{0}, 0}};
  return plan;
}

// Re-seals a body (magic + contents) with a correct checksum: tests the parser behind the CRC.
std::string Sealed(std::string body) {
  const uint32_t crc = Crc32c(body);
  ByteWriter(&body).PutU32(crc);
  return body;
}

TEST(PlanCodecTest, LocalSavePlanRoundTrip) {
  const LocalSavePlan plan = SampleLocalPlan();
  Result<LocalSavePlan> decoded = DecodeLocalSavePlan(EncodeLocalSavePlan(plan));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectEqual(plan, *decoded);
  Result<LocalSavePlan> empty = DecodeLocalSavePlan(EncodeLocalSavePlan(LocalSavePlan{}));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(empty->tensors.empty() && empty->objects.empty());
}

TEST(PlanCodecTest, RankSavePlanRoundTrip) {
  const RankSavePlan plan = SampleRankPlan();
  Result<RankSavePlan> decoded = DecodeRankSavePlan(EncodeRankSavePlan(plan));
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, plan);
  Result<RankSavePlan> empty = DecodeRankSavePlan(EncodeRankSavePlan(RankSavePlan{}));
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, RankSavePlan{});
}

// A rank's writes of one chunk per tensor, back to back in its file, take a few bytes each: the
// steps of their indices and offsets are small. Random plans, with numbers anywhere in their
// ranges, round-trip exactly.
TEST(PlanCodecTest, RankSavePlansTakeFewBytesAWriteAndRoundTripAnyNumbers) {
  RankSavePlan plan;
  plan.files = {517};
  uint64_t offset = 0;
  for (uint32_t t = 0; t < 1000; ++t) {
    const uint64_t length = 4096 * (1 + t % 5);
    plan.writes.push_back({t, 0, 517, t, 517, offset, length});
    offset += length;
  }
  const std::string bytes = EncodeRankSavePlan(plan);
  EXPECT_LT(bytes.size(), 1000u * 9) << bytes.size();  // 36 bytes a write at fixed width
  EXPECT_EQ(DecodeRankSavePlan(bytes).value(), plan);
  std::mt19937_64 rng(41);
  const auto any32 = [&] {
    const uint32_t edges[] = {0, 1, 0x7FFFFFFF, 0xFFFFFFFE, 0xFFFFFFFF};
    return rng() % 2 ? edges[rng() % 5] : static_cast<uint32_t>(rng());
  };
  for (int trial = 0; trial < 200; ++trial) {
    RankSavePlan random;
    for (int f = static_cast<int>(rng() % 4); f > 0; --f) random.files.push_back(any32());
    for (int w = static_cast<int>(rng() % 20); w > 0; --w) {
      const uint64_t offset = rng() % 3 ? rng() % 100000 : rng();
      const uint64_t length = rng() % 3 ? rng() % 999 : rng();
      random.writes.push_back({any32(), any32(), any32(), any32(), any32(), offset, length});
    }
    Result<RankSavePlan> back = DecodeRankSavePlan(EncodeRankSavePlan(random));
    ASSERT_TRUE(back.ok()) << back.status();
    ASSERT_EQ(*back, random) << trial;
  }
  // A step that leaves 32 bits names the field.
  std::string body;
  ByteWriter w(&body);
  w.PutU32(DecodeFixed32(bytes.data()));  // the magic
  w.PutVarint(1);
  w.PutSignedVarint(-1);
  w.PutVarint(0);
  const Result<RankSavePlan> forged = DecodeRankSavePlan(Sealed(body));
  ASSERT_FALSE(forged.ok());
  EXPECT_EQ(forged.status().message(),
            "rank save plan of 11 bytes: file 0 + -1 out of range at byte 5");
}

TEST(PlanCodecTest, EveryTruncationIsDataLoss) {
  const std::string local = EncodeLocalSavePlan(SampleLocalPlan());
  for (size_t n = 0; n < local.size(); ++n) {
    Result<LocalSavePlan> r = DecodeLocalSavePlan(std::string_view(local).substr(0, n));
    ASSERT_FALSE(r.ok()) << "length " << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  }
  const std::string rank = EncodeRankSavePlan(SampleRankPlan());
  for (size_t n = 0; n < rank.size(); ++n) {
    Result<RankSavePlan> r = DecodeRankSavePlan(std::string_view(rank).substr(0, n));
    ASSERT_FALSE(r.ok()) << "length " << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  }
}

TEST(PlanCodecTest, EveryBitFlipIsDataLoss) {
  const std::string local = EncodeLocalSavePlan(SampleLocalPlan());
  for (size_t bit = 0; bit < local.size() * 8; ++bit) {
    std::string bad = local;
    bad[bit / 8] = static_cast<char>(bad[bit / 8] ^ (1 << (bit % 8)));
    Result<LocalSavePlan> r = DecodeLocalSavePlan(bad);
    ASSERT_FALSE(r.ok()) << "bit " << bit;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  }
  const std::string rank = EncodeRankSavePlan(SampleRankPlan());
  for (size_t bit = 0; bit < rank.size() * 8; ++bit) {
    std::string bad = rank;
    bad[bit / 8] = static_cast<char>(bad[bit / 8] ^ (1 << (bit % 8)));
    ASSERT_FALSE(DecodeRankSavePlan(bad).ok()) << "bit " << bit;
  }
}

TEST(PlanCodecTest, MessagesAreNotInterchangeable) {
  Result<RankSavePlan> r = DecodeRankSavePlan(EncodeLocalSavePlan(SampleLocalPlan()));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("bad magic"), std::string::npos) << r.status();
}

TEST(PlanCodecTest, HostileBodiesWithValidChecksumAreDataLoss) {
  const std::string magic = EncodeLocalSavePlan(LocalSavePlan{}).substr(0, 4);
  auto decode = [](std::string body) { return DecodeLocalSavePlan(Sealed(std::move(body))); };
  // A tensor count of 2^32 - 1 with nothing behind it: refused before any allocation.
  Result<LocalSavePlan> r = decode(magic + std::string("\xff\xff\xff\xff", 4));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("cannot fit"), std::string::npos) << r.status();
  // One tensor named "t" with dtype code 99.
  std::string body = magic;
  ByteWriter w(&body);
  w.PutU32(1);
  w.PutString("t");
  w.PutU8(99);
  w.PutU32(0);
  w.PutU32(0);
  w.PutU32(0);
  r = decode(body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "local save plan of 30 bytes: tensor 't' has unknown dtype code 99");
  // An object with encoding 7.
  body = magic;
  w.PutU32(0);
  w.PutU32(1);
  w.PutString("o");
  w.PutU8(7);
  w.PutString("x");
  r = decode(body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "local save plan of 27 bytes: object 'o' has unknown encoding 7");
  // Trailing bytes after a valid plan.
  body = magic;
  w.PutU32(0);
  w.PutU32(0);
  w.PutU8(0);
  r = decode(body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "local save plan of 17 bytes: 1 unexpected trailing bytes at byte 12");
}

TEST(PlanCodecTest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(3);
  const std::string local = EncodeLocalSavePlan(SampleLocalPlan());
  const std::string rank = EncodeRankSavePlan(SampleRankPlan());
  for (int trial = 0; trial < 20000; ++trial) {
    // Mutate a valid body, then re-seal so the parser (not the checksum) sees the damage.
    const std::string& base = trial % 2 ? local : rank;
    std::string body = base.substr(0, base.size() - 4);
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits && !body.empty(); ++e) {
      const size_t pos = rng() % body.size();
      switch (rng() % 3) {
        case 0:
          body[pos] = static_cast<char>(rng());
          break;
        case 1:
          body.erase(pos, 1 + rng() % 8);
          break;
        default:
          body.insert(pos, std::string(1 + rng() % 8, static_cast<char>(rng())));
      }
    }
    Result<LocalSavePlan> a = DecodeLocalSavePlan(Sealed(body));
    Result<RankSavePlan> b = DecodeRankSavePlan(Sealed(body));
    if (!a.ok()) {
      EXPECT_EQ(a.status().code(), StatusCode::kDataLoss);
    }
    if (!b.ok()) {
      EXPECT_EQ(b.status().code(), StatusCode::kDataLoss);
    }
  }
}

}  // namespace
}  // namespace sp
