// The native metadata decoder against hostile input: truncations, bit flips, forged counts,
// inconsistent contents, and versions from the future.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/native/metadata_sections.h"
#include "shardpoint/format/native/metadata_test_util.h"

namespace sp {
namespace {

using ::sp::testing::ExpectMetadataEq;
using ::sp::testing::RandomMetadata;

constexpr char kPath[] = "/c/shardpoint.metadata";

struct SectionBytes {
  std::string bytes;
  uint32_t count;
};

std::vector<SectionBytes> SplitSections(const std::string& file) {
  std::vector<SectionBytes> out;
  uint32_t count = DecodeFixed32(file.data() + 20);
  for (uint32_t i = 0; i < count; ++i) {
    const char* p = file.data() + 32 + 24 * i;
    out.push_back({file.substr(DecodeFixed64(p), DecodeFixed64(p + 8)), DecodeFixed32(p + 20)});
  }
  return out;
}

// Lays out `sections` behind a correct header of version <major>.<minor>.
std::string Assemble(const std::vector<SectionBytes>& sections, uint32_t minor,
                     uint32_t major = 3) {
  std::string out;
  ByteWriter w(&out);
  const uint32_t header_length = 32 + 24 * sections.size() + 4;
  uint64_t size = header_length;
  for (const SectionBytes& s : sections) size += s.bytes.size();
  w.PutRaw(std::string_view("\x89SPMD\r\n\x1a", 8));
  w.PutU32(major);
  w.PutU32(minor);
  w.PutU32(header_length);
  w.PutU32(static_cast<uint32_t>(sections.size()));
  w.PutU64(size);
  uint64_t offset = header_length;
  for (const SectionBytes& s : sections) {
    w.PutU64(offset);
    w.PutU64(s.bytes.size());
    w.PutU32(Crc32c(s.bytes));
    w.PutU32(s.count);
    offset += s.bytes.size();
  }
  w.PutU32(Crc32c(out));
  for (const SectionBytes& s : sections) w.PutRaw(s.bytes);
  return out;
}

void ExpectDataLoss(const Result<CheckpointMetadata>& r, std::string_view fragment) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find(fragment), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(kPath), std::string::npos) << r.status();
}

TEST(MetadataHostileTest, EveryTruncationIsDataLoss) {
  std::string bytes = EncodeMetadata(RandomMetadata(31, 6));
  for (size_t length = 0; length < bytes.size(); ++length) {
    Result<CheckpointMetadata> r = DecodeMetadata(std::string_view(bytes).substr(0, length), kPath);
    ASSERT_FALSE(r.ok()) << "length " << length;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << "length " << length;
  }
  Result<CheckpointMetadata> extended = DecodeMetadata(bytes + "x", kPath);
  ExpectDataLoss(extended, "the header says the file holds");
}

TEST(MetadataHostileTest, EverySingleBitFlipIsDetected) {
  std::string bytes = EncodeMetadata(RandomMetadata(32, 4));
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = bytes;
      flipped[i] ^= static_cast<char>(1 << bit);
      Result<CheckpointMetadata> r = DecodeMetadata(flipped, kPath);
      ASSERT_FALSE(r.ok()) << "byte " << i << " bit " << bit;
      // Major 3 with one bit flipped is 4 or more (newer), or 2 or 1 (older: read, and then
      // the header's checksum fails).
      bool in_major = i >= 8 && i < 12;
      StatusCode expected = in_major && !(i == 8 && bit <= 1) ? StatusCode::kFailedPrecondition
                                                              : StatusCode::kDataLoss;
      ASSERT_EQ(r.status().code(), expected) << "byte " << i << " bit " << bit << ": " << r.status();
    }
  }
}

TEST(MetadataHostileTest, RandomCorruptionWithFixedChecksumsNeverCrashes) {
  CheckpointMetadata m = RandomMetadata(33, 6);
  std::string bytes = EncodeMetadata(m);
  std::vector<SectionBytes> sections = SplitSections(bytes);
  std::mt19937_64 rng(33);
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<SectionBytes> s = sections;
    SectionBytes& target = s[rng() % s.size()];
    if (target.bytes.empty()) continue;
    for (int n = 1 + rng() % 4; n > 0; --n) target.bytes[rng() % target.bytes.size()] = rng();
    Result<CheckpointMetadata> r = DecodeMetadata(Assemble(s, 0), kPath);
    if (!r.ok()) {
      ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1000);  // records carry their own CRCs in the index, so most are caught
}

TEST(MetadataHostileTest, NewerMajorIsFailedPrecondition) {
  std::string bytes = EncodeMetadata(RandomMetadata(34, 3));
  EncodeFixed32(bytes.data() + 8, 5);
  EncodeFixed32(bytes.data() + 152, Crc32c(bytes.data(), 152));
  Result<CheckpointMetadata> r = DecodeMetadata(bytes, kPath);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(),
            std::string("metadata file ") + kPath +
                ": checkpoint format version 5.0 is newer than this reader (4.x)");
  EncodeFixed32(bytes.data() + 8, 0);
  EncodeFixed32(bytes.data() + 152, Crc32c(bytes.data(), 152));
  ExpectDataLoss(DecodeMetadata(bytes, kPath), "unknown format version 0.0");
}

TEST(MetadataHostileTest, VersionTwoRecordsReadAsVersionOneAreCorrupt) {
  // A version-2 file relabelled 1.0: its records' layout bytes are read as chunk counts.
  CheckpointMetadata m = RandomMetadata(39, 6);
  const std::vector<SectionBytes> sections = SplitSections(EncodeMetadata(m));
  Result<CheckpointMetadata> r = DecodeMetadata(Assemble(sections, 0, 1), kPath);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
}

