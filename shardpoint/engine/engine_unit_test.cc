// Unit tests for the engine's internal pieces: the save messages and verified chunk reads.
#include <random>

#include <gtest/gtest.h>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/chunk_reader.h"
#include "shardpoint/engine/save_messages.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

RankWriteOrder SampleOrder() {
  RankWriteOrder order;
  order.plan.files = {0, 2};
  order.plan.writes.push_back(ChunkWrite{1, 0, 2, 5, 3, 4096, 128});
  order.files.push_back(FileOrder{0, "d-abc-r00001-f000.safetensors", std::string(64, 'h'), 999});
  order.files.push_back(FileOrder{2, "d-abc-r00001-f001.safetensors", "", 8});
  return order;
}

TEST(SaveMessagesTest, RankWriteOrderRoundTrips) {
  RankWriteOrder order = SampleOrder();
  Result<RankWriteOrder> back = DecodeRankWriteOrder(EncodeRankWriteOrder(order));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->plan.files, order.plan.files);
  ASSERT_EQ(back->plan.writes.size(), 1u);
  EXPECT_EQ(back->plan.writes[0].data_offset, 4096u);
  EXPECT_EQ(back->plan.writes[0].chunk, 3u);
  ASSERT_EQ(back->files.size(), 2u);
  EXPECT_EQ(back->files[0].name, order.files[0].name);
  EXPECT_EQ(back->files[0].header, order.files[0].header);
  EXPECT_EQ(back->files[1].size, 8u);
}

TEST(SaveMessagesTest, WriteReportRoundTrips) {
  WriteReport report;
  report.chunks.push_back(ChunkReport{7, 1, {0xdeadbeef, 1, 2}});
  report.chunks.push_back(ChunkReport{0, 0, {}});
  report.files.push_back(FileReport{3, 4096, (uint64_t{1} << 40) + 4096});
  report.files.push_back(FileReport{0, 0, 0});
  Result<WriteReport> back = DecodeWriteReport(EncodeWriteReport(report));
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->chunks.size(), 2u);
  EXPECT_EQ(back->chunks[0].tensor, 7u);
  EXPECT_EQ(back->chunks[0].block_crc32c, (std::vector<uint32_t>{0xdeadbeef, 1, 2}));
  EXPECT_TRUE(back->chunks[1].block_crc32c.empty());
  EXPECT_EQ(back->files, report.files);
}

