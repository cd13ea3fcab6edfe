// The commit's collection of the ranks' write reports (engine/write_reports.h): random plans
// collected on one thread and on a pool, against the checksums and files the ranks reported, and
// every kind of bad report refused with the same error either way.
#include "shardpoint/engine/write_reports.h"

#include <algorithm>
#include <random>

#include <gtest/gtest.h>

#include "shardpoint/engine/save_messages.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/chunk_grid.h"

namespace sp {
namespace {

// A plan whose chunks lie in files of `ranks` writers, and what each rank reports of it.
struct Case {
  CheckpointMetadata metadata;       // the files unreported, the chunks without checksums
  std::vector<TensorMetadata> want;  // the chunks with the checksums their writers report
  std::vector<DataFile> want_files;  // the files as their writers report them
  std::vector<WriteReport> reports;  // rank r's at r
};

Case RandomCase(std::mt19937_64& rng, int ranks) {
  const auto draw = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  Case c;
  const uint64_t block_sizes[] = {0, 1, 7, 64, 1 << 20};
  c.metadata.checksum_block_bytes = block_sizes[draw(0, 4)];
  c.reports.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    for (uint64_t f = draw(1, 2); f > 0; --f) {
      const uint32_t index = static_cast<uint32_t>(c.metadata.files.size());
      c.metadata.files.push_back(DataFile{"d-r" + std::to_string(r) + "-f" + std::to_string(index),
                                          0, 0, r});
      const uint64_t data_start = draw(8, 4096);
      c.want_files.push_back(DataFile{c.metadata.files.back().name, data_start,
                                      data_start + draw(0, 1 << 20), r});
      c.reports[r].files.push_back(
          FileReport{index, data_start, c.want_files.back().size});
    }
  }
  for (uint64_t t = draw(1, 8); t > 0; --t) {
    TensorMetadata tensor;
    tensor.name = "t" + std::to_string(c.metadata.tensors.size());
    tensor.dtype = DType::kUInt8;
    int64_t rows = 0;
    for (uint64_t k = draw(1, 10); k > 0; --k) {
      const uint64_t bytes = draw(0, 300);
      const uint32_t file = static_cast<uint32_t>(draw(0, c.metadata.files.size() - 1));
      tensor.chunks.emplace_back(Box(Dims{rows}, Dims{static_cast<int64_t>(bytes)}), file,
                                 draw(0, 1 << 20), bytes);
      rows += static_cast<int64_t>(bytes);
    }
    tensor.shape = Shape{rows};
    c.metadata.tensors.push_back(std::move(tensor));
  }
  c.want = c.metadata.tensors;
  for (size_t t = 0; t < c.want.size(); ++t) {
    for (size_t k = 0; k < c.want[t].chunks.size(); ++k) {
      StoredChunk& chunk = c.want[t].chunks[k];
      ChunkReport report{static_cast<uint32_t>(t), static_cast<uint32_t>(k), {}};
      for (uint64_t b = ChecksumBlockCount(chunk.byte_length, c.metadata.checksum_block_bytes);
           b > 0; --b) {
        report.block_crc32c.push_back(static_cast<uint32_t>(draw(0, UINT32_MAX)));
      }
      chunk.block_crc32c.assign(report.block_crc32c.begin(), report.block_crc32c.end());
      c.reports[c.metadata.files[chunk.file].writer_rank].chunks.push_back(std::move(report));
    }
  }
  for (WriteReport& report : c.reports) {
    std::shuffle(report.chunks.begin(), report.chunks.end(), rng);
    std::shuffle(report.files.begin(), report.files.end(), rng);
  }
  return c;
}

std::vector<std::string> Encoded(const std::vector<WriteReport>& reports) {
  std::vector<std::string> encoded;
  for (const WriteReport& r : reports) encoded.push_back(EncodeWriteReport(r));
  return encoded;
}

// CollectReports of `c` with the checksums kept apart (as a save with a plan cache commits),
// filled back into a copy of the plan's tensors; `files` takes the files as collected.
Result<std::vector<TensorMetadata>> CollectApart(const Case& c, ThreadPool* pool,
                                                 std::vector<DataFile>* files) {
  CheckpointMetadata summary = c.metadata;
  summary.tensors.clear();
  ChunkChecksums checksums;
  SP_RETURN_IF_ERROR(
      CollectReports(Encoded(c.reports), c.metadata.tensors, &summary, &checksums, pool));
  std::vector<TensorMetadata> tensors = c.metadata.tensors;
  SP_RETURN_IF_ERROR(FillChecksums(checksums, &tensors));
  *files = summary.files;
  return tensors;
}

// CollectReports of `c` with the checksums filled into the plan's own chunks.
Result<std::vector<TensorMetadata>> CollectInPlace(const Case& c, ThreadPool* pool,
                                                   std::vector<DataFile>* files) {
  CheckpointMetadata metadata = c.metadata;
  SP_RETURN_IF_ERROR(
      CollectReports(Encoded(c.reports), metadata.tensors, &metadata, nullptr, pool));
  *files = metadata.files;
  return metadata.tensors;
}

// CollectReports of `c` with every tensor whose chunks form a grid held as its cells, as a save
// plan holds it (SavePlanOptions::chunk_cells): the checksums kept apart, then filled into a copy
// of the plan's tensors, which gives them their chunks.
Result<std::vector<TensorMetadata>> CollectAsCells(const Case& c, ThreadPool* pool,
                                                   std::vector<DataFile>* files) {
  std::vector<TensorMetadata> tensors = c.metadata.tensors;
  for (TensorMetadata& t : tensors) {
    t.grid = FindChunkGrid(t.chunks, t.shape);
    CompactChunkCells(&t);
  }
  CheckpointMetadata summary = c.metadata;
  summary.tensors.clear();
  ChunkChecksums checksums;
  SP_RETURN_IF_ERROR(CollectReports(Encoded(c.reports), tensors, &summary, &checksums, pool));
  SP_RETURN_IF_ERROR(FillChecksums(checksums, &tensors));
  for (TensorMetadata& t : tensors) t.grid.reset();  // not in the cases' tensors
  *files = summary.files;
  return tensors;
}

TEST(WriteReportsTest, RandomPlansCollectTheReportedChecksumsAndFilesOnOneThreadOrAPool) {
  std::mt19937_64 rng(20261129);
  ThreadPool pool(3);
  for (int trial = 0; trial < 200; ++trial) {
    const Case c = RandomCase(rng, 1 + trial % 6);
    for (ThreadPool* on : {static_cast<ThreadPool*>(nullptr), &pool}) {
      for (auto* collect : {&CollectApart, &CollectInPlace, &CollectAsCells}) {
        std::vector<DataFile> files;
        Result<std::vector<TensorMetadata>> tensors = collect(c, on, &files);
        ASSERT_TRUE(tensors.ok()) << "trial " << trial << ": " << tensors.status();
        EXPECT_EQ(*tensors, c.want) << "trial " << trial;
        EXPECT_EQ(files, c.want_files) << "trial " << trial;
      }
    }
  }
}

// The error of collecting `c`, which must be the same on one thread and on a pool, with the
// checksums kept apart or filled in.
std::string ErrorOf(const Case& c, ThreadPool* pool) {
  std::vector<DataFile> files;
  const Status one = CollectApart(c, nullptr, &files).status();
  EXPECT_EQ(one.code(), StatusCode::kInternal) << one;
  EXPECT_EQ(CollectApart(c, pool, &files).status(), one);
  EXPECT_EQ(CollectInPlace(c, nullptr, &files).status(), one);
  EXPECT_EQ(CollectInPlace(c, pool, &files).status(), one);
  EXPECT_EQ(CollectAsCells(c, nullptr, &files).status(), one);
  EXPECT_EQ(CollectAsCells(c, pool, &files).status(), one);
  return one.message();
}

// A random case of 4 ranks in which rank `rank` reports a chunk of more than one block.
Case CaseWithBlocksAt(std::mt19937_64& rng, int rank) {
  for (;;) {
    Case c = RandomCase(rng, 4);
    for (const ChunkReport& chunk : c.reports[rank].chunks) {
      if (chunk.block_crc32c.size() > 1) return c;
    }
  }
}

TEST(WriteReportsTest, BadReportsAreRefusedNamingTheRankAndTheChunkOrFile) {
  std::mt19937_64 rng(7);
  ThreadPool pool(3);
  for (int trial = 0; trial < 20; ++trial) {
    {  // a chunk nobody reports
      Case c = CaseWithBlocksAt(rng, 2);
      const ChunkReport dropped = c.reports[2].chunks.back();
      c.reports[2].chunks.pop_back();
      const StoredChunk& chunk = c.metadata.tensors[dropped.tensor].chunks[dropped.chunk];
      EXPECT_EQ(ErrorOf(c, &pool), "no rank reported writing tensor 't" +
                                       std::to_string(dropped.tensor) + "' chunk " +
                                       chunk.box.ToString());
    }
    {  // a checksum too many, at ranks 1 and 3: the lower rank's error, also on the pool
      Case c = CaseWithBlocksAt(rng, 1);
      ChunkReport* first = nullptr;
      for (ChunkReport& chunk : c.reports[1].chunks) {
        if (chunk.block_crc32c.size() > 1) first = &chunk;
      }
      first->block_crc32c.push_back(1);
      if (!c.reports[3].chunks.empty()) c.reports[3].chunks.front().block_crc32c.push_back(1);
      const StoredChunk& chunk = c.metadata.tensors[first->tensor].chunks[first->chunk];
      EXPECT_EQ(ErrorOf(c, &pool),
                "rank 1 reported " + std::to_string(first->block_crc32c.size()) +
                    " block checksums of tensor 't" + std::to_string(first->tensor) +
                    "' chunk " + chunk.box.ToString() + ", expected " +
                    std::to_string(first->block_crc32c.size() - 1));
    }
    {  // a chunk of another tensor than the plan has
      Case c = RandomCase(rng, 4);
      c.reports[3].chunks.push_back(
          ChunkReport{static_cast<uint32_t>(c.metadata.tensors.size()), 0, {}});
      EXPECT_EQ(ErrorOf(c, &pool), "rank 3 reported an unknown chunk (tensor " +
                                       std::to_string(c.metadata.tensors.size()) + ", chunk 0)");
    }
    {  // a file reported by a rank that did not write it, twice by its writer, and by nobody
      Case c = RandomCase(rng, 4);
      c.reports[0].files.push_back(c.reports[2].files.back());
      const DataFile& file = c.metadata.files[c.reports[2].files.back().index];
      EXPECT_EQ(ErrorOf(c, &pool),
                "rank 0 reported file " + file.name + " of rank 2 (data from " +
                    std::to_string(c.reports[2].files.back().data_start) + " of " +
                    std::to_string(c.reports[2].files.back().size) + " bytes)");
      c.reports[0].files.pop_back();
      c.reports[2].files.push_back(c.reports[2].files.back());  // by its writer, twice
      EXPECT_EQ(ErrorOf(c, &pool),
                "rank 2 reported file " + file.name + " of rank 2 (data from " +
                    std::to_string(c.reports[2].files.back().data_start) + " of " +
                    std::to_string(c.reports[2].files.back().size) + " bytes) twice");
      c.reports[2].files.pop_back();
      c.reports[2].files.pop_back();
      EXPECT_EQ(ErrorOf(c, &pool), "no rank reported writing file " + file.name);
    }
  }
}

TEST(WriteReportsTest, BytesThatAreNotAReportAreDataLossNamingTheRank) {
  std::mt19937_64 rng(3);
  ThreadPool pool(3);
  const Case c = RandomCase(rng, 4);
  std::vector<std::string> reports = Encoded(c.reports);
  const std::string whole = reports[2];
  for (const std::string& bad : {whole.substr(0, whole.size() - 1), whole + "x"}) {
    reports[2] = bad;
    for (ThreadPool* on : {static_cast<ThreadPool*>(nullptr), &pool}) {
      CheckpointMetadata metadata = c.metadata;
      const Status s = CollectReports(reports, metadata.tensors, &metadata, nullptr, on);
      EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
      EXPECT_EQ(s.message().rfind("rank 2's write report: ", 0), 0u) << s;
    }
  }
}

// A chunk two ranks report is refused whichever of the two is walked second: the message then
// names that rank, so only its form is checked here.
TEST(WriteReportsTest, AChunkTwoRanksReportIsRefused) {
  std::mt19937_64 rng(11);
  ThreadPool pool(3);
  for (int trial = 0; trial < 50; ++trial) {
    Case c = RandomCase(rng, 4);
    const TensorMetadata& tensor = c.metadata.tensors[trial % c.metadata.tensors.size()];
    const StoredChunk& chunk = tensor.chunks.front();
    const int writer = c.metadata.files[chunk.file].writer_rank;
    const int other = (writer + 1 + trial % 3) % 4;
    for (const ChunkReport& report : c.reports[writer].chunks) {
      if (&c.metadata.tensors[report.tensor] == &tensor && report.chunk == 0) {
        c.reports[other].chunks.insert(c.reports[other].chunks.begin(), report);
        break;
      }
    }
    for (ThreadPool* on : {static_cast<ThreadPool*>(nullptr), &pool}) {
      std::vector<DataFile> files;
      for (auto* collect : {&CollectApart, &CollectInPlace}) {
        const Status s = collect(c, on, &files).status();
        EXPECT_EQ(s.code(), StatusCode::kInternal) << s;
        const std::string tail = " reported tensor '" + tensor.name + "' chunk " +
                                 chunk.box.ToString() + ", which another rank reported too";
        EXPECT_TRUE(s.message() == "rank " + std::to_string(writer) + tail ||
                    s.message() == "rank " + std::to_string(other) + tail)
            << s;
      }
    }
  }
}

TEST(WriteReportsTest, GridCellsTakeTheirChecksumsOnlyApart) {
  std::mt19937_64 rng(11);
  Case c = RandomCase(rng, 2);
  TensorMetadata& t = c.metadata.tensors[0];
  t.chunks = {StoredChunk(Box(Dims{0}, Dims{4}), 0, 0, 4),
              StoredChunk(Box(Dims{4}, Dims{4}), 0, 4, 4)};
  t.shape = Shape{8};
  t.grid = FindChunkGrid(t.chunks, t.shape);
  ASSERT_TRUE(CompactChunkCells(&t));
  const Status s = CollectReports(Encoded(c.reports), c.metadata.tensors, &c.metadata, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(), "tensor 't0' is held as cells: its checksums must be kept apart");
}

}  // namespace
}  // namespace sp