TEST(MetadataHostileTest, NewerMinorMayAppendSectionsAndSummaryBytes) {
  CheckpointMetadata m = RandomMetadata(35, 5);
  m.data_file_checksums = true;  // a 3.1 summary, which a newer minor extends
  for (DataFile& f : m.files) f.header_crc32c = Crc32c(f.name);
  std::vector<SectionBytes> sections = SplitSections(EncodeMetadata(m, 3));
  sections[0].bytes += "future summary fields";
  sections.push_back({"a section from version 3.3", 7});
  Result<CheckpointMetadata> r = DecodeMetadata(Assemble(sections, 3), kPath);
  ASSERT_TRUE(r.ok()) << r.status();
  m.version_minor = 3;
  ExpectMetadataEq(m, *r);
  // The same bytes claiming version 3.1 (what this reader knows) are corrupt.
  ExpectDataLoss(DecodeMetadata(Assemble(sections, 1), kPath),
                 "unexpected bytes after the summary");
  sections[0].bytes.resize(sections[0].bytes.size() - 21);
  ASSERT_TRUE(DecodeMetadata(Assemble(sections, 1), kPath).ok());  // an extra section alone is fine
  // As 3.0, the header CRCs are bytes 3.0 does not have.
  ExpectDataLoss(DecodeMetadata(Assemble(sections, 0), kPath),
                 "unexpected bytes after the summary");
  // As 3.1 without them, the summary ends too soon.
  sections[0].bytes.resize(sections[0].bytes.size() - 4 * m.files.size() + 2);
  ExpectDataLoss(DecodeMetadata(Assemble(sections, 1), kPath),
                 "the summary ends before the header CRCs of its " +
                     std::to_string(m.files.size()) + " data files");
}

TEST(MetadataHostileTest, NewerMinorMayAppendRecordBytes) {
  CheckpointMetadata m = RandomMetadata(36, 2);
  m.version_major = kNativeFormatMajor;  // the summary the record is decoded against
  std::string record =
      native_metadata::EncodeTensorRecord(m.tensors[0], m.checksum_block_bytes,
                                          kNativeFormatMajor) +
      "extension";
  EXPECT_TRUE(native_metadata::DecodeTensorRecord(record, m.tensors[0].name, m, true, kPath).ok());
  Result<TensorMetadata> strict =
      native_metadata::DecodeTensorRecord(record, m.tensors[0].name, m, false, kPath);
  EXPECT_EQ(strict.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(strict.status().message().find("9 unexpected bytes"), std::string::npos);
  std::string object = native_metadata::EncodeObjectRecord(m.objects[0]) + "x";
  EXPECT_TRUE(native_metadata::DecodeObjectRecord(object, "o", true, kPath).ok());
  EXPECT_FALSE(native_metadata::DecodeObjectRecord(object, "o", false, kPath).ok());
}

TEST(MetadataHostileTest, AbsurdCountsAreRejectedBeforeAllocation) {
  std::string bytes = EncodeMetadata(RandomMetadata(37, 3));
  std::vector<SectionBytes> sections = SplitSections(bytes);
  for (size_t i = 1; i < 5; ++i) {
    std::vector<SectionBytes> s = sections;
    s[i].count = 0xFFFFFFFF;
    s[i % 2 == 1 ? i + 1 : i - 1].count = 0xFFFFFFFF;  // keep index and records counts equal
    ExpectDataLoss(DecodeMetadata(Assemble(s, 0), kPath), "entries cannot fit");
  }
  std::string many_sections = bytes;
  EncodeFixed32(many_sections.data() + 20, 0x10000000);
  ExpectDataLoss(DecodeMetadata(many_sections, kPath), "inconsistent header");
  // The summary's file count: after save_id (4 + length), world size (4) and block size (8).
  std::vector<SectionBytes> s = sections;
  size_t at = 4 + DecodeFixed32(s[0].bytes.data()) + 4 + 8;
  EncodeFixed32(s[0].bytes.data() + at, 0xFFFFFFFF);
  ExpectDataLoss(DecodeMetadata(Assemble(s, 0), kPath), "cannot fit in the");
  // A chunk list's count, right after the dtype, rank, shape (and, in version 2, the layout).
  CheckpointMetadata m = RandomMetadata(37, 3);
  for (uint32_t major : {1u, 2u}) {
    SCOPED_TRACE(major);
    TensorMetadata tensor = m.tensors[0];
    tensor.chunks.push_back(tensor.chunks.front());  // not a grid: stored as a list
    std::string record = native_metadata::EncodeTensorRecord(tensor, m.checksum_block_bytes, major);
    const size_t at = 2 + 8 * tensor.shape.size() + (major >= 2 ? 1 : 0);
    if (major >= 2) {
      ASSERT_EQ(record[at - 1], native_metadata::kChunkList);
    }
    EncodeFixed32(record.data() + at, 0x7FFFFFFF);
    CheckpointMetadata summary = m;
    summary.version_major = major;
    Result<TensorMetadata> t = native_metadata::DecodeTensorRecord(record, "t", summary, false, kPath);
    EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(t.status().message().find("cannot fit"), std::string::npos) << t.status();
  }
}

// A record of an int8 tensor [12, 10] (version 2 or 3) up to its layout byte.
std::string RecordHead(native_metadata::TensorLayout layout) {
  std::string out;
  ByteWriter w(&out);
  w.PutU8(DTypeCode(DType::kInt8));
  w.PutU8(2);
  w.PutI64(12);
  w.PutI64(10);
  w.PutU8(layout);
  return out;
}

// A grid record of that tensor up to its cells: listed cut points (an even step where `steps`
// has one), as versions 2 and 3 give them.
std::string GridHead(const std::vector<std::vector<int64_t>>& cuts,
                     std::vector<uint32_t> intervals = {}, std::vector<int64_t> steps = {}) {
  std::string out = RecordHead(native_metadata::kGrid);
  ByteWriter w(&out);
  for (size_t d = 0; d < cuts.size(); ++d) {
    w.PutU32(d < intervals.size() ? intervals[d] : static_cast<uint32_t>(cuts[d].size() + 1));
    if (d < steps.size() && steps[d] != 0) {
      w.PutU8(native_metadata::kEvenCuts);
      w.PutI64(steps[d]);
      continue;
    }
    w.PutU8(native_metadata::kListedCuts);
    for (int64_t cut : cuts[d]) w.PutI64(cut);
  }
  return out;
}

// A version-2 grid record of that tensor (GridHead) with `cells` cells, each at offset 0 of file
// 0 with one checksum.
std::string GridRecord(const std::vector<std::vector<int64_t>>& cuts, uint32_t cells,
                       std::vector<uint32_t> intervals = {}, std::vector<int64_t> steps = {}) {
  std::string out = GridHead(cuts, std::move(intervals), std::move(steps));
  ByteWriter w(&out);
  for (uint32_t c = 0; c < cells; ++c) {
    w.PutU32(0);
    w.PutU64(0);
  }
  for (uint32_t c = 0; c < cells; ++c) w.PutU32(7);  // one block per cell (blocks of 64 bytes)
  return out;
}

// The summary the forged grids are decoded against: one data file of 120 bytes, checksums in
// blocks of 64 bytes, records of version `major`.
CheckpointMetadata ForgedGridSummary(uint32_t major) {
  CheckpointMetadata summary;
  summary.save_id = "s";
  summary.checksum_block_bytes = 64;
  summary.files = {{"d-s-r00000-f000.safetensors", 8, 8 + 120, 0}};
  summary.version_major = major;
  return summary;
}

// Expects the decoding of a forged record of tensor "g" to be refused as kDataLoss naming the
// tensor, with `message` in its message.
void ExpectForgedGridRefused(const Result<TensorMetadata>& r, std::string_view message) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find(message), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("tensor \"g\""), std::string::npos) << r.status();
}

