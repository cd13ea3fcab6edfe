#include "shardpoint/format/safetensors/hf_directory.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

struct Tensor {
  std::string name;
  DType dtype;
  Shape shape;
};

// A safetensors file holding `tensors` (data bytes i % 251) with the given __metadata__.
std::string FileBytes(const std::vector<Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {}) {
  std::vector<SafetensorsEntry> entries;
  uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    const uint64_t bytes = ShapeVolume(t.shape) * DTypeSize(t.dtype);
    entries.push_back({t.name, t.dtype, t.shape, offset, offset + bytes});
    offset += bytes;
  }
  std::string out = EncodeSafetensorsHeader(entries, metadata);
  for (uint64_t i = 0; i < offset; ++i) out.push_back(static_cast<char>(i % 251));
  return out;
}

class HfDirectoryTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(store_.CreateDirs("/hf").ok()); }

  void Write(const std::string& name, const std::string& bytes) {
    auto out = store_.NewWritableFile(JoinPath("/hf", name));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)->WriteAt(0, AsBytes(bytes)).ok());
    ASSERT_TRUE((*out)->Close().ok());
  }

  Result<CheckpointMetadata> Read(std::string_view path = "/hf") {
    return ReadSafetensorsDirectory(store_, path, &pool_);
  }

  void ExpectError(StatusCode code, const std::vector<std::string>& fragments) {
    Result<CheckpointMetadata> r = Read();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    for (const std::string& f : fragments) {
      EXPECT_NE(r.status().message().find(f), std::string::npos) << f << " in " << r.status();
    }
  }

  MemoryStore store_;
  ThreadPool pool_{3};
};

TEST_F(HfDirectoryTest, DirectoryWithoutIndexGivesOneWholeChunkPerTensor) {
  const std::string a = FileBytes({{"w", DType::kBFloat16, {4, 6}}, {"b", DType::kFloat32, {6}},
                                   {"empty", DType::kFloat32, {0, 3}}},
                                  {{"format", "pt"}});
  Write("model-00001-of-00002.safetensors", a);
  Write("model-00002-of-00002.safetensors", FileBytes({{"step", DType::kInt64, {}}}));
  Write("README.md", "not a checkpoint file");
  Write(".hidden.safetensors", "ignored");
  ASSERT_TRUE(store_.CreateDirs("/hf/sharded.safetensors").ok());  // a directory: ignored
  Result<CheckpointMetadata> md = Read();
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->format, CheckpointFormat::kSafetensors);
  EXPECT_EQ(md->checksum_block_bytes, 0u);
  ASSERT_EQ(md->files.size(), 2u);
  EXPECT_EQ(md->files[0].name, "model-00001-of-00002.safetensors");
  EXPECT_EQ(md->files[0].size, a.size());
  Result<SafetensorsHeader> header = ParseSafetensorsHeader(a, a.size(), "a");
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(md->files[0].data_start, header->data_start);
  ASSERT_EQ(md->tensors.size(), 4u);  // sorted by name
  EXPECT_EQ(md->tensors[0].name, "b");
  EXPECT_EQ(md->tensors[1].name, "empty");
  EXPECT_TRUE(md->tensors[1].chunks.empty());
  EXPECT_EQ(md->tensors[1].shape, (Shape{0, 3}));
  const TensorMetadata& w = *md->FindTensor("w");
  EXPECT_EQ(w.dtype, DType::kBFloat16);
  EXPECT_EQ(w.shape, (Shape{4, 6}));
  ASSERT_EQ(w.chunks.size(), 1u);
  EXPECT_EQ(w.chunks[0].box, Box({0, 0}, {4, 6}));
  EXPECT_EQ(w.chunks[0].data_offset, 0u);
  EXPECT_EQ(w.chunks[0].byte_length, 48u);
  EXPECT_TRUE(w.chunks[0].block_crc32c.empty());
  EXPECT_EQ(md->FindTensor("b")->chunks[0].data_offset, 48u);
  const TensorMetadata& step = *md->FindTensor("step");
  EXPECT_EQ(step.shape, Shape{});
  EXPECT_EQ(step.chunks[0].file, 1u);
  EXPECT_EQ(step.chunks[0].byte_length, 8u);
}

