// ReadExecutor on checkpoints without checksums (foreign formats): every read path (direct,
// coalesced, sliced) returns the right bytes, and chunks needing a driver decoder go through it.
#include "shardpoint/engine/read_executor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "shardpoint/base/random_id.h"
#include "shardpoint/exec/shared_io_tuner.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

constexpr uint64_t kDataStart = 100;

class UncheckedReadTest : public ::testing::Test {
 protected:
  // A [rows, cols] float32 tensor stored as two row halves in one file, no checksums.
  void Build(int64_t rows, int64_t cols) {
    rows_ = rows;
    cols_ = cols;
    values_.resize(static_cast<size_t>(rows * cols));
    std::mt19937 rng(3);
    for (float& v : values_) v = static_cast<float>(rng() % 100000) / 7.0f;
    metadata_.format = CheckpointFormat::kSafetensors;
    metadata_.checksum_block_bytes = 0;
    const uint64_t bytes = values_.size() * 4;
    metadata_.files = {{"model.safetensors", kDataStart, kDataStart + bytes, 0}};
    tensor_ = TensorMetadata{"w", DType::kFloat32, {rows, cols}, {}};
    const int64_t half = rows / 2;
    tensor_.chunks.push_back(StoredChunk{Box{{0, 0}, {half, cols}}, 0, 0,
                                         static_cast<uint64_t>(half * cols * 4), {}, {}, 0});
    tensor_.chunks.push_back(StoredChunk{Box{{half, 0}, {rows - half, cols}}, 0,
                                         static_cast<uint64_t>(half * cols * 4),
                                         static_cast<uint64_t>((rows - half) * cols * 4), {}, {}, 0});
    metadata_.tensors = {tensor_};
    std::string file(kDataStart, 'h');
    file.append(reinterpret_cast<const char*>(values_.data()), bytes);
    ASSERT_TRUE(store_.CreateDirs("/m").ok());
    auto writable = store_.NewWritableFile("/m/model.safetensors").value();
    ASSERT_TRUE(writable->WriteAt(0, AsBytes(file)).ok());
    ASSERT_TRUE(writable->Close().ok());
    files_.clear();
    files_.push_back(store_.OpenReadable("/m/model.safetensors").value());
  }

  // Loads `piece` of the tensor and compares it with the reference values.
  void LoadAndCheck(const Box& piece_box, uint64_t window) {
    std::vector<float> out(static_cast<size_t>(piece_box.volume()), -1.0f);
    const ReadDestination dest{reinterpret_cast<std::byte*>(out.data()), piece_box,
                               DType::kFloat32};
    const TensorMetadata& stored = metadata_.tensors[0];
    std::vector<ReadRequest> requests;
    for (size_t c = 0; c < stored.chunks.size(); ++c) {
      if (std::optional<Box> region = Intersect(stored.chunks[c].box, piece_box)) {
        requests.push_back(MakeReadRequest(stored, c, dest, *region));
      }
    }
    ThreadPool pool(3);
    ReadExecutorOptions options;
    options.window = window;
    Result<uint64_t> read = ExecuteReads(requests, metadata_, files_, pool, options);
    ASSERT_TRUE(read.ok()) << read.status();
    for (int64_t r = 0; r < piece_box.sizes[0]; ++r) {
      for (int64_t c = 0; c < piece_box.sizes[1]; ++c) {
        const float want = values_[static_cast<size_t>((piece_box.offsets[0] + r) * cols_ +
                                                       piece_box.offsets[1] + c)];
        ASSERT_EQ(out[static_cast<size_t>(r * piece_box.sizes[1] + c)], want)
            << "at " << r << "," << c << " of " << piece_box.ToString();
      }
    }
    // Without checksum blocks nothing is widened: rows are read whole, never more.
    EXPECT_LE(*read, static_cast<uint64_t>(piece_box.sizes[0]) * cols_ * 4 + 2 * 256 * 1024);
  }

  MemoryStore store_;
  CheckpointMetadata metadata_;
  TensorMetadata tensor_;
  std::vector<std::unique_ptr<ReadableFile>> files_;
  std::vector<float> values_;
  int64_t rows_ = 0, cols_ = 0;
};

TEST_F(UncheckedReadTest, RandomRegionsMatchTheReference) {
  Build(300, 257);
  std::mt19937 rng(11);
  for (int i = 0; i < 200; ++i) {
    const int64_t r0 = rng() % rows_, c0 = rng() % cols_;
    const int64_t r1 = r0 + 1 + rng() % (rows_ - r0), c1 = c0 + 1 + rng() % (cols_ - c0);
    const uint64_t window = (i % 3 == 0) ? 4096 : (uint64_t{64} << 20);
    LoadAndCheck(Box{{r0, c0}, {r1 - r0, c1 - c0}}, window);
  }
}

