// Verify reports what load and consolidate refuse (issue 13, defects 1, 2 and 8): sizes past the
// shared limits, DCP items that do not decode to their chunk, and native data-file headers whose
// __metadata__ block disagrees with the metadata.
#include <gtest/gtest.h>

#include <string>

#include "shardpoint/checkpoint.h"
#include "shardpoint/manage/consolidate.h"
#include "shardpoint/manage/diff.h"
#include "shardpoint/engine/edit_test_util.h"
#include "shardpoint/format/safetensors/hf_directory.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_dcp/test_util.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

using torch_dcp::FloatTensorItem;
using torch_dcp::WriteOneItemDcp;

void WriteFile(Store& store, const std::string& path, const std::string& bytes) {
  auto out = store.NewWritableFile(path);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_TRUE((*out)->WriteAt(0, AsBytes(bytes)).ok());
  ASSERT_TRUE((*out)->Close().ok());
}

// Verify, diff and consolidate all refuse the checkpoint at `path` with `message`, and
// consolidate leaves nothing behind in its output directory (no .partial file).
void ExpectEveryToolRefuses(MemoryStore& store, const std::string& path,
                            const std::string& message) {
  Result<VerifyReport> report = Verify(path, &store);
  ASSERT_FALSE(report.ok()) << "verify found " << report->defects.size() << " defects";
  EXPECT_EQ(report.status().code(), StatusCode::kDataLoss) << report.status();
  EXPECT_NE(report.status().message().find(message), std::string::npos) << report.status();
  DiffOptions diff;
  diff.store_a = &store;
  diff.store_b = &store;
  Result<DiffReport> compared = Diff(path, path, diff);
  ASSERT_FALSE(compared.ok());
  EXPECT_NE(compared.status().message().find(message), std::string::npos) << compared.status();
  ConsolidateOptions options;
  options.store = &store;
  Result<ConsolidateResult> out = Consolidate(path, "/out", options);
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find(message), std::string::npos) << out.status();
  Result<std::vector<DirEntry>> left = store.ListDir("/out");
  if (left.ok()) {
    for (const DirEntry& e : *left) ADD_FAILURE() << "consolidate left /out/" << e.name;
  }
}

TEST(VerifyTest, Defect1WrappingDcpSizeIsRefusedByEveryTool) {
  constexpr int64_t kWrapping = 0x5555555555555556;  // 3 * it wraps to 2
  MemoryStore store;
  WriteOneItemDcp(store, "/dcp", "w", {3, kWrapping}, FloatTensorItem(1, {3, kWrapping}, {0, 0}));
  ExpectEveryToolRefuses(store, "/dcp",
                         "DCP metadata /dcp/.metadata: key 'w' size: dimension 1 of shape [3, "
                         "6148914691236517206] is out of range [0, 2^62]");
}

TEST(VerifyTest, Defect2ShardingOffsetsNear2To62AreRefusedByEveryTool) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("/hf").ok());
  const std::vector<SafetensorsEntry> entries = {{"w", DType::kFloat32, {2, 2}, 0, 16}};
  const std::string info = "{\"w\": {\"saved_offsets\": [4611686018427387900, 4611686018427387900]}}";
  WriteFile(store, "/hf/m.safetensors",
            EncodeSafetensorsHeader(entries, {{kDcpShardingInfoKey, info}}) + std::string(16, '\1'));
  ExpectEveryToolRefuses(store, "/hf",
                         "tensor 'w' (DCP_SHARDING_INFO of /hf/m.safetensors): shape "
                         "[4611686018427387902, 4611686018427387902] of float32 exceeds 2^62 bytes");
}

VerifyReport VerifyOk(MemoryStore& store, const std::string& path) {
  Result<VerifyReport> report = Verify(path, &store);
  EXPECT_TRUE(report.ok()) << report.status();
  return report.ok() ? *report : VerifyReport{};
}

