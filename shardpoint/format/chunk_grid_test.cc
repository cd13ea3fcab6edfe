#include "shardpoint/format/chunk_grid.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "shardpoint/plan/box_set.h"

namespace sp {
namespace {

// The chunks of the grid cut at `cuts` (per dimension, the interior cut points), row-major.
std::vector<StoredChunk> GridChunks(const Shape& shape,
                                    const std::vector<std::vector<int64_t>>& cuts) {
  std::vector<std::vector<int64_t>> bounds(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    bounds[d].push_back(0);
    bounds[d].insert(bounds[d].end(), cuts[d].begin(), cuts[d].end());
    bounds[d].push_back(shape[d]);
  }
  std::vector<StoredChunk> chunks;
  std::vector<size_t> cell(shape.size(), 0);
  while (true) {
    StoredChunk chunk;
    for (size_t d = 0; d < shape.size(); ++d) {
      chunk.box.offsets.push_back(bounds[d][cell[d]]);
      chunk.box.sizes.push_back(bounds[d][cell[d] + 1] - bounds[d][cell[d]]);
    }
    chunk.data_offset = chunks.size() * 100;
    chunks.push_back(chunk);
    size_t d = shape.size();
    while (d-- > 0) {
      if (++cell[d] + 1 < bounds[d].size()) break;
      cell[d] = 0;
    }
    if (d == static_cast<size_t>(-1)) return chunks;
  }
}

StoredChunk Chunk(std::vector<int64_t> offsets, std::vector<int64_t> sizes) {
  StoredChunk chunk;
  chunk.box = Box(std::move(offsets), std::move(sizes));
  return chunk;
}

TEST(ChunkGridTest, RowMajorCellsAreAGrid) {
  const Shape shape = {10, 7};
  std::vector<StoredChunk> chunks = GridChunks(shape, {{3, 4, 9}, {5}});
  ASSERT_EQ(chunks.size(), 8u);
  std::optional<ChunkGrid> grid = FindChunkGrid(chunks, shape);
  ASSERT_TRUE(grid.has_value());
  EXPECT_EQ(grid->bounds, (std::vector<std::vector<int64_t>>{{0, 3, 4, 9, 10}, {0, 5, 7}}));
  EXPECT_EQ(grid->strides, (std::vector<uint64_t>{2, 1}));
  std::vector<uint32_t> hits;
  GridChunksIntersecting(*grid, Box({3, 4}, {2, 2}), &hits);  // rows 3:5 x columns 4:6
  EXPECT_EQ(hits, (std::vector<uint32_t>{2, 3, 4, 5}));
}

TEST(ChunkGridTest, GridMatchesOnlyTheChunksItWasFoundIn) {
  const Shape shape = {10, 7, 3};
  const std::vector<StoredChunk> chunks = GridChunks(shape, {{3, 4, 9}, {5}, {1}});
  const std::optional<ChunkGrid> grid = FindChunkGrid(chunks, shape);
  ASSERT_TRUE(grid.has_value());
  EXPECT_EQ(grid->cell_count(), chunks.size());
  EXPECT_TRUE(GridMatches(*grid, chunks));
  for (size_t c = 0; c < chunks.size(); ++c) EXPECT_EQ(GridCellBox(*grid, c), chunks[c].box);
  std::vector<StoredChunk> swapped = chunks;
  std::swap(swapped[1].box, swapped[2].box);
  EXPECT_FALSE(GridMatches(*grid, swapped));
  std::vector<StoredChunk> shorter(chunks.begin(), chunks.end() - 1);
  EXPECT_FALSE(GridMatches(*grid, shorter));
  std::vector<StoredChunk> resized = chunks;
  resized.back().box.sizes[2] = 1;
  EXPECT_FALSE(GridMatches(*grid, resized));
  ChunkGrid bad_strides = *grid;
  bad_strides.strides[0] = 1;
  EXPECT_FALSE(GridMatches(bad_strides, chunks));
  ChunkGrid bad_bounds = *grid;
  bad_bounds.bounds[0][2] = bad_bounds.bounds[0][1];
  EXPECT_FALSE(GridMatches(bad_bounds, chunks));
  // A scalar's grid has one cell.
  const std::vector<StoredChunk> scalar = {Chunk({}, {})};
  const std::optional<ChunkGrid> point = FindChunkGrid(scalar, {});
  ASSERT_TRUE(point.has_value());
  EXPECT_EQ(point->cell_count(), 1u);
  EXPECT_TRUE(GridMatches(*point, scalar));
  EXPECT_EQ(GridCellBox(*point, 0), Box({}, {}));
}

TEST(ChunkGridTest, IndexChunkGridsSetsTheGridsOfGridsOnly) {
  CheckpointMetadata md;
  md.tensors.push_back(TensorMetadata{"grid", DType::kInt8, {10, 7}, GridChunks({10, 7}, {{4}, {}})});
  std::vector<StoredChunk> reversed = GridChunks({10, 7}, {{4}, {}});
  std::reverse(reversed.begin(), reversed.end());
  md.tensors.push_back(TensorMetadata{"list", DType::kInt8, {10, 7}, reversed});
  md.tensors.push_back(TensorMetadata{"empty", DType::kInt8, {0, 7}, {}});
  ChunkGrid kept;  // an existing grid is left alone
  kept.bounds = {{0, 5, 10}};
  kept.strides = {1};
  md.tensors.push_back(TensorMetadata{"kept", DType::kInt8, {10}, GridChunks({10}, {{5}})});
  md.tensors.back().grid = kept;
  IndexChunkGrids(&md);
  ASSERT_TRUE(md.tensors[0].grid.has_value());
  EXPECT_EQ(md.tensors[0].grid->bounds, (std::vector<std::vector<int64_t>>{{0, 4, 10}, {0, 7}}));
  EXPECT_FALSE(md.tensors[1].grid.has_value());
  EXPECT_FALSE(md.tensors[2].grid.has_value());
  EXPECT_EQ(md.tensors[3].grid, kept);
  // The grid is an index, not part of what a tensor is.
  TensorMetadata without = md.tensors[0];
  without.grid.reset();
  EXPECT_TRUE(without == md.tensors[0]);
}

// A random tiling of `shape` that is not a grid: the shape cut along dimension 0 into bands,
// each band cut along dimension 1 at its own points (flat-range and brick layouts look so).
std::vector<StoredChunk> RandomBricks(std::mt19937_64& rng, const Shape& shape) {
  std::vector<StoredChunk> chunks;
  for (int64_t row = 0; row < shape[0];) {
    const int64_t rows = std::min<int64_t>(shape[0] - row, 1 + rng() % 4);
    for (int64_t col = 0; col < shape[1];) {
      const int64_t cols = std::min<int64_t>(shape[1] - col, 1 + rng() % 5);
      std::vector<int64_t> offsets = {row, col}, sizes = {rows, cols};
      for (size_t d = 2; d < shape.size(); ++d) {
        offsets.push_back(0);
        sizes.push_back(shape[d]);
      }
      chunks.push_back(Chunk(offsets, sizes));
      col += cols;
    }
    row += rows;
  }
  std::shuffle(chunks.begin(), chunks.end(), rng);
  return chunks;
}

TEST(ChunkGridTest, IndexedChunksAreThoseOfTheBruteForce) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 300; ++trial) {
    Shape shape = {1 + static_cast<int64_t>(rng() % 20), 1 + static_cast<int64_t>(rng() % 20)};
    if (trial % 3 == 0) shape.push_back(1 + static_cast<int64_t>(rng() % 3));
    std::vector<StoredChunk> chunks = RandomBricks(rng, shape);
    if (trial % 4 == 0) chunks.push_back(Chunk(std::vector<int64_t>(shape.size(), 0),
                                               std::vector<int64_t>(shape.size(), 0)));  // empty
    const std::optional<ChunkIndex> index = BuildChunkIndex(chunks, shape);
    ASSERT_TRUE(index.has_value());
    EXPECT_EQ(index->chunk_count, chunks.size());
    EXPECT_TRUE(std::is_sorted(index->starts.begin(), index->starts.end()));
    for (int q = 0; q < 20; ++q) {
      Box box;
      for (int64_t dim : shape) {
        const int64_t a = rng() % dim, b = a + rng() % (dim - a + 1);
        box.offsets.push_back(a);
        box.sizes.push_back(b - a);
      }
      std::vector<uint32_t> found, expected;
      ASSERT_TRUE(IndexedChunksIntersecting(*index, chunks, box, &found));
      for (uint32_t c = 0; c < chunks.size(); ++c) {
        if (BoxesOverlap(chunks[c].box, box)) expected.push_back(c);
      }
      ASSERT_EQ(found, expected) << box.ToString();
    }
  }
}