TEST_F(UncheckedReadTest, WholeTensorTakesTheDirectPath) {
  Build(512, 512);  // 1 MiB: each half is read straight into the destination
  LoadAndCheck(Box{{0, 0}, {512, 512}}, uint64_t{64} << 20);
}

// Requests that split the columns of chunks whose rows exceed the window (what a rank reads for
// the ranks it shares a chunk with) are sliced at the same rows: each slab is read once for all
// of them, not once per request.
TEST_F(UncheckedReadTest, SlicedReadsOfTheSameRowsShareEachSlab) {
  Build(256, 64);  // two chunks of 128 rows of 256 bytes; the window holds 16 rows
  const int64_t quarter = 16;
  std::vector<std::vector<float>> outs(4);
  std::vector<ReadRequest> requests;
  const TensorMetadata& stored = metadata_.tensors[0];
  for (int64_t q = 0; q < 4; ++q) {
    // Two quarters take every row; the others rows 10-199, cut at other rows.
    const Box piece = q < 2 ? Box{{0, q * quarter}, {256, quarter}}
                            : Box{{10, q * quarter}, {190, quarter}};
    outs[q].assign(static_cast<size_t>(piece.volume()), -1.0f);
    const ReadDestination dest{reinterpret_cast<std::byte*>(outs[q].data()), piece,
                               DType::kFloat32};
    for (size_t c = 0; c < stored.chunks.size(); ++c) {
      if (std::optional<Box> region = Intersect(stored.chunks[c].box, piece)) {
        requests.push_back(MakeReadRequest(stored, c, dest, *region));
      }
    }
  }
  ThreadPool pool(3);
  ReadExecutorOptions options;
  options.window = 4096;
  options.scatter_min_run_bytes = uint64_t{1} << 20;  // column runs are staged, not scattered
  options.max_gap_bytes = 0;
  Result<uint64_t> read = ExecuteReads(requests, metadata_, files_, pool, options);
  ASSERT_TRUE(read.ok()) << read.status();
  for (int64_t q = 0; q < 4; ++q) {
    const int64_t first = q < 2 ? 0 : 10, rows = q < 2 ? 256 : 190;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < quarter; ++c) {
        ASSERT_EQ(outs[q][static_cast<size_t>(r * quarter + c)],
                  values_[static_cast<size_t>((first + r) * cols_ + q * quarter + c)])
            << "quarter " << q << " at " << r << "," << c;
      }
    }
  }
  // Slabs start at the region's first row in its chunk and hold 16 rows. The first two quarters
  // share every slab: all 256 rows once. The other two share theirs: in the first chunk rows
  // 10-127 (118 rows), cut at other rows than the first two's, once more; in the second, rows
  // 128-199 are cut at the first two's rows, so only the last slab (rows 192-199, 8 rows) is a
  // slab of their own. Before, each request read its own slabs: 256 x 2 + 190 x 2 rows.
  EXPECT_EQ(*read, static_cast<uint64_t>(256 + 118 + 8) * cols_ * 4);
}

// A load that does not verify a checkpoint with checksums reads the rows it needs, not the
// checksum blocks around them.
TEST_F(UncheckedReadTest, UnverifiedReadsAreNotRoundedToChecksumBlocks) {
  Build(256, 64);  // chunks of 128 rows of 256 bytes (32 KiB), inside one 1 MiB block each
  metadata_.checksum_block_bytes = uint64_t{1} << 20;
  const Box piece{{10, 8}, {10, 16}};
  std::vector<float> out(static_cast<size_t>(piece.volume()), -1.0f);
  const ReadDestination dest{reinterpret_cast<std::byte*>(out.data()), piece, DType::kFloat32};
  const std::vector<ReadRequest> requests = {
      MakeReadRequest(metadata_.tensors[0], 0, dest, piece)};
  ThreadPool pool(2);
  ReadExecutorOptions options;
  options.verify = false;
  options.scatter_min_run_bytes = uint64_t{1} << 20;  // staged
  Result<uint64_t> read = ExecuteReads(requests, metadata_, files_, pool, options);
  ASSERT_TRUE(read.ok()) << read.status();
  for (int64_t r = 0; r < 10; ++r) {
    for (int64_t c = 0; c < 16; ++c) {
      ASSERT_EQ(out[static_cast<size_t>(r * 16 + c)],
                values_[static_cast<size_t>((10 + r) * cols_ + 8 + c)]);
    }
  }
  EXPECT_EQ(*read, uint64_t{10} * 256);  // the 10 rows, not the chunk's block
}

