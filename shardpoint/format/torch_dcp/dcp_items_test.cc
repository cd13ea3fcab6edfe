#include "shardpoint/format/torch_dcp/dcp_items.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/test_util.h"
#include "shardpoint/format/torch_save/torch_save.h"

namespace sp::torch_dcp {

using torch_save::MemoryRangeReader;
using torch_save::ParseTorchSaveObject;
using torch_save::ParseTorchSaveTensor;
using torch_save::PlainValue;
using torch_save::TorchSaveTensorInfo;

namespace {

TEST(DecodeTransformedItem, ZstdItemsWrittenByTorch) {
  Result<DcpMetadata> md = DecodeDcpMetadata(AsBytes(TestData("zstd/.metadata")), "zstd/.metadata");
  ASSERT_TRUE(md.ok()) << md.status();
  std::string data = TestData("zstd/__0_0.distcp");
  std::vector<int64_t> origin = {0, 0};
  const DcpStorageEntry* w = md->FindStorage("w", &origin);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->transform_descriptors, std::vector<std::string>{kZstdTransformDescriptor});
  Result<std::string> item = DecodeTransformedItem(
      w->transform_descriptors, AsBytes(data).subspan(w->offset, w->length), 1 << 20, "w");
  ASSERT_TRUE(item.ok()) << item.status();
  Result<TorchSaveTensorInfo> t = ParseTorchSaveTensor(MemoryRangeReader(AsBytes(*item)), item->size(), "w");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->dtype, DType::kInt64);
  EXPECT_EQ(t->shape, (Shape{8, 8}));
  int64_t last;
  std::memcpy(&last, item->data() + t->data_offset + 63 * 8, 8);
  EXPECT_EQ(last, 63);

  const DcpStorageEntry* note = md->FindStorage("note", nullptr);
  ASSERT_NE(note, nullptr);
  Result<std::string> obj = DecodeTransformedItem(
      note->transform_descriptors, AsBytes(data).subspan(note->offset, note->length), 1 << 20, "note");
  ASSERT_TRUE(obj.ok()) << obj.status();
  Result<PlainValue> v = ParseTorchSaveObject(MemoryRangeReader(AsBytes(*obj)), obj->size(), "note");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, PlainValue::String("compressed"));

  // The size cap, truncation, and transforms that are not supported.
  ByteView stored = AsBytes(data).subspan(w->offset, w->length);
  SP_EXPECT_ERROR(DecodeTransformedItem(w->transform_descriptors, stored, 100, "w").status(),
                  StatusCode::kResourceExhausted, "more than 100 bytes");
  SP_EXPECT_ERROR(DecodeTransformedItem(w->transform_descriptors, stored.first(stored.size() - 5), 1 << 20, "w")
                      .status(),
                  StatusCode::kDataLoss, "zstd item w");
  std::vector<std::string> unknown = {"stream.lz4/1"};
  SP_EXPECT_ERROR(DecodeTransformedItem(unknown, stored, 1 << 20, "w").status(), StatusCode::kUnimplemented,
                  "unknown stream transform 'stream.lz4/1'");
  std::vector<std::string> v2 = {"stream.zstd/2"};
  SP_EXPECT_ERROR(DecodeTransformedItem(v2, stored, 1 << 20, "w").status(), StatusCode::kUnimplemented,
                  "stream.zstd/2");
}

TEST(DecodeTransformedItem, RoundTripsAndPassesRawItemsThrough) {
  std::string raw;
  for (int i = 0; i < 300000; ++i) raw.push_back(static_cast<char>(i % 251));
  Result<std::string> z = EncodeZstdItem(AsBytes(raw));
  ASSERT_TRUE(z.ok());
  std::vector<std::string> zstd = {kZstdTransformDescriptor};
  Result<std::string> back = DecodeTransformedItem(zstd, AsBytes(*z), raw.size(), "x");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, raw);
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(*z), raw.size() - 1, "x").status(),
                  StatusCode::kResourceExhausted, "more than");
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(std::string_view("not zstd")), 100, "x").status(),
                  StatusCode::kDataLoss, "zstd item x");
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, ByteView(), 100, "x").status(), StatusCode::kDataLoss, "truncated");
  Result<std::string> plain = DecodeTransformedItem({}, AsBytes(raw), raw.size(), "x");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(*plain, raw);
}

std::string Pattern(size_t n) {
  std::string raw(n, '\0');
  for (size_t i = 0; i < n; ++i) raw[i] = static_cast<char>((i * 7 + i / 1000) % 251);
  return raw;
}

