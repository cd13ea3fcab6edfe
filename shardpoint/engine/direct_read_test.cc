// Direct I/O loads that land in place: where a destination's address agrees with its bytes' file
// offset modulo the direct-I/O alignment, its whole aligned blocks are read straight into it (no
// staging, no copy); elsewhere they are staged and copied. Both are bit-exact and verified.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "shardpoint/checkpoint.h"
#include "shardpoint/engine/read_executor.h"
#include "shardpoint/store/posix_store.h"
#include "shardpoint/testing/hook_store.h"

namespace sp {
namespace {

// Records the pieces of every direct scatter read of its files.
class RecordingStore : public testing::ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;

  Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) override {
    SP_ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, base()->OpenReadable(path));
    return std::unique_ptr<ReadableFile>(new File(std::move(file), this));
  }

  // The direct reads' pieces that lie inside [begin, begin + size).
  int PiecesInside(const std::byte* begin, uint64_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (const MutableByteView& p : pieces_) {
      if (p.data() >= begin && p.data() + p.size() <= begin + size) ++n;
    }
    return n;
  }
  int direct_reads() {
    std::lock_guard<std::mutex> lock(mu_);
    return direct_reads_;
  }
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    pieces_.clear();
    direct_reads_ = 0;
  }
  // What its files say of ReadableFile::small_pages_shorten_requests.
  bool small_pages = false;

 private:
  class File : public ReadableFile {
   public:
    File(std::unique_ptr<ReadableFile> base, RecordingStore* store)
        : base_(std::move(base)), store_(store) {}
    Status ReadAt(uint64_t offset, MutableByteView out) const override {
      return base_->ReadAt(offset, out);
    }
    Status ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const override {
      return base_->ReadVAt(offset, pieces);
    }
    uint64_t size() const override { return base_->size(); }
    const std::string& path() const override { return base_->path(); }
    Status DropCache() override { return base_->DropCache(); }
    std::optional<double> CachedFraction(uint64_t offset, uint64_t length) const override {
      return base_->CachedFraction(offset, length);
    }
    uint64_t direct_io_alignment() const override { return base_->direct_io_alignment(); }
    bool small_pages_shorten_requests() const override { return store_->small_pages; }
    Result<uint64_t> ReadDirectVAt(uint64_t offset,
                                   std::span<const MutableByteView> pieces) const override {
      {
        std::lock_guard<std::mutex> lock(store_->mu_);
        ++store_->direct_reads_;
        store_->pieces_.insert(store_->pieces_.end(), pieces.begin(), pieces.end());
      }
      return base_->ReadDirectVAt(offset, pieces);
    }

   private:
    std::unique_ptr<ReadableFile> base_;
    RecordingStore* store_;
  };

  std::mutex mu_;
  std::vector<MutableByteView> pieces_;
  int direct_reads_ = 0;
};

class DirectReadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() / "sp_direct_read_XXXXXX").string();
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
    path_ = dir_ + "/ckpt";
    // "a.small" (odd length) comes first in plan order; "b.big" (4 MiB) and "c.rows" after it.
    for (size_t i = 0; i < small_.size(); ++i) small_[i] = static_cast<std::byte>(i * 7 + 1);
    for (size_t i = 0; i < big_.size(); ++i) big_[i] = static_cast<std::byte>((i * 131) >> 3);
    SaveState state;
    state.tensors.push_back({"a.small", DType::kFloat32, {37, 11}, {{Box::Whole({37, 11}), small_.data()}}});
    state.tensors.push_back({"b.big", DType::kFloat32, {1024, 1024}, {{Box::Whole({1024, 1024}), big_.data()}}});
    SaveOptions options;
    options.pool = &pool_;
    options.store = &posix_;
    ASSERT_TRUE(Save(state, path_, options).ok());
    Result<CheckpointMetadata> md = ReadCheckpointMetadata(path_, &posix_);
    ASSERT_TRUE(md.ok()) << md.status();
    metadata_ = *md;
    Result<std::unique_ptr<ReadableFile>> file = posix_.OpenReadable(DataPath());
    ASSERT_TRUE(file.ok()) << file.status();
    alignment_ = (*file)->direct_io_alignment();
    if (alignment_ == 0) GTEST_SKIP() << "no direct I/O under " << dir_;
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string DataPath() const { return path_ + "/" + metadata_.files.at(0).name; }

  // Loads "b.big" with direct I/O into `out` and returns the status.
  Status LoadBig(std::byte* out) {
    LoadState state;
    state.tensors.push_back({"b.big", DType::kFloat32, {1024, 1024}, {{Box::Whole({1024, 1024}), out}}});
    LoadOptions options;
    options.pool = &pool_;
    options.store = &recording_;
    options.strict = false;
    options.direct_io = true;
    return Load(state, path_, options).status();
  }

  std::string dir_, path_;
  std::vector<std::byte> small_ = std::vector<std::byte>(37 * 11 * 4);
  std::vector<std::byte> big_ = std::vector<std::byte>(1024 * 1024 * 4);
  PosixStore posix_;
  RecordingStore recording_{&posix_};
  ThreadPool pool_{3};
  CheckpointMetadata metadata_;
  uint64_t alignment_ = 0;
};

