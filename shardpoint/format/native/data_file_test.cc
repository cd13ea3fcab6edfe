#include <gtest/gtest.h>

#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/native/metadata_test_util.h"
#include "shardpoint/format/safetensors/safetensors.h"

namespace sp {
namespace {

TEST(DataFileTest, ChunkEntryNames) {
  EXPECT_EQ(ChunkEntryName("model.layers.0.w", Box({0, 128}, {64, 64})), "model.layers.0.w@0,128");
  EXPECT_EQ(ChunkEntryName("step", Box({}, {})), "step@");
  EXPECT_EQ(ChunkEntryName("a@b", Box({7}, {1})), "a@b@7");
}

TEST(DataFileTest, DataFileNames) {
  EXPECT_EQ(DataFileName("20260101-abc", 3, 1), "d-20260101-abc-r00003-f001.safetensors");
  EXPECT_EQ(DataFileName("s", 123456, 1000), "d-s-r123456-f1000.safetensors");
  EXPECT_STREQ(kMetadataFileName, "shardpoint.metadata");
}

// Every data file header of random metadata parses back as a valid safetensors header whose
// entries are exactly that file's chunks, in data order.
TEST(DataFileTest, HeadersDescribeEachFilesChunks) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    CheckpointMetadata m = testing::RandomMetadata(seed, 15);
    size_t chunks_seen = 0;
    for (uint32_t f = 0; f < m.files.size(); ++f) {
      std::string header = BuildDataFileHeader(m, f);
      ASSERT_EQ(header.size() % 8, 0u);
      ASSERT_EQ(header.size(), m.files[f].data_start);
      Result<SafetensorsHeader> parsed = ParseSafetensorsHeader(header, m.files[f].size, m.files[f].name);
      ASSERT_TRUE(parsed.ok()) << parsed.status();
      EXPECT_EQ(parsed->data_start, m.files[f].data_start);
      EXPECT_EQ(parsed->metadata, (std::map<std::string, std::string>{
                                      {"format", "shardpoint"}, {"format_version", "3.0"}, {"save_id", m.save_id}}));
      uint64_t previous_end = 0;
      for (const SafetensorsEntry& e : parsed->entries) {
        EXPECT_EQ(e.begin, previous_end);
        previous_end = e.end;
        size_t at = e.name.rfind('@');
        ASSERT_NE(at, std::string::npos);
        const TensorMetadata* t = m.FindTensor(e.name.substr(0, at));
        ASSERT_NE(t, nullptr) << e.name;
        auto chunk = std::find_if(t->chunks.begin(), t->chunks.end(), [&](const StoredChunk& c) {
          return c.file == f && c.data_offset == e.begin && ChunkEntryName(t->name, c.box) == e.name;
        });
        ASSERT_NE(chunk, t->chunks.end()) << e.name;
        EXPECT_EQ(e.dtype, t->dtype);
        EXPECT_EQ(e.shape, chunk->box.sizes);
        EXPECT_EQ(e.end - e.begin, chunk->byte_length);
        ++chunks_seen;
      }
    }
    size_t chunks_total = 0;
    for (const TensorMetadata& t : m.tensors) chunks_total += t.chunks.size();
    EXPECT_EQ(chunks_seen, chunks_total);
  }
}

// The headers of all files built in one pass are, byte for byte, those built file by file, and
// those EncodeSafetensorsHeader gives for the file's entries (ChunkEntryName, data order).
TEST(DataFileTest, AllHeadersAtOnceAreEachFilesHeader) {
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    CheckpointMetadata m = testing::RandomMetadata(seed, 15);
    std::vector<std::string> headers = BuildDataFileHeaders(m);
    ASSERT_EQ(headers.size(), m.files.size());
    for (uint32_t f = 0; f < m.files.size(); ++f) {
      EXPECT_EQ(headers[f], BuildDataFileHeader(m, f)) << "seed " << seed << " file " << f;
      std::vector<SafetensorsEntry> entries;
      for (const TensorMetadata& t : m.tensors) {
        for (const StoredChunk& c : t.chunks) {
          if (c.file != f) continue;
          entries.push_back({ChunkEntryName(t.name, c.box), t.dtype, Shape(c.box.sizes), c.data_offset,
                             c.data_offset + c.byte_length});
        }
      }
      std::stable_sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
        return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
      });
      // Padded so that the data section starts at a multiple of kDataAlignmentBytes.
      EXPECT_EQ(headers[f].size() % kDataAlignmentBytes, 0u);
      EXPECT_EQ(headers[f],
                EncodeSafetensorsHeader(entries,
                                        {{"format", "shardpoint"},
                                         {"format_version", "3.0"},
                                         {"save_id", m.save_id}},
                                        kDataAlignmentBytes))
          << "seed " << seed << " file " << f;
    }
  }
}

}  // namespace
}  // namespace sp
