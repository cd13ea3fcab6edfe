// Verify reports what load and consolidate refuse (issue 13, defects 1, 2 and 8): sizes past the
// shared limits, DCP items that do not decode to their chunk, and native data-file headers whose
// __metadata__ block disagrees with the metadata.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "shardpoint/base/crc32c.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/header_checksums.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/manage/consolidate.h"
#include "shardpoint/manage/diff.h"
#include "shardpoint/engine/edit_test_util.h"
#include "shardpoint/format/safetensors/hf_directory.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/format/torch_dcp/dcp_items.h"
#include "shardpoint/format/torch_dcp/test_util.h"
#include "shardpoint/store/memory_store.h"
#include "shardpoint/testing/hook_store.h"

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
      {"\"4.0\"", "\"4.2\""},  // a minor newer than the metadata's
      {"\"4.0\"", "\"5.0\""},  // a newer major
      {"\"4.0\"", "\"0.9\""},  // no such version
      {"\"4.0\"", "\"4.x\""},
      {"\"4.0\"", "\"04.\""},
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
                                     "format_version=4.0, save_id=" + md.save_id + "})"),
              std::string::npos)
        << report.defects[0];
  }
  // Data files of older versions under newer metadata (a prune of an older checkpoint keeps its
  // untouched files): the metadata records the header's CRC, which a prune would have taken
  // from the file.
  const std::string metadata_path = JoinPath("/ckpt", kMetadataFileName);
  const std::string metadata = store.ReadFile(metadata_path).value();
  for (const char* version : {"\"1.0\"", "\"2.0\"", "\"3.0\"", "\"3.1\""}) {
    std::string older = original;
    older.replace(older.find("\"4.0\""), 5, version);
    WriteFile(store, path, older);
    CheckpointMetadata with_crc = md;
    with_crc.files[0].header_crc32c = Crc32c(older.substr(0, md.files[0].data_start));
    WriteFile(store, metadata_path, EncodeMetadata(with_crc));
    EXPECT_TRUE(VerifyOk(store, "/ckpt").defects.empty()) << version;
  }
  WriteFile(store, metadata_path, metadata);
  WriteFile(store, path, original);
  EXPECT_TRUE(VerifyOk(store, "/ckpt").ok());
}