TEST(MetadataHostileTest, ForgedGridsAreDataLoss) {
  const CheckpointMetadata summary = ForgedGridSummary(2);
  auto decode = [&](const std::string& record) {
    return native_metadata::DecodeTensorRecord(record, "g", summary, false, kPath);
  };
  // The valid grid: rows cut at 4 and 8, columns at 5.
  Result<TensorMetadata> good = decode(GridRecord({{4, 8}, {5}}, 6));
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_TRUE(good->grid.has_value());
  EXPECT_EQ(good->chunks.size(), 6u);
  EXPECT_EQ(good->chunks[3].box, Box({4, 5}, {4, 5}));
  EXPECT_EQ(good->chunks[3].byte_length, 20u);
  // The same rows as an even step of 4 (three intervals), and torch.chunk's split of 10 columns
  // in three: 4, 4, 2.
  Result<TensorMetadata> even = decode(GridRecord({{}, {}}, 9, {3, 3}, {4, 4}));
  ASSERT_TRUE(even.ok()) << even.status();
  EXPECT_EQ(even->grid->bounds, (std::vector<std::vector<int64_t>>{{0, 4, 8, 12}, {0, 4, 8, 10}}));
  EXPECT_EQ(even->chunks[8].box, Box({8, 8}, {4, 2}));
  const std::vector<std::pair<std::string, std::string>> forged = {
      {GridRecord({{8, 4}, {5}}, 6), "cut point 2 at 4 is not between 8 and 12"},
      {GridRecord({{4, 4}, {5}}, 6), "cut point 2 at 4 is not between 4 and 12"},
      {GridRecord({{0}, {5}}, 4), "cut point 1 at 0 is not between 0 and 12"},
      {GridRecord({{12}, {5}}, 4), "cut point 1 at 12 is not between 0 and 12"},
      {GridRecord({{}, {5}}, 2, {0}), "dimension 0 of size 12 cut into 0 intervals"},
      {GridRecord({{}, {5}}, 2, {13}), "dimension 0 of size 12 cut into 13 intervals"},
      {GridRecord({{}, {5}}, 2, {0xFFFFFFFF}), "cut into 4294967295 intervals"},
      {GridRecord({{4, 8}, {5}}, 3), "6 grid cells cannot fit"},
      {GridRecord({{4, 8}, {5}}, 6) + "x", "1 unexpected bytes"},
      {GridRecord({{}, {}}, 9, {3, 3}, {6, 4}), "dimension 0 of size 12 cut into 3 intervals of 6"},
      {GridRecord({{}, {}}, 9, {3, 3}, {3, 4}), "dimension 0 of size 12 cut into 3 intervals of 3"},
      {GridRecord({{}, {}}, 9, {3, 3}, {-4, 4}), "cut into 3 intervals of -4"},
      {GridRecord({{}, {}}, 9, {3, 3}, {13, 4}), "cut into 3 intervals of 13"},
      {GridRecord({{}, {}}, 9, {3, 3}, {int64_t{1} << 62, 4}), "intervals of 4611686018427387904"},
  };
  for (const auto& [record, message] : forged) {
    SCOPED_TRACE(message);
    ExpectForgedGridRefused(decode(record), message);
  }
  // A cell outside its file, and an unknown layout byte.
  std::string far = GridRecord({{4, 8}, {5}}, 6);
  EncodeFixed64(far.data() + 2 + 16 + 1 + (4 + 1 + 16) + (4 + 1 + 8) + 12 * 2 + 4, 200);
  Result<TensorMetadata> outside = decode(far);
  ASSERT_FALSE(outside.ok());
  EXPECT_NE(outside.status().message().find("chunk 2: bytes [200, +20) lie outside the 120 data"),
            std::string::npos)
      << outside.status();
  // A rank that keeps only cell 0 finds cell 2 outside its file all the same.
  const std::vector<Box> first_cell = {Box({0, 0}, {1, 1})};
  EXPECT_EQ(native_metadata::DecodeTensorRecord(far, "g", summary, false, kPath, &first_cell)
                .status(),
            outside.status());
  Result<TensorMetadata> kept =
      native_metadata::DecodeTensorRecord(GridRecord({{4, 8}, {5}}, 6), "g", summary, false,
                                          kPath, &first_cell);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->kept, std::vector<uint32_t>{0});
  EXPECT_EQ(kept->chunks, std::vector<StoredChunk>{good->chunks[0]});
  // Checksums cut short: the same cell named, kept or not.
  std::string short_crcs = GridRecord({{4, 8}, {5}}, 6);
  short_crcs.resize(short_crcs.size() - 3);
  const Status short_whole = decode(short_crcs).status();
  EXPECT_NE(short_whole.message().find("block checksums cannot fit"), std::string::npos)
      << short_whole;
  EXPECT_EQ(native_metadata::DecodeTensorRecord(short_crcs, "g", summary, false, kPath,
                                                &first_cell)
                .status(),
            short_whole);
  std::string unknown = GridRecord({{4, 8}, {5}}, 6);
  unknown[2 + 16] = 7;
  EXPECT_NE(decode(unknown).status().message().find("unknown layout 7"), std::string::npos);
  // 2^24 intervals of one element each: the step is valid for the shape, but the record holds no
  // cells to pay for them, and nothing is allocated for its bounds.
  std::string huge;
  ByteWriter w(&huge);
  w.PutU8(DTypeCode(DType::kInt8));
  w.PutU8(1);
  w.PutI64(int64_t{1} << 24);
  w.PutU8(native_metadata::kGrid);
  w.PutU32(uint32_t{1} << 24);
  w.PutU8(native_metadata::kEvenCuts);
  w.PutI64(1);
  Result<TensorMetadata> unpaid = decode(huge);
  ASSERT_FALSE(unpaid.ok());
  EXPECT_NE(unpaid.status().message().find("16777216 grid cells cannot fit in the 9 remaining"),
            std::string::npos)
      << unpaid.status();
  std::string kind = GridRecord({{4, 8}, {5}}, 6);
  kind[2 + 16 + 1 + 4] = 2;
  EXPECT_NE(decode(kind).status().message().find("dimension 0: unknown cut kind 2"),
            std::string::npos);
}