TEST(ChunkGridTest, AStaleIndexSaysSo) {
  std::mt19937_64 rng(18);
  std::vector<StoredChunk> chunks = RandomBricks(rng, {12, 9});
  const ChunkIndex index = BuildChunkIndex(chunks, {12, 9}).value();
  const Box all({0, 0}, {12, 9});
  std::vector<uint32_t> found = {99};
  std::vector<StoredChunk> fewer(chunks.begin(), chunks.end() - 1);
  EXPECT_FALSE(IndexedChunksIntersecting(index, fewer, all, &found));
  std::vector<StoredChunk> moved = chunks;
  moved[index.chunks[0]].box.offsets[index.dim] += 1;
  EXPECT_FALSE(IndexedChunksIntersecting(index, moved, all, &found));
  EXPECT_EQ(found, std::vector<uint32_t>{99});  // left as it was
  // Rank 0 has no index; IndexChunkGrids gives the bricks an index and a grid no index.
  EXPECT_FALSE(BuildChunkIndex(std::vector<StoredChunk>{Chunk({}, {})}, {}).has_value());
  CheckpointMetadata md;
  md.tensors.push_back(TensorMetadata{"bricks", DType::kInt8, {12, 9}, chunks});
  md.tensors.push_back(TensorMetadata{"grid", DType::kInt8, {10, 7}, GridChunks({10, 7}, {{4}, {}})});
  IndexChunkGrids(&md);
  EXPECT_FALSE(md.tensors[0].grid.has_value());
  EXPECT_EQ(md.tensors[0].index, index);
  EXPECT_TRUE(md.tensors[1].grid.has_value());
  EXPECT_FALSE(md.tensors[1].index.has_value());
}

