#include "shardpoint/format/metadata_wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>

#include "shardpoint/base/coding.h"

#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/testing/chunk_filter_reference.h"

namespace sp {
namespace {

CheckpointMetadata Sample() {
  CheckpointMetadata m;
  m.save_id = "abc123";
  m.world_size = 3;
  m.format = CheckpointFormat::kTorchDcp;
  m.checksum_block_bytes = 0;
  m.files = {{"__0_0.distcp", 0, 4096, 0}, {"__1_0.distcp", 0, 100, 1}};
  m.attributes = {{"step", "7"}, {"origin", "torch"}};
  TensorMetadata a{"layers.0.w", DType::kBFloat16, {4, 6}, {}};
  StoredChunk c0{Box{{0, 0}, {2, 6}}, 0, 64, 24, {}, ChunkEncoding::kRaw, 0};
  StoredChunk c1{Box{{2, 0}, {2, 6}}, 1, 0, 24, {1, 2}, ChunkEncoding::kDriverDecoded, 90, 1};
  a.chunks = {c0, c1};
  TensorMetadata scalar{"step", DType::kInt64, {}, {{Box{{}, {}}, 0, 8, 8, {}, {}, 0}}};
  TensorMetadata list{"listed", DType::kInt8, {4}, {}};
  list.chunks = {StoredChunk{Box{{2}, {2}}, 0, 0, 2, {}, {}, 0},
                 StoredChunk{Box{{0}, {2}}, 0, 2, 2, {}, {}, 0}};  // not in grid order
  m.tensors = {a, scalar, list};
  IndexChunkGrids(&m);
  m.objects = {{"cfg", ObjectEncoding::kJson, "{\"lr\": 0.1}"},
               {"rng", ObjectEncoding::kPickle, std::string("\x80\x02N.", 4)},
               {"sched", ObjectEncoding::kTorchSave, "PK\x03\x04"},
               {"unread", ObjectEncoding::kTorchSave, "", StoredObjectItem{1, 64, 32, 1}}};
  return m;
}

TEST(MetadataWireTest, RoundTripsEveryField) {
  const CheckpointMetadata m = Sample();
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(EncodeMetadataForWire(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == m);
  EXPECT_EQ(back->tensors[0].chunks[1].encoding, ChunkEncoding::kDriverDecoded);
  EXPECT_EQ(back->tensors[0].chunks[1].stored_length, 90u);
  EXPECT_EQ(back->format, CheckpointFormat::kTorchDcp);
  for (size_t t = 0; t < m.tensors.size(); ++t) EXPECT_EQ(back->tensors[t].grid, m.tensors[t].grid);
  EXPECT_TRUE(back->tensors[0].grid.has_value());
  EXPECT_TRUE(back->tensors[1].grid.has_value());
  EXPECT_FALSE(back->tensors[2].grid.has_value());
}

// A chunk's driver tag is kept in 16 bits; the wire carries 32, and a larger value is refused
// instead of being cut short.
TEST(MetadataWireTest, ADriverTagTravelsWholeAndOneBeyond16BitsIsRefused) {
  CheckpointMetadata m = Sample();
  m.tensors[0].chunks[1].driver_tag = 0xBEEF;
  const std::string bytes = EncodeMetadataForWire(m);
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->tensors[0].chunks[1].driver_tag, 0xBEEF);
  const std::string tag("\xEF\xBE\x00\x00", 4);
  const size_t at = bytes.find(tag);
  ASSERT_NE(at, std::string::npos);
  ASSERT_EQ(bytes.find(tag, at + 1), std::string::npos);
  std::string forged = bytes;
  forged[at + 2] = '\x01';
  back = DecodeMetadataFromWire(forged);
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(back.status().message().find("driver tag 114415 out of range (at most 65535)"),
            std::string::npos)
      << back.status();
}

TEST(MetadataWireTest, AGridThatNoLongerFitsItsChunksTravelsAsAList) {
  CheckpointMetadata m = Sample();
  const size_t with_grid = EncodeMetadataForWire(m).size();
  // Chunks changed after the grid was proved (same count, other boxes): the list is sent, and
  // the receiver gets no grid.
  std::swap(m.tensors[0].chunks[0].box, m.tensors[0].chunks[1].box);
  const std::string bytes = EncodeMetadataForWire(m);
  EXPECT_GT(bytes.size(), with_grid);
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == m);
  EXPECT_FALSE(back->tensors[0].grid.has_value());
}

TEST(MetadataWireTest, GridsOfManyCellsTravelWithoutBoxes) {
  CheckpointMetadata m;
  m.save_id = "g";
  m.files = {{"f", 0, uint64_t{1} << 40, 0}};
  TensorMetadata t{"w", DType::kFloat32, {4096, 64}, {}};
  for (int64_t row = 0; row < 4096; row += 4) {
    for (int64_t col = 0; col < 64; col += 32) {
      t.chunks.push_back(StoredChunk{Box{{row, col}, {4, 32}}, 0,
                                     static_cast<uint64_t>(row * 64 + col) * 4, 512, {7}, {}, 0});
    }
  }
  m.tensors = {t};
  IndexChunkGrids(&m);
  ASSERT_TRUE(m.tensors[0].grid.has_value());
  const std::string bytes = EncodeMetadataForWire(m);
  // 2,048 raw cells of file, offset and one checksum each; even cuts are a step.
  EXPECT_LT(bytes.size(), 2048u * (4 + 8 + 4 + 4) + 200);
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == m);
  EXPECT_EQ(back->tensors[0].grid, m.tensors[0].grid);
}

