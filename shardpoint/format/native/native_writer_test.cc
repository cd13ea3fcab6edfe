// The native CheckpointWriter (native_writer.h): file names and layout, checksummed chunk
// writes, the commit's metadata, and which files it claims.
#include "shardpoint/format/native/native_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>


#include "shardpoint/base/crc32c.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/native/metadata_test_util.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/format/writer_test_util.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

using ::testing::ElementsAre;

// Three files (two of rank 0, one of rank 2) holding "w", and int64 "b" after w's chunk in the
// first file.
CheckpointMetadata PlannedMetadata() {
  CheckpointMetadata md = testing::PlannedMetadata({0, 0, 2});
  TensorMetadata b;
  b.name = "b";
  b.dtype = DType::kInt64;
  b.shape = {5};
  StoredChunk c;
  c.box = Box({0}, {5});
  c.data_offset = 32;
  c.byte_length = 40;
  b.chunks.push_back(c);
  md.tensors.insert(md.tensors.begin(), b);
  return md;
}

// A cached layout renamed for another save is that save's layout: the same names and headers as
// laying the files out again, and the same sizes. Anything but its own text is refused.
TEST(NativeWriterTest, RenamingForAnotherSaveIsLayingOutAgain) {
  MemoryStore store;
  std::unique_ptr<CheckpointWriter> writer = MakeNativeWriter();
  CheckpointMetadata old_md = PlannedMetadata();
  old_md.save_id = "0123456789ab";
  Result<std::vector<std::string>> old_headers = writer->LayOutFiles(store, "ckpt", &old_md);
  ASSERT_TRUE(old_headers.ok());
  CheckpointMetadata new_md = PlannedMetadata();
  new_md.save_id = "ba9876543210";
  Result<std::vector<std::string>> new_headers = writer->LayOutFiles(store, "ckpt", &new_md);
  ASSERT_TRUE(new_headers.ok());
  for (size_t f = 0; f < old_md.files.size(); ++f) {
    std::string name = old_md.files[f].name, header = (*old_headers)[f];
    ASSERT_TRUE(writer->RenameForSave(old_md.save_id, new_md.save_id, &name, &header)) << f;
    EXPECT_EQ(name, new_md.files[f].name);
    EXPECT_EQ(header, (*new_headers)[f]);
    EXPECT_EQ(old_md.files[f].size, new_md.files[f].size);
  }
  std::string name = old_md.files[0].name, header = (*old_headers)[0];
  EXPECT_FALSE(writer->RenameForSave(old_md.save_id, "short", &name, &header));
  EXPECT_FALSE(writer->RenameForSave("aaaaaaaaaaaa", new_md.save_id, &name, &header));
  std::string twice = header + "\"save_id\":\"" + old_md.save_id + "\"";
  EXPECT_FALSE(writer->RenameForSave(old_md.save_id, new_md.save_id, &name, &twice));
  EXPECT_EQ(name, old_md.files[0].name);  // a refused rename changes nothing
  EXPECT_EQ(header, (*old_headers)[0]);
}

TEST(NativeWriterTest, NamesFilesByRankAndNumberAndWritesHeaders) {
  MemoryStore store;
  std::unique_ptr<CheckpointWriter> writer = MakeNativeWriter();
  EXPECT_EQ(writer->kind(), "native");
  EXPECT_EQ(writer->format(), CheckpointFormat::kNative);
  EXPECT_EQ(writer->metadata_file_name(), "shardpoint.metadata");
  CheckpointMetadata md = PlannedMetadata();
  Result<std::vector<std::string>> headers = writer->LayOutFiles(store, "ckpt", &md);
  ASSERT_TRUE(headers.ok()) << headers.status();
  ASSERT_EQ(headers->size(), 3u);
  EXPECT_EQ(md.files[0].name, "d-s7-r00000-f000.safetensors");
  EXPECT_EQ(md.files[1].name, "d-s7-r00000-f001.safetensors");
  EXPECT_EQ(md.files[2].name, "d-s7-r00002-f000.safetensors");
  EXPECT_EQ(md.checksum_block_bytes, 16u);
  const uint64_t data_bytes[3] = {72, 32, 32};
  for (uint32_t f = 0; f < 3; ++f) {
    EXPECT_EQ((*headers)[f], BuildDataFileHeader(md, f));
    EXPECT_EQ(md.files[f].data_start, (*headers)[f].size());
    EXPECT_EQ(md.files[f].size, (*headers)[f].size() + data_bytes[f]);
    Result<SafetensorsHeader> parsed =
        ParseSafetensorsHeader((*headers)[f], md.files[f].size, md.files[f].name);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
  }
  EXPECT_EQ(md.tensors[0].chunks[0].data_offset, 32u);  // the plan's placement stays
}

