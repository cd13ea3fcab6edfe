#include "shardpoint/format/metadata_wire.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <set>

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
  // The chunk's stored length and driver tag, as varints.
  std::string tag;
  ByteWriter t(&tag);
  t.PutVarint(90);
  t.PutVarint(0xBEEF);
  const size_t at = bytes.find(tag);
  ASSERT_NE(at, std::string::npos);
  ASSERT_EQ(bytes.find(tag, at + 1), std::string::npos);
  ASSERT_EQ(tag.size(), 4u);
  std::string forged = bytes;
  forged[at + 3] = '\x06';  // the tag's top 7 bits: 0x1BEEF
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
    if (!whole.ok()) {
      ASSERT_EQ(mine.status(), whole.status());
    }
    rejected += !whole.ok();
  }
  EXPECT_GT(rejected, 100);
}

// Random tensors of rank 0 to 3: grids with uneven cuts in every dimension (raw cells, or placed
// ones), the same chunks listed out of grid order (an index), chunks that are no grid at all (a
// scan); spread over 6 files, a few of which hold only a stored object.
CheckpointMetadata RandomTensors(std::mt19937_64& rng) {
  CheckpointMetadata m;
  m.save_id = "random";
  m.world_size = 6;
  for (int f = 0; f < 9; ++f) m.files.push_back({"f" + std::to_string(f), 64, 1 << 30, f % 6});
  m.attributes["step"] = "12";
  for (int t = 0; t < 40; ++t) {
    const size_t rank = rng() % 4;
    TensorMetadata tensor{"t" + std::to_string(100 + t), DType::kBFloat16, Shape(rank), {}};
    ChunkGrid grid;
    for (size_t d = 0; d < rank; ++d) {
      std::vector<int64_t> cuts = {0};
      for (int64_t at = 0; cuts.size() < 1 + 1 + rng() % 5;) {
        at += 1 + static_cast<int64_t>(rng() % 4);
        cuts.push_back(at);
      }
      tensor.shape[d] = cuts.back();
      grid.bounds.push_back(cuts);
    }
    grid.strides.assign(rank, 1);
    for (size_t d = rank; d-- > 1;) {
      grid.strides[d - 1] = grid.strides[d] * (grid.bounds[d].size() - 1);
    }
    const bool placed = rng() % 4 == 0;
    for (uint64_t c = 0; c < grid.cell_count(); ++c) {
      const Box box = GridCellBox(grid, c);
      const uint64_t bytes = 2 * static_cast<uint64_t>(box.volume());
      tensor.chunks.push_back(StoredChunk{box, static_cast<uint32_t>(rng() % 6), 100 * c, bytes,
                                          {static_cast<uint32_t>(rng())},
                                          placed ? ChunkEncoding::kDriverDecoded
                                                 : ChunkEncoding::kRaw,
                                          placed ? bytes + 3 : 0,
                                          static_cast<uint16_t>(placed ? 2 : 0)});
    }
    if (rng() % 3 == 0) std::shuffle(tensor.chunks.begin(), tensor.chunks.end(), rng);
    m.tensors.push_back(std::move(tensor));
  }
  IndexChunkGrids(&m);
  m.objects = {{"cfg", ObjectEncoding::kJson, "{}"},
               {"unread", ObjectEncoding::kTorchSave, "", StoredObjectItem{7, 64, 32, 1}}};
  return m;
}

// Random boxes for a tensor of `shape`: inside it, past it, empty, of another rank, or none.
std::vector<Box> RandomBoxes(const Shape& shape, std::mt19937_64& rng) {
  std::vector<Box> boxes;
  for (int n = static_cast<int>(rng() % 3); n > 0; --n) {
    Box box = Box::Whole(shape);
    for (size_t d = 0; d < shape.size(); ++d) {
      box.offsets[d] = static_cast<int64_t>(rng() % shape[d]);
      box.sizes[d] = 1 + static_cast<int64_t>(rng() % (shape[d] - box.offsets[d]));
    }
    switch (rng() % 8) {
      case 0: if (!shape.empty()) box.sizes[0] += 1; break;  // past the shape
      case 1: if (!shape.empty()) box.sizes[0] = 0; break;   // empty
      case 2: box = Box::Whole(Shape(shape.size() + 1, 1)); break;  // another rank
      default: break;
    }
    boxes.push_back(box);
  }
  return boxes;
}