// A zstd frame whose header declares its content size (what the zstd CLI writes).
std::string ZstdWithContentSize(const std::string& raw) {
  std::string out(ZSTD_compressBound(raw.size()), '\0');
  size_t n = ZSTD_compress(out.data(), out.size(), raw.data(), raw.size(), 3);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(n);
  return out;
}

// Regression (issue 13, defect 7): an item whose decoded size is a multiple of 131,072 bytes
// (zstd's streaming output block) was reported truncated; the end of the stream is where the
// decoder says a frame ended, not where output space was left over.
TEST(DecodeTransformedItem, DecodedSizesOnBlockBoundaries) {
  const std::vector<std::string> zstd = {kZstdTransformDescriptor};
  for (size_t n : {size_t{0}, size_t{1}, size_t{131071}, size_t{131072}, size_t{131073},
                   size_t{262144}, size_t{393216}}) {
    const std::string raw = Pattern(n);
    Result<std::string> z = EncodeZstdItem(AsBytes(raw));
    ASSERT_TRUE(z.ok());
    for (const std::string& stored : {*z, ZstdWithContentSize(raw)}) {
      Result<std::string> back = DecodeTransformedItem(zstd, AsBytes(stored), n, "x");
      ASSERT_TRUE(back.ok()) << n << " bytes: " << back.status();
      EXPECT_EQ(*back, raw) << n;
      // Truly truncated: every proper prefix is refused (never returned as a shorter item).
      for (size_t cut : {size_t{1}, stored.size() / 2, stored.size() - 1}) {
        if (cut >= stored.size()) continue;
        Result<std::string> part =
            DecodeTransformedItem(zstd, AsBytes(stored).first(cut), n + 1, "x");
        EXPECT_FALSE(part.ok()) << n << " bytes cut at " << cut;
        if (!part.ok()) {
          EXPECT_EQ(part.status().code(), StatusCode::kDataLoss) << part.status();
        }
      }
    }
    if (n > 0) {
      SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(*z), n - 1, "x").status(),
                      StatusCode::kResourceExhausted, "decodes to more than " + std::to_string(n - 1));
    }
  }
}

TEST(DecodeTransformedItem, SeveralFramesDecodeToTheirConcatenation) {
  const std::vector<std::string> zstd = {kZstdTransformDescriptor};
  const std::string a = Pattern(131072), b = Pattern(5000), c = Pattern(262144);
  Result<std::string> za = EncodeZstdItem(AsBytes(a));
  Result<std::string> zc = EncodeZstdItem(AsBytes(c));
  ASSERT_TRUE(za.ok() && zc.ok());
  const std::string stored = *za + ZstdWithContentSize(b) + *zc;
  Result<std::string> back = DecodeTransformedItem(zstd, AsBytes(stored), a.size() + b.size() + c.size(), "x");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, a + b + c);
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(stored).first(stored.size() - 3), 1 << 20, "x").status(),
                  StatusCode::kDataLoss, "zstd item x");
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(stored), a.size() + b.size(), "x").status(),
                  StatusCode::kResourceExhausted, "decodes to more than");
}

// Regression (issue 13, defect 3): a frame that declares a content size over the cap is refused
// from its header, before any output is produced.
TEST(DecodeTransformedItem, DeclaredSizeOverTheCapIsRefusedUpFront) {
  const std::vector<std::string> zstd = {kZstdTransformDescriptor};
  const std::string stored = ZstdWithContentSize(std::string(size_t{1} << 20, 'z'));
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(stored), 1000, "object 'cfg'").status(),
                  StatusCode::kResourceExhausted,
                  "zstd item object 'cfg' declares 1048576 decoded bytes, more than 1000");
}

