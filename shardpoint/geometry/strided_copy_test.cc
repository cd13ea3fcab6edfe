#include "shardpoint/geometry/strided_copy.h"

#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

// Row-major element index of global point `p` inside chunk `box`.
int64_t IndexIn(const Box& box, const std::vector<int64_t>& p) {
  int64_t index = 0;
  for (size_t d = 0; d < box.rank(); ++d) index = index * box.sizes[d] + (p[d] - box.offsets[d]);
  return index;
}

// Calls fn(point) for every point of `region` in row-major order.
template <typename Fn>
void ForEachPoint(const Box& region, Fn&& fn) {
  if (region.empty()) return;
  std::vector<int64_t> p(region.offsets);
  while (true) {
    fn(p);
    size_t d = region.rank();
    while (d-- > 0) {
      if (++p[d] < region.exclusive_max(d)) break;
      p[d] = region.offsets[d];
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

std::vector<std::byte> RandomBytes(std::mt19937_64& rng, size_t n) {
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng());
  return out;
}

// A random box of `rank` around [0, 8)^rank and a random sub-box of it.
std::pair<Box, Box> RandomBoxAndSubBox(std::mt19937_64& rng, size_t rank) {
  Box outer, inner;
  for (size_t d = 0; d < rank; ++d) {
    const int64_t off = static_cast<int64_t>(rng() % 4);
    const int64_t size = static_cast<int64_t>(1 + rng() % 6);
    outer.offsets.push_back(off);
    outer.sizes.push_back(size);
    const int64_t lo = off + static_cast<int64_t>(rng() % size);
    const int64_t hi = lo + 1 + static_cast<int64_t>(rng() % (off + size - lo));
    inner.offsets.push_back(lo);
    inner.sizes.push_back(hi - lo);
  }
  return {outer, inner};
}

// Grows `chunk` randomly so that it still contains `region`.
Box GrowAround(std::mt19937_64& rng, const Box& region) {
  Box chunk = region;
  for (size_t d = 0; d < region.rank(); ++d) {
    const int64_t before = static_cast<int64_t>(rng() % 3);
    const int64_t after = static_cast<int64_t>(rng() % 3);
    chunk.offsets[d] -= before;
    chunk.sizes[d] += before + after;
  }
  return chunk;
}

void CheckRandomCopy(std::mt19937_64& rng, ThreadPool* pool, size_t parallel_min_bytes) {
  static constexpr size_t kElementSizes[] = {1, 2, 4, 8, 16};
  const size_t rank = rng() % 5;
  const size_t es = kElementSizes[rng() % 5];
  auto [unused, region] = RandomBoxAndSubBox(rng, rank);
  const Box src_box = GrowAround(rng, region);
  const Box dst_box = GrowAround(rng, region);
  const auto src = RandomBytes(rng, src_box.volume() * es);
  auto dst = RandomBytes(rng, dst_box.volume() * es);
  auto expected = dst;
  ForEachPoint(region, [&](const std::vector<int64_t>& p) {
    std::memcpy(&expected[IndexIn(dst_box, p) * es], &src[IndexIn(src_box, p) * es], es);
  });
  Status status = CopyRegion(ConstChunkView{src.data(), src_box, es},
                             ChunkView{dst.data(), dst_box, es}, region, pool, parallel_min_bytes);
  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(dst, expected) << "src " << src_box.ToString() << " dst " << dst_box.ToString()
                           << " region " << region.ToString() << " element size " << es;
}

TEST(CopyRegionTest, RandomAgainstPerElementReference) {
  std::mt19937_64 rng(1);
  for (int i = 0; i < 2000; ++i) CheckRandomCopy(rng, nullptr, 8u << 20);
}

TEST(CopyRegionTest, RandomWithPoolAndSplitting) {
  ThreadPool pool(4);
  std::mt19937_64 rng(2);
  for (int i = 0; i < 2000; ++i) CheckRandomCopy(rng, &pool, /*parallel_min_bytes=*/0);
}

TEST(CopyRegionTest, LargeContiguousCopySplitAcrossPool) {
  ThreadPool pool(3);
  std::mt19937_64 rng(3);
  const Box box({0, 0}, {64, 1000});
  const auto src = RandomBytes(rng, box.volume() * 4);
  std::vector<std::byte> dst(src.size());
  ASSERT_TRUE(CopyRegion(ConstChunkView{src.data(), box, 4}, ChunkView{dst.data(), box, 4}, box,
                         &pool, 1024)
                  .ok());
  EXPECT_EQ(dst, src);
}

TEST(CopyRegionTest, RowsOfA2DChunk) {
  // Columns 2..5 of rows 1..2 of a 4x8 chunk into a 2x4 chunk.
  std::vector<uint8_t> src(32);
  for (int i = 0; i < 32; ++i) src[i] = static_cast<uint8_t>(i);
  std::vector<uint8_t> dst(8, 0xEE);
  const Box region({1, 2}, {2, 4});
  ASSERT_TRUE(CopyRegion(ConstChunkView{reinterpret_cast<const std::byte*>(src.data()),
                                        Box({0, 0}, {4, 8}), 1},
                         ChunkView{reinterpret_cast<std::byte*>(dst.data()), region, 1}, region)
                  .ok());
  EXPECT_EQ(dst, (std::vector<uint8_t>{10, 11, 12, 13, 18, 19, 20, 21}));
}

TEST(CopyRegionTest, RankZeroAndEmpty) {
  const uint64_t value = 0x0123456789ABCDEF;
  uint64_t out = 0;
  ASSERT_TRUE(CopyRegion(ConstChunkView{reinterpret_cast<const std::byte*>(&value), Box(), 8},
                         ChunkView{reinterpret_cast<std::byte*>(&out), Box(), 8}, Box())
                  .ok());
  EXPECT_EQ(out, value);
  // An empty region copies nothing, even with null data.
  EXPECT_TRUE(CopyRegion(ConstChunkView{nullptr, Box({0}, {4}), 4},
                         ChunkView{nullptr, Box({0}, {4}), 4}, Box({2}, {0}))
                  .ok());
}

TEST(CopyRegionTest, RegionOutsideAChunkNamesTheBoxes) {
  std::vector<std::byte> src(16), dst(16);
  Status status = CopyRegion(ConstChunkView{src.data(), Box({0}, {16}), 1},
                             ChunkView{dst.data(), Box({8}, {16}), 1}, Box({4}, {8}));
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("[4:12]"), std::string::npos) << status;
  EXPECT_NE(status.message().find("[0:16]"), std::string::npos) << status;
  EXPECT_NE(status.message().find("[8:24]"), std::string::npos) << status;
  EXPECT_EQ(CopyRegion(ConstChunkView{src.data(), Box({0}, {16}), 1},
                       ChunkView{dst.data(), Box({0, 0}, {4, 4}), 1}, Box({0}, {4}))
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CopyRegion(ConstChunkView{src.data(), Box({0}, {8}), 2},
                       ChunkView{dst.data(), Box({0}, {4}), 4}, Box({0}, {4}))
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CopyRegion(ConstChunkView{src.data(), Box({0}, {8}), 2},
                       ChunkView{dst.data(), Box({0}, {8}), 2}, Box({4}, {-2}))
                .code(),
            StatusCode::kInvalidArgument);
}

// Reference runs: the byte offsets of every element, sorted, merged when adjacent.
std::vector<std::pair<uint64_t, uint64_t>> ReferenceRuns(const Box& chunk, const Box& region,
                                                         size_t es) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  ForEachPoint(region, [&](const std::vector<int64_t>& p) {
    const uint64_t offset = static_cast<uint64_t>(IndexIn(chunk, p)) * es;
    if (!runs.empty() && runs.back().first + runs.back().second == offset) {
      runs.back().second += es;
    } else {
      runs.emplace_back(offset, es);
    }
  });
  return runs;
}