// Where the ranks build the headers, the coordinator names the files and places the chunks as
// LayOutFiles does, and each file's header built from that file's chunks alone is LayOutFiles's.
TEST(NativeWriterTest, HeadersBuiltFromEachFilesChunksAreTheLaidOutHeaders) {
  MemoryStore store;
  std::unique_ptr<CheckpointWriter> writer = MakeNativeWriter();
  ASSERT_TRUE(writer->ranks_build_headers());
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    CheckpointMetadata laid_out = testing::RandomMetadata(seed, 15);
    for (DataFile& f : laid_out.files) f.name.clear(), f.data_start = f.size = 0;
    CheckpointMetadata named = laid_out;
    Result<std::vector<std::string>> headers = writer->LayOutFiles(store, "ckpt", &laid_out);
    ASSERT_TRUE(headers.ok()) << headers.status();
    ASSERT_TRUE(writer->NameFiles(store, "ckpt", &named).ok());
    ASSERT_EQ(named.files.size(), laid_out.files.size());
    for (uint32_t f = 0; f < named.files.size(); ++f) {
      EXPECT_EQ(named.files[f].name, laid_out.files[f].name);
      EXPECT_EQ(named.files[f].data_start, 0u);  // reported by the writing rank
      EXPECT_EQ(named.files[f].size, 0u);
      EXPECT_TRUE(named.data_file_checksums);  // the headers keep room for the checksums
      EXPECT_TRUE(laid_out.data_file_checksums);
      std::vector<DataFileChunk> chunks;
      uint64_t data_bytes = 0;
      for (const TensorMetadata& t : named.tensors) {
        for (const StoredChunk& c : t.chunks) {
          if (c.file != f) continue;
          chunks.push_back(DataFileChunk{t.name, t.dtype, &c.box, c.data_offset, c.byte_length});
          data_bytes += c.byte_length;
        }
      }
      const std::string header =
          writer->BuildFileHeader(named.save_id, std::move(chunks), named.checksum_block_bytes);
      EXPECT_EQ(header, (*headers)[f]) << "seed " << seed << " file " << f;
      EXPECT_EQ(header.size() + data_bytes, laid_out.files[f].size);
    }
    EXPECT_EQ(named.tensors, laid_out.tensors);  // the same placement
  }
}

TEST(NativeWriterTest, ChunkWritesGoAfterTheHeaderWithBlockChecksums) {
  MemoryStore store;
  std::unique_ptr<CheckpointWriter> writer = MakeNativeWriter();
  Result<std::unique_ptr<WritableFile>> file = store.NewWritableFile("f");
  ASSERT_TRUE(file.ok());
  // 40 bytes in blocks of 16: three checksums, the last over 8 bytes.
  std::vector<std::byte> data(40);
  for (size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i * 7 + 1);
  std::unique_ptr<ChunkWriter> chunks = writer->NewChunkWriter(1, 16);
  TaskGroup group(nullptr);
  uint64_t written = 0;
  const WrittenCallback on_written = [&](uint64_t n) { written += n; };
  std::vector<uint32_t> crcs;
  ASSERT_TRUE(chunks
                  ->QueueChunk(0, ChunkBytes{DType::kInt64, Box({0}, {5}), data.data(), 40, 100},
                               **file, group, &on_written, &crcs)
                  .ok());
  ASSERT_TRUE(group.Wait().ok());
  ASSERT_TRUE(chunks->Finish().ok());
  ASSERT_TRUE((*file)->Close().ok());
  EXPECT_EQ(written, 40u);
  EXPECT_THAT(crcs, ElementsAre(Crc32c(data.data(), 16), Crc32c(data.data() + 16, 16),
                                Crc32c(data.data() + 32, 8)));
  Result<std::string> bytes = store.ReadFile("f");
  ASSERT_TRUE(bytes.ok());
  ASSERT_EQ(bytes->size(), 140u);
  EXPECT_EQ(bytes->substr(100), std::string(reinterpret_cast<const char*>(data.data()), 40));
}

TEST(NativeWriterTest, CommitBytesAreTheEncodedMetadata) {
  MemoryStore store;
  std::unique_ptr<CheckpointWriter> writer = MakeNativeWriter();
  CheckpointMetadata md = PlannedMetadata();
  ASSERT_TRUE(writer->LayOutFiles(store, "ckpt", &md).ok());
  for (TensorMetadata& t : md.tensors) {
    for (StoredChunk& c : t.chunks) c.block_crc32c.assign((c.byte_length + 15) / 16, 0x1234u);
  }
  Result<std::string> bytes = writer->PrepareCommit(store, "ckpt", 0, &md);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, EncodeMetadata(md));
  EXPECT_EQ(md.files.size(), 3u);  // no side files
}

TEST(NativeWriterTest, RemovesItsMetadataOnlyWhenAnotherKindCommitted) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("c").ok());
  ASSERT_TRUE(WriteFileDurably(store, "c", "shardpoint.metadata", "m.tmp", "old").ok());
  std::unique_ptr<CheckpointWriter> writer = MakeNativeWriter();
  ASSERT_TRUE(writer->RemoveReplaced(store, "c", "shardpoint.metadata").ok());
  EXPECT_TRUE(*store.Exists("c/shardpoint.metadata"));
  ASSERT_TRUE(writer->RemoveReplaced(store, "c", ".metadata").ok());
  EXPECT_FALSE(*store.Exists("c/shardpoint.metadata"));
  ASSERT_TRUE(writer->RemoveReplaced(store, "c", ".metadata").ok());  // nothing left to remove
}

TEST(NativeWriterTest, ClaimsItsDataFilesAndTemporariesOnly) {
  std::unique_ptr<CheckpointWriter> writer = MakeNativeWriter();
  for (const char* name : {"d-s7-r00000-f000.safetensors", "d-s7-r00000-f000.safetensors.tmp",
                           "shardpoint.metadata.tmp-s7"}) {
    EXPECT_TRUE(writer->OwnsFile(name)) << name;
  }
  for (const char* name : {"shardpoint.metadata", "model.safetensors", "__0_0.distcp", ".metadata",
                           ".metadata.tmp-s7", "d-notes.txt", "common.pt"}) {
    EXPECT_FALSE(writer->OwnsFile(name)) << name;
  }
}

}  // namespace
}  // namespace sp
