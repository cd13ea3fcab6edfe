// The opened-checkpoint helper (missing, short and unneeded files) and the read request builder
// (requests it makes read bit-exact through ExecuteReads, verified and cast).
#include "shardpoint/engine/opened_checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "shardpoint/base/crc32c.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

constexpr char kDir[] = "/ckpt";
constexpr uint64_t kDataStart = 40;
constexpr uint64_t kBlock = 64;

// A checkpoint of one [6, 10] float32 tensor "w" stored as two row halves, each in a file of its
// own (a 40-byte head, then the chunk), with 64-byte checksum blocks.
class OpenedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    values_.resize(60);
    std::mt19937 rng(5);
    for (float& v : values_) v = static_cast<float>(rng() % 100000) / 3.0f;
    metadata_.checksum_block_bytes = kBlock;
    TensorMetadata t{"w", DType::kFloat32, {6, 10}, {}};
    ASSERT_TRUE(store_.CreateDirs(kDir).ok());
    for (int half = 0; half < 2; ++half) {
      const std::string name = "part" + std::to_string(half);
      const char* bytes = reinterpret_cast<const char*>(values_.data() + half * 30);
      const std::string data(bytes, 30 * sizeof(float));
      StoredChunk c;
      c.box = Box({half * 3, 0}, {3, 10});
      c.file = static_cast<uint32_t>(half);
      c.byte_length = data.size();
      for (uint64_t lo = 0; lo < data.size(); lo += kBlock) {
        c.block_crc32c.push_back(Crc32c(data.data() + lo, std::min(kBlock, data.size() - lo)));
      }
      t.chunks.push_back(std::move(c));
      const std::string file = std::string(kDataStart, 'h') + data;
      metadata_.files.push_back(DataFile{name, kDataStart, file.size(), 0});
      Put(JoinPath(kDir, name), file);
    }
    metadata_.tensors = {std::move(t)};
  }

  void Put(const std::string& path, const std::string& bytes) {
    auto file = store_.NewWritableFile(path).value();
    ASSERT_TRUE(file->WriteAt(0, AsBytes(bytes)).ok());
    ASSERT_TRUE(file->Close().ok());
  }

  MemoryStore store_;
  CheckpointMetadata metadata_;
  std::vector<float> values_;
};

TEST_F(OpenedCheckpointTest, OpensOnlyTheFilesAskedFor) {
  Result<DataFiles> files = OpenDataFiles(store_, kDir, metadata_, {false, true});
  ASSERT_TRUE(files.ok()) << files.status();
  ASSERT_EQ(files->size(), 2u);
  EXPECT_EQ((*files)[0], nullptr);
  ASSERT_NE((*files)[1], nullptr);
  EXPECT_EQ((*files)[1]->path(), "/ckpt/part1");
  EXPECT_EQ((*files)[1]->size(), metadata_.files[1].size);
  EXPECT_EQ(AllDataFiles(metadata_), (std::vector<bool>{true, true}));
  EXPECT_EQ(OpenDataFiles(store_, kDir, metadata_, {true}).status(),
            InternalError("OpenDataFiles: 1 flags for 2 data files"));
}

TEST_F(OpenedCheckpointTest, MissingFileIsDataLossNamingIt) {
  ASSERT_TRUE(store_.RemoveFile("/ckpt/part1").ok());
  const Status from_store = store_.OpenInDirectory(kDir, "part1").status();
  ASSERT_EQ(from_store.code(), StatusCode::kNotFound);
  const Status expected = DataLossError(
      "data file /ckpt/part1 named by the committed metadata is missing: " + from_store.message());
  EXPECT_EQ(OpenDataFile(store_, kDir, metadata_, 1).status(), expected);
  EXPECT_EQ(OpenDataFiles(store_, kDir, metadata_, AllDataFiles(metadata_)).status(), expected);
  // An unneeded missing file is not opened.
  EXPECT_TRUE(OpenDataFiles(store_, kDir, metadata_, {true, false}).ok());
  DataFileAttempt attempt = TryOpenDataFile(store_, kDir, metadata_, 1);
  EXPECT_EQ(attempt.file, nullptr);
  EXPECT_EQ(attempt.open_error, from_store);
}