TEST(ChunkGridTest, OneChunkScalarsAndFlatRangesAreGrids) {
  std::optional<ChunkGrid> scalar = FindChunkGrid(std::vector<StoredChunk>{Chunk({}, {})}, Shape{});
  ASSERT_TRUE(scalar.has_value());
  std::vector<uint32_t> hits;
  GridChunksIntersecting(*scalar, Box({}, {}), &hits);
  EXPECT_EQ(hits, std::vector<uint32_t>{0});

  std::optional<ChunkGrid> whole = FindChunkGrid(std::vector<StoredChunk>{Chunk({0, 0}, {4, 4})},
                                                 Shape{4, 4});
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->bounds, (std::vector<std::vector<int64_t>>{{0, 4}, {0, 4}}));

  // Megatron's flat optimizer shards: uneven ranges of one dimension.
  std::vector<StoredChunk> flat = {Chunk({0}, {5}), Chunk({5}, {1}), Chunk({6}, {94})};
  std::optional<ChunkGrid> ranges = FindChunkGrid(flat, Shape{100});
  ASSERT_TRUE(ranges.has_value());
  hits.clear();
  GridChunksIntersecting(*ranges, Box({5}, {2}), &hits);
  EXPECT_EQ(hits, (std::vector<uint32_t>{1, 2}));
  hits.clear();
  GridChunksIntersecting(*ranges, Box({5}, {0}), &hits);  // empty: nothing
  EXPECT_TRUE(hits.empty());
}