TEST_F(HfDirectoryTest, ASingleFileIsACheckpointWhoseFileResolvesToItsPath) {
  Write("model.safetensors", FileBytes({{"x", DType::kFloat16, {3, 2}}}));
  Result<CheckpointMetadata> md = Read("/hf/model.safetensors");
  ASSERT_TRUE(md.ok()) << md.status();
  ASSERT_EQ(md->files.size(), 1u);
  EXPECT_EQ(JoinPath("/hf/model.safetensors", md->files[0].name), "/hf/model.safetensors");
  EXPECT_EQ(md->FindTensor("x")->shape, (Shape{3, 2}));
  EXPECT_TRUE(*LooksLikeSafetensorsCheckpoint(store_, "/hf/model.safetensors"));
  EXPECT_TRUE(*LooksLikeSafetensorsCheckpoint(store_, "/hf"));
}

TEST_F(HfDirectoryTest, Detection) {
  EXPECT_FALSE(*LooksLikeSafetensorsCheckpoint(store_, "/hf"));  // empty directory
  Write("notes.txt", "x");
  EXPECT_FALSE(*LooksLikeSafetensorsCheckpoint(store_, "/hf"));
  EXPECT_FALSE(*LooksLikeSafetensorsCheckpoint(store_, "/hf/notes.txt"));
  EXPECT_EQ(LooksLikeSafetensorsCheckpoint(store_, "/nowhere").status().code(),
            StatusCode::kNotFound);
  ExpectError(StatusCode::kNotFound, {"no safetensors checkpoint at /hf"});
  Write(kSafetensorsIndexFileName, R"({"weight_map": {}})");
  EXPECT_TRUE(*LooksLikeSafetensorsCheckpoint(store_, "/hf"));
}

TEST_F(HfDirectoryTest, TheIndexPicksTheFilesAndIsCheckedAgainstTheHeaders) {
  Write("model-00001-of-00002.safetensors", FileBytes({{"a", DType::kFloat32, {2}}}));
  Write("model-00002-of-00002.safetensors",
        FileBytes({{"b", DType::kFloat32, {2}}, {"c", DType::kInt8, {5}}}));
  Write("consolidated.safetensors", FileBytes({{"a", DType::kFloat32, {2}}}));  // not indexed
  Write(kSafetensorsIndexFileName, R"({
  "metadata": {"total_size": 21, "format": "pt", "ratio": 0.5, "flag": true, "none": null},
  "weight_map": {"a": "model-00001-of-00002.safetensors",
                 "b": "model-00002-of-00002.safetensors",
                 "c": "model-00002-of-00002.safetensors"}
})");
  Result<CheckpointMetadata> md = Read();
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->files.size(), 2u);
  EXPECT_EQ(md->tensors.size(), 3u);
  EXPECT_EQ(md->attributes.at("total_size"), "21");
  EXPECT_EQ(md->attributes.at("format"), "pt");
  EXPECT_EQ(md->attributes.at("ratio"), "0.5");
  EXPECT_EQ(md->FindTensor("c")->chunks[0].file, 1u);
}

TEST_F(HfDirectoryTest, IndexMismatchesAreErrorsNamingTensorAndFiles) {
  Write("m1.safetensors", FileBytes({{"a", DType::kFloat32, {2}}}));
  Write("m2.safetensors", FileBytes({{"b", DType::kFloat32, {2}}}));
  Write(kSafetensorsIndexFileName,
        R"({"weight_map": {"a": "m1.safetensors", "b": "m1.safetensors"}})");
  ExpectError(StatusCode::kDataLoss, {"weight_map puts tensor 'b' in m1.safetensors",
                                      "whose header does not hold it"});
  Write(kSafetensorsIndexFileName,
        R"({"weight_map": {"a": "m1.safetensors", "b": "m2.safetensors", "z": "m2.safetensors"}})");
  ExpectError(StatusCode::kDataLoss, {"tensor 'z' in m2.safetensors"});
  Write(kSafetensorsIndexFileName, R"({"weight_map": {"a": "m1.safetensors"}})");
  Write("m1.safetensors",
        FileBytes({{"a", DType::kFloat32, {2}}, {"extra", DType::kFloat32, {1}}}));
  ExpectError(StatusCode::kDataLoss,
              {"tensor 'extra' of m1.safetensors is not in the weight_map"});
  Write(kSafetensorsIndexFileName, R"({"weight_map": {"a": "m3.safetensors"}})");
  ExpectError(StatusCode::kDataLoss, {"names data file m3.safetensors, which is missing"});
  Write(kSafetensorsIndexFileName, R"({"weight_map": {"a": "../m1.safetensors"}})");
  ExpectError(StatusCode::kDataLoss, {"\"../m1.safetensors\", which is not a file name"});
  Write(kSafetensorsIndexFileName, R"({"weight_map": {"a": 3}})");
  ExpectError(StatusCode::kDataLoss, {"weight_map value of \"a\" is not a file name"});
  Write(kSafetensorsIndexFileName, R"({"metadata": {}})");
  ExpectError(StatusCode::kDataLoss, {"no \"weight_map\" object"});
  Write(kSafetensorsIndexFileName, R"({"weight_map": {"a": "m1.safetensors",})");
  ExpectError(StatusCode::kDataLoss, {kSafetensorsIndexFileName, "at byte"});
}