// What the coordinator of a load sends a rank (EncodeMetadataPartForWire) decodes to what the
// whole encoding decodes to with the rank's filter: the same tensors, chunks and stored numbers
// (checked against a plain scan too, through grids, indexes and lists alike), the same objects
// and attributes, and the files its chunks and objects name, the others without a name. It is
// smaller than the whole encoding when a rank reaches a small part.
TEST(MetadataWireTest, APartDecodesToWhatTheWholeEncodingGivesWithItsFilter) {
  std::mt19937_64 rng(31);
  int parts = 0, wholes = 0, grids = 0;
  for (int trial = 0; trial < 60; ++trial) {
    CheckpointMetadata m = RandomTensors(rng);
    // Metadata received from the wire is not checked for order: a part of tensors out of order,
    // or of one name twice, keeps what each tensor's name reaches all the same.
    if (trial % 3 == 1) std::reverse(m.tensors.begin(), m.tensors.end());
    if (trial % 3 == 2) m.tensors[1].name = m.tensors[0].name;
    for (const TensorMetadata& t : m.tensors) grids += t.grid.has_value();
    const std::string whole = EncodeMetadataForWire(m);
    ChunkFilter filter;
    for (const TensorMetadata& t : m.tensors) {
      if (rng() % 5 != 0) filter[t.name] = RandomBoxes(t.shape, rng);
      // Names the metadata does not have, before, between and after its own: nothing is kept
      // for them.
      if (rng() % 4 == 0) filter[t.name + "~"] = RandomBoxes(t.shape, rng);
      if (rng() % 8 == 0) filter[t.name.substr(0, t.name.size() - 1)] = {Box::Whole(t.shape)};
    }
    if (trial % 2 == 0) filter["~"] = {Box{{0}, {1}}};
    for (const TensorMetadata& t : m.tensors) {
      auto it = filter.find(t.name);
      static const std::vector<Box> kNone;
      EXPECT_EQ(ChunksReached(t, it != filter.end() ? it->second : kNone),
                testing::ReachedChunks(t, it != filter.end() ? &it->second : nullptr))
          << t.name;
    }
    const CheckpointMetadata expected = DecodeMetadataFromWire(whole, nullptr, &filter).value();
    const std::string bytes = EncodeMetadataPartForWire(m, filter);
    // As the coordinator answers a request: the filter decoded as a list, the part appended.
    const ChunkFilterList list = DecodeChunkFilterList(EncodeChunkFilter(filter), "f").value();
    std::string answered = "prefix";
    MetadataPartEncoder(m).EncodeTo(list, &answered);
    EXPECT_EQ(answered, "prefix" + bytes);
    Result<CheckpointMetadata> part = DecodeMetadataFromWire(bytes);
    ASSERT_TRUE(part.ok()) << part.status();
    ASSERT_EQ(part->tensors.size(), m.tensors.size());
    std::set<uint32_t> named;
    for (size_t t = 0; t < m.tensors.size(); ++t) {
      SCOPED_TRACE(m.tensors[t].name);
      EXPECT_TRUE(part->tensors[t] == expected.tensors[t]);
      auto it = filter.find(m.tensors[t].name);
      const size_t kept = testing::ExpectPartOf(m.tensors[t], part->tensors[t],
                                                it != filter.end() ? &it->second : nullptr);
      (kept == m.tensors[t].chunks.size() ? wholes : parts) += 1;
      for (const StoredChunk& c : part->tensors[t].chunks) named.insert(c.file);
    }
    named.insert(7);  // the stored object's
    EXPECT_EQ(part->objects, m.objects);
    EXPECT_EQ(part->attributes, m.attributes);
    EXPECT_EQ(part->save_id, m.save_id);
    EXPECT_EQ(part->world_size, m.world_size);
    ASSERT_EQ(part->files.size(), m.files.size());
    for (uint32_t f = 0; f < m.files.size(); ++f) {
      EXPECT_EQ(part->files[f], named.count(f) ? m.files[f] : DataFile()) << "file " << f;
    }
  }
  EXPECT_GT(parts, 1000);
  EXPECT_GT(wholes, 100);
  EXPECT_GT(grids, 1000);
  // One rank's share of many: a few rows of every tensor of ManyTensors, and one cell of a grid
  // of 64 x 32 cells, which travels as a part of the grid (its cuts, then the cell).
  CheckpointMetadata m = ManyTensors();
  ChunkFilter few;
  for (const TensorMetadata& t : m.tensors) {
    few[t.name] = {Box::Whole(t.shape)};
    if (!t.shape.empty()) few[t.name][0].sizes[0] = 1;
  }
  // (Each tensor's name and header travel in both, about 10 bytes of its 50 in the whole.)
  EXPECT_LT(EncodeMetadataPartForWire(m, few).size(), EncodeMetadataForWire(m).size() * 2 / 3);
  TensorMetadata big{"big", DType::kFloat32, {4096, 64}, {}};
  for (int64_t row = 0; row < 4096; row += 64) {
    for (int64_t col = 0; col < 64; col += 2) {
      big.chunks.push_back(StoredChunk{Box{{row, col}, {64, 2}}, 0, 0, 512, {7}, {}, 0});
    }
  }
  CheckpointMetadata one;
  one.files = {{"f", 0, 1 << 20, 0}};
  one.tensors = {big};
  IndexChunkGrids(&one);
  ASSERT_TRUE(one.tensors[0].grid.has_value());
  const ChunkFilter cell = {{"big", {Box{{70, 3}, {1, 1}}}}};
  const std::string bytes = EncodeMetadataPartForWire(one, cell);
  EXPECT_LT(bytes.size(), 200u);
  const CheckpointMetadata back = DecodeMetadataFromWire(bytes).value();
  EXPECT_EQ(back.tensors[0].kept, std::optional<std::vector<uint32_t>>(std::vector<uint32_t>{33}));
  EXPECT_EQ(back.tensors[0].chunks, std::vector<StoredChunk>({one.tensors[0].chunks[33]}));
}