// A run of grid cells in a version-3 record: its length and the step from each cell's file and
// data offset to the next's.
struct CellRun {
  uint64_t length;
  int64_t file_step;
  int64_t offset_step;
};

// A version-3 grid record of that tensor, rows cut at 4 and 8 and columns at 5 (six cells of 20
// bytes), whose cells' files and offsets are the runs given, each cell with one checksum.
std::string PackedGridRecord(const std::vector<CellRun>& runs) {
  std::string out = GridHead({{4, 8}, {5}});
  ByteWriter w(&out);
  w.PutVarint(runs.size());
  for (const CellRun& run : runs) {
    w.PutVarint(run.length);
    w.PutSignedVarint(run.file_step);
    w.PutSignedVarint(run.offset_step);
  }
  for (uint32_t c = 0; c < 6; ++c) w.PutU32(100 + c);
  return out;
}

// Version 3 packs the tables: files and offsets as steps from the chunk before, boxes and counts
// as varints, no byte lengths. Every packed value that cannot hold is refused by name.
TEST(MetadataHostileTest, ForgedPackedRecordsAreDataLoss) {
  CheckpointMetadata summary = ForgedGridSummary(3);
  ASSERT_EQ(CheckpointMetadata().version_major, 3u);  // what a save writes
  const std::vector<Box> first_cell = {Box({0, 0}, {1, 1})};
  auto decode = [&](const std::string& record, const std::vector<Box>* keep = nullptr) {
    return native_metadata::DecodeTensorRecord(record, "g", summary, false, kPath, keep);
  };
  // The six cells back to back in file 0, offsets 0, 20, ..., 100: the first cell, then a run
  // of five cells 20 bytes apart.
  const std::vector<CellRun> back_to_back = {{1, 0, 0}, {5, 0, 20}};
  Result<TensorMetadata> good = decode(PackedGridRecord(back_to_back));
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(good->chunks.size(), 6u);
  for (size_t c = 0; c < 6; ++c) {
    EXPECT_EQ(good->chunks[c].data_offset, 20 * c);
    EXPECT_EQ(good->chunks[c].file, 0u);
    EXPECT_EQ(good->chunks[c].block_crc32c, (InlineVector<uint32_t, 2>{100 + uint32_t(c)}));
  }
  EXPECT_EQ(good->chunks[3].box, Box({4, 5}, {4, 5}));
  EXPECT_EQ(good->chunks[3].byte_length, 20u);
  // The encoder writes the same runs (it gives the rows' cuts as an even step).
  const std::string encoded = native_metadata::EncodeTensorRecord(*good, 64, 3);
  const std::string forged_good = PackedGridRecord(back_to_back);
  const size_t table_bytes = 1 + 2 * 3 + 6 * 4;
  ASSERT_GT(encoded.size(), table_bytes);
  EXPECT_EQ(encoded.substr(encoded.size() - table_bytes),
            forged_good.substr(forged_good.size() - table_bytes));
  // The same cells in one file each, at one offset, as a tensor sharded over six ranks.
  summary.files.resize(6, summary.files[0]);
  Result<TensorMetadata> spread = decode(PackedGridRecord({{1, 0, 0}, {5, 1, 0}}));
  ASSERT_TRUE(spread.ok()) << spread.status();
  for (uint32_t c = 0; c < 6; ++c) {
    EXPECT_EQ(spread->chunks[c].file, c);
    EXPECT_EQ(spread->chunks[c].data_offset, 0u);
  }
  summary.files.resize(1);

  std::vector<std::pair<std::string, std::string>> forged = {
      {PackedGridRecord({{1, -1, 0}, {5, 0, 20}}),
       "chunk 0: file index 0 + -1 is out of range (1 files)"},
      {PackedGridRecord({{1, 0, 0}, {3, 0, 20}, {1, 1, 20}, {1, -1, 20}}),
       "chunk 4: file index 1 is out of range (1 files)"},
      {PackedGridRecord({{1, 0, 0}, {1, INT64_MAX, 0}, {4, 0, 20}}),
       "chunk 1: file index 0 + 9223372036854775807 is out of range (1 files)"},
      {PackedGridRecord({{1, 0, 0}, {1, 0, 20}, {1, 0, 160}, {3, 0, 20}}),
       "chunk 2: bytes [180, +20) lie outside the 120 data"},
      {PackedGridRecord({{1, 0, -1}, {5, 0, 20}}),
       "chunk 0: bytes [18446744073709551615, +20) lie outside"},
      {PackedGridRecord({}), "0 runs of cells for 6 grid cells"},
      {PackedGridRecord({{1, 0, 0}, {6, 0, 20}}),
       "run 1 of 6 cells from cell 1 does not end at the 6 grid cells"},
      {PackedGridRecord({{1, 0, 0}, {4, 0, 20}}),
       "run 1 of 4 cells from cell 1 does not end at the 6 grid cells"},
      {PackedGridRecord({{0, 0, 0}, {6, 0, 20}}),
       "run 0 of 0 cells from cell 0 does not end within the 6 grid cells"},
      {PackedGridRecord({{1, 0, 0}, {1, 0, 20}, {1, 0, 20}, {1, 0, 20}, {1, 0, 20}, {1, 0, 20},
                         {1, 0, 20}}),
       "7 runs of cells for 6 grid cells"},
  };
  // Six cells need at least 24 bytes, a checksum each.
  std::string few = PackedGridRecord(back_to_back);
  few.resize(few.size() - 4 * 6 + 3);
  forged.push_back({few, "6 grid cells cannot fit in the"});
  // A varint of eleven bytes where the count of runs should be.
  std::string overlong = PackedGridRecord(back_to_back);
  const size_t runs_at = RecordHead(native_metadata::kGrid).size() + (4 + 1 + 16) +
                         (4 + 1 + 8);
  overlong.insert(runs_at, std::string(10, '\x80'));
  forged.push_back({overlong, "does not fit in 64 bits"});
  // Checksums cut short.
  std::string short_crcs = PackedGridRecord(back_to_back);
  short_crcs.resize(short_crcs.size() - 2);
  forged.push_back(
      {short_crcs, "chunk 5: 1 block checksums cannot fit in the 2 remaining bytes"});

  // A chunk list: rows [0, 6) and [6, 12), of 60 bytes each at offsets 0 and 60, one checksum
  // each (blocks of 64 bytes).
  auto list = [](uint64_t count, int64_t second_offset_step, uint64_t blocks, uint64_t row) {
    std::string out = RecordHead(native_metadata::kChunkList);
    ByteWriter w(&out);
    w.PutVarint(count);
    for (int c = 0; c < 2; ++c) {
      w.PutSignedVarint(0);
      w.PutSignedVarint(c == 0 ? 0 : second_offset_step);
      for (uint64_t v : {c == 0 ? 0 : row, uint64_t{0}, uint64_t{6}, uint64_t{10}}) w.PutVarint(v);
      w.PutVarint(c == 0 ? 1 : blocks);
      for (uint64_t b = 0; b < (c == 0 ? 1 : std::min<uint64_t>(blocks, 2)); ++b) w.PutU32(7);
    }
    return out;
  };
  Result<TensorMetadata> listed = decode(list(2, 60, 1, 6));
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->chunks.size(), 2u);
  EXPECT_EQ(listed->chunks[1], StoredChunk(Box({6, 0}, {6, 10}), 0, 60, 60, {7}));
  forged.push_back({list(2, 60, 2, 6), "chunk 1: 2 block checksums, expected 1"});
  forged.push_back(
      {list(2, 60, uint64_t{1} << 40, 6), "chunk 1: 1099511627776 block checksums, expected 1"});
  forged.push_back({list(2, 60, 1, uint64_t{1} << 63), "chunk 1: dimension 0"});
  forged.push_back({list(2, 61, 1, 6), "chunk 1: bytes [61, +60) lie outside the 120 data"});
  forged.push_back({list(1, 60, 1, 6), "chunks hold 60 elements, the shape [12, 10] has 120"});
  forged.push_back({list(1000, 60, 1, 6), "count 1000 at byte 19 cannot fit"});
  forged.push_back({list(uint64_t{1} << 32, 60, 1, 6), "cannot fit"});

  for (const auto& [record, message] : forged) {
    SCOPED_TRACE(message);
    Result<TensorMetadata> r = decode(record);
    ExpectForgedGridRefused(r, message);
    // A rank that keeps only the first cell fails alike.
    EXPECT_EQ(decode(record, &first_cell).status(), r.status());
  }
}