TEST_F(HfDirectoryTest, AKeyInTwoFilesIsAnErrorNamingBoth) {
  Write("m1.safetensors", FileBytes({{"a", DType::kFloat32, {2}}}));
  Write("m2.safetensors", FileBytes({{"a", DType::kFloat32, {2}}}));
  ExpectError(StatusCode::kDataLoss,
              {"tensor 'a' is in both /hf/m1.safetensors and /hf/m2.safetensors"});
}

TEST_F(HfDirectoryTest, HostileHeadersGiveTheCodecsErrorNamingTheFile) {
  Write("m1.safetensors", FileBytes({{"a", DType::kFloat32, {2}}}));
  std::string bad = FileBytes({{"b", DType::kFloat32, {4}}});
  bad.resize(bad.size() - 3);  // truncated data section
  Write("m2.safetensors", bad);
  ExpectError(StatusCode::kDataLoss, {"safetensors file /hf/m2.safetensors",
                                      "the entries cover 16 data bytes"});
  Write("m2.safetensors", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10));
  ExpectError(StatusCode::kDataLoss, {"/hf/m2.safetensors", "exceeds the limit"});
  Write("m2.safetensors", "abc");
  ExpectError(StatusCode::kDataLoss, {"/hf/m2.safetensors", "too short"});
}

TEST_F(HfDirectoryTest, DataFilesOfAnUncommittedNativeCheckpointAreRefused) {
  Write("d-s1-r00000-f000.safetensors",
        FileBytes({{"a@0", DType::kFloat32, {2}}},
                  {{"format", "shardpoint"}, {"format_version", "1.0"}, {"save_id", "s1"}}));
  ExpectError(StatusCode::kNotFound,
              {"no committed checkpoint at /hf (/hf/d-s1-r00000-f000.safetensors is a data file "
               "of a shardpoint save whose metadata is missing)"});
}

std::string Sharding(const std::map<std::string, std::vector<int>>& offsets) {
  std::string json = "{";
  for (const auto& [fqn, o] : offsets) {
    if (json.size() > 1) json += ", ";
    json += "\"" + fqn + "\": {\"saved_offsets\": [";
    for (size_t i = 0; i < o.size(); ++i) json += (i ? ", " : "") + std::to_string(o[i]);
    json += "]}";
  }
  return json + "}";
}

TEST_F(HfDirectoryTest, DcpShardedFilesBecomeChunksAtTheirGlobalOffsets) {
  // "w" [5, 4] split 3 + 2 rows, "v" [4] split 2 + 2, "s" a scalar on rank 0 only.
  Write("shard-00001-model-00001-of-00001.safetensors",
        FileBytes({{"w", DType::kFloat32, {3, 4}}, {"v", DType::kInt32, {2}},
                   {"s", DType::kInt64, {}}},
                  {{kDcpShardingInfoKey, Sharding({{"w", {0, 0}}, {"v", {0}}, {"s", {}}})},
                   {"DCP_VERSION", "1.0"}, {"format", "pt"}}));
  Write("shard-00002-model-00001-of-00001.safetensors",
        FileBytes({{"w", DType::kFloat32, {2, 4}}, {"v", DType::kInt32, {2}}},
                  {{kDcpShardingInfoKey, Sharding({{"w", {3, 0}}, {"v", {2}}})}}));
  Result<CheckpointMetadata> md = Read();
  ASSERT_TRUE(md.ok()) << md.status();
  const TensorMetadata& w = *md->FindTensor("w");
  EXPECT_EQ(w.shape, (Shape{5, 4}));
  ASSERT_EQ(w.chunks.size(), 2u);
  EXPECT_EQ(w.chunks[0].box, Box({0, 0}, {3, 4}));
  EXPECT_EQ(w.chunks[0].file, 0u);
  EXPECT_EQ(w.chunks[1].box, Box({3, 0}, {2, 4}));
  EXPECT_EQ(w.chunks[1].file, 1u);
  EXPECT_EQ(w.chunks[1].data_offset, 0u);
  EXPECT_EQ(w.chunks[1].byte_length, 32u);
  EXPECT_EQ(md->FindTensor("v")->shape, Shape{4});
  EXPECT_EQ(md->FindTensor("s")->shape, Shape{});
}