// A save writes each data file's block checksums into its header (docs/FORMAT.md §2.2) and the
// header's CRC into the metadata (version 4, whose records hold no checksums); verify and loads
// check the header against its CRC and the chunks against the header's checksums. Metadata of
// version 3.1 holds the checksums as well, and verify checks that they are the header's.
TEST(VerifyTest, DataFileHeadersHoldTheirChunksChecksums) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("/ckpt").ok());
  SaveOptions options;
  options.checksum_block_bytes = 16;  // several blocks a chunk
  ASSERT_TRUE(testing::SaveWhole(&store, "/ckpt",
                                 {testing::Iota("a", {6, 5}), testing::Iota("b", {7}, 100),
                                  testing::Iota("c", {2, 2}, 7, /*owner=*/1),
                                  testing::Iota("empty", {0, 3})},
                                 {}, 3, options)
                  .ok());
  const CheckpointMetadata md = ReadCheckpointMetadata("/ckpt", &store).value();
  EXPECT_EQ(md.version_major, 4u);
  EXPECT_EQ(md.version_minor, 0u);
  ASSERT_TRUE(md.data_file_checksums);
  ASSERT_TRUE(md.checksums_in_headers);
  ASSERT_EQ(md.files.size(), 3u);
  // The same metadata as version 3.1: the chunks with their checksums, taken from the files.
  CheckpointMetadata v31 = md;
  v31.checksums_in_headers = false;
  std::string first_tensor;  // a tensor with a chunk in the first file
  for (TensorMetadata& t : v31.tensors) {
    for (StoredChunk& c : t.chunks) {
      EXPECT_TRUE(c.block_crc32c.empty()) << t.name;
      const DataFile& file = md.files[c.file];
      const std::string bytes = store.ReadFile(JoinPath("/ckpt", file.name)).value();
      for (uint64_t lo = 0; lo < c.byte_length; lo += 16) {
        const uint64_t at = file.data_start + c.data_offset + lo;
        c.block_crc32c.push_back(
            Crc32c(bytes.substr(at, std::min<uint64_t>(16, c.byte_length - lo))));
      }
      if (c.file == 0 && c.byte_length > 0 && first_tensor.empty()) first_tensor = t.name;
    }
  }
  ASSERT_FALSE(first_tensor.empty());
  for (uint32_t f = 0; f < md.files.size(); ++f) {
    const DataFile& file = md.files[f];
    const std::string bytes = store.ReadFile(JoinPath("/ckpt", file.name)).value();
    EXPECT_EQ(Crc32c(bytes.substr(0, file.data_start)), file.header_crc32c) << file.name;
    Result<SafetensorsHeader> header = ParseSafetensorsHeader(bytes, bytes.size(), file.name);
    ASSERT_TRUE(header.ok()) << header.status();
    EXPECT_EQ(header->metadata.at("format_version"), "4.0");
    // The header holds each block's checksum of the file's chunks, in data offset order.
    std::vector<std::pair<uint64_t, std::vector<uint32_t>>> chunks;
    for (const TensorMetadata& t : v31.tensors) {
      for (const StoredChunk& c : t.chunks) {
        if (c.file != f || c.byte_length == 0) continue;
        chunks.emplace_back(c.data_offset,
                            std::vector<uint32_t>(c.block_crc32c.begin(), c.block_crc32c.end()));
      }
    }
    std::sort(chunks.begin(), chunks.end());
    std::vector<uint32_t> want;
    for (const auto& [offset, crcs] : chunks) want.insert(want.end(), crcs.begin(), crcs.end());
    Result<DataFileChecksums> found = ReadDataFileChecksums(*header, 16, file.name);
    ASSERT_TRUE(found.ok()) << found.status();
    EXPECT_EQ(found->crcs, want) << file.name;
    EXPECT_GT(want.size(), 2u);
  }
  EXPECT_TRUE(VerifyOk(store, "/ckpt").ok());

  // One hex digit of the first file's checksums changed: its header no longer has the CRC the
  // metadata records. Verify reports it, and a load of a tensor in that file refuses it.
  const DataFile& file = md.files[0];
  const std::string path = JoinPath("/ckpt", file.name);
  const std::string original = store.ReadFile(path).value();
  const size_t digits = original.find("\"crc32c\":\"") + 10;
  std::string changed = original;
  changed[digits] = changed[digits] == 'a' ? 'b' : 'a';
  WriteFile(store, path, changed);
  VerifyReport report = VerifyOk(store, "/ckpt");
  ASSERT_EQ(report.defects.size(), 1u);
  char want_crc[16];
  std::snprintf(want_crc, sizeof(want_crc), "0x%08x", file.header_crc32c);
  EXPECT_NE(report.defects[0].find("data file " + file.name + ": its header's CRC32C is 0x"),
            std::string::npos)
      << report.defects[0];
  EXPECT_NE(report.defects[0].find(std::string(", the metadata records ") + want_crc),
            std::string::npos)
      << report.defects[0];
  Status load = testing::LoadWhole(&store, "/ckpt", first_tensor).status();
  EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load;
  EXPECT_NE(load.message().find("data file " + file.name + ": its header's CRC32C is 0x"),
            std::string::npos)
      << load;
  EXPECT_NE(load.message().find(std::string(", the metadata records ") + want_crc +
                                ": the header, which holds its chunks' checksums, is damaged"),
            std::string::npos)
      << load;
  // Loads that do not verify do not read headers.
  LoadOptions unverified;
  unverified.verify_checksums = false;
  EXPECT_TRUE(testing::LoadWhole(&store, "/ckpt", first_tensor, unverified).ok());

  // The same header with the metadata recording its CRC: the checksum changed is no longer its
  // block's, which verify and the load find in the chunk's bytes.
  const std::string metadata_path = JoinPath("/ckpt", kMetadataFileName);
  const std::string metadata = store.ReadFile(metadata_path).value();
  CheckpointMetadata edited = md;
  edited.files[0].header_crc32c = Crc32c(changed.substr(0, file.data_start));
  WriteFile(store, metadata_path, EncodeMetadata(edited));
  report = VerifyOk(store, "/ckpt");
  ASSERT_EQ(report.defects.size(), 1u);
  EXPECT_NE(report.defects[0].find("checksum mismatch in tensor '"), std::string::npos)
      << report.defects[0];
  EXPECT_NE(report.defects[0].find("(file /ckpt/" + file.name + ", chunk bytes 0..16)"),
            std::string::npos)
      << report.defects[0];
  load = testing::LoadWhole(&store, "/ckpt", first_tensor).status();
  EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load;
  EXPECT_NE(load.message().find("checksum mismatch in tensor '" + first_tensor + "'"),
            std::string::npos)
      << load;

  // As version 3.1 (data files that say so) the metadata holds the checksums as well: verify
  // finds the header's differ from them; loads read the metadata's, which the chunks' bytes
  // match.
  CheckpointMetadata edited31 = v31;
  std::vector<std::string> files_as_v4;
  for (uint32_t f = 0; f < md.files.size(); ++f) {
    const std::string file_path = JoinPath("/ckpt", md.files[f].name);
    files_as_v4.push_back(store.ReadFile(file_path).value());
    std::string bytes = files_as_v4.back();
    bytes.replace(bytes.find("\"4.0\""), 5, "\"3.1\"");
    WriteFile(store, file_path, bytes);
    edited31.files[f].header_crc32c = Crc32c(bytes.substr(0, md.files[f].data_start));
  }
  WriteFile(store, metadata_path, EncodeMetadata(edited31, 3));
  ASSERT_EQ(ReadCheckpointMetadata("/ckpt", &store)->version_minor, 1u);
  report = VerifyOk(store, "/ckpt");
  ASSERT_EQ(report.defects.size(), 1u);
  EXPECT_NE(report.defects[0].find("data file " + file.name +
                                   ": its header's block checksums of tensor '"),
            std::string::npos)
      << report.defects[0];
  EXPECT_NE(report.defects[0].find("differ from the metadata's"), std::string::npos)
      << report.defects[0];
  EXPECT_TRUE(testing::LoadWhole(&store, "/ckpt", first_tensor).ok());
  for (uint32_t f = 0; f < md.files.size(); ++f) {
    WriteFile(store, JoinPath("/ckpt", md.files[f].name), files_as_v4[f]);
  }

  // A digit that is not one.
  changed[digits] = 'G';
  WriteFile(store, path, changed);
  edited.files[0].header_crc32c = Crc32c(changed.substr(0, file.data_start));
  WriteFile(store, metadata_path, EncodeMetadata(edited));
  report = VerifyOk(store, "/ckpt");
  ASSERT_EQ(report.defects.size(), 1u);
  EXPECT_NE(report.defects[0].find("data file " + file.name + ": its header's block checksums "
                                   "hold 'G' at digit 0, not a lowercase hex digit"),
            std::string::npos)
      << report.defects[0];
  load = testing::LoadWhole(&store, "/ckpt", first_tensor).status();
  EXPECT_NE(load.message().find("hold 'G' at digit 0"), std::string::npos) << load;

  WriteFile(store, metadata_path, metadata);
  WriteFile(store, path, original);
  EXPECT_TRUE(VerifyOk(store, "/ckpt").ok());
  EXPECT_TRUE(testing::LoadWhole(&store, "/ckpt", first_tensor).ok());
}

