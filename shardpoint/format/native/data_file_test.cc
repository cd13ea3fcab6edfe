#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

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

// Version 3.1: a header keeps room for its chunks' block checksums (8 hex digits a block, first
// in __metadata__), which FillDataFileChecksums fills and ReadDataFileChecksums reads back.
TEST(DataFileTest, Version31AndFourHeadersHoldTheirChunksChecksums) {
  size_t blocks_seen = 0;
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    CheckpointMetadata m = testing::RandomMetadata(seed, 10);
    m.data_file_checksums = true;
    for (uint32_t f = 0; f < m.files.size(); ++f) {
      SCOPED_TRACE("seed " + std::to_string(seed) + " file " + std::to_string(f));
      // The file's chunks in data order (empty ones first at an offset), with checksums.
      std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::vector<uint32_t>>> chunks;
      for (const TensorMetadata& t : m.tensors) {
        for (const StoredChunk& c : t.chunks) {
          if (c.file != f) continue;
          chunks.push_back({{c.data_offset, c.data_offset + c.byte_length},
                            std::vector<uint32_t>(c.block_crc32c.begin(), c.block_crc32c.end())});
        }
      }
      std::stable_sort(chunks.begin(), chunks.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      std::vector<uint32_t> crcs;
      for (const auto& [extent, own] : chunks) crcs.insert(crcs.end(), own.begin(), own.end());
      blocks_seen += crcs.size();

      std::string header = BuildDataFileHeader(m, f);
      EXPECT_EQ(header.substr(8, 27), "{\"__metadata__\":{\"crc32c\":\"");
      const uint64_t size = header.size() + m.files[f].size - m.files[f].data_start;
      Result<SafetensorsHeader> room = ParseSafetensorsHeader(header, size, "f");
      ASSERT_TRUE(room.ok()) << room.status();
      EXPECT_EQ(room->metadata.at("crc32c"), std::string(8 * crcs.size(), '0'));
      EXPECT_EQ(room->metadata.at("format_version"), "4.0");
      const size_t length = header.size();
      ASSERT_TRUE(FillDataFileChecksums(&header, crcs).ok());
      EXPECT_EQ(header.size(), length);
      Result<SafetensorsHeader> filled = ParseSafetensorsHeader(header, size, "f");
      ASSERT_TRUE(filled.ok()) << filled.status();
      Result<DataFileChecksums> read = ReadDataFileChecksums(*filled, m.checksum_block_bytes, "f");
      ASSERT_TRUE(read.ok()) << read.status();
      EXPECT_EQ(read->crcs, crcs);
      ASSERT_EQ(read->entry_begin.size(), chunks.size());
      for (size_t e = 0; e < chunks.size(); ++e) {
        EXPECT_EQ(read->entry_begin[e], chunks[e].first.first);
        EXPECT_EQ(read->entry_first[e + 1] - read->entry_first[e], chunks[e].second.size());
      }
      // Each chunk's checksums by its offset (an empty chunk has none, though others start there).
      for (const TensorMetadata& t : m.tensors) {
        for (const StoredChunk& c : t.chunks) {
          if (c.file != f) continue;
          const std::span<const uint32_t> of = read->Of(c.data_offset, c.byte_length);
          EXPECT_EQ(std::vector<uint32_t>(of.begin(), of.end()),
                    std::vector<uint32_t>(c.block_crc32c.begin(), c.block_crc32c.end()));
        }
      }
      EXPECT_TRUE(read->Of(m.files[f].size, 1).empty());  // no entry starts past the data
      // Room for another count is an internal error; the header is left as it was.
      crcs.push_back(1);
      Status wrong = FillDataFileChecksums(&header, crcs);
      EXPECT_EQ(wrong.code(), StatusCode::kInternal);
      EXPECT_NE(wrong.message().find("keeps no room for its " + std::to_string(crcs.size()) +
                                     " block checksums"),
                std::string::npos)
          << wrong;
    }
  }
  EXPECT_GT(blocks_seen, 100u);

  // What a reader refuses: no checksums, too few digits, a digit that is not one.
  CheckpointMetadata m = testing::RandomMetadata(3, 4);
  const std::string plain = BuildDataFileHeader(m, 0);  // 3.0: no room
  Result<SafetensorsHeader> parsed = ParseSafetensorsHeader(plain, m.files[0].size, "f");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->metadata.at("format_version"), "3.0");
  Result<DataFileChecksums> none = ReadDataFileChecksums(*parsed, m.checksum_block_bytes, "f0");
  EXPECT_EQ(none.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(none.status().message().find("data file f0: its header holds no block checksums"),
            std::string::npos)
      << none.status();
  uint64_t blocks = 0;
  for (const SafetensorsEntry& e : parsed->entries) {
    blocks += ChecksumBlockCount(e.end - e.begin, m.checksum_block_bytes);
  }
  parsed->metadata["crc32c"] = std::string(8 * blocks - 1, '0');
  Result<DataFileChecksums> short_ = ReadDataFileChecksums(*parsed, m.checksum_block_bytes, "f0");
  EXPECT_NE(short_.status().message().find(
                "data file f0: its header holds " + std::to_string(8 * blocks - 1) +
                " hex digits of block checksums, its " + std::to_string(parsed->entries.size()) +
                " entries need " + std::to_string(8 * blocks)),
            std::string::npos)
      << short_.status();
  // Entries that claim more blocks than any header can hold: counted without wrapping, refused.
  SafetensorsHeader huge;
  huge.metadata["crc32c"] = "00000000";
  huge.entries = {{"a@0", DType::kUInt8, {}, 0, uint64_t{1} << 62},
                  {"b@0", DType::kUInt8, {}, uint64_t{1} << 62, uint64_t{1} << 63}};
  Result<DataFileChecksums> too_many = ReadDataFileChecksums(huge, 1, "f0");
  EXPECT_NE(too_many.status().message().find(
                "its header holds 8 hex digits of block checksums, its 2 entries need " +
                std::to_string(uint64_t{1} << 63)),
            std::string::npos)
      << too_many.status();
  parsed->metadata["crc32c"] = std::string(8 * blocks - 1, '0') + "A";
  Result<DataFileChecksums> upper = ReadDataFileChecksums(*parsed, m.checksum_block_bytes, "f0");
  EXPECT_NE(upper.status().message().find("hold 'A' at digit " + std::to_string(8 * blocks - 1) +
                                          ", not a lowercase hex digit"),
            std::string::npos)
      << upper.status();
}

}  // namespace
}  // namespace sp