TEST(ChunkGridTest, ListsThatAreNotRowMajorGridsAreRefused) {
  const Shape shape = {4, 6};
  const std::vector<StoredChunk> grid = GridChunks(shape, {{2}, {3}});
  ASSERT_TRUE(FindChunkGrid(grid, shape).has_value());

  std::vector<StoredChunk> swapped = grid;  // a grid, but not in row-major order
  std::swap(swapped[1], swapped[2]);
  EXPECT_FALSE(FindChunkGrid(swapped, shape).has_value());

  // Bricks: the rows are cut at different columns.
  const std::vector<StoredChunk> bricks = {Chunk({0, 0}, {2, 3}), Chunk({0, 3}, {2, 3}),
                                           Chunk({2, 0}, {2, 2}), Chunk({2, 2}, {2, 4})};
  EXPECT_FALSE(FindChunkGrid(bricks, shape).has_value());

  std::vector<StoredChunk> hole = grid;  // the last cell is missing
  hole.pop_back();
  EXPECT_FALSE(FindChunkGrid(hole, shape).has_value());

  std::vector<StoredChunk> overlap = grid;  // the last cell reaches into its neighbour
  overlap[3].box = Box({2, 2}, {2, 4});
  EXPECT_FALSE(FindChunkGrid(overlap, shape).has_value());

  std::vector<StoredChunk> outside = grid;  // the last row of cells ends past the shape
  outside[2].box.sizes[0] = 3;
  outside[3].box.sizes[0] = 3;
  EXPECT_FALSE(FindChunkGrid(outside, shape).has_value());

  std::vector<StoredChunk> short_shape = grid;  // the shape is cut short
  EXPECT_FALSE(FindChunkGrid(short_shape, Shape{4, 5}).has_value());

  std::vector<StoredChunk> wrong_rank = grid;  // one box has a dimension too few
  wrong_rank[3].box = Box({2}, {2});
  EXPECT_FALSE(FindChunkGrid(wrong_rank, shape).has_value());
  wrong_rank[3].box = Box({2, 3}, {2});  // fewer sizes than offsets
  EXPECT_FALSE(FindChunkGrid(wrong_rank, shape).has_value());

  std::vector<StoredChunk> extra = grid;  // one cell twice
  extra.push_back(grid.back());
  EXPECT_FALSE(FindChunkGrid(extra, shape).has_value());

  std::vector<StoredChunk> negative = {Chunk({0}, {-2}), Chunk({-2}, {4})};
  EXPECT_FALSE(FindChunkGrid(negative, Shape{2}).has_value());
  EXPECT_FALSE(FindChunkGrid(std::vector<StoredChunk>{}, Shape{0, 4}).has_value());
  EXPECT_FALSE(FindChunkGrid(std::vector<StoredChunk>{Chunk({}, {})}, Shape{1}).has_value());
}

// Random grids of rank 0 to 4, random boxes: the chunks found are exactly those the brute force
// finds, in increasing order.
TEST(ChunkGridTest, IntersectingChunksAreThoseOfTheBruteForce) {
  std::mt19937_64 rng(20261125);
  for (int trial = 0; trial < 500; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const size_t rank = rng() % 5;
    Shape shape;
    std::vector<std::vector<int64_t>> cuts(rank);
    for (size_t d = 0; d < rank; ++d) {
      shape.push_back(1 + static_cast<int64_t>(rng() % (trial % 2 == 0 ? 12 : 40)));
      if (trial % 4 == 1) {  // even, or as torch.chunk cuts: every interval `step` but the last
        const int64_t step = 1 + static_cast<int64_t>(rng() % shape[d]);
        for (int64_t at = step; at < shape[d]; at += step) cuts[d].push_back(at);
        continue;
      }
      for (int64_t at = 1; at < shape[d]; ++at) {
        if (rng() % (trial % 4 == 3 ? 9 : 3) == 0) cuts[d].push_back(at);
      }
    }
    const std::vector<StoredChunk> chunks = GridChunks(shape, cuts);
    std::optional<ChunkGrid> grid = FindChunkGrid(chunks, shape);
    ASSERT_TRUE(grid.has_value());
    for (int q = 0; q < 20; ++q) {
      Box box;
      for (size_t d = 0; d < rank; ++d) {
        const int64_t a = static_cast<int64_t>(rng() % (shape[d] + 1));
        const int64_t b = static_cast<int64_t>(rng() % (shape[d] + 1));
        box.offsets.push_back(std::min(a, b));
        box.sizes.push_back(std::max(a, b) - std::min(a, b));
        if (q % 5 == 4) box.sizes.back() += 3;  // past the shape's end
        if (q % 7 == 6) box.offsets.back() -= 2, box.sizes.back() += 2;  // before its start
      }
      std::vector<uint32_t> expected;
      for (uint32_t c = 0; c < chunks.size(); ++c) {
        if (!box.empty() && (rank == 0 || BoxesOverlap(box, chunks[c].box))) expected.push_back(c);
      }
      std::vector<uint32_t> hits;
      GridChunksIntersecting(*grid, box, &hits);
      ASSERT_EQ(hits, expected) << box.ToString();
    }
    // A shuffled list is the same chunks but no longer a row-major grid.
    if (chunks.size() > 1) {
      std::vector<StoredChunk> shuffled = chunks;
      do {
        std::shuffle(shuffled.begin(), shuffled.end(), rng);
      } while (shuffled == chunks);
      EXPECT_FALSE(FindChunkGrid(shuffled, shape).has_value());
    }
  }
}

}  // namespace
}  // namespace sp
