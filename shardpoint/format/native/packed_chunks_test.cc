// Packed chunk lists (ChunkList in format/metadata.h): the native decoder keeps a grid tensor's
// cells and a listed tensor's chunks packed, and they must read, copy, change and travel exactly
// as the chunks they stand for.
#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <vector>

#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/native/metadata_test_util.h"

namespace sp {
namespace {

using ::sp::testing::AsVersionFour;
using ::sp::testing::ExpectMetadataEq;
using ::sp::testing::ExpectTensorEq;
using ::sp::testing::RandomMetadata;

constexpr char kPath[] = "/ckpt/shardpoint.metadata";

// `m` with every chunk list unpacked into a vector of its own (what a decoder that kept none
// packed gives).
CheckpointMetadata Unpacked(CheckpointMetadata m) {
  for (TensorMetadata& t : m.tensors) t.chunks.mut();
  return m;
}

// The tensors of `m` whose chunks are packed, and of those the ones not unpacked yet.
size_t PackedCount(const CheckpointMetadata& m) {
  size_t packed = 0;
  for (const TensorMetadata& t : m.tensors) packed += t.chunks.packed();
  return packed;
}
size_t StillPackedCount(const CheckpointMetadata& m) {
  size_t packed = 0;
  for (const TensorMetadata& t : m.tensors) packed += !t.chunks.unpacked();
  return packed;
}

// Boxes within `shape`, some of them empty or the whole shape.
std::vector<Box> RandomBoxesIn(const Shape& shape, std::mt19937_64& rng) {
  std::vector<Box> boxes(1 + rng() % 3);
  for (Box& box : boxes) {
    if (rng() % 6 == 0) {
      box = Box::Whole(shape);
      continue;
    }
    for (int64_t size : shape) {
      const int64_t begin = size == 0 ? 0 : static_cast<int64_t>(rng() % size);
      const int64_t end =
          begin + (size == begin ? 0 : static_cast<int64_t>(rng() % (size - begin)) + 1);
      box.offsets.push_back(begin);
      box.sizes.push_back(end - begin);
    }
  }
  return boxes;
}

TEST(PackedChunksTest, DecodedGridsAndListsStayPackedUntilWalkedAndReadAsTheirChunks) {
  size_t packed_tensors = 0, listed_tensors = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    for (const uint32_t version : {3u, 2u}) {
      SCOPED_TRACE("version " + std::to_string(version));
      const std::string bytes = EncodeMetadata(m, version);
      Result<CheckpointMetadata> decoded = DecodeMetadata(bytes, kPath);
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      for (size_t i = 0; i < m.tensors.size(); ++i) {
        const TensorMetadata& want = m.tensors[i];
        const TensorMetadata& got = decoded->tensors[i];
        SCOPED_TRACE(want.name);
        // Packed, as the cells of a grid exactly where the record is one (FindChunkGrid, as the
        // encoder stores one).
        const bool grid = FindChunkGrid(want.chunks, want.shape).has_value();
        ASSERT_TRUE(got.chunks.packed());
        ASSERT_EQ(got.chunks.packed_grid(), grid);
        if (!grid) {  // indexed from the packed boxes, as from the chunks
          EXPECT_EQ(got.index, BuildChunkIndex(want.chunks, want.shape));
        }
        (grid ? packed_tensors : listed_tensors) += 1;
        ASSERT_EQ(got.chunks.size(), want.chunks.size());
        for (size_t c = 0; c < want.chunks.size(); ++c) {
          EXPECT_EQ(got.chunks.file(c), want.chunks[c].file);
          EXPECT_EQ(got.chunks.data_offset(c), want.chunks[c].data_offset);
          EXPECT_EQ(got.chunks.box(c), want.chunks[c].box);
          const std::span<const uint32_t> crcs = got.chunks.block_crc32c(c);
          EXPECT_EQ(std::vector<uint32_t>(crcs.begin(), crcs.end()),
                    std::vector<uint32_t>(want.chunks[c].block_crc32c.begin(),
                                          want.chunks[c].block_crc32c.end()));
        }
        if (grid) {  // the cells' placement as runs: in order, each cell in one
          const PackedChunks& packed = *got.chunks.packed_chunks();
          std::vector<CellRun> greedy;
          for (size_t c = 0; c < want.chunks.size(); ++c) {
            AppendCellRun(&greedy, c, want.chunks[c].file, want.chunks[c].data_offset);
          }
          uint64_t next = 0;
          for (const CellRun& run : packed.runs) {
            EXPECT_EQ(run.first, next);
            EXPECT_GT(run.count, 0u);
            next = run.first + run.count;
          }
          EXPECT_EQ(next, want.chunks.size());
          // As few as the steps allow, whatever runs the record stores.
          EXPECT_EQ(packed.runs, greedy);
        }
        // Sizes and the accessors read the packed form; nothing was unpacked.
        EXPECT_FALSE(got.chunks.unpacked());
        // A copy shares the packed form.
        const TensorMetadata copy = got;
        EXPECT_EQ(copy.chunks.packed_chunks(), got.chunks.packed_chunks());
        // Walked, the chunks are the stored ones, in both the copy and the original, and the
        // copy's walk unpacked the form they share.
        ExpectTensorEq(want, copy);
        EXPECT_EQ(copy.chunks.data(), got.chunks.data());
        ExpectTensorEq(want, got);
      }
      ExpectMetadataEq(version == 3 ? m : [&] {
        CheckpointMetadata as_v2 = m;
        as_v2.version_major = 2;
        return as_v2;
      }(), *decoded);
      // Encoded again from its packed form, the file is the same.
      EXPECT_EQ(EncodeMetadata(*DecodeMetadata(bytes, kPath), version), bytes);
    }
  }
  EXPECT_GT(packed_tensors, 200u);
  EXPECT_GT(listed_tensors, 50u);
}

// A weight sharded over 1,000 ranks, one cell at the same offset of each rank's file (FSDP): its
// thousand cells are held as one run, whatever the version, and read back cell by cell.
TEST(PackedChunksTest, ACellPerFileAtOneOffsetIsHeldAsARun) {
  constexpr uint32_t kRanks = 1000;
  CheckpointMetadata m;
  m.save_id = "s";
  m.world_size = kRanks;
  m.checksum_block_bytes = 1 << 20;
  TensorMetadata t("w", DType::kFloat32, {kRanks * 4, 8});
  for (uint32_t r = 0; r < kRanks; ++r) {
    m.files.push_back(
        DataFile{"d-s-r" + std::to_string(r), 8, 8 + 4096 + 128, static_cast<int32_t>(r)});
    t.chunks.push_back(StoredChunk(Box({int64_t{4} * r, 0}, {4, 8}), r, 4096, 128, {r * 7 + 1}));
  }
  m.tensors.push_back(std::move(t));
  for (const uint32_t version : {3u, 2u}) {
    SCOPED_TRACE("version " + std::to_string(version));
    Result<CheckpointMetadata> decoded = DecodeMetadata(EncodeMetadata(m, version), kPath);
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    const ChunkList& chunks = decoded->tensors[0].chunks;
    ASSERT_TRUE(chunks.packed());
    // Version 3 stores the first cell as a step from file 0 and offset 0, then a run of steps
    // of one file; version 2 lists each cell. The decoder holds one run for both.
    EXPECT_EQ(chunks.packed_chunks()->runs.size(), 1u);
    for (uint32_t r = 0; r < kRanks; ++r) {
      ASSERT_EQ(chunks.file(r), r);
      ASSERT_EQ(chunks.data_offset(r), 4096u);
      ASSERT_EQ(chunks.block_crc32c(r)[0], r * 7 + 1);
    }
    EXPECT_LT(ChunkListBytes(decoded->tensors), 5u * kRanks);  // the checksums, and the runs
    ExpectTensorEq(m.tensors[0], decoded->tensors[0]);
  }
}

// An irregular tensor (row bands cut into columns unevenly: no grid) is kept packed as a list:
// each chunk's box, file, offset and checksums (of uneven counts) read back without unpacking,
// its index and the chunks a filter reaches are those of its chunks, it becomes cells as they do,
// and it takes a fraction of their bytes.
TEST(PackedChunksTest, AListKeepsEachChunksBoxAndChecksumsAndIsSearchedPacked) {
  CheckpointMetadata m;
  m.save_id = "s";
  m.world_size = 2;
  m.checksum_block_bytes = 16;
  m.files.push_back(DataFile{"d-s-r0", 8, 8 + 4096, 0});
  m.files.push_back(DataFile{"d-s-r1", 8, 8 + 4096, 1});
  TensorMetadata t("w", DType::kFloat32, {10, 7});
  // 84, 56 and 140 bytes: 6, 4 and 9 checksums of 16-byte blocks.
  const std::vector<Box> boxes = {Box({0, 0}, {3, 7}), Box({3, 0}, {7, 2}), Box({3, 2}, {7, 5})};
  const std::vector<std::pair<uint32_t, uint64_t>> places = {{1, 0}, {0, 64}, {1, 84}};
  uint32_t crc = 1;
  for (size_t c = 0; c < boxes.size(); ++c) {
    const uint64_t bytes = static_cast<uint64_t>(boxes[c].volume()) * 4;
    InlineVector<uint32_t, 2> crcs;
    for (uint64_t b = 0; b < ChecksumBlockCount(bytes, 16); ++b) crcs.push_back(crc++);
    t.chunks.push_back(StoredChunk(boxes[c], places[c].first, places[c].second, bytes, crcs));
  }
  ASSERT_FALSE(FindChunkGrid(t.chunks, t.shape).has_value());
  m.tensors.push_back(t);
  for (const uint32_t version : {3u, 2u}) {
    SCOPED_TRACE("version " + std::to_string(version));
    const std::string bytes = EncodeMetadata(m, version);
    CheckpointMetadata decoded = DecodeMetadata(bytes, kPath).value();
    const TensorMetadata& got = decoded.tensors[0];
    ASSERT_TRUE(got.chunks.packed());
    EXPECT_FALSE(got.chunks.packed_grid());
    EXPECT_FALSE(got.grid.has_value());
    const PackedChunks& packed = *got.chunks.packed_chunks();
    EXPECT_EQ(packed.checksums.starts, (std::vector<uint64_t>{0, 6, 10, 19}));
    for (size_t c = 0; c < boxes.size(); ++c) {
      EXPECT_EQ(got.chunks.box(c), boxes[c]);
      EXPECT_EQ(got.chunks.file(c), places[c].first);
      EXPECT_EQ(got.chunks.data_offset(c), places[c].second);
      const std::span<const uint32_t> sums = got.chunks.block_crc32c(c);
      EXPECT_EQ(std::vector<uint32_t>(sums.begin(), sums.end()),
                std::vector<uint32_t>(t.chunks[c].block_crc32c.begin(),
                                      t.chunks[c].block_crc32c.end()));
    }
    EXPECT_EQ(got.index, BuildChunkIndex(t.chunks, t.shape));
    ASSERT_TRUE(got.index.has_value());
    // The chunks under a box, found through the index on the packed boxes.
    const std::vector<Box> under = {Box({2, 1}, {2, 1})};
    EXPECT_EQ(ChunksReached(got, under), (std::vector<uint32_t>{0, 1}));
    EXPECT_EQ(ChunksReached(got, std::vector<Box>{Box({5, 4}, {1, 3})}),
              (std::vector<uint32_t>{2}));
    // Held as cells (the save plan's form), straight from the packed form.
    TensorMetadata as_cells = got;
    TensorMetadata from_chunks = t;
    ASSERT_TRUE(CompactChunkCells(&as_cells));
    ASSERT_TRUE(CompactChunkCells(&from_chunks));
    EXPECT_EQ(as_cells.cells, from_chunks.cells);
    EXPECT_FALSE(got.chunks.unpacked());
    ExpectTensorEq(t, got);  // walked: the chunks themselves
    EXPECT_TRUE(got.chunks.unpacked());
    EXPECT_EQ(EncodeMetadata(DecodeMetadata(bytes, kPath).value(), version), bytes);
  }
  // Version 1 lists every chunk at fixed width and holds no grids: its chunks are not packed.
  EXPECT_FALSE(DecodeMetadata(EncodeMetadata(m, 1), kPath).value().tensors[0].chunks.packed());
}

// 8,192 flat ranges of uneven length (a Megatron-style flat optimizer shard) are held in about a
// quarter of the bytes of their StoredChunks.
TEST(PackedChunksTest, AListOfFlatRangesTakesAQuarterOfItsChunksBytes) {
  constexpr uint32_t kRanks = 8192;
  CheckpointMetadata m;
  m.save_id = "s";
  m.world_size = kRanks;
  m.checksum_block_bytes = 1 << 20;
  m.data_file_checksums = true;
  TensorMetadata t("flat", DType::kFloat32, {0});
  int64_t at = 0;
  for (uint32_t r = 0; r < kRanks; ++r) {
    const int64_t length = 100 + (r * 37) % 61;
    m.files.push_back(DataFile{"d-s-r" + std::to_string(r), 8, 8 + 4096 + 1024,
                               static_cast<int32_t>(r)});
    t.chunks.push_back(StoredChunk(Box({at}, {length}), r, 4096,
                                   static_cast<uint64_t>(length) * 4, {r}));
    at += length;
  }
  t.shape = {at};
  m.tensors.push_back(std::move(t));
  const CheckpointMetadata decoded = DecodeMetadata(EncodeMetadata(m), kPath).value();
  ASSERT_EQ(decoded.version_major, 4u);
  ASSERT_TRUE(decoded.tensors[0].chunks.packed());
  EXPECT_LT(ChunkListBytes(decoded.tensors) * 4, ChunkListBytes(m.tensors));
  EXPECT_FALSE(decoded.tensors[0].chunks.unpacked());
  ExpectTensorEq(AsVersionFour(m).tensors[0], decoded.tensors[0]);
}

TEST(PackedChunksTest, ChangingACopyUnpacksItAloneAndTheOriginalStays) {
  const CheckpointMetadata m = RandomMetadata(7, 25);
  const CheckpointMetadata decoded = DecodeMetadata(EncodeMetadata(m), kPath).value();
  size_t changed = 0;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const TensorMetadata& original = decoded.tensors[i];
    if (!original.chunks.packed()) continue;
    SCOPED_TRACE(original.name);
    ++changed;
    TensorMetadata copy = original;
    copy.chunks[0].data_offset += 4096;  // a non-const element: the copy's own vector
    EXPECT_FALSE(copy.chunks.packed());
    EXPECT_TRUE(original.chunks.packed());
    EXPECT_EQ(copy.chunks[0].data_offset, m.tensors[i].chunks[0].data_offset + 4096);
    EXPECT_EQ(original.chunks.data_offset(0), m.tensors[i].chunks[0].data_offset);
    EXPECT_EQ(original.chunks[0], m.tensors[i].chunks[0]);
    EXPECT_FALSE(copy == original);
    // Appending and clearing work on the copy's own vector too.
    TensorMetadata grown = original;
    grown.chunks.push_back(grown.chunks.back());
    EXPECT_EQ(grown.chunks.size(), original.chunks.size() + 1);
    EXPECT_EQ(grown.chunks.back(), m.tensors[i].chunks.back());
    TensorMetadata cleared = original;
    cleared.chunks.clear();
    EXPECT_TRUE(cleared.chunks.empty());
    EXPECT_FALSE(cleared.chunks.packed());
    EXPECT_EQ(original.chunks.size(), m.tensors[i].chunks.size());
    // The only holder of a packed form takes its chunks when it changes.
    TensorMetadata alone = DecodeMetadata(EncodeMetadata(m), kPath).value().tensors[i];
    ASSERT_TRUE(alone.chunks.packed());
    alone.chunks.resize(1);
    EXPECT_EQ(alone.chunks.size(), 1u);
    EXPECT_EQ(alone.chunks[0], m.tensors[i].chunks[0]);
  }
  EXPECT_GT(changed, 5u);
}