TEST(ByteRunTest, RandomAgainstReference) {
  std::mt19937_64 rng(5);
  static constexpr size_t kElementSizes[] = {1, 2, 4, 8, 16};
  for (int i = 0; i < 3000; ++i) {
    const size_t rank = rng() % 5;
    const size_t es = kElementSizes[rng() % 5];
    auto [chunk, region] = RandomBoxAndSubBox(rng, rank);
    std::vector<std::pair<uint64_t, uint64_t>> runs;
    ForEachByteRun(chunk, region, es, [&](uint64_t o, uint64_t n) { runs.emplace_back(o, n); });
    const auto expected = ReferenceRuns(chunk, region, es);
    ASSERT_EQ(runs, expected) << chunk.ToString() << " " << region.ToString();
    const RunSummary summary = SummarizeByteRuns(chunk, region, es);
    EXPECT_EQ(summary.runs, expected.size());
    EXPECT_EQ(summary.first_byte, expected.front().first);
    EXPECT_EQ(summary.end_byte, expected.back().first + expected.back().second);
    uint64_t bytes = 0;
    for (const auto& run : expected) bytes += run.second;
    EXPECT_EQ(summary.bytes, bytes);
  }
}

TEST(ByteRunTest, KnownLayouts) {
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  auto collect = [&](uint64_t o, uint64_t n) { runs.emplace_back(o, n); };
  // Full rows 1..2 of a 4x8 float chunk: one run.
  ForEachByteRun(Box({0, 0}, {4, 8}), Box({1, 0}, {2, 8}), 4, collect);
  EXPECT_EQ(runs, (std::vector<std::pair<uint64_t, uint64_t>>{{32, 64}}));
  runs.clear();
  // A column: one run per row.
  ForEachByteRun(Box({0, 0}, {3, 8}), Box({0, 5}, {3, 1}), 4, collect);
  EXPECT_EQ(runs, (std::vector<std::pair<uint64_t, uint64_t>>{{20, 4}, {52, 4}, {84, 4}}));
  runs.clear();
  // Region outside the chunk, or empty: nothing.
  ForEachByteRun(Box({0}, {4}), Box({2}, {4}), 4, collect);
  ForEachByteRun(Box({0}, {4}), Box({2}, {0}), 4, collect);
  EXPECT_TRUE(runs.empty());
  const RunSummary none = SummarizeByteRuns(Box({0}, {4}), Box({2}, {4}), 4);
  EXPECT_EQ(none.runs, 0u);
  EXPECT_EQ(none.bytes, 0u);
  const RunSummary column = SummarizeByteRuns(Box({0, 0}, {3, 8}), Box({0, 5}, {3, 1}), 4);
  EXPECT_EQ(column.runs, 3u);
  EXPECT_EQ(column.first_byte, 20u);
  EXPECT_EQ(column.end_byte, 88u);
  EXPECT_EQ(column.bytes, 12u);
}

