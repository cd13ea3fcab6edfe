#include "shardpoint/format/safetensors/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "shardpoint/base/coding.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

constexpr char kPath[] = "/hf/model.safetensors";

// `bytes` as a file of a fresh in-memory store, opened for reading.
std::unique_ptr<ReadableFile> FileOf(const std::string& bytes) {
  MemoryStore store;
  EXPECT_TRUE(store.CreateDirs("/hf").ok());
  auto out = store.NewWritableFile(kPath);
  EXPECT_TRUE(out.ok() && (*out)->WriteAt(0, AsBytes(bytes)).ok() && (*out)->Close().ok());
  return std::move(store.OpenReadable(kPath)).value();
}

// A header followed by `data_bytes` zero bytes.
std::string WholeFile(const std::vector<SafetensorsEntry>& entries,
                      const std::map<std::string, std::string>& metadata, uint64_t data_bytes) {
  return EncodeSafetensorsHeader(entries, metadata) + std::string(data_bytes, '\0');
}

// A file whose header JSON is `json` (not padded) and whose data section has `data_bytes` bytes.
std::string RawFile(std::string_view json, uint64_t data_bytes) {
  std::string out(8, '\0');
  EncodeFixed64(out.data(), json.size());
  out.append(json);
  out.append(data_bytes, '\0');
  return out;
}

void ExpectCorrupt(const std::string& file, std::string_view fragment) {
  Result<SafetensorsHeader> r = ParseSafetensorsHeader(file, file.size(), kPath);
  ASSERT_FALSE(r.ok()) << fragment;
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find(fragment), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find(kPath), std::string::npos) << r.status();
}

std::vector<SafetensorsEntry> RandomEntries(std::mt19937_64& rng, uint64_t* data_bytes) {
  std::vector<SafetensorsEntry> entries;
  uint64_t offset = 0;
  for (int i = 0, n = rng() % 12; i < n; ++i) {
    SafetensorsEntry e;
    e.name = "t" + std::to_string(i) + (rng() % 2 ? "@0,4" : "\xc3\xa9\"\\\n");
    e.dtype = AllDTypes()[rng() % AllDTypes().size()];
    for (int d = 0, rank = rng() % 4; d < rank; ++d) e.shape.push_back(rng() % 5);
    e.begin = offset;
    e.end = offset + ShapeVolume(e.shape) * DTypeSize(e.dtype);
    offset = e.end;
    entries.push_back(e);
  }
  *data_bytes = offset;
  return entries;
}

TEST(SafetensorsTest, RandomHeadersRoundTrip) {
  std::mt19937_64 rng(9);
  for (int trial = 0; trial < 300; ++trial) {
    uint64_t data_bytes;
    std::vector<SafetensorsEntry> entries = RandomEntries(rng, &data_bytes);
    std::map<std::string, std::string> metadata;
    if (rng() % 2) metadata = {{"format", "shardpoint"}, {"k\u00e9y", "v\t\"x\""}};
    std::string file = WholeFile(entries, metadata, data_bytes);
    uint64_t header_length = DecodeFixed64(file.data());
    ASSERT_EQ(header_length % 8, 0u);
    Result<SafetensorsHeader> r = ParseSafetensorsHeader(file, file.size(), kPath);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->data_start, 8 + header_length);
    EXPECT_EQ(r->entries, entries);
    EXPECT_EQ(r->metadata, metadata);
    Result<SafetensorsHeader> read = ReadSafetensorsHeader(*FileOf(file));
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->entries, entries);
  }
}

TEST(SafetensorsTest, HeadersPaddedToADataAlignmentParseTheSame) {
  std::mt19937_64 rng(10);
  for (int trial = 0; trial < 50; ++trial) {
    uint64_t data_bytes;
    std::vector<SafetensorsEntry> entries = RandomEntries(rng, &data_bytes);
    const std::map<std::string, std::string> metadata = {{"format", "shardpoint"}};
    for (uint64_t alignment : {uint64_t{8}, uint64_t{512}, uint64_t{4096}}) {
      std::string file = EncodeSafetensorsHeader(entries, metadata, alignment);
      ASSERT_EQ(file.size() % alignment, 0u) << alignment;
      ASSERT_LT(file.size(), EncodeSafetensorsHeader(entries, metadata).size() + alignment);
      file.append(data_bytes, '\x5a');
      Result<SafetensorsHeader> r = ParseSafetensorsHeader(file, file.size(), kPath);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->data_start % alignment, 0u);
      EXPECT_EQ(r->entries, entries);
      EXPECT_EQ(r->metadata, metadata);
    }
  }
}