TEST(PackedChunksTest, ThreadsThatWalkOnePackedListAtOnceSeeTheSameChunks) {
  const CheckpointMetadata m = RandomMetadata(11, 25);
  for (int round = 0; round < 20; ++round) {
    const CheckpointMetadata decoded = DecodeMetadata(EncodeMetadata(m), kPath).value();
    ASSERT_GT(PackedCount(decoded), 0u);
    constexpr int kThreads = 4;
    std::vector<std::vector<const StoredChunk*>> seen(kThreads);
    std::vector<std::thread> threads;
    for (int k = 0; k < kThreads; ++k) {
      threads.emplace_back([&, k] {
        for (size_t i = 0; i < decoded.tensors.size(); ++i) {
          const TensorMetadata& t = decoded.tensors[(i + k) % decoded.tensors.size()];
          seen[k].push_back(t.chunks.data());
          for (size_t c = 0; c < t.chunks.size(); ++c) (void)t.chunks[c].byte_length;
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (int k = 1; k < kThreads; ++k) {
      for (size_t i = 0; i < decoded.tensors.size(); ++i) {
        EXPECT_EQ(seen[k][(i + decoded.tensors.size() - k) % decoded.tensors.size()],
                  seen[0][i]);
      }
    }
    ExpectMetadataEq(m, decoded);
  }
}

// The coordinator of a load answers each rank from the packed form without unpacking it, with
// the bytes the unpacked chunks give.
TEST(PackedChunksTest, PartsAndWireEncodingsOfPackedChunksAreThoseOfTheUnpacked) {
  std::mt19937_64 rng(5);
  ThreadPool pool(3);
  size_t parts = 0;
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    const CheckpointMetadata packed = DecodeMetadata(EncodeMetadata(m), kPath).value();
    const size_t packed_before = PackedCount(packed);
    EXPECT_EQ(StillPackedCount(packed), packed_before);
    // From a decoding of its own: unpacking a copy would unpack the form the copies share.
    const CheckpointMetadata unpacked = Unpacked(DecodeMetadata(EncodeMetadata(m), kPath).value());
    ASSERT_EQ(PackedCount(unpacked), 0u);
    EXPECT_EQ(EncodeMetadataForWire(packed), EncodeMetadataForWire(unpacked));
    EXPECT_EQ(WireMetadataBound(packed), WireMetadataBound(unpacked));
    const MetadataPartEncoder from_packed(packed, &pool);
    const MetadataPartEncoder from_unpacked(unpacked, &pool);
    for (int trial = 0; trial < 8; ++trial) {
      ChunkFilter filter;
      for (const TensorMetadata& t : m.tensors) {
        if (rng() % 4 != 0) filter[t.name] = RandomBoxesIn(t.shape, rng);
      }
      const std::string part = from_packed.Encode(filter);
      EXPECT_EQ(part, from_unpacked.Encode(filter));
      EXPECT_EQ(part, EncodeMetadataPartForWire(unpacked, filter));
      ++parts;
    }
    EXPECT_EQ(StillPackedCount(packed), packed_before);
  }
  EXPECT_EQ(parts, 240u);
}

}  // namespace
}  // namespace sp
