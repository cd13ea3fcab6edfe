#include "shardpoint/format/native/metadata_codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/format/native/metadata_sections.h"
#include "shardpoint/format/native/metadata_test_util.h"
#include "shardpoint/testing/chunk_filter_reference.h"

namespace sp {
namespace {

using ::sp::testing::AsVersionFour;
using ::sp::testing::ExpectMetadataEq;
using ::sp::testing::ExpectTensorEq;
using ::sp::testing::RandomMetadata;

// An in-memory ReadableFile that counts the bytes read through it.
class CountingFile : public ReadableFile {
 public:
  CountingFile(std::string bytes, std::string path, std::atomic<uint64_t>* bytes_read)
      : bytes_(std::move(bytes)), path_(std::move(path)), bytes_read_(bytes_read) {}
  Status ReadAt(uint64_t offset, MutableByteView out) const override {
    if (offset > bytes_.size() || out.size() > bytes_.size() - offset) {
      return DataLossError("read past the end of " + path_);
    }
    std::memcpy(out.data(), bytes_.data() + offset, out.size());
    *bytes_read_ += out.size();
    return OkStatus();
  }
  uint64_t size() const override { return bytes_.size(); }
  const std::string& path() const override { return path_; }

 private:
  std::string bytes_;
  std::string path_;
  std::atomic<uint64_t>* bytes_read_;
};

TEST(MetadataCodecTest, RandomRoundTripsAreExact) {
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    std::string bytes = EncodeMetadata(m);
    Result<CheckpointMetadata> decoded = DecodeMetadata(bytes, "/ckpt/shardpoint.metadata");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    ExpectMetadataEq(m, *decoded);
    EXPECT_EQ(EncodeMetadata(*decoded), bytes);  // the encoding is canonical
  }
}

// The file as docs/FORMAT.md §3 lays it out, built the plain way: every section encoded on its
// own (records and index entries in name order), then the header, then the sections in order.
std::string ReferenceEncoding(const CheckpointMetadata& m, uint32_t major) {
  std::string sections[native_metadata::kSectionCount];
  sections[native_metadata::kSummary] = native_metadata::EncodeSummary(m);
  std::vector<const TensorMetadata*> tensors;
  for (const TensorMetadata& t : m.tensors) tensors.push_back(&t);
  std::sort(tensors.begin(), tensors.end(),
            [](const TensorMetadata* a, const TensorMetadata* b) { return a->name < b->name; });
  for (const TensorMetadata* t : tensors) {
    const std::string record =
        native_metadata::EncodeTensorRecord(*t, m.checksum_block_bytes, major);
    native_metadata::EncodeIndexEntry(
        &sections[native_metadata::kTensorIndex], t->name,
        {sections[native_metadata::kTensorRecords].size(), record.size(), Crc32c(record)});
    sections[native_metadata::kTensorRecords] += record;
  }
  std::vector<const ObjectEntry*> objects;
  for (const ObjectEntry& o : m.objects) objects.push_back(&o);
  std::sort(objects.begin(), objects.end(),
            [](const ObjectEntry* a, const ObjectEntry* b) { return a->name < b->name; });
  for (const ObjectEntry* o : objects) {
    const std::string record = native_metadata::EncodeObjectRecord(*o);
    native_metadata::EncodeIndexEntry(
        &sections[native_metadata::kObjectIndex], o->name,
        {sections[native_metadata::kObjectRecords].size(), record.size(), Crc32c(record)});
    sections[native_metadata::kObjectRecords] += record;
  }
  const uint32_t counts[] = {0, static_cast<uint32_t>(m.tensors.size()),
                             static_cast<uint32_t>(m.tensors.size()),
                             static_cast<uint32_t>(m.objects.size()),
                             static_cast<uint32_t>(m.objects.size())};
  const uint32_t header_length = 32 + 24 * native_metadata::kSectionCount + 4;
  uint64_t size = header_length;
  for (const std::string& section : sections) size += section.size();
  std::string out;
  ByteWriter w(&out);
  w.PutRaw(std::string_view(native_metadata::kMagic, sizeof(native_metadata::kMagic)));
  w.PutU32(major);
  w.PutU32(0);
  w.PutU32(header_length);
  w.PutU32(native_metadata::kSectionCount);
  w.PutU64(size);
  uint64_t offset = header_length;
  for (uint32_t i = 0; i < native_metadata::kSectionCount; ++i) {
    w.PutU64(offset);
    w.PutU64(sections[i].size());
    w.PutU32(Crc32c(sections[i]));
    w.PutU32(counts[i]);
    offset += sections[i].size();
  }
  w.PutU32(Crc32c(out));
  for (const std::string& section : sections) out += section;
  return out;
}

// The encoder writes the tensor records in place, in a buffer reserved to a bound of their size;
// its bytes must be those of the plain layout, in both versions, and the bound must hold.
TEST(MetadataCodecTest, TheInPlaceEncodingIsThePlainLayoutByteForByte) {
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    for (uint32_t major : {1u, 2u, 3u}) {
      EXPECT_EQ(EncodeMetadata(m, major), ReferenceEncoding(m, major)) << "version " << major;
      for (const TensorMetadata& t : m.tensors) {
        EXPECT_GE(native_metadata::TensorRecordBound(t),
                  native_metadata::EncodeTensorRecord(t, m.checksum_block_bytes, major).size())
            << t.name;
      }
    }
  }
}