TEST(VerifyTest, Defect8DcpZstdItemsAreDecodedAsLoadDecodesThem) {
  const std::vector<std::string> zstd = {"stream.zstd/1"};
  const std::string archive = FloatTensorItem(4, {2, 2});
  const std::string good = torch_dcp::EncodeZstdItem(AsBytes(archive), 3).value();
  {
    MemoryStore store;
    WriteOneItemDcp(store, "/dcp", "w", {2, 2}, good, zstd);
    VerifyReport report = VerifyOk(store, "/dcp");
    EXPECT_TRUE(report.ok()) << report.defects.at(0);
    EXPECT_EQ(report.chunks_checked, 1u);
    EXPECT_EQ(report.bytes_checked, good.size());
  }
  struct Case {
    std::string name;
    std::string item;
    std::string defect;
  };
  const std::string wrong_shape =
      torch_dcp::EncodeZstdItem(AsBytes(FloatTensorItem(4, {4})), 3).value();
  const std::vector<Case> cases = {
      {"garbage", std::string(64, 'x'), "zstd item tensor 'w' chunk [0:2, 0:2] (item at offset 0 of __0_0.distcp): "},
      {"truncated", good.substr(0, good.size() - 4), "is truncated (the stream does not end)"},
      {"wrong shape", wrong_shape, "has shape [4], .metadata says [2, 2]"},
  };
  for (const Case& c : cases) {
    MemoryStore store;
    WriteOneItemDcp(store, "/dcp", "w", {2, 2}, c.item, zstd);
    VerifyReport report = VerifyOk(store, "/dcp");
    ASSERT_EQ(report.defects.size(), 1u) << c.name;
    EXPECT_NE(report.defects[0].find(c.defect), std::string::npos) << c.name << ": " << report.defects[0];
    // Load refuses the same item with the same message.
    Result<std::vector<std::byte>> loaded = testing::LoadWhole(&store, "/dcp", "w");
    ASSERT_FALSE(loaded.ok()) << c.name;
    EXPECT_NE(loaded.status().message().find(c.defect), std::string::npos) << loaded.status();
  }
}

TEST(VerifyTest, Defect8NativeDataFileMetadataBlockIsChecked) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("/ckpt").ok());
  ASSERT_TRUE(testing::SaveWhole(&store, "/ckpt", {testing::Iota("w", {4, 2})}, {}, 1).ok());
  EXPECT_TRUE(VerifyOk(store, "/ckpt").ok());
  const CheckpointMetadata md = ReadCheckpointMetadata("/ckpt", &store).value();
  const std::string path = JoinPath("/ckpt", md.files.at(0).name);
  const std::string original = store.ReadFile(path).value();
  // Same-length edits that keep the header valid JSON and its entries intact.
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"\"shardpoint\"", "\"shardpoinu\""},
      {"\"format_version\"", "\"format_versioo\""},
      {"\"3.0\"", "\"3.1\""},  // a minor newer than the metadata's
      {"\"3.0\"", "\"4.0\""},  // a newer major
      {"\"3.0\"", "\"0.9\""},  // no such version
      {"\"3.0\"", "\"3.x\""},
      {"\"3.0\"", "\"03.\""},
      {"\"" + md.save_id + "\"", "\"" + std::string(md.save_id.size(), 'z') + "\""},
  };
  for (const auto& [from, to] : edits) {
    std::string bytes = original;
    const size_t at = bytes.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    bytes.replace(at, from.size(), to);
    WriteFile(store, path, bytes);
    VerifyReport report = VerifyOk(store, "/ckpt");
    ASSERT_EQ(report.defects.size(), 1u) << from;
    EXPECT_NE(report.defects[0].find("data file " + md.files[0].name +
                                     ": its safetensors header's __metadata__ {"),
              std::string::npos)
        << report.defects[0];
    EXPECT_NE(report.defects[0].find("does not match the metadata (expected {format=shardpoint, "
                                     "format_version=3.0, save_id=" + md.save_id + "})"),
              std::string::npos)
        << report.defects[0];
  }
  // Data files of versions 1 and 2 under version-3 metadata (a prune of an older checkpoint
  // keeps its untouched files): the data file format did not change.
  for (const char* version : {"\"1.0\"", "\"2.0\""}) {
    std::string older = original;
    older.replace(older.find("\"3.0\""), 5, version);
    WriteFile(store, path, older);
    EXPECT_TRUE(VerifyOk(store, "/ckpt").defects.empty()) << version;
  }
  WriteFile(store, path, original);
  EXPECT_TRUE(VerifyOk(store, "/ckpt").ok());
}

}  // namespace
}  // namespace sp