// 120 tensors: row grids over 1 to 8 files, chunk lists out of grid order, scalars.
CheckpointMetadata ManyTensors() {
  CheckpointMetadata m;
  m.save_id = "many";
  m.world_size = 8;
  for (int f = 0; f < 8; ++f) m.files.push_back({"f" + std::to_string(f), 0, 1 << 30, f});
  for (int t = 0; t < 120; ++t) {
    TensorMetadata tensor{"t" + std::to_string(1000 + t), DType::kFloat32, {}, {}};
    if (t % 3 == 2) {  // a scalar
      tensor.chunks = {StoredChunk{Box{{}, {}}, static_cast<uint32_t>(t % 8), 4u * t, 4, {9}, {}, 0}};
    } else {
      const int64_t rows = 1 + t % 8;
      tensor.shape = {rows * 2, 3};
      for (int64_t r = 0; r < rows; ++r) {
        tensor.chunks.push_back(StoredChunk{Box{{2 * r, 0}, {2, 3}}, static_cast<uint32_t>(r),
                                            24u * t, 24, {static_cast<uint32_t>(t * r)}, {}, 0});
      }
      if (t % 3 == 1 && rows > 1) std::swap(tensor.chunks.front(), tensor.chunks.back());
    }
    m.tensors.push_back(std::move(tensor));
  }
  IndexChunkGrids(&m);
  return m;
}

// The encoder reserves WireMetadataBound and must never outgrow it: every kind of tensor (grids
// of raw cells and of placed ones, lists, scalars, ranks up to 5, chunks of several checksum
// blocks), objects read and unread, attributes. The bound stays within twice the bytes.
TEST(MetadataWireTest, TheBoundHoldsEveryEncoding) {
  std::vector<CheckpointMetadata> cases = {Sample(), ManyTensors()};
  std::mt19937_64 rng(77);
  for (int trial = 0; trial < 40; ++trial) {
    CheckpointMetadata m;
    m.save_id = "s" + std::to_string(trial);
    m.world_size = 4;
    m.checksum_block_bytes = 16;
    for (int f = 0; f < 4; ++f) m.files.push_back({"file-" + std::to_string(f), 0, 1 << 30, f});
    m.attributes["step"] = std::string(rng() % 40, 'x');
    for (int t = 0; t < 12; ++t) {
      const size_t rank = rng() % 6;
      TensorMetadata tensor{"t" + std::to_string(t), DType::kFloat32, Shape(rank, 1), {}};
      const int64_t pieces = rank == 0 ? 1 : 1 + static_cast<int64_t>(rng() % 4);
      if (rank > 0) tensor.shape[0] = pieces * 3;
      for (int64_t p = 0; p < pieces; ++p) {
        Dims offsets(rank, 0), sizes(rank, 1);
        if (rank > 0) {
          offsets[0] = 3 * p;
          sizes[0] = 3;
        }
        const uint64_t bytes = 4 * static_cast<uint64_t>(Box(offsets, sizes).volume());
        InlineVector<uint32_t, 2> crcs;
        for (uint64_t b = 0; b < (bytes + 15) / 16; ++b) {
          crcs.push_back(static_cast<uint32_t>(rng()));
        }
        const bool placed = rng() % 3 == 0;
        tensor.chunks.push_back(StoredChunk{Box(offsets, sizes), static_cast<uint32_t>(rng() % 4),
                                            100 * static_cast<uint64_t>(p), bytes, crcs,
                                            placed ? ChunkEncoding::kDriverDecoded
                                                   : ChunkEncoding::kRaw,
                                            placed ? bytes + 7 : 0,
                                            static_cast<uint16_t>(placed ? 3 : 0)});
      }
      if (rng() % 4 == 0) std::reverse(tensor.chunks.begin(), tensor.chunks.end());
      m.tensors.push_back(std::move(tensor));
    }
    IndexChunkGrids(&m);
    m.objects = {{"cfg", ObjectEncoding::kJson, std::string(rng() % 100, '1')},
                 {"unread", ObjectEncoding::kTorchSave, "", StoredObjectItem{1, 64, 32, 1}}};
    cases.push_back(std::move(m));
  }
  for (const CheckpointMetadata& m : cases) {
    const uint64_t size = EncodeMetadataForWire(m).size();
    EXPECT_GE(WireMetadataBound(m), size) << m.save_id;
    EXPECT_LE(WireMetadataBound(m), 2 * size) << m.save_id;
  }
}