// A commit encodes the metadata from a plan's tensors (their chunks without checksums) and the
// checksums the ranks reported, kept apart (engine/save.cc): the bytes must be those of the same
// metadata with the checksums filled in, whatever the order of the plan's tensors.
// A random box of `shape`: inside it, sometimes empty, sometimes the whole shape, and now and then
// one a filter cannot use (another rank, or past the shape).
Box RandomFilterBox(std::mt19937_64& rng, const Shape& shape) {
  Box box = Box::Whole(shape);
  const uint64_t kind = rng() % 10;
  if (kind == 0) return box;
  if (kind == 1 && !shape.empty()) {
    box.sizes[0] = shape[0] + 1;  // past the shape
    return box;
  }
  if (kind == 2) {
    box.offsets.push_back(0);  // another rank
    box.sizes.push_back(1);
    return box;
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 0) continue;
    box.offsets[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(shape[d]));
    const uint64_t room = static_cast<uint64_t>(shape[d] - box.offsets[d]);
    box.sizes[d] = static_cast<int64_t>(rng() % (room + 1));
  }
  return box;
}

TEST(MetadataCodecTest, AFilterKeepsExactlyTheChunksItsBoxesReachUnderTheirStoredNumbers) {
  ThreadPool pool(3);
  uint64_t partial = 0, whole = 0, none = 0;
  for (uint64_t seed = 0; seed < 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const CheckpointMetadata m = RandomMetadata(seed, 16);
    const std::string bytes = EncodeMetadata(m);
    const CheckpointMetadata full = DecodeMetadata(bytes, "/c/shardpoint.metadata").value();
    std::mt19937_64 rng(seed);
    ChunkFilter filter;
    for (const TensorMetadata& t : m.tensors) {
      if (rng() % 5 == 0) continue;  // not named: keeps none
      std::vector<Box>& boxes = filter[t.name];
      for (int n = static_cast<int>(rng() % 4); n > 0; --n) {
        boxes.push_back(RandomFilterBox(rng, t.shape));
      }
    }
    Result<CheckpointMetadata> part =
        DecodeMetadata(bytes, "/c/shardpoint.metadata", seed % 2 ? &pool : nullptr, &filter);
    ASSERT_TRUE(part.ok()) << part.status();
    EXPECT_EQ(WithoutTensors(*part), WithoutTensors(full));
    ASSERT_EQ(part->tensors.size(), full.tensors.size());
    for (size_t i = 0; i < full.tensors.size(); ++i) {
      const TensorMetadata& f = full.tensors[i];
      const TensorMetadata& p = part->tensors[i];
      SCOPED_TRACE(f.name);
      auto it = filter.find(f.name);
      const size_t reached =
          testing::ExpectPartOf(f, p, it != filter.end() ? &it->second : nullptr);
      reached == f.chunks.size() ? ++whole : reached == 0 ? ++none : ++partial;
    }
  }
  // Every kind of outcome came up.
  EXPECT_GT(partial, 50u);
  EXPECT_GT(whole, 50u);
  EXPECT_GT(none, 50u);
}