// A part damaged on the way is refused as kDataLoss or decodes to a metadata whose chunks are
// inside the files it holds; never anything else.
TEST(MetadataWireTest, ADamagedPartIsRefusedOrHoldsOnlyItsFiles) {
  std::mt19937_64 rng(5);
  std::mt19937 damage(6);
  int rejected = 0;
  for (int trial = 0; trial < 30; ++trial) {
    const CheckpointMetadata m = RandomTensors(rng);
    ChunkFilter filter;
    for (const TensorMetadata& t : m.tensors) filter[t.name] = RandomBoxes(t.shape, rng);
    const std::string bytes = EncodeMetadataPartForWire(m, filter);
    for (int k = 0; k < 100; ++k) {
      Result<CheckpointMetadata> back = DecodeMetadataFromWire(Damaged(bytes, damage));
      if (!back.ok()) {
        ASSERT_EQ(back.status().code(), StatusCode::kDataLoss) << back.status();
        ++rejected;
        continue;
      }
      for (const TensorMetadata& t : back->tensors) {
        for (const StoredChunk& c : t.chunks) {
          ASSERT_LT(c.file, back->files.size());
          ASSERT_FALSE(back->files[c.file].name.empty()) << t.name;
        }
        if (t.kept) {
          ASSERT_EQ(t.kept->size(), t.chunks.size());
          ASSERT_TRUE(std::is_sorted(t.kept->begin(), t.kept->end()));
        }
      }
    }
  }
  EXPECT_GT(rejected, 1000);
}

