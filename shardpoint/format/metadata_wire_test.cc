#include "shardpoint/format/metadata_wire.h"

#include <gtest/gtest.h>

#include <random>

namespace sp {
namespace {

CheckpointMetadata Sample() {
  CheckpointMetadata m;
  m.save_id = "abc123";
  m.world_size = 3;
  m.format = CheckpointFormat::kTorchDcp;
  m.checksum_block_bytes = 0;
  m.files = {{"__0_0.distcp", 0, 4096, 0}, {"__1_0.distcp", 0, 100, 1}};
  m.attributes = {{"step", "7"}, {"origin", "torch"}};
  TensorMetadata a{"layers.0.w", DType::kBFloat16, {4, 6}, {}};
  StoredChunk c0{Box{{0, 0}, {2, 6}}, 0, 64, 24, {}, ChunkEncoding::kRaw, 0};
  StoredChunk c1{Box{{2, 0}, {2, 6}}, 1, 0, 24, {1, 2}, ChunkEncoding::kDriverDecoded, 90, 1};
  a.chunks = {c0, c1};
  TensorMetadata scalar{"step", DType::kInt64, {}, {{Box{{}, {}}, 0, 8, 8, {}, {}, 0}}};
  m.tensors = {a, scalar};
  m.objects = {{"cfg", ObjectEncoding::kJson, "{\"lr\": 0.1}"},
               {"rng", ObjectEncoding::kPickle, std::string("\x80\x02N.", 4)},
               {"sched", ObjectEncoding::kTorchSave, "PK\x03\x04"},
               {"unread", ObjectEncoding::kTorchSave, "", StoredObjectItem{1, 64, 32, 1}}};
  return m;
}

TEST(MetadataWireTest, RoundTripsEveryField) {
  const CheckpointMetadata m = Sample();
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(EncodeMetadataForWire(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == m);
  EXPECT_EQ(back->tensors[0].chunks[1].encoding, ChunkEncoding::kDriverDecoded);
  EXPECT_EQ(back->tensors[0].chunks[1].stored_length, 90u);
  EXPECT_EQ(back->format, CheckpointFormat::kTorchDcp);
}

TEST(MetadataWireTest, EveryTruncationIsAnError) {
  const std::string bytes = EncodeMetadataForWire(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    Result<CheckpointMetadata> back = DecodeMetadataFromWire(std::string_view(bytes).substr(0, n));
    ASSERT_FALSE(back.ok()) << "prefix of " << n << " bytes decoded";
  }
  Result<CheckpointMetadata> trailing = DecodeMetadataFromWire(bytes + "x");
  ASSERT_FALSE(trailing.ok());
  EXPECT_NE(trailing.status().message().find("1 trailing bytes"), std::string::npos)
      << trailing.status();
}

TEST(MetadataWireTest, RandomByteFlipsNeverCrash) {
  const std::string bytes = EncodeMetadataForWire(Sample());
  std::mt19937 rng(5);
  for (int i = 0; i < 5000; ++i) {
    std::string damaged = bytes;
    damaged[rng() % damaged.size()] ^= static_cast<char>(1 + rng() % 255);
    (void)DecodeMetadataFromWire(damaged);  // must return, whatever it returns
  }
}

}  // namespace
}  // namespace sp