TEST_F(DirectReadTest, LargeChunksStartAlignedInTheirFile) {
  // The data section starts at a multiple of kDataAlignmentBytes and the 4 MiB chunk, although
  // planned after the small one, comes first in the file.
  ASSERT_EQ(metadata_.files.size(), 1u);
  EXPECT_EQ(metadata_.files[0].data_start % kDataAlignmentBytes, 0u);
  const TensorMetadata* big = metadata_.FindTensor("b.big");
  const TensorMetadata* small = metadata_.FindTensor("a.small");
  ASSERT_NE(big, nullptr);
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(big->chunks[0].data_offset, 0u);
  EXPECT_EQ(small->chunks[0].data_offset, big->chunks[0].byte_length);
}

TEST_F(DirectReadTest, AnAgreeingDestinationIsReadInPlace) {
  AlignedBuffer out(big_.size(), kDataAlignmentBytes);
  std::memset(out.data(), 0, out.size());
  ASSERT_TRUE(LoadBig(out.data()).ok());
  EXPECT_EQ(std::memcmp(out.data(), big_.data(), big_.size()), 0);
  EXPECT_GT(recording_.direct_reads(), 0);
  EXPECT_GT(recording_.PiecesInside(out.data(), out.size()), 0);
}

TEST_F(DirectReadTest, ADisagreeingDestinationIsStagedAndCopied) {
  // 64 bytes past an aligned address, as glibc places large allocations (torch's CPU tensors):
  // in place only where the alignment divides 64.
  AlignedBuffer buffer(big_.size() + 64, kDataAlignmentBytes);
  std::byte* out = buffer.data() + 64;
  std::memset(out, 0, big_.size());
  ASSERT_TRUE(LoadBig(out).ok());
  EXPECT_EQ(std::memcmp(out, big_.data(), big_.size()), 0);
  EXPECT_GT(recording_.direct_reads(), 0);
  EXPECT_EQ(recording_.PiecesInside(out, big_.size()) > 0, 64 % alignment_ == 0);
}

TEST_F(DirectReadTest, TheStagedRangeIsStagedWhereSmallPagesShortenTheDevicesRequests) {
  // An agreeing destination inside ReadExecutorOptions' staged range: staged (none of the direct
  // reads' pieces lies in it) exactly where the file says that requests into small pages are
  // shorter; read in place otherwise, and when the range lies elsewhere. Bit-exact every time.
  const TensorMetadata* big = metadata_.FindTensor("b.big");
  ASSERT_NE(big, nullptr);
  Result<std::unique_ptr<ReadableFile>> file = recording_.OpenReadable(DataPath());
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<std::unique_ptr<ReadableFile>> files;
  files.push_back(std::move(file).value());
  AlignedBuffer out(big_.size(), kDataAlignmentBytes);
  AlignedBuffer elsewhere(4096, 4096);
  for (const bool small_pages : {true, false}) {
    for (const bool in_range : {true, false}) {
      SCOPED_TRACE(std::string(small_pages ? "small pages" : "no small pages") +
                   (in_range ? ", in the range" : ", the range elsewhere"));
      recording_.small_pages = small_pages;
      recording_.Reset();
      std::memset(out.data(), 0, out.size());
      const std::vector<ReadRequest> requests = {MakeReadRequest(
          *big, 0, ReadDestination{out.data(), big->chunks[0].box, DType::kFloat32},
          big->chunks[0].box)};
      ReadExecutorOptions options;
      options.direct_io = true;
      std::byte* range = in_range ? out.data() : elsewhere.data();
      options.staged_from = range;
      options.staged_to = range + (in_range ? out.size() : elsewhere.size());
      Result<uint64_t> read = ExecuteReads(requests, metadata_, files, pool_, options);
      ASSERT_TRUE(read.ok()) << read.status();
      EXPECT_EQ(std::memcmp(out.data(), big_.data(), big_.size()), 0);
      EXPECT_GT(recording_.direct_reads(), 0);
      EXPECT_EQ(recording_.PiecesInside(out.data(), out.size()) == 0, small_pages && in_range);
    }
  }
}

TEST_F(DirectReadTest, CorruptionInABlockReadInPlaceIsCaught) {
  const TensorMetadata* big = metadata_.FindTensor("b.big");
  ASSERT_NE(big, nullptr);
  {
    Result<std::string> bytes = posix_.ReadFile(DataPath());
    ASSERT_TRUE(bytes.ok());
    (*bytes)[metadata_.files[0].data_start + big->chunks[0].data_offset + 3 * 1048576 + 5] ^= 0x20;
    Result<std::unique_ptr<WritableFile>> file = posix_.NewWritableFile(DataPath());
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE((*file)->WriteAt(0, AsBytes(*bytes)).ok());
    ASSERT_TRUE((*file)->Sync().ok());
    ASSERT_TRUE((*file)->Close().ok());
  }
  AlignedBuffer out(big_.size(), kDataAlignmentBytes);
  Status s = LoadBig(out.data());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("checksum mismatch in tensor 'b.big' chunk " +
                             big->chunks[0].box.ToString() + " (file " + DataPath() +
                             ", chunk bytes 3145728..4194304)"),
            std::string::npos)
      << s;
  EXPECT_GT(recording_.PiecesInside(out.data(), out.size()), 0);
}

}  // namespace
}  // namespace sp