// HeaderChecksums, what loads take the checksums of format 4 from: each file's table once, every
// chunk's checksums those of its blocks (none for an empty chunk), and a clear refusal of a file
// that is not open, or whose header the metadata gives an impossible length.
// Holds every read of a data file's header (at offset 0) until a read of some data file's chunks
// has begun, for at most 10 s (then it lets it through and says so).
class HeadersAfterDataStore : public testing::ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;

  Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) override {
    SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, base()->OpenReadable(path));
    if (!path.ends_with(".safetensors")) return file;
    return std::unique_ptr<ReadableFile>(new File(std::move(file), this));
  }
  bool headers_waited_out() {
    std::lock_guard<std::mutex> lock(mu_);
    return waited_out_;
  }

 private:
  class File : public ReadableFile {
   public:
    File(std::unique_ptr<ReadableFile> base, HeadersAfterDataStore* store)
        : base_(std::move(base)), store_(store) {}
    Status ReadAt(uint64_t offset, MutableByteView out) const override {
      store_->Before(offset);
      return base_->ReadAt(offset, out);
    }
    Status ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const override {
      store_->Before(offset);
      return base_->ReadVAt(offset, pieces);
    }
    uint64_t size() const override { return base_->size(); }
    const std::string& path() const override { return base_->path(); }

   private:
    std::unique_ptr<ReadableFile> base_;
    HeadersAfterDataStore* store_;
  };

  void Before(uint64_t offset) {
    std::unique_lock<std::mutex> lock(mu_);
    if (offset > 0) {
      data_began_ = true;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, std::chrono::seconds(10), [&] { return data_began_; })) {
      waited_out_ = true;
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool data_began_ = false;
  bool waited_out_ = false;
};