TEST_F(HfDirectoryTest, HostileShardingInfoIsRefused) {
  struct Case {
    std::string info;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"[1]", "DCP_SHARDING_INFO is not a JSON object"},
      {"{\"w\": {\"saved_offsets\": [0]}}", "tensor 'w': 1 saved_offsets for a chunk of shape [3, 4]"},
      {"{\"w\": {}}", "tensor 'w': no \"saved_offsets\" array"},
      {"{\"w\": 7}", "tensor 'w': no \"saved_offsets\" array"},
      {"{\"q\": {\"saved_offsets\": [0, 0]}}", "tensor 'q': not stored in the file"},
      {"{\"w\": {\"saved_offsets\": [0, 9223372036854775806]}}", "inside int64"},
      {"{\"w\": {\"saved_offsets\": [0, -1]}}", "saved_offsets are not integers"},
      {"{\"w\": {\"saved_offsets\": [0, 0]}", "DCP_SHARDING_INFO: unexpected end of JSON"},
  };
  for (const Case& c : cases) {
    Write("m.safetensors",
          FileBytes({{"w", DType::kFloat32, {3, 4}}}, {{kDcpShardingInfoKey, c.info}}));
    ExpectError(StatusCode::kDataLoss, {"/hf/m.safetensors", c.fragment});
  }
}

TEST_F(HfDirectoryTest, ShardingOffsetsNear2To62AreRefusedBeforeAnySizeWraps) {
  // Issue 13 defect 2: a 2x2 chunk at offsets near 2^62 makes a shape whose element count wraps.
  Write("m.safetensors",
        FileBytes({{"w", DType::kFloat32, {2, 2}}},
                  {{kDcpShardingInfoKey, "{\"w\": {\"saved_offsets\": [4611686018427387900, "
                                         "4611686018427387900]}}"}}));
  ExpectError(StatusCode::kDataLoss,
              {"tensor 'w' (DCP_SHARDING_INFO of /hf/m.safetensors): shape [4611686018427387902, "
               "4611686018427387902] of float32 exceeds 2^62 bytes"});
  // One dimension alone past 2^62 bytes (int8: 2^62 + 2 elements).
  Write("m.safetensors",
        FileBytes({{"w", DType::kInt8, {2}}},
                  {{kDcpShardingInfoKey, "{\"w\": {\"saved_offsets\": [4611686018427387904]}}"}}));
  ExpectError(StatusCode::kDataLoss, {"tensor 'w' (DCP_SHARDING_INFO of /hf/m.safetensors): "
                                      "dimension 0 of shape [4611686018427387906] is out of range"});
  // The largest shape within the limit is accepted (2^62 one-byte elements).
  Write("m.safetensors",
        FileBytes({{"w", DType::kInt8, {2}}},
                  {{kDcpShardingInfoKey, "{\"w\": {\"saved_offsets\": [4611686018427387902]}}"}}));
  Result<CheckpointMetadata> md = Read();
  ASSERT_TRUE(md.ok()) << md.status();
  EXPECT_EQ(md->tensors[0].shape, Shape{int64_t{1} << 62});
}

TEST_F(HfDirectoryTest, ShardedChunksMustAgreeOnDtypeAndRank) {
  Write("a.safetensors", FileBytes({{"w", DType::kFloat32, {2, 4}}},
                                   {{kDcpShardingInfoKey, Sharding({{"w", {0, 0}}})}}));
  Write("b.safetensors", FileBytes({{"w", DType::kFloat16, {2, 4}}},
                                   {{kDcpShardingInfoKey, Sharding({{"w", {2, 0}}})}}));
  ExpectError(StatusCode::kDataLoss, {"tensor 'w' is in both /hf/a.safetensors and "
                                      "/hf/b.safetensors with different dtypes or ranks"});
  Write("b.safetensors", FileBytes({{"w", DType::kFloat32, {2, 4}}}));  // no offsets
  ExpectError(StatusCode::kDataLoss, {"without DCP sharding offsets"});
}

}  // namespace
}  // namespace sp