TEST(MetadataCodecTest, ChecksumsKeptApartEncodeAsFilledIn) {
  int cell_tensors = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    std::vector<size_t> order(m.tensors.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::mt19937_64 rng(seed);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<TensorMetadata> planned;
    ChunkChecksums checksums;
    for (size_t i : order) {
      TensorMetadata t = m.tensors[i];
      ChunkChecksums::Tensor& table = checksums.tensors.emplace_back();
      for (StoredChunk& c : t.chunks) {
        table.starts.push_back(table.crcs.size());
        table.crcs.insert(table.crcs.end(), c.block_crc32c.begin(), c.block_crc32c.end());
        c.block_crc32c.clear();
      }
      table.starts.push_back(table.crcs.size());
      // Held as a save plan with SavePlanOptions::chunk_cells holds it, in every other tensor
      // whose chunks are raw: as cells, no chunks.
      t.grid = FindChunkGrid(t.chunks, t.shape);
      if (rng() % 2 == 0 && CompactChunkCells(&t)) {
        ++cell_tensors;
        EXPECT_TRUE(t.chunks.empty());
      }
      planned.push_back(std::move(t));
    }
    CheckpointMetadata summary = m;
    summary.tensors.clear();
    for (uint32_t major : {1u, 2u, 3u}) {
      EXPECT_EQ(EncodeMetadata(summary, planned, checksums, major), EncodeMetadata(m, major))
          << "version " << major;
      for (size_t k = 0; k < planned.size(); ++k) {
        EXPECT_GE(native_metadata::TensorRecordBound(planned[k], &checksums.tensors[k]),
                  native_metadata::EncodeTensorRecord(m.tensors[order[k]], m.checksum_block_bytes,
                                                      major)
                      .size())
            << planned[k].name;
      }
    }
    ASSERT_TRUE(CheckChecksumsFit(planned, checksums).ok());
    ASSERT_TRUE(FillChecksums(checksums, &planned).ok());
    for (size_t k = 0; k < planned.size(); ++k) {
      EXPECT_FALSE(planned[k].cells.has_value());
      ExpectTensorEq(m.tensors[order[k]], planned[k]);
    }
    // Decoded as a save plan's cache restores it: every tensor of raw chunks as cells, which are
    // the chunks' places and boxes.
    ThreadPool pool(2);
    Result<CheckpointMetadata> as_plan =
        DecodeMetadata(EncodeMetadata(m), "/ckpt/shardpoint.metadata", &pool, nullptr, true);
    ASSERT_TRUE(as_plan.ok()) << as_plan.status();
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      TensorMetadata t = as_plan->tensors[i];
      const bool raw = std::all_of(
          m.tensors[i].chunks.begin(), m.tensors[i].chunks.end(),
          [](const StoredChunk& c) { return c.encoding == ChunkEncoding::kRaw; });
      ASSERT_EQ(t.cells.has_value(), raw) << t.name;
      if (t.cells) {
        EXPECT_EQ(t.cells->boxes.empty(),
                  FindChunkGrid(m.tensors[i].chunks, m.tensors[i].shape).has_value())
            << t.name;
      }
      ExpandChunkCells(&t);
      ASSERT_EQ(t.chunks.size(), m.tensors[i].chunks.size()) << t.name;
      for (size_t c = 0; c < t.chunks.size(); ++c) {
        StoredChunk expected = m.tensors[i].chunks[c];
        if (as_plan->tensors[i].cells) expected.block_crc32c.clear();
        EXPECT_EQ(t.chunks[c], expected) << t.name << " chunk " << c;
      }
    }
  }
  EXPECT_GT(cell_tensors, 50);
}

TEST(MetadataCodecTest, ChecksumsThatDoNotFitTheTensorsAreRefused) {
  const CheckpointMetadata m = RandomMetadata(5, 6);
  ChunkChecksums checksums;
  for (const TensorMetadata& t : m.tensors) {
    checksums.tensors.emplace_back().starts.assign(t.chunks.size() + 1, 0);
  }
  EXPECT_TRUE(CheckChecksumsFit(m.tensors, checksums).ok());
  checksums.tensors[2].starts.pop_back();
  Status s = CheckChecksumsFit(m.tensors, checksums);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_NE(s.message().find("tensor '" + m.tensors[2].name + "'"), std::string::npos) << s;
  checksums.tensors.pop_back();
  s = CheckChecksumsFit(m.tensors, checksums);
  EXPECT_NE(s.message().find("checksums of 5 tensors for metadata of 6"), std::string::npos) << s;
  // A count per chunk instead of starts: as many chunks as the tensor has, and as many checksums
  // as they take.
  checksums.tensors.clear();
  for (const TensorMetadata& t : m.tensors) {
    ChunkChecksums::Tensor& table = checksums.tensors.emplace_back();
    table.chunks = t.chunks.size();
    table.per_chunk = 2;
    table.crcs.assign(2 * t.chunks.size(), 0);
  }
  EXPECT_TRUE(CheckChecksumsFit(m.tensors, checksums).ok());
  checksums.tensors[3].crcs.pop_back();
  s = CheckChecksumsFit(m.tensors, checksums);
  EXPECT_EQ(s.message(), "the checksums of tensor '" + m.tensors[3].name + "' are for " +
                             std::to_string(m.tensors[3].chunks.size()) + " chunks of 2 in " +
                             std::to_string(2 * m.tensors[3].chunks.size() - 1) +
                             ", not for its " + std::to_string(m.tensors[3].chunks.size()) +
                             " chunks");
  checksums.tensors[3].crcs.push_back(0);
  checksums.tensors[1].chunks += 1;
  checksums.tensors[1].crcs.resize(checksums.tensors[1].crcs.size() + 2);
  EXPECT_EQ(CheckChecksumsFit(m.tensors, checksums).code(), StatusCode::kInternal);
}