// `bytes` with one to four of its bytes changed at random.
std::string Damaged(const std::string& bytes, std::mt19937& rng) {
  std::string damaged = bytes;
  for (int n = 1 + rng() % 4; n > 0; --n) {
    damaged[rng() % damaged.size()] ^= static_cast<char>(1 + rng() % 255);
  }
  return damaged;
}

TEST(MetadataWireTest, APoolDecodesAlikeAndReportsTheSameFirstError) {
  ThreadPool pool(4);
  const CheckpointMetadata m = ManyTensors();
  const std::string bytes = EncodeMetadataForWire(m);
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(bytes, &pool);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == m);
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    EXPECT_EQ(back->tensors[t].grid, m.tensors[t].grid) << t;
    EXPECT_EQ(back->tensors[t].index, m.tensors[t].index) << t;
  }
  std::mt19937 rng(11);
  int rejected = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const std::string damaged = Damaged(bytes, rng);
    Result<CheckpointMetadata> inline_result = DecodeMetadataFromWire(damaged);
    Result<CheckpointMetadata> pooled = DecodeMetadataFromWire(damaged, &pool);
    ASSERT_EQ(pooled.ok(), inline_result.ok());
    if (!inline_result.ok()) {
      ASSERT_EQ(pooled.status().message(), inline_result.status().message());
      ++rejected;
    } else {
      EXPECT_TRUE(*pooled == *inline_result);
    }
  }
  EXPECT_GT(rejected, 200);
}

// A load rank's part (DecodeMetadataFromWire with a ChunkFilter): exactly the chunks its boxes
// reach, under their stored numbers, checked against a plain scan of the whole decoding; and on
// damaged bytes the same status as the whole decoding, message included.
TEST(MetadataWireTest, AFilterKeepsTheChunksItsBoxesReachAndFailsAsAWholeDecoding) {
  ThreadPool pool(3);
  const CheckpointMetadata m = ManyTensors();
  const std::string bytes = EncodeMetadataForWire(m);
  ChunkFilter filter;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMetadata& tensor = m.tensors[t];
    switch (t % 5) {
      case 0: break;  // not named: keeps none
      case 1: filter[tensor.name] = {}; break;
      case 2: filter[tensor.name] = {Box::Whole(tensor.shape)}; break;
      default: {
        Box rows = Box::Whole(tensor.shape);  // the first rows, or a scalar whole
        if (!tensor.shape.empty()) rows.sizes[0] = std::min<int64_t>(3, tensor.shape[0]);
        filter[tensor.name] = {rows, Box::Whole(Shape(tensor.shape.size() + 1, 1))};
      }
    }
  }
  Result<CheckpointMetadata> part = DecodeMetadataFromWire(bytes, &pool, &filter);
  ASSERT_TRUE(part.ok()) << part.status();
  ASSERT_EQ(part->tensors.size(), m.tensors.size());
  int partial = 0;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    const TensorMetadata& whole = m.tensors[t];
    const TensorMetadata& mine = part->tensors[t];
    SCOPED_TRACE(whole.name);
    auto it = filter.find(whole.name);
    partial += testing::ExpectPartOf(whole, mine, it != filter.end() ? &it->second : nullptr) !=
               whole.chunks.size();
  }
  EXPECT_GT(partial, 50);
  std::mt19937 rng(13);
  int rejected = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    const std::string damaged = Damaged(bytes, rng);
    const Result<CheckpointMetadata> whole = DecodeMetadataFromWire(damaged);
    const Result<CheckpointMetadata> mine =
        DecodeMetadataFromWire(damaged, trial % 2 ? &pool : nullptr, &filter);
    ASSERT_EQ(mine.ok(), whole.ok()) << (whole.ok() ? mine.status() : whole.status());
    if (!whole.ok()) ASSERT_EQ(mine.status(), whole.status());
    rejected += !whole.ok();
  }
  EXPECT_GT(rejected, 100);
}