// A report of one chunk per tensor, each with one checksum, takes the checksum and a few bytes
// (16 at fixed width); a step past 32 bits is refused naming the field.
TEST(SaveMessagesTest, WriteReportsTakeFewBytesAChunkAndRefuseIndicesPast32Bits) {
  WriteReport report;
  for (uint32_t t = 0; t < 1000; ++t) report.chunks.push_back(ChunkReport{t, 8191, {t * 7919}});
  report.files.push_back(FileReport{8191, 4096, uint64_t{1} << 33});
  const std::string bytes = EncodeWriteReport(report);
  EXPECT_LT(bytes.size(), 1000u * 8) << bytes.size();
  Result<WriteReport> back = DecodeWriteReport(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_EQ(back->chunks.size(), 1000u);
  EXPECT_EQ(back->chunks[999].tensor, 999u);
  EXPECT_EQ(back->chunks[999].chunk, 8191u);
  EXPECT_EQ(back->chunks[999].block_crc32c, std::vector<uint32_t>{999 * 7919});
  EXPECT_EQ(back->files, report.files);
  std::string forged;
  ByteWriter w(&forged);
  w.PutVarint(1);
  w.PutSignedVarint(int64_t{1} << 32);
  EXPECT_EQ(DecodeWriteReport(forged).status().message(),
            "write report: tensor 0 + 4294967296 out of range at byte 1");
}

TEST(SaveMessagesTest, EveryTruncationAndTrailingBytesAreDataLoss) {
  const std::string order = EncodeRankWriteOrder(SampleOrder());
  for (size_t n = 0; n < order.size(); ++n) {
    EXPECT_EQ(DecodeRankWriteOrder(order.substr(0, n)).status().code(), StatusCode::kDataLoss) << n;
  }
  EXPECT_EQ(DecodeRankWriteOrder(order + "x").status().code(), StatusCode::kDataLoss);
  WriteReport report;
  report.chunks.push_back(ChunkReport{1, 2, {3, 4}});
  report.files.push_back(FileReport{5, 4096, 8192});
  const std::string encoded = EncodeWriteReport(report);
  for (size_t n = 0; n < encoded.size(); ++n) {
    EXPECT_EQ(DecodeWriteReport(encoded.substr(0, n)).status().code(), StatusCode::kDataLoss) << n;
  }
  EXPECT_EQ(DecodeWriteReport(encoded + "x").status().code(), StatusCode::kDataLoss);
}

TEST(SaveMessagesTest, PlanRequestsAndRepliesRoundTripAndRefuseUnknownKinds) {
  const PlanRequest request{PlanRequest::Kind::kCached, 0x0123456789abcdefull, "a1b2c3", "objects"};
  Result<PlanRequest> request_back = DecodePlanRequest(EncodePlanRequest(request));
  ASSERT_TRUE(request_back.ok()) << request_back.status();
  EXPECT_EQ(request_back->kind, PlanRequest::Kind::kCached);
  EXPECT_EQ(request_back->plan_id, 0x0123456789abcdefull);
  EXPECT_EQ(request_back->files_save_id, "a1b2c3");
  EXPECT_EQ(request_back->plan, "objects");
  const PlanReply reply{PlanReply::Kind::kFilesOnly, 42, "0123abcd", SampleOrder()};
  const std::string encoded = EncodePlanReply(reply);
  Result<PlanReply> reply_back = DecodePlanReply(encoded);
  ASSERT_TRUE(reply_back.ok()) << reply_back.status();
  EXPECT_EQ(reply_back->kind, PlanReply::Kind::kFilesOnly);
  EXPECT_EQ(reply_back->plan_id, 42u);
  EXPECT_EQ(reply_back->save_id, "0123abcd");
  EXPECT_EQ(reply_back->order.plan, reply.order.plan);
  ASSERT_EQ(reply_back->order.files.size(), 2u);
  EXPECT_EQ(reply_back->order.files[0].header, reply.order.files[0].header);
  for (size_t n = 0; n < encoded.size(); ++n) {
    EXPECT_EQ(DecodePlanReply(encoded.substr(0, n)).status().code(), StatusCode::kDataLoss) << n;
  }
  for (size_t n = 0; n < 9 + 4 + 6; ++n) {
    EXPECT_EQ(DecodePlanRequest(EncodePlanRequest(request).substr(0, n)).status().code(),
              StatusCode::kDataLoss) << n;
  }
  std::string unknown = EncodePlanRequest(request);
  unknown[0] = 4;
  Status status = DecodePlanRequest(unknown).status();
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "plan request: unknown kind 4");
  unknown = encoded;
  unknown[0] = 7;
  status = DecodePlanReply(unknown).status();
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "plan reply: unknown kind 7");
  // The kind alone, as a rank reads it to tell a request for its plan from its order.
  EXPECT_EQ(PlanReplyKind(encoded), PlanReply::Kind::kFilesOnly);
  for (PlanReply::Kind kind : {PlanReply::Kind::kOrder, PlanReply::Kind::kResend,
                               PlanReply::Kind::kRenamed, PlanReply::Kind::kResendShared}) {
    EXPECT_EQ(PlanReplyKind(EncodePlanReply(PlanReply{kind, 0, "", {}})), kind);
  }
  EXPECT_EQ(PlanReplyKind(unknown), std::nullopt);
  EXPECT_EQ(PlanReplyKind(""), std::nullopt);
}

TEST(SaveMessagesTest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 5000; ++i) {
    std::string bytes(rng() % 64, '\0');
    for (char& c : bytes) c = static_cast<char>(rng());
    DecodeRankWriteOrder(bytes).status().IgnoreError();
    DecodeWriteReport(bytes).status().IgnoreError();
    DecodePlanRequest(bytes).status().IgnoreError();
    DecodePlanReply(bytes).status().IgnoreError();
  }
}