std::string ReadFixture() {
  std::ifstream in(SP_SAFETENSORS_TESTDATA "/python_written.safetensors", std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// python_written.safetensors was written by the reference Python package (testdata/make_fixture.py).
TEST(SafetensorsTest, ReadsAFileWrittenByTheReferenceImplementation) {
  std::string file = ReadFixture();
  ASSERT_EQ(file.size(), 538u);
  Result<SafetensorsHeader> r = ParseSafetensorsHeader(file, file.size(), "python_written");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->metadata, (std::map<std::string, std::string>{{"note", "h\xc3\xa9llo \"quoted\"\n\t\x01"}}));
  std::vector<SafetensorsEntry> expected = {
      {"ids", DType::kInt64, {2}, 0, 16},          {"step", DType::kInt64, {}, 16, 24},
      {"weight", DType::kFloat32, {2, 3}, 24, 48}, {"bias", DType::kFloat16, {3}, 48, 54},
      {"name\xc3\xa9\"q", DType::kInt8, {1}, 54, 55}, {"empty", DType::kUInt8, {0, 4}, 55, 55},
      {"flags", DType::kBool, {3}, 55, 58},
  };
  EXPECT_EQ(r->entries, expected);
  const char* data = file.data() + r->data_start;
  int64_t ids[2];
  std::memcpy(ids, data, 16);
  EXPECT_EQ(ids[1], int64_t{1} << 40);
  EXPECT_EQ(DecodeFixed64(data + 16), 5u);
  float weight[6];
  std::memcpy(weight, data + 24, 24);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(weight[i], 0.5f * i);
  EXPECT_EQ(std::string(data + 55, 3), std::string("\x01\x00\x01", 3));
  // Given the same entries and metadata, shardpoint writes the reference's header byte for byte.
  EXPECT_EQ(EncodeSafetensorsHeader(r->entries, r->metadata), file.substr(0, r->data_start));
}

TEST(SafetensorsTest, ScalarsAndEmptyTensorsAreValid) {
  std::vector<SafetensorsEntry> entries = {{"e", DType::kFloat32, {0, 3}, 0, 0},
                                           {"s", DType::kComplex128, {}, 0, 16}};
  std::string file = WholeFile(entries, {}, 16);
  Result<SafetensorsHeader> r = ParseSafetensorsHeader(file, file.size(), kPath);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->entries, entries);
  std::string empty = WholeFile({}, {}, 0);
  EXPECT_EQ(empty.size(), 16u);  // "{}" padded to 8
  ASSERT_TRUE(ParseSafetensorsHeader(empty, empty.size(), kPath).ok());
}

TEST(SafetensorsTest, ValidationRulesNameTheFileAndEntry) {
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  ExpectCorrupt(RawFile("{" + a + "}", 4), "the entries cover 8 data bytes but the file holds 4");
  ExpectCorrupt(RawFile("{" + a + "}", 9), "the entries cover 8 data bytes but the file holds 9");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,7]}})", 7),
                "entry \"a\": data_offsets [0, 7) hold 7 bytes, expected 8 for shape [2] of F32");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                "entry \"a\": data_offsets begin at 4, expected 0 (hole)");
  ExpectCorrupt(RawFile("{" + a + R"(,"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})", 8),
                "entry \"b\": data_offsets begin at 4, expected 8 (overlap)");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"X9","shape":[],"data_offsets":[0,1]}})", 1),
                "entry \"a\": unknown dtype \"X9\"");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"U8","shape":[],"data_offsets":[1,0]}})", 1),
                "end before they begin");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"U8","shape":[]}})", 0), "entry \"a\": missing field \"data_offsets\"");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"U8","shape":[],"data_offsets":[0,1],"x":1}})", 1),
                "entry \"a\": unexpected field \"x\"");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"U8","shape":[],"data_offsets":[0]}})", 1),
                "\"data_offsets\" is not an array of two integers");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"U8","shape":{},"data_offsets":[0,1]}})", 1), "\"shape\" is not an array");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":1,"shape":[],"data_offsets":[0,1]}})", 1), "\"dtype\" is not a string");
  ExpectCorrupt(RawFile(R"({"a":[]})", 0), "entry \"a\": value is not an object");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,1]}})", 1),
                "shape dimension is not an integer in [0, 2^63)");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", 1),
                "element count overflows 64 bits");
  ExpectCorrupt(RawFile(R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,1]}})", 1),
                "byte size overflows 64 bits");
  ExpectCorrupt(RawFile(R"({"__metadata__":{"k":1}})", 0), "\"__metadata__\" value of \"k\" is not a string");
  ExpectCorrupt(RawFile(R"({"__metadata__":[]})", 0), "\"__metadata__\" is not an object");
  ExpectCorrupt(RawFile(R"({"a":1,"a":2})", 0), "header JSON: duplicate key \"a\" at byte 7");
  ExpectCorrupt(RawFile(R"([])", 0), "header does not start with '{'");
  ExpectCorrupt(RawFile(R"( {})", 0), "header does not start with '{'");
  ExpectCorrupt(RawFile("", 0), "header does not start with '{'");
  ExpectCorrupt("1234567", "too short for the 8-byte header length");
}