TEST(MetadataWireTest, SizesAreValidatedOnAPoolWithTheFirstErrorInOrder) {
  ThreadPool pool(4);
  CheckpointMetadata m = ManyTensors();
  ASSERT_TRUE(ValidateCheckpointSizes(m, "/c", &pool).ok());
  // Two tensors whose first chunk lies past the end of its file: the first is named.
  for (size_t t : {90, 31}) m.tensors[t].chunks[0].data_offset = uint64_t{1} << 31;
  const Status inline_status = ValidateCheckpointSizes(m, "/c");
  const Status pooled = ValidateCheckpointSizes(m, "/c", &pool);
  ASSERT_FALSE(inline_status.ok());
  EXPECT_NE(inline_status.message().find("'t1031'"), std::string::npos) << inline_status;
  EXPECT_EQ(pooled.message(), inline_status.message());
}

// Whether every chunk of `m` lies within its tensor's shape and its file, and holds the bytes of
// its box: the rules of ValidateCheckpointSizes, restated in wide arithmetic.
bool ChunksWithinBounds(const CheckpointMetadata& m) {
  for (const TensorMetadata& t : m.tensors) {
    for (const StoredChunk& c : t.chunks) {
      if (c.file >= m.files.size() || c.box.offsets.size() != t.shape.size() ||
          c.box.sizes.size() != t.shape.size()) {
        return false;
      }
      __int128 volume = 1;
      for (size_t d = 0; d < t.shape.size(); ++d) {
        const __int128 offset = c.box.offsets[d], size = c.box.sizes[d];
        if (offset < 0 || size < 0 || offset + size > t.shape[d]) return false;
        volume *= size;
      }
      if (volume * DTypeSize(t.dtype) != c.byte_length) return false;
      const uint64_t length = c.encoding == ChunkEncoding::kRaw ? c.byte_length : c.stored_length;
      const DataFile& f = m.files[c.file];
      if (__int128{f.data_start} + c.data_offset + length > f.size) return false;
    }
  }
  return true;
}