// A version-4 grid record of an int8 tensor of `shape`, cut into elements along every dimension,
// its cells one byte each, back to back in file 0: a few bytes whatever the cell count.
std::string ElementGridRecord(const Shape& shape) {
  std::string out;
  ByteWriter w(&out);
  w.PutU8(DTypeCode(DType::kInt8));
  w.PutU8(static_cast<uint8_t>(shape.size()));
  for (int64_t dim : shape) w.PutI64(dim);
  w.PutU8(native_metadata::kGrid);
  uint64_t cells = 1;
  for (int64_t dim : shape) {
    w.PutU32(static_cast<uint32_t>(dim));
    w.PutU8(native_metadata::kEvenCuts);
    w.PutI64(1);
    cells *= static_cast<uint64_t>(dim);
  }
  w.PutVarint(2);  // the first cell at offset 0, then every other a byte on
  w.PutVarint(1);
  w.PutSignedVarint(0);
  w.PutSignedVarint(0);
  w.PutVarint(cells - 1);
  w.PutSignedVarint(0);
  w.PutSignedVarint(1);
  return out;
}

// From version 4 a grid cell takes no bytes of its record, so a few bytes can claim 2^24 cells:
// the cells of all records together are bounded by the data files (GridCellBudget), and the
// first record past the bound is refused before it, or any after it, is decoded.
TEST(MetadataHostileTest, VersionFourGridCellsAreBoundedByTheDataFiles) {
  CheckpointMetadata summary;
  summary.save_id = "s";
  summary.data_file_checksums = true;
  summary.files = {{"d-s-r00000-f000.safetensors", 8, 8 + (uint64_t{1} << 24), 0}};
  const std::vector<std::pair<std::string, std::string>> records = {
      {"a", ElementGridRecord({64, 65})},      // 4,160 cells
      {"b", ElementGridRecord({4096, 4096})},  // 2^24 cells: 64 past the budget with a's
      {"c", ElementGridRecord({2, 2})}};
  ASSERT_EQ(native_metadata::GridCellBudget(summary), (uint64_t{1} << 24) + 4096);
  EXPECT_EQ(native_metadata::GridRecordCells(records[0].second, 4), 4160u);
  EXPECT_EQ(native_metadata::GridRecordCells(records[1].second, 4), uint64_t{1} << 24);
  EXPECT_EQ(native_metadata::GridRecordCells(records[0].second.substr(0, 30), 4), 0u);
  std::vector<SectionBytes> sections(5);
  sections[0].bytes = native_metadata::EncodeSummary(summary, /*header_crcs=*/true);
  for (const auto& [name, record] : records) {
    const uint64_t at = sections[2].bytes.size();
    native_metadata::EncodeIndexEntry(&sections[1].bytes, name,
                                      {at, record.size(), Crc32c(record)});
    sections[2].bytes += record;
  }
  sections[1].count = sections[2].count = static_cast<uint32_t>(records.size());
  const std::string file = Assemble(sections, 0, 4);
  ExpectDataLoss(DecodeMetadata(file, kPath),
                 "tensor \"b\": its grid cells take the records' total past 16781312, the "
                 "budget of 2^24 cells and 4096 for each of the 1 data files");
  // Alike on a pool, and for a rank that keeps only a's chunks.
  ThreadPool pool(3);
  const ChunkFilter filter = {{"a", {Box({0, 0}, {1, 1})}}};
  EXPECT_EQ(DecodeMetadata(file, kPath, &pool, &filter).status(),
            DecodeMetadata(file, kPath).status());
  // Without b, the others decode: a's 4,160 cells one byte apart.
  sections[1].bytes.clear();
  sections[2].bytes.clear();
  for (size_t i : {0, 2}) {
    const uint64_t at = sections[2].bytes.size();
    native_metadata::EncodeIndexEntry(&sections[1].bytes, records[i].first,
                                      {at, records[i].second.size(), Crc32c(records[i].second)});
    sections[2].bytes += records[i].second;
  }
  sections[1].count = sections[2].count = 2;
  Result<CheckpointMetadata> r = DecodeMetadata(Assemble(sections, 0, 4), kPath);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->checksums_in_headers);
  ASSERT_EQ(r->tensors[0].chunks.size(), 4160u);
  EXPECT_EQ(r->tensors[0].chunks[4159].data_offset, 4159u);
  EXPECT_TRUE(r->tensors[0].chunks[7].block_crc32c.empty());
}