TEST(DcpSafetensorsChunks, UsesShardingInfo) {
  std::vector<SafetensorsEntry> entries = {{"w", DType::kFloat32, {2, 3}, 0, 24}, {"b", DType::kBFloat16, {4}, 24, 32}};
  std::map<std::string, std::string> meta = {
      {"DCP_SHARDING_INFO", R"({"w": {"saved_offsets": [2, 0]}, "b": {"saved_offsets": [4]}})"},
      {"DCP_VERSION", "1.0"},
      {"format", "pt"}};
  std::string header = EncodeSafetensorsHeader(entries, meta);
  std::string file = header + std::string(32, '\0');
  Result<SafetensorsHeader> parsed = ParseSafetensorsHeader(file, file.size(), "shard.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  Result<std::vector<DcpSafetensorsChunk>> chunks = DcpSafetensorsChunks(*parsed, "shard.safetensors");
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  ASSERT_EQ(chunks->size(), 2u);
  EXPECT_EQ((*chunks)[0].fqn, "w");
  EXPECT_EQ((*chunks)[0].box, Box({2, 0}, {2, 3}));
  EXPECT_EQ((*chunks)[0].data_offset, header.size());
  EXPECT_EQ((*chunks)[1].box, Box({4}, {4}));
  EXPECT_EQ((*chunks)[1].data_offset, header.size() + 24);

  parsed->metadata["DCP_SHARDING_INFO"] = R"({"w": {"saved_offsets": [2]}})";
  SP_EXPECT_ERROR(DcpSafetensorsChunks(*parsed, "shard.safetensors").status(), StatusCode::kDataLoss,
                  "has 1 offsets for a tensor of rank 2");
  parsed->metadata["DCP_SHARDING_INFO"] = R"({"ghost": {"saved_offsets": []}})";
  SP_EXPECT_ERROR(DcpSafetensorsChunks(*parsed, "shard.safetensors").status(), StatusCode::kDataLoss,
                  "names 'ghost'");
  parsed->metadata.clear();
  chunks = DcpSafetensorsChunks(*parsed, "plain.safetensors");
  ASSERT_TRUE(chunks.ok());
  EXPECT_EQ((*chunks)[0].box, Box({0, 0}, {2, 3}));
}

// libzstd also decodes the legacy formats (v0.5-v0.7); their headers are not checked against the
// output, so a legacy frame could declare a size it does not decode to. Such frames are refused
// by their magic number, wherever they stand (found by zstd_item_fuzz: a v0.6 magic, 0xFD2FB526).
TEST(DecodeTransformedItem, LegacyZstdFramesAreRefused) {
  const std::vector<std::string> zstd = {kZstdTransformDescriptor};
  const std::string legacy("\x26\xb5\x2f\xfd\xc2\xc2\xc2\xc2\xc2\x2f\xfd\xc2\x04\xe9\xd8\x51", 16);
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(legacy), 1 << 20, "x").status(), StatusCode::kDataLoss,
                  "zstd item x: the frame at byte 0 has magic number 0xFD2FB526, expected a zstd frame");
  Result<std::string> good = EncodeZstdItem(AsBytes(std::string_view("abc")));
  ASSERT_TRUE(good.ok());
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(*good + legacy), 1 << 20, "x").status(),
                  StatusCode::kDataLoss,
                  "the frame at byte " + std::to_string(good->size()) + " has magic number 0xFD2FB526");
}

// A frame whose last block is empty ends without libzstd comparing what it decoded with the
// content size its header declares, when it is decoded in more than one step (a declared size
// over libzstd's streaming output size, ZSTD_DStreamOutSize(), 128 KiB): this one declares
// 200,000 bytes (under the cap) and decodes to none, with a valid checksum (the XXH64 of no
// bytes). Each frame is checked against its own header, wherever it stands in the item
// (found by zstd_item_fuzz with a declared 3,145,000).
TEST(DecodeTransformedItem, FramesThatDecodeToLessThanTheyDeclareAreRefused) {
  const std::vector<std::string> zstd = {kZstdTransformDescriptor};
  // magic, descriptor (4-byte content size, checksum), window, size 200,000, an empty raw last
  // block, checksum.
  ASSERT_GT(200000u, ZSTD_DStreamOutSize());
  const std::string short_frame("\x28\xb5\x2f\xfd\x84\x51\x40\x0d\x03\x00\x01\x00\x00"
                                "\x99\xe9\xd8\x51", 17);
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(short_frame), 1 << 20, "x").status(),
                  StatusCode::kDataLoss,
                  "zstd item x: the frame at byte 0 decodes to 0 bytes, but its header declares 200000");
  Result<std::string> good = EncodeZstdItem(AsBytes(std::string_view("abc")));
  ASSERT_TRUE(good.ok());
  SP_EXPECT_ERROR(DecodeTransformedItem(zstd, AsBytes(*good + short_frame), 1 << 20, "x").status(),
                  StatusCode::kDataLoss,
                  "the frame at byte " + std::to_string(good->size()) +
                      " decodes to 0 bytes, but its header declares 200000");
  Result<std::string> both = DecodeTransformedItem(zstd, AsBytes(*good + *good), 1 << 20, "x");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_EQ(*both, "abcabc");
}

}  // namespace
}  // namespace sp::torch_dcp
