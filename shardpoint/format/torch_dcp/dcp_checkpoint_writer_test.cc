// The torch-dcp CheckpointWriter (dcp_checkpoint_writer.h): file names and item layout, items
// written in pieces with their CRC-32, the commit's side files, and what it removes and claims.
#include "shardpoint/format/torch_dcp/dcp_checkpoint_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shardpoint/format/torch_dcp/dcp_metadata.h"
#include "shardpoint/format/torch_dcp/dcp_writer.h"
#include "shardpoint/format/torch_dcp/megatron.h"
#include "shardpoint/format/torch_save/torch_save.h"
#include "shardpoint/format/torch_save/zip.h"
#include "shardpoint/format/writer_test_util.h"
#include "shardpoint/store/memory_store.h"

namespace sp::torch_dcp {
namespace {

using ::testing::HasSubstr;

// Two ranks, one file each, plus an object.
CheckpointMetadata PlannedMetadata() {
  CheckpointMetadata md = testing::PlannedMetadata({0, 1});
  md.format = CheckpointFormat::kTorchDcp;
  md.objects.push_back(ObjectEntry("step", ObjectEncoding::kJson, "7"));
  return md;
}

std::string Str(ByteView b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

TEST(DcpCheckpointWriterTest, NamesFilesAsTorchDoesUnlessReplacingADcpCheckpoint) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("c").ok());
  std::unique_ptr<CheckpointWriter> writer = MakeDcpCheckpointWriter(false);
  EXPECT_EQ(writer->kind(), "torch-dcp");
  EXPECT_EQ(MakeDcpCheckpointWriter(true)->kind(), "megatron");
  EXPECT_EQ(writer->metadata_file_name(), ".metadata");
  CheckpointMetadata md = PlannedMetadata();
  Result<std::vector<std::string>> headers = writer->LayOutFiles(store, "c", &md);
  ASSERT_TRUE(headers.ok()) << headers.status();
  EXPECT_EQ(*headers, std::vector<std::string>(2));  // items frame themselves
  EXPECT_EQ(md.checksum_block_bytes, 0u);
  EXPECT_EQ(md.files[0].name, "__0_0.distcp");
  EXPECT_EQ(md.files[1].name, "__1_0.distcp");
  Result<torch_save::TorchSaveLayout> item = ChunkItemLayout(DType::kFloat32, Box({0, 0}, {2, 4}));
  ASSERT_TRUE(item.ok());
  EXPECT_EQ(md.tensors[0].chunks[0].data_offset, item->data_offset(0));
  EXPECT_EQ(md.files[0].data_start, 0u);
  EXPECT_EQ(md.files[0].size, item->total_size());

  // A committed DCP checkpoint at the path: the new files must not replace its files before the
  // new `.metadata` commits.
  ASSERT_TRUE(WriteFileDurably(store, "c", ".metadata", ".metadata.tmp", "old").ok());
  md = PlannedMetadata();
  ASSERT_TRUE(writer->LayOutFiles(store, "c", &md).ok());
  EXPECT_EQ(md.files[0].name, "__0_0-s7.distcp");
  EXPECT_EQ(md.files[1].name, "__1_0-s7.distcp");
}

// An item larger than one write piece: torch reads it back as a tensor of the chunk's shape
// whose storage passes its CRC-32 check.
TEST(DcpCheckpointWriterTest, ItemsAreTorchSaveArchivesWithTheChunksCrc) {
  MemoryStore store;
  std::unique_ptr<CheckpointWriter> writer = MakeDcpCheckpointWriter(false);
  const Box box({0, 0}, {3, static_cast<int64_t>((kWriteTaskBytes + 4096) / 4 / 3 + 1)});
  Result<torch_save::TorchSaveLayout> layout = ChunkItemLayout(DType::kFloat32, box);
  ASSERT_TRUE(layout.ok());
  const uint64_t bytes = layout->data_bytes(0);
  ASSERT_GT(bytes, kWriteTaskBytes);
  std::vector<std::byte> data(bytes);
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::byte((i * 2654435761u) >> 13);
  const uint64_t item_start = 64;  // an earlier item before it
  Result<std::unique_ptr<WritableFile>> file = store.NewWritableFile("__0_0.distcp");
  ASSERT_TRUE(file.ok());
  std::unique_ptr<ChunkWriter> chunks = writer->NewChunkWriter(2, 0);
  TaskGroup group(nullptr);
  uint64_t written = 0;
  const WrittenCallback on_written = [&](uint64_t n) { written += n; };
  std::vector<uint32_t> crcs;
  ASSERT_TRUE(chunks
                  ->QueueChunk(1,
                               ChunkBytes{DType::kFloat32, box, data.data(), bytes,
                                          item_start + layout->data_offset(0)},
                               **file, group, &on_written, &crcs)
                  .ok());
  ASSERT_TRUE(group.Wait().ok());
  ASSERT_TRUE(chunks->Finish().ok());  // slot 0 was never queued: nothing to finish there
  ASSERT_TRUE((*file)->Close().ok());
  EXPECT_EQ(written, bytes);
  EXPECT_TRUE(crcs.empty());
  Result<std::string> stored = store.ReadFile("__0_0.distcp");
  ASSERT_TRUE(stored.ok());
  ASSERT_EQ(stored->size(), item_start + layout->total_size());
  const std::string archive = stored->substr(item_start);
  const torch_save::RangeReader read = torch_save::MemoryRangeReader(AsBytes(archive));
  Result<torch_save::TorchSaveTensorInfo> info =
      torch_save::ParseTorchSaveTensor(read, archive.size(), "item");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->shape, box.sizes);
  EXPECT_EQ(info->data_offset, layout->data_offset(0));
  Result<torch_save::ZipDirectory> dir = torch_save::ReadZipDirectory(read, archive.size(), "item");
  ASSERT_TRUE(dir.ok());
  const torch_save::ZipEntry* entry = dir->Find(info->record);
  ASSERT_NE(entry, nullptr);
  EXPECT_NE(entry->crc32, 0u);
  Result<std::string> storage = torch_save::ReadZipEntry(read, *dir, *entry, "item", bytes);
  ASSERT_TRUE(storage.ok()) << storage.status();  // the CRC-32 matches
  EXPECT_EQ(*storage, Str(ByteView(data.data(), data.size())));
}