// Random damage to chunks' files, boxes, lengths and places, and to files' sizes: the size
// checks refuse exactly the metadata whose chunks leave their bounds, as kDataLoss naming the
// tensor, the chunk's box and its file.
TEST(MetadataWireTest, SizeChecksRefuseExactlyTheChunksOutOfBounds) {
  std::mt19937_64 rng(2026);
  const CheckpointMetadata sound = ManyTensors();
  ASSERT_TRUE(ChunksWithinBounds(sound));
  ASSERT_TRUE(ValidateCheckpointSizes(sound, "/c").ok());
  const std::vector<int64_t> values = {-1,
                                       0,
                                       1,
                                       2,
                                       3,
                                       16,
                                       (int64_t{1} << 30) - 24,
                                       int64_t{1} << 62,
                                       std::numeric_limits<int64_t>::max()};
  int refused = 0, sound_left = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    CheckpointMetadata m = sound;
    TensorMetadata& t = m.tensors[rng() % m.tensors.size()];
    StoredChunk& c = t.chunks[rng() % t.chunks.size()];
    const int64_t v = values[rng() % values.size()];
    const size_t d = t.shape.empty() ? 0 : rng() % t.shape.size();
    switch (rng() % 9) {
      case 0: c.file = static_cast<uint32_t>(rng() % 10); break;
      case 1: if (!t.shape.empty()) c.box.offsets[d] = v; break;
      case 2: if (!t.shape.empty()) c.box.sizes[d] = v; break;
      case 3: c.box.sizes.push_back(1); c.box.offsets.push_back(0); break;
      case 4: c.byte_length = static_cast<uint64_t>(v); break;
      case 5: c.data_offset = static_cast<uint64_t>(v); break;
      case 6: m.files[c.file].size = static_cast<uint64_t>(std::max<int64_t>(v, 0)); break;
      case 7: m.files[c.file].data_start = static_cast<uint64_t>(v); break;
      default:
        c.encoding = ChunkEncoding::kDriverDecoded;
        c.stored_length = static_cast<uint64_t>(v);
        break;
    }
    const Status status = ValidateCheckpointSizes(m, "/c");
    ASSERT_EQ(status.ok(), ChunksWithinBounds(m)) << "trial " << trial << ": " << status;
    if (status.ok()) {
      ++sound_left;
      continue;
    }
    ++refused;
    ASSERT_EQ(status.code(), StatusCode::kDataLoss) << status;
    // The first chunk out of bounds is named; here the damaged chunk, unless a file's damage
    // reaches a chunk of an earlier tensor first.
    EXPECT_EQ(status.message().rfind("/c: tensor '", 0), 0u) << status;
    EXPECT_NE(status.message().find(" chunk ["), std::string::npos) << status;
  }
  EXPECT_GT(refused, 1500);
  EXPECT_GT(sound_left, 200);
}

TEST(MetadataWireTest, EveryTruncationIsAnError) {
  const std::string bytes = EncodeMetadataForWire(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    Result<CheckpointMetadata> back = DecodeMetadataFromWire(std::string_view(bytes).substr(0, n));
    ASSERT_FALSE(back.ok()) << "prefix of " << n << " bytes decoded";
  }
  Result<CheckpointMetadata> trailing = DecodeMetadataFromWire(bytes + "x");
  ASSERT_FALSE(trailing.ok());
  EXPECT_NE(trailing.status().message().find("1 trailing bytes"), std::string::npos)
      << trailing.status();
}

TEST(MetadataWireTest, RandomByteFlipsNeverCrash) {
  const std::string bytes = EncodeMetadataForWire(Sample());
  std::mt19937 rng(5);
  for (int i = 0; i < 5000; ++i) {
    std::string damaged = bytes;
    damaged[rng() % damaged.size()] ^= static_cast<char>(1 + rng() % 255);
    (void)DecodeMetadataFromWire(damaged);  // must return, whatever it returns
  }
}

TEST(MetadataWireTest, AForgedGridCannotAllocateMoreThanItsBytesPayFor) {
  CheckpointMetadata m;
  m.save_id = "g";
  m.files = {{"f", 0, uint64_t{1} << 62, 0}};
  const int64_t quarter = int64_t{1} << 38;
  TensorMetadata t{"w", DType::kInt8, {4 * quarter}, {}};
  for (int64_t k = 0; k < 4; ++k) {
    t.chunks.push_back(StoredChunk{Box{{k * quarter}, {quarter}}, 0,
                                   static_cast<uint64_t>(k * quarter), static_cast<uint64_t>(quarter),
                                   {}, {}, 0});
  }
  m.tensors = {t};
  IndexChunkGrids(&m);
  std::string bytes = EncodeMetadataForWire(m);
  // The cut points as sent: 5 bounds, an even step of 2^38.
  std::string sent(13, '\0'), forged(13, '\0');
  EncodeFixed32(sent.data(), 5);
  sent[4] = 1;
  EncodeFixed64(sent.data() + 5, static_cast<uint64_t>(quarter));
  const size_t at = bytes.find(sent);
  ASSERT_NE(at, std::string::npos);
  ASSERT_TRUE(DecodeMetadataFromWire(bytes).ok());
  // 2^30 bounds 1,024 apart fit the dimension, and would take 8 GiB: refused before allocating.
  EncodeFixed32(forged.data(), uint32_t{1} << 30);
  forged[4] = 1;
  EncodeFixed64(forged.data() + 5, 1024);
  bytes.replace(at, 13, forged);
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(bytes);
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("too many grid cells"), std::string::npos)
      << back.status();
}

}  // namespace
}  // namespace sp