TEST(MetadataHostileTest, EveryTruncatedOrFlippedRecordFailsCleanly) {
  CheckpointMetadata m = RandomMetadata(38, 12);
  std::mt19937_64 rng(38);
  for (const TensorMetadata& tensor : m.tensors) {
    std::string record =
        native_metadata::EncodeTensorRecord(tensor, m.checksum_block_bytes, kNativeFormatMajor);
    for (size_t length = 0; length < record.size(); ++length) {
      Result<TensorMetadata> r = native_metadata::DecodeTensorRecord(
          std::string_view(record).substr(0, length), tensor.name, m, false, kPath);
      ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << tensor.name << " length " << length;
    }
    for (int trial = 0; trial < 200; ++trial) {
      std::string bad = record;
      bad[rng() % bad.size()] ^= static_cast<char>(1 + rng() % 255);
      Result<TensorMetadata> r = native_metadata::DecodeTensorRecord(bad, tensor.name, m, false, kPath);
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
      }
    }
  }
}

// The file of `sections` with one to six bytes of its tensor records changed, behind checksums
// that match them (so that the records' decoding, not a CRC, finds what is wrong).
std::string WithRecordsDamaged(std::vector<SectionBytes> sections, std::mt19937_64& rng,
                               uint32_t major = kNativeFormatMajor) {
  std::string& records = sections[2].bytes;
  for (int n = 1 + rng() % 6; n > 0; --n) records[rng() % records.size()] ^= 1 + rng() % 255;
  return Assemble(sections, 0, major);
}