TEST_F(UncheckedReadTest, DecodedChunkWithoutADecoderIsAClearError) {
  Build(8, 8);
  metadata_.tensors[0].chunks[1].encoding = ChunkEncoding::kDriverDecoded;
  metadata_.tensors[0].chunks[1].stored_length = 16;
  std::vector<float> out(64);
  const ReadDestination dest{reinterpret_cast<std::byte*>(out.data()), Box{{0, 0}, {8, 8}},
                             DType::kFloat32};
  const TensorMetadata& stored = metadata_.tensors[0];
  std::vector<ReadRequest> requests = {MakeReadRequest(stored, 1, dest, stored.chunks[1].box)};
  ThreadPool pool(2);
  Result<uint64_t> read = ExecuteReads(requests, metadata_, files_, pool, {});
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(read.status().message().find("tensor 'w' chunk"), std::string::npos) << read.status();
  EXPECT_NE(read.status().message().find("model.safetensors"), std::string::npos);
}

// The mostly staged extents of a file are spread evenly over the load, and those of different
// files apart from each other: of N files with one each, no two closer than a third of 1/N.
TEST(SpreadPositionTest, SpreadsAFilesExtentsEvenlyAndTheFilesApart) {
  for (size_t n : {1, 2, 5}) {
    for (size_t k = 0; k < n; ++k) {
      EXPECT_DOUBLE_EQ(SpreadPosition(0, k, n), (static_cast<double>(k) + 0.5) / n);
    }
  }
  for (uint32_t files : {2u, 4u, 8u, 16u, 64u, 1000u}) {
    std::vector<double> at;
    for (uint32_t f = 0; f < files; ++f) {
      for (size_t k = 0; k < 3; ++k) {
        const double p = SpreadPosition(f, k, 3);
        ASSERT_GE(p, 0.0);
        ASSERT_LT(p, 1.0);
        // Each file's own stay a third apart, whatever the shift.
        const double next = SpreadPosition(f, (k + 1) % 3, 3);
        EXPECT_NEAR(std::fmod(next - p + 1.0, 1.0), 1.0 / 3, 1e-9) << f << " " << k;
      }
      at.push_back(SpreadPosition(f, 0, 1));
    }
    std::sort(at.begin(), at.end());
    double closest = 1.0 - at.back() + at.front();
    for (size_t i = 1; i < at.size(); ++i) closest = std::min(closest, at[i] - at[i - 1]);
    EXPECT_GE(closest * files, 1.0 / 3) << files << " files";
  }
}

// A file that counts the reads running at once across every file sharing `counters`.
struct ReadCounters {
  std::atomic<int> running{0};
  std::atomic<int> most{0};
  std::atomic<int> reads{0};
};

class CountingFile : public ReadableFile {
 public:
  CountingFile(std::unique_ptr<ReadableFile> base, ReadCounters& counters)
      : base_(std::move(base)), counters_(counters) {}
  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    return Counted([&] { return base_->ReadAt(offset, out); });
  }
  Status ReadVAt(uint64_t offset, std::span<const MutableByteView> pieces) const override {
    return Counted([&] { return base_->ReadVAt(offset, pieces); });
  }
  uint64_t size() const override { return base_->size(); }
  const std::string& path() const override { return base_->path(); }

 private:
  template <typename F>
  Status Counted(F read) const {
    const int now = ++counters_.running;
    int seen = counters_.most.load();
    while (now > seen && !counters_.most.compare_exchange_weak(seen, now)) {
    }
    ++counters_.reads;
    std::this_thread::sleep_for(std::chrono::milliseconds(3));  // long enough to overlap
    Status status = read();
    --counters_.running;
    return status;
  }

  std::unique_ptr<ReadableFile> base_;
  ReadCounters& counters_;
};

// 24 files of one chunk each: 24 extents, so the reads could all run at once on a pool as large.
class ReadDepthTest : public ::testing::Test {
 protected:
  static constexpr int kFiles = 24;
  static constexpr int64_t kRows = 64, kCols = 32;  // per file, float32: 8 KiB

  void SetUp() override {
    metadata_.format = CheckpointFormat::kSafetensors;
    metadata_.checksum_block_bytes = 0;
    TensorMetadata tensor{"w", DType::kFloat32, {kRows * kFiles, kCols}, {}};
    std::mt19937 rng(5);
    values_.resize(static_cast<size_t>(kRows * kFiles * kCols));
    for (float& v : values_) v = static_cast<float>(rng() % 1000003);
    ASSERT_TRUE(store_.CreateDirs("/d").ok());
    const uint64_t bytes = kRows * kCols * 4;
    for (int f = 0; f < kFiles; ++f) {
      const std::string name = "part-" + std::to_string(f);
      metadata_.files.push_back({name, 0, bytes, 0});
      tensor.chunks.push_back(StoredChunk{Box{{f * kRows, 0}, {kRows, kCols}},
                                          static_cast<uint32_t>(f), 0, bytes, {}, {}, 0});
      auto writable = store_.NewWritableFile("/d/" + name).value();
      ASSERT_TRUE(writable->WriteAt(0, ByteView(reinterpret_cast<const std::byte*>(
                                                    values_.data() + f * kRows * kCols),
                                                bytes))
                      .ok());
      ASSERT_TRUE(writable->Close().ok());
    }
    metadata_.tensors = {tensor};
  }