// A chunk of 10,000 bytes at offset 123 of a file, with 1,000-byte checksum blocks.
class ChunkReaderTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kBlock = 1000;
  static constexpr uint64_t kOffset = 123;

  void SetUp() override {
    std::mt19937_64 rng(9);
    bytes_.resize(10'000);
    for (char& c : bytes_) c = static_cast<char>(rng());
    tensor_.name = "layers.0.w";
    tensor_.dtype = DType::kUInt8;
    tensor_.shape = {10'000};
    chunk_.box = Box({0}, {10'000});
    chunk_.byte_length = bytes_.size();
    for (uint64_t lo = 0; lo < bytes_.size(); lo += kBlock) {
      chunk_.block_crc32c.push_back(Crc32c(bytes_.data() + lo, std::min(kBlock, bytes_.size() - lo)));
    }
    Write(bytes_);
  }

  void Write(const std::string& chunk_bytes) {
    auto file = store_.NewWritableFile("f");
    ASSERT_TRUE(file.ok());
    std::string all = std::string(kOffset, 'p') + chunk_bytes;
    ASSERT_TRUE((*file)->WriteAt(0, AsBytes(all)).ok());
    ASSERT_TRUE((*file)->Close().ok());
    readable_ = std::move(store_.OpenReadable("f")).value();
  }

  StoredChunkRef Ref() {
    return StoredChunkRef{readable_.get(), &tensor_, &chunk_, kOffset, kBlock,
                          OwnChecksums(chunk_)};
  }

  MemoryStore store_;
  std::string bytes_;
  TensorMetadata tensor_;
  StoredChunk chunk_;
  std::unique_ptr<ReadableFile> readable_;
};

TEST_F(ChunkReaderTest, AnyRangeReadsExactBytesAndCountsEdgeReads) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 300; ++i) {
    uint64_t a = rng() % bytes_.size(), b = rng() % (bytes_.size() + 1);
    if (a > b) std::swap(a, b);
    std::string out(b - a, '\0');
    std::atomic<uint64_t> read{0};
    ASSERT_TRUE(ReadChunkBytes(Ref(), a, b, reinterpret_cast<std::byte*>(out.data()), true, &read).ok());
    EXPECT_EQ(out, bytes_.substr(a, b - a));
    if (a == b) continue;
    // Exactly the whole blocks touched by [a, b) were read, once each.
    uint64_t lo = a / kBlock * kBlock, hi = std::min<uint64_t>(bytes_.size(), (b + kBlock - 1) / kBlock * kBlock);
    EXPECT_EQ(read.load(), hi - lo);
  }
}

TEST_F(ChunkReaderTest, CorruptionInsideOrAtTheEdgeOfARangeIsCaught) {
  std::string bad = bytes_;
  bad[2500] ^= 0x10;  // block 2
  Write(bad);
  std::string out(10, '\0');
  auto* dst = reinterpret_cast<std::byte*>(out.data());
  // The range [2990, 3000) never covers byte 2500, but its block does.
  Status s = ReadChunkBytes(Ref(), 2990, 3000, dst, true, nullptr);
  ASSERT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("checksum mismatch in tensor 'layers.0.w' chunk [0:10000]"), std::string::npos) << s;
  EXPECT_NE(s.message().find("chunk bytes 2000..3000"), std::string::npos) << s;
  // Block 3 is sound; without verification corruption is not looked for.
  EXPECT_TRUE(ReadChunkBytes(Ref(), 3000, 3010, dst, true, nullptr).ok());
  EXPECT_TRUE(ReadChunkBytes(Ref(), 2990, 3000, dst, false, nullptr).ok());
  EXPECT_EQ(VerifyBlocks(Ref(), 2, 3, reinterpret_cast<const std::byte*>(bad.data()) + 2000).code(),
            StatusCode::kDataLoss);
  EXPECT_TRUE(VerifyBlocks(Ref(), 3, 10, reinterpret_cast<const std::byte*>(bad.data()) + 3000).ok());
}

TEST_F(ChunkReaderTest, WrongChecksumCountIsDataLoss) {
  chunk_.block_crc32c.pop_back();
  std::string out(1, '\0');
  Status s = ReadChunkBytes(Ref(), 0, 1, reinterpret_cast<std::byte*>(out.data()), true, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("has 9 checksums, expected 10"), std::string::npos) << s;
}

TEST_F(ChunkReaderTest, ShortFileIsDataLoss) {
  Write(bytes_.substr(0, 5000));
  std::string out(100, '\0');
  Status s = ReadChunkBytes(Ref(), 6000, 6100, reinterpret_cast<std::byte*>(out.data()), true, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
}

TEST(EngineContextTest, CoordinatorOutsideTheGroupIsInvalidArgument) {
  MemoryStore store;
  SaveOptions save_options;
  save_options.store = &store;
  save_options.coordinator = 1;
  Status s = Save(SaveState(), "/ckpt", save_options);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "coordinator rank 1 is outside the group of 1");
  LoadOptions load_options;
  load_options.store = &store;
  load_options.coordinator = -1;
  EXPECT_EQ(Load(LoadState(), "/ckpt", load_options).status().message(),
            "coordinator rank -1 is outside the group of 1");
  EXPECT_FALSE(store.Exists("/ckpt").value());
}

}  // namespace
}  // namespace sp