TEST_F(OpenedCheckpointTest, ShortFileIsDataLossWithBothSizes) {
  const std::string whole = store_.ReadFile("/ckpt/part0").value();
  Put("/ckpt/part0", whole.substr(0, whole.size() - 5));
  const Status expected = DataLossError("data file /ckpt/part0 has " +
                                        std::to_string(whole.size() - 5) + " bytes, expected " +
                                        std::to_string(whole.size()) + " (truncated or replaced)");
  EXPECT_EQ(OpenDataFile(store_, kDir, metadata_, 0).status(), expected);
  EXPECT_EQ(OpenDataFiles(store_, kDir, metadata_, AllDataFiles(metadata_)).status(), expected);
  DataFileAttempt attempt = TryOpenDataFile(store_, kDir, metadata_, 0);
  ASSERT_NE(attempt.file, nullptr);
  EXPECT_TRUE(attempt.open_error.ok());
  EXPECT_FALSE(attempt.size_matches);
  EXPECT_EQ(attempt.file->size(), whole.size() - 5);
}

TEST_F(OpenedCheckpointTest, BuiltRequestsReadBitExactVerifiedAndCast) {
  const TensorMetadata& w = metadata_.tensors[0];
  // Rows 2..4, columns 3..9: a region across both chunks, into a float32 and a float64 buffer.
  const Box piece({2, 3}, {3, 7});
  std::vector<float> same(21, -1.0f);
  std::vector<double> wider(21, -1.0);
  std::vector<ReadRequest> requests;
  for (size_t c = 0; c < w.chunks.size(); ++c) {
    const Box region = Intersect(w.chunks[c].box, piece).value();
    requests.push_back(MakeReadRequest(
        w, c, ReadDestination{reinterpret_cast<std::byte*>(same.data()), piece, DType::kFloat32},
        region));
    requests.push_back(MakeReadRequest(
        w, c, ReadDestination{reinterpret_cast<std::byte*>(wider.data()), piece, DType::kFloat64},
        region));
    EXPECT_EQ(requests.back().stored, &w);
    EXPECT_EQ(requests.back().chunk, &w.chunks[c]);
    EXPECT_EQ(requests.back().region, region);
  }
  EXPECT_EQ(DataFilesRead(requests, metadata_), (std::vector<bool>{true, true}));
  DataFiles files =
      OpenDataFiles(store_, kDir, metadata_, DataFilesRead(requests, metadata_)).value();
  ThreadPool pool(2);
  Result<uint64_t> read = ExecuteReads(requests, metadata_, files, pool, {});
  ASSERT_TRUE(read.ok()) << read.status();
  // Two requests per chunk, so both are staged: whole rows widened to whole checksum blocks.
  // Chunk 0 (120 bytes): row 2 is bytes 80..120, in block 64..120; chunk 1: rows 3..4 are bytes
  // 0..80, in blocks 0..120.
  EXPECT_EQ(*read, 56u + 120u);
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t c = 0; c < 7; ++c) {
      const float want = values_[static_cast<size_t>((2 + r) * 10 + 3 + c)];
      const size_t at = static_cast<size_t>(r * 7 + c);
      EXPECT_EQ(std::memcmp(&same[at], &want, sizeof(float)), 0) << r << "," << c;
      EXPECT_EQ(wider[at], static_cast<double>(want)) << r << "," << c;
    }
  }
}

TEST_F(OpenedCheckpointTest, BuiltRequestsFindCorruptionAndRefuseNoDestination) {
  std::string bytes = store_.ReadFile("/ckpt/part1").value();
  bytes[kDataStart + 70] = static_cast<char>(bytes[kDataStart + 70] ^ 1);
  Put("/ckpt/part1", bytes);
  const TensorMetadata& w = metadata_.tensors[0];
  std::vector<float> out(30);
  std::vector<ReadRequest> requests = {MakeReadRequest(
      w, 1, ReadDestination{reinterpret_cast<std::byte*>(out.data()), w.chunks[1].box,
                            DType::kFloat32},
      w.chunks[1].box)};
  DataFiles files = OpenDataFiles(store_, kDir, metadata_, AllDataFiles(metadata_)).value();
  ThreadPool pool(2);
  Result<uint64_t> read = ExecuteReads(requests, metadata_, files, pool, {});
  EXPECT_EQ(read.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(read.status().message().find("checksum mismatch in tensor 'w' chunk " +
                                         w.chunks[1].box.ToString() + " (file /ckpt/part1"),
            std::string::npos)
      << read.status();

  requests.push_back(MakeReadRequest(w, 0, ReadDestination{}, w.chunks[0].box));
  EXPECT_TRUE(requests.back().dest.empty());
  EXPECT_EQ(ExecuteReads(requests, metadata_, files, pool, {}).status(),
            InvalidArgumentError("read of tensor 'w' chunk " + w.chunks[0].box.ToString() +
                                 " has no destination"));
}

}  // namespace
}  // namespace sp