  // Reads the whole tensor with `options` on `pool`; checks every value.
  void ReadAll(ThreadPool& pool, const ReadExecutorOptions& options, ReadCounters& counters) {
    std::vector<std::unique_ptr<ReadableFile>> files;
    for (const DataFile& f : metadata_.files) {
      files.push_back(
          std::make_unique<CountingFile>(store_.OpenReadable("/d/" + f.name).value(), counters));
    }
    std::vector<float> out(values_.size(), -1.0f);
    const TensorMetadata& stored = metadata_.tensors[0];
    const ReadDestination dest{reinterpret_cast<std::byte*>(out.data()),
                               Box{{0, 0}, {kRows * kFiles, kCols}}, DType::kFloat32};
    std::vector<ReadRequest> requests;
    for (size_t c = 0; c < stored.chunks.size(); ++c) {
      requests.push_back(MakeReadRequest(stored, c, dest, stored.chunks[c].box));
    }
    Result<uint64_t> read = ExecuteReads(requests, metadata_, files, pool, options);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(*read, values_.size() * 4);
    EXPECT_EQ(out, values_);
  }

  MemoryStore store_;
  CheckpointMetadata metadata_;
  std::vector<float> values_;
};

TEST_F(ReadDepthTest, AFixedDepthBoundsTheReadsInFlight) {
  ThreadPool pool(8);
  for (int depth : {1, 3}) {
    ReadCounters counters;
    ReadExecutorOptions options;
    options.io_depth = depth;
    ReadAll(pool, options, counters);
    EXPECT_EQ(counters.reads.load(), kFiles);
    EXPECT_EQ(counters.most.load(), depth) << "io_depth " << depth;
  }
}

TEST_F(ReadDepthTest, TheTunedDepthStaysWithinThePoolAndIsSharedByItsCallers) {
  ThreadPool pool(6);
  ReadCounters counters;
  // Three callers at once, as three in-process ranks: together they never pass the depth the
  // pool's tuner allows, which never passes the pool's threads.
  std::vector<std::thread> callers;
  for (int i = 0; i < 3; ++i) {
    callers.emplace_back([&] { ReadAll(pool, ReadExecutorOptions{}, counters); });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(counters.reads.load(), 3 * kFiles);
  EXPECT_GE(counters.most.load(), 2);
  EXPECT_LE(counters.most.load(), std::min(4, pool.size()));  // the tuner starts at 4
  EXPECT_LE(pool.io_tuner().depth(), pool.size());
}

TEST_F(ReadDepthTest, CallersOnPoolsOfTheirOwnShareAMachineGate) {
  // Three callers, as three processes of a machine, each on its own pool of 6 threads: with a
  // shared gate of depth 2 among them, never more than 2 reads at once; with a gate each, more.
  const std::string name = "/sp-read-depth-test-" + RandomHexId(12);
  IoTunerConfig config;
  config.max_depth = 2;
  config.fixed = true;
  std::vector<std::unique_ptr<SharedIoTuner>> gates;
  for (int member = 0; member < 3; ++member) {
    Result<std::unique_ptr<SharedIoTuner>> gate = SharedIoTuner::Attach(name, 3, member, config);
    ASSERT_TRUE(gate.ok()) << gate.status();
    gates.push_back(std::move(gate).value());
  }
  for (bool shared : {true, false}) {
    ReadCounters counters;
    std::vector<std::thread> callers;
    for (int i = 0; i < 3; ++i) {
      callers.emplace_back([&, i] {
        ThreadPool pool(6);
        ReadExecutorOptions options;
        if (shared) options.gate = gates[static_cast<size_t>(i)].get();
        ReadAll(pool, options, counters);
      });
    }
    for (std::thread& t : callers) t.join();
    EXPECT_EQ(counters.reads.load(), 3 * kFiles);
    if (shared) {
      EXPECT_EQ(counters.most.load(), 2);
    } else {
      EXPECT_GT(counters.most.load(), 2);  // each pool's tuner starts at 4
    }
  }
}

}  // namespace
}  // namespace sp