// Copying run by run as ForEachCopyRun lists them gives what CopyRegion gives, and
// SummarizeCopyRuns counts those runs.
TEST(CopyRunTest, RunByRunCopyEqualsCopyRegion) {
  std::mt19937_64 rng(7);
  static constexpr size_t kElementSizes[] = {1, 2, 4, 8, 16};
  for (int i = 0; i < 2000; ++i) {
    const size_t rank = 1 + rng() % 4;
    const size_t es = kElementSizes[rng() % 5];
    auto [unused, region] = RandomBoxAndSubBox(rng, rank);
    const Box src_box = GrowAround(rng, region);
    const Box dst_box = GrowAround(rng, region);
    const auto src = RandomBytes(rng, src_box.volume() * es);
    const auto before = RandomBytes(rng, dst_box.volume() * es);
    auto expected = before;
    ASSERT_TRUE(CopyRegion(ConstChunkView{src.data(), src_box, es},
                           ChunkView{expected.data(), dst_box, es}, region).ok());
    const CopyRuns runs = SummarizeCopyRuns(src_box, dst_box, region, es);
    auto dst = before;
    uint64_t count = 0;
    ForEachCopyRun(src_box, dst_box, region, es, [&](uint64_t s, uint64_t d) {
      ASSERT_LE(s + runs.run_bytes, src.size());
      ASSERT_LE(d + runs.run_bytes, dst.size());
      std::memcpy(&dst[d], &src[s], runs.run_bytes);
      ++count;
    });
    EXPECT_EQ(count, runs.count);
    EXPECT_EQ(runs.run_bytes * runs.count, region.volume() * es);
    ASSERT_EQ(dst, expected) << "src " << src_box.ToString() << " dst " << dst_box.ToString()
                             << " region " << region.ToString();
  }
  // Half the columns of a 4x8 float chunk into a 4x4 one: a run of 16 bytes per row.
  const CopyRuns half = SummarizeCopyRuns(Box({0, 0}, {4, 8}), Box({0, 4}, {4, 4}),
                                          Box({0, 4}, {4, 4}), 4);
  EXPECT_EQ(half.run_bytes, 16u);
  EXPECT_EQ(half.count, 4u);
  // A region outside the destination: nothing.
  const CopyRuns outside = SummarizeCopyRuns(Box({0}, {8}), Box({0}, {2}), Box({1}, {4}), 4);
  EXPECT_EQ(outside.count, 0u);
  int calls = 0;
  ForEachCopyRun(Box({0}, {8}), Box({0}, {2}), Box({1}, {4}), 4,
                 [&](uint64_t, uint64_t) { ++calls; });
  EXPECT_EQ(calls, 0);
}

}  // namespace
}  // namespace sp