TEST(MetadataHostileTest, APoolDecodesAlikeAndReportsTheSameFirstBadRecord) {
  ThreadPool pool(4);
  CheckpointMetadata m = RandomMetadata(41, 64);
  // Fixed-width tables (version 2) and packed ones (version 3). Packed records are mostly
  // checksums, whose damage no check can see, so fewer damaged files are refused.
  for (const auto& [major, least_rejected] : {std::pair{2u, 250}, std::pair{3u, 150}}) {
    SCOPED_TRACE(major);
    m.version_major = major;
    const std::string bytes = EncodeMetadata(m, major);
    Result<CheckpointMetadata> pooled = DecodeMetadata(bytes, kPath, &pool);
    ASSERT_TRUE(pooled.ok()) << pooled.status();
    ExpectMetadataEq(*pooled, *DecodeMetadata(bytes, kPath));
    // Damaged records behind fixed checksums: the same error (the first bad record by name) with
    // the pool as without, whichever record is damaged first.
    std::vector<SectionBytes> sections = SplitSections(bytes);
    std::mt19937_64 rng(41);
    int rejected = 0;
    for (int trial = 0; trial < 400; ++trial) {
      const std::string damaged = WithRecordsDamaged(sections, rng, major);
      Result<CheckpointMetadata> inline_result = DecodeMetadata(damaged, kPath);
      Result<CheckpointMetadata> pooled_result = DecodeMetadata(damaged, kPath, &pool);
      ASSERT_EQ(pooled_result.ok(), inline_result.ok());
      if (!inline_result.ok()) {
        ASSERT_EQ(pooled_result.status().message(), inline_result.status().message());
        ++rejected;
      } else {  // a change the checks cannot see (a checksum value, an offset within its file)
        ExpectMetadataEq(*pooled_result, *inline_result);
      }
    }
    EXPECT_GT(rejected, least_rejected);
  }
}

// A rank that keeps part of the chunks (DecodeMetadata with a filter) checks every byte and every
// chunk as a whole decoding does: damaged records behind fixed checksums fail it with the same
// message, whichever chunks it keeps, so the ranks of a load that decode the same bytes agree.
TEST(MetadataHostileTest, AFilteredDecodingFailsExactlyAsAWholeOne) {
  ThreadPool pool(4);
  CheckpointMetadata m = RandomMetadata(43, 48);
  const std::string bytes = EncodeMetadata(m);
  std::mt19937_64 rng(43);
  // Three filters: the first chunk of every tensor, one box in the middle of each, nothing.
  std::vector<ChunkFilter> filters(3);
  for (const TensorMetadata& t : m.tensors) {
    if (!t.chunks.empty()) filters[0][t.name] = {t.chunks.front().box};
    Box middle = Box::Whole(t.shape);
    for (size_t d = 0; d < t.shape.size(); ++d) {
      middle.offsets[d] = t.shape[d] / 2;
      middle.sizes[d] = t.shape[d] > 0 ? 1 : 0;
    }
    filters[1][t.name] = {middle};
  }
  std::vector<SectionBytes> sections = SplitSections(bytes);
  int rejected = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::string damaged = WithRecordsDamaged(sections, rng);
    const Result<CheckpointMetadata> whole = DecodeMetadata(damaged, kPath);
    for (const ChunkFilter& filter : filters) {
      Result<CheckpointMetadata> part =
          DecodeMetadata(damaged, kPath, trial % 2 ? &pool : nullptr, &filter);
      ASSERT_EQ(part.ok(), whole.ok()) << (whole.ok() ? part.status() : whole.status());
      if (!whole.ok()) {
        ASSERT_EQ(part.status(), whole.status());
      }
    }
    rejected += !whole.ok();
  }
  EXPECT_GT(rejected, 250);
}

struct Violation {
  const char* what;
  std::function<void(CheckpointMetadata&)> mutate;
  const char* message;
  // The first version whose records do not store what is violated (0: every version stores it).
  uint32_t not_stored_from = 0;
};