// A rank's request (EncodeChunkFilter) round-trips, and bytes that are not one are refused by name.
TEST(MetadataWireTest, AChunkFilterRoundTripsAndBadBytesAreRefusedByName) {
  const ChunkFilter filter = {{"a", {}},
                              {"b.w", {Box{{0, 4}, {2, 2}}, Box{{}, {}}}},
                              {"c", {Box{{-1}, {3}}}}};
  const std::string bytes = EncodeChunkFilter(filter);
  EXPECT_EQ(DecodeChunkFilter(bytes, "x").value(), filter);
  EXPECT_EQ(DecodeChunkFilter(EncodeChunkFilter({}), "x").value(), ChunkFilter());
  // As a list: the same names, in order, each with its boxes.
  const ChunkFilterList list = DecodeChunkFilterList(bytes, "x").value();
  ASSERT_EQ(list.size(), 3u);
  size_t i = 0;
  for (const auto& [name, boxes] : filter) {
    EXPECT_EQ(list.name(i), name);
    EXPECT_EQ(std::vector<Box>(list.boxes(i).begin(), list.boxes(i).end()), boxes) << name;
    ++i;
  }
  EXPECT_EQ(DecodeChunkFilterList(EncodeChunkFilter({}), "x")->size(), 0u);
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    const Result<ChunkFilter> back = DecodeChunkFilter(bytes.substr(0, cut), "rank 3's filter");
    ASSERT_FALSE(back.ok()) << cut;
    EXPECT_EQ(back.status().code(), StatusCode::kDataLoss);
    EXPECT_EQ(back.status().message().rfind("rank 3's filter", 0), 0u) << back.status();
    EXPECT_EQ(DecodeChunkFilterList(bytes.substr(0, cut), "rank 3's filter").status(),
              back.status());
  }
  EXPECT_EQ(DecodeChunkFilter(bytes + "z", "f").status(),
            DataLossError("f: 1 trailing bytes"));
  std::string swapped;  // names out of order
  ByteWriter w(&swapped);
  w.PutVarint(2);
  for (const char* name : {"b", "a"}) {
    w.PutVarint(0);  // bytes shared with the start and the end of the name before
    w.PutVarint(0);
    w.PutVarint(1);
    w.PutRaw(name);
    w.PutVarint(0);  // boxes
  }
  EXPECT_EQ(DecodeChunkFilter(swapped, "f").status().message(),
            "f: tensor names out of order at 'a'");
  std::string ranks;  // a box of 1 offset and 2 sizes
  ByteWriter v(&ranks);
  v.PutVarint(1);
  v.PutVarint(0);
  v.PutVarint(0);
  v.PutVarint(1);
  v.PutRaw("a");
  v.PutVarint(1);
  v.PutVarint(1);
  v.PutSignedVarint(0);
  v.PutVarint(2);
  v.PutSignedVarint(1);
  v.PutSignedVarint(1);
  EXPECT_EQ(DecodeChunkFilter(ranks, "f").status().message(),
            "f: a box of tensor 'a' has 1 offsets and 2 sizes");
  EXPECT_EQ(DecodeChunkFilterList(ranks, "f").status(), DecodeChunkFilter(ranks, "f").status());
  EXPECT_EQ(DecodeChunkFilterList(swapped, "f").status(),
            DecodeChunkFilter(swapped, "f").status());
}

// Names travel as what each does not share with the start and the end of the one before: a
// name that claims more of the one before than it has is refused, and so are names that would
// decode to more than sixteen times the bytes sent (a few bytes can name a long name again and
// again).
TEST(MetadataWireTest, NamesSharedWithTheOneBeforeAreCheckedAndBounded) {
  std::string claims;
  ByteWriter c(&claims);
  c.PutVarint(2);
  c.PutVarint(0);  // shares no byte of the start of the name before, nor of its end
  c.PutVarint(0);
  c.PutVarint(2);
  c.PutRaw("ab");
  c.PutVarint(0);  // boxes
  c.PutVarint(2);  // all of "ab" at the start, and one more byte at the end
  c.PutVarint(1);
  c.PutVarint(1);
  c.PutRaw("c");
  c.PutVarint(0);
  EXPECT_EQ(DecodeChunkFilter(claims, "f").status().message(),
            "f: the name at byte 7 shares 2 + 1 bytes with a name of 2");
  // A name of 1 MiB, then 120 names, each above the one before, that each share all of it but
  // its last byte: 120 MiB of names from 1 MiB of bytes.
  const std::string first(size_t{1} << 20, 'x');
  std::string long_names;
  ByteWriter l(&long_names);
  l.PutVarint(121);
  l.PutVarint(0);
  l.PutVarint(0);
  l.PutVarint(first.size());
  l.PutRaw(first);
  l.PutVarint(0);
  for (int i = 0; i < 120; ++i) {
    l.PutVarint(first.size() - 1);
    l.PutVarint(0);
    l.PutVarint(1);
    l.PutRaw(std::string(1, static_cast<char>(0x80 + i)));
    l.PutVarint(0);
  }
  const Result<ChunkFilter> refused = DecodeChunkFilter(long_names, "f");
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("the input allows"), std::string::npos)
      << refused.status();
  // 129 x after 128 x: sharing 127 bytes at the start and one at the end takes a byte less than
  // sharing 128 at the start (4 bytes against 5), and is what is sent.
  const ChunkFilter xs = {{std::string(128, 'x'), {}}, {std::string(129, 'x'), {}}};
  EXPECT_EQ(EncodeChunkFilter(xs).size(), 1u + (1 + 1 + 2 + 128 + 1) + (4 + 1));
  EXPECT_EQ(DecodeChunkFilter(EncodeChunkFilter(xs), "f").value(), xs);
  // Names of a model, sorted: the whole encoding takes fewer bytes than the names alone, and
  // so does a request naming them all; both give them back.
  CheckpointMetadata m;
  m.save_id = "n";
  m.files = {{"f", 0, 1 << 20, 0}};
  uint64_t name_bytes = 0;
  for (int layer = 0; layer < 20; ++layer) {
    for (const char* leaf : {"attention.wk.weight", "attention.wq.weight", "mlp.w1.weight"}) {
      TensorMetadata t{"model.layers." + std::to_string(100 + layer) + "." + leaf,
                       DType::kFloat32, {2}, {}};
      t.chunks = {StoredChunk{Box{{0}, {2}}, 0, 8u * m.tensors.size(), 8, {}, {}, 0}};
      name_bytes += t.name.size();
      m.tensors.push_back(std::move(t));
    }
  }
  IndexChunkGrids(&m);
  const std::string bytes = EncodeMetadataForWire(m);
  EXPECT_LT(bytes.size(), name_bytes);
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == m);
  ChunkFilter filter;
  for (const TensorMetadata& t : m.tensors) filter[t.name] = {Box{{0}, {1}}};
  EXPECT_LT(EncodeChunkFilter(filter).size(), name_bytes);
  EXPECT_EQ(DecodeChunkFilter(EncodeChunkFilter(filter), "f").value(), filter);
}

