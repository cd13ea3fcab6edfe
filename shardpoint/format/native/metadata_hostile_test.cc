// The native metadata decoder against hostile input: truncations, bit flips, forged counts,
// inconsistent contents, and versions from the future.
#include <gtest/gtest.h>

#include <functional>
#include <random>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
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

// Lays out `sections` behind a correct header of version 1.<minor>.
std::string Assemble(const std::vector<SectionBytes>& sections, uint32_t minor) {
  std::string out;
  ByteWriter w(&out);
  const uint32_t header_length = 32 + 24 * sections.size() + 4;
  uint64_t size = header_length;
  for (const SectionBytes& s : sections) size += s.bytes.size();
  w.PutRaw(std::string_view("\x89SPMD\r\n\x1a", 8));
  w.PutU32(1);
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
      bool in_major = i >= 8 && i < 12;
      StatusCode expected = in_major && (i > 8 || bit > 0) ? StatusCode::kFailedPrecondition
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
  EncodeFixed32(bytes.data() + 8, 2);
  EncodeFixed32(bytes.data() + 152, Crc32c(bytes.data(), 152));
  Result<CheckpointMetadata> r = DecodeMetadata(bytes, kPath);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.status().message(), std::string("metadata file ") + kPath +
                                      ": checkpoint format version 2.0 is newer than this reader (1.x)");
  EncodeFixed32(bytes.data() + 8, 0);
  ExpectDataLoss(DecodeMetadata(bytes, kPath), "unknown format version 0.0");
}

TEST(MetadataHostileTest, NewerMinorMayAppendSectionsAndSummaryBytes) {
  CheckpointMetadata m = RandomMetadata(35, 5);
  std::vector<SectionBytes> sections = SplitSections(EncodeMetadata(m));
  sections[0].bytes += "future summary fields";
  sections.push_back({"a section from version 1.3", 7});
  Result<CheckpointMetadata> r = DecodeMetadata(Assemble(sections, 3), kPath);
  ASSERT_TRUE(r.ok()) << r.status();
  m.version_minor = 3;
  ExpectMetadataEq(m, *r);
  // The same bytes claiming version 1.0 are corrupt.
  ExpectDataLoss(DecodeMetadata(Assemble(sections, 0), kPath), "unexpected bytes after the summary");
  sections[0].bytes.resize(sections[0].bytes.size() - 21);
  ASSERT_TRUE(DecodeMetadata(Assemble(sections, 0), kPath).ok());  // an extra section alone is fine
}

TEST(MetadataHostileTest, NewerMinorMayAppendRecordBytes) {
  CheckpointMetadata m = RandomMetadata(36, 2);
  std::string record = native_metadata::EncodeTensorRecord(m.tensors[0]) + "extension";
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
  // A tensor record's chunk count, right after the dtype, rank and shape.
  CheckpointMetadata m = RandomMetadata(37, 3);
  std::string record = native_metadata::EncodeTensorRecord(m.tensors[0]);
  EncodeFixed32(record.data() + 2 + 8 * m.tensors[0].shape.size(), 0x7FFFFFFF);
  Result<TensorMetadata> t = native_metadata::DecodeTensorRecord(record, "t", m, false, kPath);
  EXPECT_EQ(t.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(t.status().message().find("cannot fit"), std::string::npos) << t.status();
}

TEST(MetadataHostileTest, EveryTruncatedOrFlippedRecordFailsCleanly) {
  CheckpointMetadata m = RandomMetadata(38, 12);
  std::mt19937_64 rng(38);
  for (const TensorMetadata& tensor : m.tensors) {
    std::string record = native_metadata::EncodeTensorRecord(tensor);
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

struct Violation {
  const char* what;
  std::function<void(CheckpointMetadata&)> mutate;
  const char* message;
};

TEST(MetadataHostileTest, InconsistentContentsAreDataLoss) {
  const std::vector<Violation> violations = {
      {"file index", [](auto& m) { m.tensors[0].chunks[0].file = 99; }, "file index 99 is out of range"},
      {"byte length", [](auto& m) { m.tensors[0].chunks[0].byte_length += 1; }, "byte length"},
      {"block count", [](auto& m) { m.tensors[0].chunks[0].block_crc32c.push_back(1); }, "block checksums, expected"},
      {"box outside", [](auto& m) { m.tensors[0].chunks[0].box.offsets[0] = 5; }, "lies outside the shape"},
      {"negative box", [](auto& m) { m.tensors[0].chunks[0].box.sizes[0] = -1; }, "lies outside the shape"},
      {"missing chunk", [](auto& m) { m.tensors[0].chunks.pop_back(); }, "chunks hold 8 elements, the shape [4, 4] has 16"},
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
  for (const Violation& v : violations) {
    SCOPED_TRACE(v.what);
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
    ASSERT_TRUE(DecodeMetadata(EncodeMetadata(m), kPath).ok());
    v.mutate(m);
    ExpectDataLoss(DecodeMetadata(EncodeMetadata(m), kPath), v.message);
  }
}

TEST(MetadataHostileTest, NotAMetadataFile) {
  ExpectDataLoss(DecodeMetadata("", kPath), "shorter than the 32-byte header");
  std::string text(200, 'x');
  ExpectDataLoss(DecodeMetadata(text, kPath), "bad magic");
}

}  // namespace
}  // namespace sp