// The table a commit collects checksums into gives every chunk its count of blocks, as a count per
// chunk where they all have the same (no starts: 4 bytes a chunk of one block, not 12), else as
// starts.
TEST(MetadataCodecTest, AChecksumTableGivesEachChunkItsBlocksAndStartsOnlyWhereTheyDiffer) {
  size_t uniform = 0, listed = 0;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 9);
    for (uint64_t block_bytes : {uint64_t{0}, uint64_t{1}, uint64_t{64}, uint64_t{1} << 20}) {
      const ChunkChecksums table = LayOutChunkChecksums(m.tensors, block_bytes).value();
      ASSERT_TRUE(CheckChecksumsFit(m.tensors, table).ok());
      for (size_t t = 0; t < m.tensors.size(); ++t) {
        const TensorMetadata& tensor = m.tensors[t];
        const ChunkChecksums::Tensor& entry = table.tensors[t];
        std::set<uint64_t> counts;
        uint64_t next = 0;
        for (size_t c = 0; c < tensor.chunks.size(); ++c) {
          const uint64_t count = ChecksumBlockCount(tensor.chunks[c].byte_length, block_bytes);
          counts.insert(count);
          EXPECT_EQ(entry.start(c), next) << tensor.name << " chunk " << c;
          EXPECT_EQ(entry.of(c).size(), count) << tensor.name << " chunk " << c;
          next += count;
        }
        EXPECT_EQ(entry.crcs.size(), next);
        EXPECT_EQ(entry.chunk_count(), tensor.chunks.size());
        EXPECT_EQ(entry.starts.empty(), counts.size() <= 1) << tensor.name;
        (entry.starts.empty() ? uniform : listed) += 1;
      }
    }
  }
  EXPECT_GT(uniform, 100u);
  EXPECT_GT(listed, 100u);
}

// Version 4 round-trips every random layout without the chunks' checksums, grids as grids (each
// cell's checksums were most of a grid record before), in less than version 3.1 takes.
TEST(MetadataCodecTest, VersionFourRoundTripsWithoutChecksumsAndKeepsGrids) {
  ThreadPool pool(3);
  size_t grids = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    m.data_file_checksums = true;
    const std::string bytes = EncodeMetadata(m);
    for (ThreadPool* on : {static_cast<ThreadPool*>(nullptr), &pool}) {
      Result<CheckpointMetadata> decoded = DecodeMetadata(bytes, "/ckpt/shardpoint.metadata", on);
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      ExpectMetadataEq(AsVersionFour(m), *decoded);
      EXPECT_EQ(EncodeMetadata(*decoded), bytes);
      for (size_t i = 0; i < m.tensors.size(); ++i) {
        const std::optional<ChunkGrid> grid =
            FindChunkGrid(m.tensors[i].chunks, m.tensors[i].shape);
        EXPECT_EQ(decoded->tensors[i].grid.has_value(), grid.has_value());
        grids += grid.has_value() && on == nullptr;
      }
    }
    EXPECT_LT(bytes.size(), EncodeMetadata(m, 3).size());
  }
  EXPECT_GT(grids, 100u);
}