// What a load rank is sent for a tensor sharded over the ranks: its own cell of the grid, in a
// few bytes beside its name (the cut points are an even step), not every cell.
TEST(MetadataWireTest, APartOfOneCellPerTensorTakesAFewBytesATensor) {
  CheckpointMetadata m;
  m.save_id = "p";
  m.world_size = 64;
  m.checksum_block_bytes = uint64_t{1} << 30;
  for (int f = 0; f < 64; ++f) {
    m.files.push_back({"d-0123456789ab-r000" + std::to_string(10 + f) + "-f000.safetensors", 4096,
                       1 << 30, f});
  }
  for (int t = 0; t < 200; ++t) {
    TensorMetadata tensor{"layers." + std::to_string(1000 + t) + ".w", DType::kBFloat16,
                          {64 * 128, 512}, {}};
    for (int64_t r = 0; r < 64; ++r) {
      tensor.chunks.push_back(StoredChunk{Box{{128 * r, 0}, {128, 512}},
                                          static_cast<uint32_t>(r), 131072u * t, 131072,
                                          {static_cast<uint32_t>(t * 64 + r)}, {}, 0});
    }
    m.tensors.push_back(std::move(tensor));
  }
  IndexChunkGrids(&m);
  ChunkFilter filter;
  for (const TensorMetadata& t : m.tensors) filter[t.name] = {Box{{128 * 5, 0}, {128, 512}}};
  const std::string part = EncodeMetadataPartForWire(m, filter);
  // Per tensor: its name's entry (4 bytes), length, dtype, shape, layout and raw flag (9), cut
  // points (9), the cell's number, file and offset steps and one checksum (12 at most); at fixed
  // width these took about 110. The file it names: 5 bytes of name, then 8.
  EXPECT_LT(part.size(), 200u * 36 + 100) << part.size();
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(part);
  ASSERT_TRUE(back.ok()) << back.status();
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    ASSERT_EQ(back->tensors[t].chunks.size(), 1u);
    EXPECT_EQ(back->tensors[t].chunks[0], m.tensors[t].chunks[5]);
    EXPECT_EQ(back->tensors[t].kept, std::vector<uint32_t>{5});
  }
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
  std::string sent, forged;
  ByteWriter(&sent).PutVarint(5);
  ByteWriter(&sent).PutU8(1);
  ByteWriter(&sent).PutSignedVarint(quarter);
  const size_t at = bytes.find(sent);
  ASSERT_NE(at, std::string::npos);
  ASSERT_TRUE(DecodeMetadataFromWire(bytes).ok());
  // 2^30 bounds 1,024 apart fit the dimension, and would take 8 GiB: refused before allocating.
  ByteWriter(&forged).PutVarint(uint64_t{1} << 30);
  ByteWriter(&forged).PutU8(1);
  ByteWriter(&forged).PutSignedVarint(1024);
  ASSERT_EQ(forged.size(), sent.size());  // the tensor keeps its length
  bytes.replace(at, sent.size(), forged);
  Result<CheckpointMetadata> back = DecodeMetadataFromWire(bytes);
  ASSERT_FALSE(back.ok());
  EXPECT_NE(back.status().message().find("too many grid cells"), std::string::npos)
      << back.status();
}

}  // namespace
}  // namespace sp