TEST(SafetensorsTest, SubByteDTypesAreUnimplemented) {
  std::string file = RawFile(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", 1);
  Result<SafetensorsHeader> r = ParseSafetensorsHeader(file, file.size(), kPath);
  EXPECT_EQ(r.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(r.status().message().find("dtype F4 is not supported"), std::string::npos);
}

TEST(SafetensorsTest, HeaderLengthIsCappedAndCheckedAgainstTheFile) {
  std::string file(16, '\0');
  EncodeFixed64(file.data(), 100'000'001);
  ExpectCorrupt(file, "header length 100000001 exceeds the limit of 100000000 bytes");
  EncodeFixed64(file.data(), 9);
  ExpectCorrupt(file, "header length 9 runs past the end of the file (16 bytes)");
  EncodeFixed64(file.data(), UINT64_MAX);
  ExpectCorrupt(file, "exceeds the limit");
  EXPECT_EQ(ReadSafetensorsHeader(*FileOf(file)).status().code(), StatusCode::kDataLoss);
  // A caller that passes fewer bytes than the header needs gets kDataLoss, not a read past them.
  std::string good = WholeFile({{"a", DType::kUInt8, {1}, 0, 1}}, {}, 1);
  Result<SafetensorsHeader> r = ParseSafetensorsHeader(std::string_view(good).substr(0, 20), good.size(), kPath);
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("header truncated"), std::string::npos);
  r = ParseSafetensorsHeader(std::string_view(good).substr(0, 3), good.size(), kPath);
  EXPECT_NE(r.status().message().find("header truncated: 8 bytes expected, 3 available"),
            std::string::npos) << r.status();
}

TEST(SafetensorsTest, EveryTruncationAndBitFlipFailsCleanly) {
  std::mt19937_64 rng(10);
  uint64_t data_bytes;
  std::vector<SafetensorsEntry> entries = RandomEntries(rng, &data_bytes);
  while (entries.size() < 3) entries = RandomEntries(rng, &data_bytes);
  std::string file = WholeFile(entries, {{"format", "shardpoint"}}, data_bytes);
  for (size_t length = 0; length < file.size(); ++length) {
    std::string cut = file.substr(0, length);
    Result<SafetensorsHeader> r = ParseSafetensorsHeader(cut, cut.size(), kPath);
    ASSERT_FALSE(r.ok()) << "length " << length;
    ASSERT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  }
  int accepted = 0;
  for (size_t i = 0; i < file.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::string flipped = file;
      flipped[i] ^= static_cast<char>(1 << bit);
      Result<SafetensorsHeader> r = ParseSafetensorsHeader(flipped, flipped.size(), kPath);
      if (r.ok()) {
        ++accepted;  // e.g. a changed letter in a name or a metadata value: still a valid file
        continue;
      }
      StatusCode code = r.status().code();
      ASSERT_TRUE(code == StatusCode::kDataLoss || code == StatusCode::kUnimplemented) << r.status();
    }
  }
  EXPECT_LT(accepted, static_cast<int>(file.size()) * 8);
}

}  // namespace
}  // namespace sp