TEST(MetadataCodecTest, GridsAreStoredAsGridsAndVersionsOneAndTwoStillRead) {
  size_t grids = 0, lists = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    const std::string v3 = EncodeMetadata(m);
    Result<CheckpointMetadata> decoded = DecodeMetadata(v3, "/ckpt/shardpoint.metadata");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    size_t seed_grids = 0;
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      const TensorMetadata& t = decoded->tensors[i];
      // A grid record exactly where the chunks are a grid in row-major order, and it comes back
      // as the tensor's index.
      const std::optional<ChunkGrid> grid = FindChunkGrid(m.tensors[i].chunks, m.tensors[i].shape);
      ASSERT_EQ(t.grid.has_value(), grid.has_value()) << t.name;
      if (grid) {
        EXPECT_EQ(*t.grid, *grid) << t.name;
      }
      (grid ? seed_grids : lists) += 1;
    }
    grids += seed_grids;
    // The same checkpoint as version 2: its tables at fixed width, read back the same, grids
    // included; larger wherever there are chunks (a packed cell or chunk costs fewer bytes here,
    // where files and offsets move by little from one chunk to the next).
    const std::string v2 = EncodeMetadata(m, 2);
    EXPECT_EQ(DecodeFixed32(v2.data() + 8), 2u);
    Result<CheckpointMetadata> fixed = DecodeMetadata(v2, "/ckpt/shardpoint.metadata");
    ASSERT_TRUE(fixed.ok()) << fixed.status();
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      EXPECT_EQ(fixed->tensors[i].grid, decoded->tensors[i].grid) << m.tensors[i].name;
    }
    CheckpointMetadata as_v2 = m;
    as_v2.version_major = 2;
    ExpectMetadataEq(as_v2, *fixed);
    ExpectMetadataEq(m, *decoded);
    if (!m.tensors.empty()) {
      EXPECT_LT(v3.size(), v2.size());
    }
    // The same checkpoint as version 1: every chunk listed, read back the same.
    const std::string v1 = EncodeMetadata(m, 1);
    EXPECT_EQ(DecodeFixed32(v1.data() + 8), 1u);
    Result<CheckpointMetadata> old = DecodeMetadata(v1, "/ckpt/shardpoint.metadata");
    ASSERT_TRUE(old.ok()) << old.status();
    m.version_major = 1;
    ExpectMetadataEq(m, *old);
    for (const TensorMetadata& t : old->tensors) EXPECT_FALSE(t.grid.has_value()) << t.name;
    // A grid cell costs its file, offset and checksums; a listed chunk also its box, length and
    // count.
    if (seed_grids > 0) {
      EXPECT_LT(v2.size(), v1.size());
    }
  }
  EXPECT_GT(grids, 200u);
  EXPECT_GT(lists, 50u);
}

TEST(MetadataReaderTest, ReadTensorOfAGridRecordCarriesItsGrid) {
  CheckpointMetadata m = RandomMetadata(12, 40);
  std::atomic<uint64_t> bytes_read{0};
  Result<std::unique_ptr<MetadataReader>> reader = MetadataReader::Open(
      std::make_unique<CountingFile>(EncodeMetadata(m), "/c/shardpoint.metadata", &bytes_read));
  ASSERT_TRUE(reader.ok()) << reader.status();
  size_t grids = 0;
  for (const TensorMetadata& expected : m.tensors) {
    Result<TensorMetadata> t = (*reader)->ReadTensor(expected.name);
    ASSERT_TRUE(t.ok()) << t.status();
    ExpectTensorEq(expected, *t);
    EXPECT_EQ(t->grid, FindChunkGrid(expected.chunks, expected.shape)) << expected.name;
    grids += t->grid.has_value();
  }
  EXPECT_GT(grids, 10u);
}

TEST(MetadataCodecTest, CoversEveryDTypeRankAndEncoding) {
  std::set<DType> dtypes;
  std::set<size_t> ranks;
  std::set<ObjectEncoding> encodings;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    CheckpointMetadata m = RandomMetadata(seed, 1 + seed % 25);
    for (const TensorMetadata& t : m.tensors) {
      dtypes.insert(t.dtype);
      ranks.insert(t.shape.size());
    }
    for (const ObjectEntry& o : m.objects) encodings.insert(o.encoding);
  }
  EXPECT_EQ(dtypes.size(), AllDTypes().size());
  EXPECT_EQ(ranks.size(), 6u);
  EXPECT_EQ(encodings.size(), 4u);
}

TEST(MetadataCodecTest, EmptyCheckpointRoundTrips) {
  CheckpointMetadata m;
  m.save_id = "empty";
  std::string bytes = EncodeMetadata(m);
  // Header, then a summary of save_id (4 + 5), world size, block size, file and attribute counts.
  EXPECT_EQ(bytes.size(), 156u + 9 + 4 + 8 + 4 + 4);
  Result<CheckpointMetadata> decoded = DecodeMetadata(bytes, "m");
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  ExpectMetadataEq(m, *decoded);
}