TEST(MetadataHostileTest, InconsistentContentsAreDataLoss) {
  const std::vector<Violation> violations = {
      {"file index", [](auto& m) { m.tensors[0].chunks[0].file = 99; }, "file index 99 is out of range"},
      // Version 3 stores no byte length: a chunk's is its box's.
      {"byte length", [](auto& m) { m.tensors[0].chunks[0].byte_length += 1; }, "byte length", 3},
      {"block count", [](auto& m) { m.tensors[0].chunks[0].block_crc32c.push_back(1); }, "block checksums, expected"},
      {"box outside", [](auto& m) { m.tensors[0].chunks[0].box.offsets[0] = 5; }, "lies outside the shape"},
      {"negative box", [](auto& m) { m.tensors[0].chunks[0].box.sizes[0] = -1; }, "lies outside the shape"},
      {"missing chunk", [](auto& m) { m.tensors[0].chunks.mut().pop_back(); },
       "chunks hold 8 elements, the shape [4, 4] has 16"},
      {"extra chunk", [](auto& m) { m.tensors[0].chunks.push_back(m.tensors[0].chunks[0]); }, "chunks hold"},
      {"past file end", [](auto& m) { m.tensors[0].chunks[1].data_offset = 1000; }, "lie outside the"},
      {"unknown dtype", [](auto& m) { m.tensors[1].dtype = static_cast<DType>(77); }, "unknown dtype code 77"},
      {"negative dim", [](auto& m) { m.tensors[1].shape = {-3}; }, "dimension -3 is out of range"},
      {"huge tensor", [](auto& m) { m.tensors[1].shape = {int64_t{1} << 40, int64_t{1} << 40}; }, "size exceeds 2^62 bytes"},
      {"duplicate", [](auto& m) { m.tensors[1].name = m.tensors[0].name; }, "empty, duplicate or out of order"},
      {"empty name", [](auto& m) { m.objects[0].name = ""; }, "empty, duplicate or out of order"},
      {"encoding", [](auto& m) { m.objects[0].encoding = static_cast<ObjectEncoding>(9); }, "unknown encoding 9"},
      {"save id", [](auto& m) { m.save_id = "../x"; }, "save_id \"../x\""},
      {"empty save id", [](auto& m) { m.save_id = ""; }, "save_id \"\""},
      {"file name", [](auto& m) { m.files[0].name = "../../etc/passwd"; }, "is not a single path component"},
      {"dot name", [](auto& m) { m.files[0].name = ".."; }, "is not a single path component"},
      {"writer rank", [](auto& m) { m.files[0].writer_rank = 2; }, "writer rank 2"},
      {"world size", [](auto& m) { m.world_size = 0; }, "world size 0"},
      {"block size", [](auto& m) { m.checksum_block_bytes = 0; }, "checksum block size 0"},
      {"data start", [](auto& m) { m.files[0].data_start = m.files[0].size + 1; }, "data_start"},
  };
  for (const uint32_t major : {2u, 3u}) {
    for (const Violation& v : violations) {
      SCOPED_TRACE(std::string(v.what) + ", version " + std::to_string(major));
      if (v.not_stored_from != 0 && major >= v.not_stored_from) continue;
      CheckpointMetadata m;
      m.save_id = "s1";
      m.world_size = 2;
      m.checksum_block_bytes = 16;
      m.files = {{"d-s1-r00000-f000.safetensors", 64, 64 + 64, 0}};
      TensorMetadata t{"a", DType::kFloat32, {4, 4}, {}};
      t.chunks.push_back({Box({0, 0}, {2, 4}), 0, 0, 32, {1, 2}});
      t.chunks.push_back({Box({2, 0}, {2, 4}), 0, 32, 32, {3, 4}});
      m.tensors.push_back(t);
      m.tensors.push_back({"b", DType::kInt8, {0}, {}});
      m.objects.push_back({"o", ObjectEncoding::kJson, "{}"});
      ASSERT_TRUE(DecodeMetadata(EncodeMetadata(m, major), kPath).ok());
      v.mutate(m);
      ExpectDataLoss(DecodeMetadata(EncodeMetadata(m, major), kPath), v.message);
    }
  }
}

TEST(MetadataHostileTest, NotAMetadataFile) {
  ExpectDataLoss(DecodeMetadata("", kPath), "shorter than the 32-byte header");
  std::string text(200, 'x');
  ExpectDataLoss(DecodeMetadata(text, kPath), "bad magic");
}

// A version-4 record that a decoding keeps whole is checked on paths of its own (a chunk list
// read straight into its packed form, a grid's cells checked by their runs' steps); damaged, it
// fails with the message of the chunk-by-chunk decoding that a filter keeping a part gets.
TEST(MetadataHostileTest, DamagedVersionFourRecordsFailAsTheChunkByChunkDecodingSays) {
  std::mt19937_64 rng(41);
  size_t failed = 0, lists = 0, grids = 0;
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 12);
    CheckpointMetadata summary = m;
    summary.tensors.clear();
    summary.version_major = 4;
    summary.data_file_checksums = summary.checksums_in_headers = true;
    for (const TensorMetadata& t : m.tensors) {
      SCOPED_TRACE(t.name);
      const std::string record =
          native_metadata::EncodeTensorRecord(t, m.checksum_block_bytes, 4);
      const bool grid = record[2 + 8 * t.shape.size()] == native_metadata::kGrid;
      (grid ? grids : lists) += 1;
      // One element at the origin: a part, so every chunk is decoded one by one.
      const std::vector<Box> part = {Box(Dims(t.shape.size(), 0), Dims(t.shape.size(), 1))};
      for (int trial = 0; trial < 40; ++trial) {
        std::string bad = record;
        const size_t at = rng() % bad.size();
        bad[at] = static_cast<char>(trial % 2 == 0 ? rng() : bad[at] + 1);
        const Result<TensorMetadata> whole =
            native_metadata::DecodeTensorRecord(bad, t.name, summary, false, kPath);
        const Result<TensorMetadata> one_by_one =
            native_metadata::DecodeTensorRecord(bad, t.name, summary, false, kPath, &part);
        EXPECT_EQ(whole.status(), one_by_one.status()) << "byte " << at;
        failed += !whole.ok();
      }
    }
  }
  EXPECT_GT(lists, 20u);
  EXPECT_GT(grids, 20u);
  EXPECT_GT(failed, 1000u);
}

}  // namespace
}  // namespace sp