// A load does not wait for its files' headers (format 4: the chunks' checksums) before it begins
// reading their chunks: it reads the headers beside the chunks and verifies each chunk once both
// are in. A damaged header still fails the load with its own error, found after the chunks' reads
// began.
TEST(VerifyTest, ChunksAreReadWhileTheHeadersAreReadAndVerifiedAfter) {
  MemoryStore memory;
  ASSERT_TRUE(memory.CreateDirs("/ckpt").ok());
  SaveOptions options;
  options.checksum_block_bytes = 64;
  const testing::WholeTensor w = testing::Iota("w", {48, 40}, 3);
  ASSERT_TRUE(testing::SaveWhole(&memory, "/ckpt", {w}, {}, 2, options).ok());
  const CheckpointMetadata md = ReadCheckpointMetadata("/ckpt", &memory).value();
  ASSERT_TRUE(md.checksums_in_headers);
  {
    HeadersAfterDataStore store(&memory);
    Result<std::vector<std::byte>> loaded = testing::LoadWhole(&store, "/ckpt", "w");
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_FALSE(store.headers_waited_out()) << "the chunks' reads waited for the headers";
    EXPECT_EQ(*loaded, w.bytes);
  }
  // A damaged header: the load names it, as when headers were read before the chunks.
  const DataFile& file = md.files[0];
  const std::string path = JoinPath("/ckpt", file.name);
  std::string bytes = memory.ReadFile(path).value();
  const size_t digits = bytes.find("\"crc32c\":\"") + 10;
  ASSERT_LT(digits, file.data_start);
  bytes[digits] = bytes[digits] == 'a' ? 'b' : 'a';
  WriteFile(memory, path, bytes);
  HeadersAfterDataStore store(&memory);
  Status load = testing::LoadWhole(&store, "/ckpt", "w").status();
  EXPECT_FALSE(store.headers_waited_out());
  EXPECT_EQ(load.code(), StatusCode::kDataLoss) << load;
  EXPECT_NE(load.message().find("data file " + file.name + ": its header's CRC32C is 0x"),
            std::string::npos)
      << load;
}

TEST(VerifyTest, HeaderChecksumsGiveEachChunkItsBlocksChecksums) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("/ckpt").ok());
  SaveOptions options;
  options.checksum_block_bytes = 8;
  ASSERT_TRUE(testing::SaveWhole(&store, "/ckpt",
                                 {testing::Iota("a", {6, 5}), testing::Iota("b", {7}, 100),
                                  testing::Iota("empty", {0, 3})},
                                 {}, 2, options)
                  .ok());
  CheckpointMetadata md = ReadCheckpointMetadata("/ckpt", &store).value();
  ASSERT_TRUE(md.checksums_in_headers);
  std::vector<std::unique_ptr<ReadableFile>> handles(md.files.size());
  std::vector<uint32_t> all;
  for (uint32_t f = 0; f < md.files.size(); ++f) {
    handles[f] = store.OpenReadable(JoinPath("/ckpt", md.files[f].name)).value();
    all.push_back(f);
  }
  ThreadPool pool(2);
  HeaderChecksums headers(md.files.size());
  const StoredChunk& first = md.tensors[0].chunks[0];
  EXPECT_TRUE(headers.Of(first).empty());  // not loaded yet
  all.push_back(0);  // asked twice: read once
  ASSERT_TRUE(headers.Load(md, handles, all, &pool).ok());
  size_t chunks = 0;
  for (const TensorMetadata& t : md.tensors) {
    for (const StoredChunk& c : t.chunks) {
      std::string bytes(c.byte_length, '\0');
      ASSERT_TRUE(handles[c.file]
                      ->ReadAt(md.files[c.file].data_start + c.data_offset,
                               AsMutableBytes(bytes.data(), bytes.size()))
                      .ok());
      std::vector<uint32_t> want;
      for (uint64_t lo = 0; lo < bytes.size(); lo += 8) {
        want.push_back(Crc32c(std::string_view(bytes).substr(lo, 8)));
      }
      const std::span<const uint32_t> found = headers.Of(c);
      EXPECT_EQ(std::vector<uint32_t>(found.begin(), found.end()), want) << t.name;
      ++chunks;
    }
  }
  EXPECT_GE(chunks, 3u);
  // A file that is not open.
  std::vector<std::unique_ptr<ReadableFile>> none(md.files.size());
  HeaderChecksums fresh(md.files.size());
  const Status closed = fresh.Load(md, none, all, nullptr);
  EXPECT_EQ(closed.code(), StatusCode::kInternal) << closed;
  EXPECT_NE(closed.message().find("the header of data file 0 is needed, and the file is not open"),
            std::string::npos)
      << closed;
  // A header longer than any safetensors header may be, by the metadata's word.
  md.files[0].data_start = 8 + kMaxSafetensorsHeaderBytes + 1;
  const Status long_header = fresh.Load(md, handles, all, nullptr);
  EXPECT_EQ(long_header.code(), StatusCode::kDataLoss) << long_header;
  EXPECT_NE(long_header.message().find("data file " + md.files[0].name + ": its header of " +
                                       "100000001 bytes exceeds the limit of 100000000 bytes"),
            std::string::npos)
      << long_header;
}

}  // namespace
}  // namespace sp