TEST(MetadataCodecTest, EncoderSortsTensorsAndObjects) {
  CheckpointMetadata m = RandomMetadata(7, 10);
  CheckpointMetadata shuffled = m;
  std::reverse(shuffled.tensors.begin(), shuffled.tensors.end());
  std::reverse(shuffled.objects.begin(), shuffled.objects.end());
  EXPECT_EQ(EncodeMetadata(shuffled), EncodeMetadata(m));
}

TEST(MetadataCodecTest, FileStartsWithMagicAndVersion) {
  std::string bytes = EncodeMetadata(RandomMetadata(3));
  EXPECT_EQ(bytes.substr(0, 8), std::string("\x89SPMD\r\n\x1a", 8));
  EXPECT_EQ(DecodeFixed32(bytes.data() + 8), 3u);
  EXPECT_EQ(DecodeFixed32(bytes.data() + 12), 0u);
  EXPECT_EQ(DecodeFixed32(bytes.data() + 16), 156u);
  EXPECT_EQ(DecodeFixed64(bytes.data() + 24), bytes.size());
  EXPECT_EQ(DecodeFixed32(bytes.data() + 152), Crc32c(bytes.data(), 152));
}

TEST(MetadataReaderTest, PartialReadsTouchOnlyTheRecordsAskedFor) {
  CheckpointMetadata m = RandomMetadata(11, 400);
  std::string bytes = EncodeMetadata(m);
  // Header, summary and both indexes: everything before the tensor records, plus the object index.
  const uint64_t tensor_records_at = DecodeFixed64(bytes.data() + 32 + 2 * 24);
  const uint64_t object_index_length = DecodeFixed64(bytes.data() + 32 + 3 * 24 + 8);
  std::atomic<uint64_t> bytes_read{0};
  Result<std::unique_ptr<MetadataReader>> reader =
      MetadataReader::Open(std::make_unique<CountingFile>(bytes, "/c/shardpoint.metadata", &bytes_read));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(bytes_read.load(), 32 + tensor_records_at + object_index_length);
  EXPECT_LT(bytes_read.load(), bytes.size() / 4);

  const TensorMetadata& wanted = m.tensors[123];
  uint64_t before = bytes_read.load();
  Result<TensorMetadata> tensor = (*reader)->ReadTensor(wanted.name);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  ExpectTensorEq(wanted, *tensor);
  // dtype, rank, shape, layout; then a grid's interval counts, cut points and cells, or a list,
  // as version 3 packs them: files and offsets as zigzag varints of their steps from the chunk
  // before (a grid's in runs of cells that repeat a step), box values and counts as varints,
  // checksums at 4 bytes.
  const auto varint = [](uint64_t v) {
    uint64_t n = 1;
    for (; v >= 0x80; v >>= 7) ++n;
    return n;
  };
  const auto steps = [&](const StoredChunk& c, uint32_t* file, uint64_t* offset) {
    const uint64_t n = varint(ZigZag(static_cast<int64_t>(c.file) - *file)) +
                       varint(ZigZag(static_cast<int64_t>(c.data_offset - *offset)));
    *file = c.file;
    *offset = c.data_offset;
    return n;
  };
  uint32_t file = 0;
  uint64_t offset = 0;
  uint64_t record_length = 2 + 8 * wanted.shape.size() + 1;
  if (tensor->grid) {
    for (const std::vector<int64_t>& bounds : tensor->grid->bounds) {
      const size_t n = bounds.size() - 1;
      bool even = n >= 3 && bounds[n] - bounds[n - 1] <= bounds[1];
      for (size_t k = 2; k < n; ++k) even = even && bounds[k] - bounds[k - 1] == bounds[1];
      record_length += 4 + 1 + (even ? 8 : 8 * (n - 1));
    }
    // The runs: a new one wherever the step from the cell before changes.
    uint64_t runs = 0;
    std::pair<int64_t, int64_t> run_step;
    for (const StoredChunk& c : wanted.chunks) {
      const std::pair<int64_t, int64_t> step = {
          static_cast<int64_t>(c.file) - file, static_cast<int64_t>(c.data_offset - offset)};
      file = c.file;
      offset = c.data_offset;
      if (runs == 0 || step != run_step) {
        ++runs;
        run_step = step;
        record_length += varint(ZigZag(step.first)) + varint(ZigZag(step.second));
        uint64_t length = 1;  // the run's length
        const size_t at = &c - wanted.chunks.data();
        for (size_t n = at + 1; n < wanted.chunks.size(); ++n, ++length) {
          const StoredChunk& x = wanted.chunks[n];
          const StoredChunk& before = wanted.chunks[n - 1];
          if (std::pair<int64_t, int64_t>{static_cast<int64_t>(x.file) - before.file,
                                          static_cast<int64_t>(x.data_offset -
                                                               before.data_offset)} != step) {
            break;
          }
        }
        record_length += varint(length);
      }
      record_length += 4 * c.block_crc32c.size();
    }
    record_length += varint(runs);
  } else {
    record_length += varint(wanted.chunks.size());
    for (const StoredChunk& c : wanted.chunks) {
      record_length += steps(c, &file, &offset) + varint(c.block_crc32c.size()) +
                       4 * c.block_crc32c.size();
      for (size_t d = 0; d < wanted.shape.size(); ++d) {
        record_length += varint(c.box.offsets[d]) + varint(c.box.sizes[d]);
      }
    }
  }
  EXPECT_EQ(bytes_read.load() - before, record_length);
}