TEST(DcpCheckpointWriterTest, LayoutThatDisagreesWithThePlanIsRefused) {
  MemoryStore store;
  Result<std::unique_ptr<WritableFile>> file = store.NewWritableFile("f");
  ASSERT_TRUE(file.ok());
  std::unique_ptr<ChunkWriter> chunks = MakeDcpCheckpointWriter(false)->NewChunkWriter(1, 0);
  TaskGroup group(nullptr);
  std::vector<std::byte> data(32);
  std::vector<uint32_t> crcs;
  Status s = chunks->QueueChunk(0, ChunkBytes{DType::kFloat32, Box({0}, {8}), data.data(), 24, 4096},
                                **file, group, nullptr, &crcs);
  EXPECT_THAT(s.message(), HasSubstr("DCP item layout disagrees with the save plan"));
  EXPECT_TRUE(group.Wait().ok());
}

TEST(DcpCheckpointWriterTest, CommitWritesTheObjectFileAndReturnsDcpMetadata) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("c").ok());
  std::unique_ptr<CheckpointWriter> writer = MakeDcpCheckpointWriter(false);
  CheckpointMetadata md = PlannedMetadata();
  ASSERT_TRUE(writer->LayOutFiles(store, "c", &md).ok());
  Result<std::string> bytes = writer->PrepareCommit(store, "c", 0, &md);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_EQ(md.files.size(), 3u);
  EXPECT_EQ(md.files[2].name, "__0_1.distcp");  // the objects, after rank 0's data file
  EXPECT_TRUE(*store.Exists("c/__0_1.distcp"));
  Result<DcpMetadata> decoded = DecodeDcpMetadata(AsBytes(*bytes), "c/.metadata");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(decoded->state_dict_metadata.size(), 2u);  // w and step
  EXPECT_FALSE(*store.Exists("c/common.pt"));
}

TEST(DcpCheckpointWriterTest, MegatronCommitWritesCommonPtInsteadOfByteIoItems) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("c").ok());
  std::unique_ptr<CheckpointWriter> writer = MakeDcpCheckpointWriter(true);
  CheckpointMetadata md = PlannedMetadata();
  ASSERT_TRUE(writer->LayOutFiles(store, "c", &md).ok());
  Result<std::string> bytes = writer->PrepareCommit(store, "c", 0, &md);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(md.files.size(), 2u);  // no object file
  ASSERT_EQ(md.objects.size(), 1u);  // the objects stay in the metadata
  EXPECT_TRUE(*store.Exists("c/common.pt"));
  Result<std::string> config = store.ReadFile("c/metadata.json");
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(ParseMegatronConfig(*config, "c/metadata.json").ok());
}

TEST(DcpCheckpointWriterTest, RemovesReplacedMetadataAndOnlyMegatronsOwnConfig) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("c").ok());
  auto put = [&](const std::string& name, const std::string& bytes) {
    ASSERT_TRUE(WriteFileDurably(store, "c", name, name + ".t", bytes).ok());
  };
  put(".metadata", "old");
  put("metadata.json", EncodeMegatronConfig());
  put("common.pt", "old");
  std::unique_ptr<CheckpointWriter> dcp = MakeDcpCheckpointWriter(false);
  std::unique_ptr<CheckpointWriter> megatron = MakeDcpCheckpointWriter(true);
  // A plain DCP checkpoint committed: Megatron's files go, `.metadata` is the new one's.
  ASSERT_TRUE(megatron->RemoveReplaced(store, "c", ".metadata").ok());
  EXPECT_TRUE(*store.Exists("c/.metadata"));
  EXPECT_FALSE(*store.Exists("c/metadata.json"));
  EXPECT_FALSE(*store.Exists("c/common.pt"));
  // A native checkpoint committed: `.metadata` goes.
  ASSERT_TRUE(dcp->RemoveReplaced(store, "c", "shardpoint.metadata").ok());
  EXPECT_FALSE(*store.Exists("c/.metadata"));
  // A metadata.json that is not Megatron's is the user's.
  put("metadata.json", "{\"model\": \"mine\"}");
  put("common.pt", "mine");
  ASSERT_TRUE(megatron->RemoveReplaced(store, "c", "shardpoint.metadata").ok());
  EXPECT_TRUE(*store.Exists("c/metadata.json"));
  EXPECT_TRUE(*store.Exists("c/common.pt"));
}

TEST(DcpCheckpointWriterTest, ClaimsItsDataFilesAndTemporariesOnly) {
  for (bool megatron : {false, true}) {
    std::unique_ptr<CheckpointWriter> writer = MakeDcpCheckpointWriter(megatron);
    for (const char* name : {"__0_0.distcp", "__3_1-s7.distcp", "__0_0.distcp.tmp",
                             ".metadata.tmp-s7"}) {
      EXPECT_TRUE(writer->OwnsFile(name)) << name;
    }
    for (const char* name : {".metadata", "d-s7-r00000-f000.safetensors", "common.pt",
                             "metadata.json", "shardpoint.metadata.tmp-s7", "__notes.txt"}) {
      EXPECT_FALSE(writer->OwnsFile(name)) << name;
    }
  }
}

}  // namespace
}  // namespace sp::torch_dcp