TEST(MetadataReaderTest, NamesSummaryObjectsAndReadAll) {
  CheckpointMetadata m = RandomMetadata(12, 30);
  std::atomic<uint64_t> bytes_read{0};
  auto reader = MetadataReader::Open(
      std::make_unique<CountingFile>(EncodeMetadata(m), "/c/shardpoint.metadata", &bytes_read));
  ASSERT_TRUE(reader.ok()) << reader.status();
  const MetadataReader& r = **reader;
  ASSERT_EQ(r.tensor_names().size(), m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) EXPECT_EQ(r.tensor_names()[i], m.tensors[i].name);
  ASSERT_EQ(r.object_names().size(), m.objects.size());
  EXPECT_TRUE(r.summary().tensors.empty());
  EXPECT_TRUE(r.summary().objects.empty());
  CheckpointMetadata expected_summary = m;
  expected_summary.tensors.clear();
  expected_summary.objects.clear();
  ExpectMetadataEq(expected_summary, r.summary());
  for (const ObjectEntry& o : m.objects) {
    Result<ObjectEntry> got = r.ReadObject(o.name);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->encoding, o.encoding);
    EXPECT_EQ(got->payload, o.payload);
  }
  Result<CheckpointMetadata> all = r.ReadAll();
  ASSERT_TRUE(all.ok()) << all.status();
  ExpectMetadataEq(m, *all);
}

TEST(MetadataReaderTest, MissingNamesAreNotFoundNamingTheFile) {
  std::atomic<uint64_t> bytes_read{0};
  auto reader = MetadataReader::Open(std::make_unique<CountingFile>(
      EncodeMetadata(RandomMetadata(5)), "/c/shardpoint.metadata", &bytes_read));
  ASSERT_TRUE(reader.ok());
  Result<TensorMetadata> t = (*reader)->ReadTensor("model.nope");
  EXPECT_EQ(t.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(t.status().message(),
            "tensor \"model.nope\" not found in metadata file /c/shardpoint.metadata");
  Result<ObjectEntry> o = (*reader)->ReadObject("obj.zzz");
  EXPECT_EQ(o.status().code(), StatusCode::kNotFound);
  EXPECT_NE(o.status().message().find("obj.zzz"), std::string::npos);
}

TEST(MetadataReaderTest, CorruptRecordIsDataLossOnlyForThatTensor) {
  CheckpointMetadata m = RandomMetadata(21, 10);
  std::string bytes = EncodeMetadata(m);
  // Flip the last byte of the tensor records section: the last tensor's record.
  const uint64_t records_at = DecodeFixed64(bytes.data() + 32 + 2 * 24);
  const uint64_t records_length = DecodeFixed64(bytes.data() + 32 + 2 * 24 + 8);
  bytes[records_at + records_length - 1] ^= 0x40;
  std::atomic<uint64_t> bytes_read{0};
  auto reader = MetadataReader::Open(std::make_unique<CountingFile>(bytes, "/c/m", &bytes_read));
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_TRUE((*reader)->ReadTensor(m.tensors.front().name).ok());
  Result<TensorMetadata> bad = (*reader)->ReadTensor(m.tensors.back().name);
  EXPECT_EQ(bad.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(bad.status().message().find("metadata file /c/m: tensor \"" + m.tensors.back().name +
                                        "\" record checksum mismatch"),
            std::string::npos)
      << bad.status();
  EXPECT_EQ((*reader)->ReadAll().status().code(), StatusCode::kDataLoss);
}

// WithoutTensors copies every field but the tensors: the fields set off their defaults here catch
// one that a later change adds to CheckpointMetadata and the copy forgets.
// Metadata whose data files hold their checksums is version 4: the summary ends with each file's
// header CRC, and the records hold no checksums (those are in the headers). Asked for major 3, the
// encoder writes 3.1, with both; asked for an older major, that major's .0, without the CRCs.
TEST(MetadataCodecTest, DataFileChecksumsMakeVersionFourWithEachHeadersCrc) {
  for (uint64_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    CheckpointMetadata m = RandomMetadata(seed, 4);
    m.data_file_checksums = true;
    for (DataFile& f : m.files) f.header_crc32c = Crc32c(f.name) ^ static_cast<uint32_t>(seed);
    const std::string v4 = EncodeMetadata(m);
    EXPECT_EQ(DecodeFixed32(v4.data() + 8), 4u);
    EXPECT_EQ(DecodeFixed32(v4.data() + 12), 0u);
    Result<CheckpointMetadata> four = DecodeMetadata(v4, "/ckpt/shardpoint.metadata");
    ASSERT_TRUE(four.ok()) << four.status();
    ExpectMetadataEq(AsVersionFour(m), *four);
    EXPECT_EQ(EncodeMetadata(*four), v4);
    // Metadata without its checksums is written as version 4 whatever the major asked for.
    EXPECT_EQ(EncodeMetadata(*four, 2), v4);
    const std::string bytes = EncodeMetadata(m, 3);
    EXPECT_EQ(DecodeFixed32(bytes.data() + 8), 3u);
    EXPECT_EQ(DecodeFixed32(bytes.data() + 12), 1u);
    Result<CheckpointMetadata> decoded = DecodeMetadata(bytes, "/ckpt/shardpoint.metadata");
    ASSERT_TRUE(decoded.ok()) << decoded.status();
    m.version_minor = 1;
    ExpectMetadataEq(m, *decoded);
    EXPECT_EQ(EncodeMetadata(*decoded, 3), bytes);
    // The checksums are 4 bytes a block of the records, and a varint count a chunk of a list.
    uint64_t blocks = 0;
    for (const TensorMetadata& t : m.tensors) {
      for (const StoredChunk& c : t.chunks) blocks += c.block_crc32c.size();
    }
    EXPECT_GE(bytes.size(), v4.size() + 4 * blocks);
    // Without the flag, the same metadata is 3.0 (even asked for 4) and its summary 4 bytes a
    // file shorter than 3.1's.
    CheckpointMetadata plain = m;
    plain.data_file_checksums = false;
    const std::string v30 = EncodeMetadata(plain);
    EXPECT_EQ(DecodeFixed32(v30.data() + 8), 3u);
    EXPECT_EQ(DecodeFixed32(v30.data() + 12), 0u);
    EXPECT_EQ(bytes.size(), v30.size() + 4 * m.files.size());
    for (const uint32_t major : {2u, 1u}) {
      Result<CheckpointMetadata> older =
          DecodeMetadata(EncodeMetadata(m, major), "/ckpt/shardpoint.metadata");
      ASSERT_TRUE(older.ok()) << older.status();
      EXPECT_EQ(older->version_minor, 0u);
      EXPECT_FALSE(older->data_file_checksums);
      for (const DataFile& f : older->files) EXPECT_EQ(f.header_crc32c, 0u);
    }
  }
}

TEST(MetadataCodecTest, WithoutTensorsKeepsEveryOtherField) {
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    CheckpointMetadata md = RandomMetadata(seed);
    md.version_major = 1;
    md.version_minor = static_cast<uint32_t>(seed);
    md.format = CheckpointFormat::kTorchDcp;
    md.data_file_checksums = seed % 2 == 1;
    md.files.at(0).header_crc32c = 7;
    ASSERT_FALSE(md.tensors.empty());
    CheckpointMetadata expected = md;
    expected.tensors.clear();
    EXPECT_EQ(WithoutTensors(md), expected);
    EXPECT_TRUE(WithoutTensors(md).tensors.empty());

    uint64_t chunks = 0;
    for (TensorMetadata& t : md.tensors) {
      t.chunks.mut().shrink_to_fit();
      chunks += t.chunks.size();
    }
    EXPECT_EQ(ChunkListBytes(md.tensors), chunks * sizeof(StoredChunk));
  }
}

}  // namespace
}  // namespace sp
