#include "shardpoint/plan/box_set.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "shardpoint/plan/plan_test_util.h"

namespace sp {
namespace {

std::vector<const Box*> Pointers(const std::vector<Box>& boxes) {
  std::vector<const Box*> out;
  for (const Box& b : boxes) out.push_back(&b);
  return out;
}

Box RandomBox(std::mt19937_64& rng, const Shape& shape) {
  Box box;
  for (int64_t extent : shape) {
    int64_t a = static_cast<int64_t>(rng() % (extent + 1));
    int64_t b = static_cast<int64_t>(rng() % (extent + 1));
    if (a > b) std::swap(a, b);
    box.offsets.push_back(a);
    box.sizes.push_back(b - a);
  }
  return box;
}

TEST(BoxSetTest, BoxesOverlapTouchingEmptyAndScalar) {
  EXPECT_TRUE(BoxesOverlap(Box({0, 0}, {4, 4}), Box({3, 3}, {2, 2})));
  EXPECT_FALSE(BoxesOverlap(Box({0, 0}, {4, 4}), Box({4, 0}, {2, 4})));  // touching
  EXPECT_FALSE(BoxesOverlap(Box({0, 0}, {4, 4}), Box({1, 1}, {0, 2})));  // empty
  EXPECT_TRUE(BoxesOverlap(Box({}, {}), Box({}, {})));                   // scalars
  EXPECT_FALSE(BoxesOverlap(Box({0}, {4}), Box({0, 0}, {4, 4})));        // rank mismatch
}

TEST(BoxSetTest, FindOverlappingPairNamesTheOverlappingBoxes) {
  std::vector<Box> boxes = {Box({0, 0}, {2, 8}), Box({2, 0}, {2, 8}), Box({4, 0}, {0, 8}),
                            Box({3, 4}, {3, 4}), Box({6, 0}, {2, 8})};
  auto pair = FindOverlappingPair(Pointers(boxes));
  ASSERT_TRUE(pair.has_value());
  EXPECT_EQ(pair->first, 1u);
  EXPECT_EQ(pair->second, 3u);
  boxes[3] = Box({4, 0}, {2, 8});
  EXPECT_FALSE(FindOverlappingPair(Pointers(boxes)).has_value());
}

TEST(BoxSetTest, FindOverlappingPairMatchesBruteForceOnRandomBoxes) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    Shape shape;
    const size_t rank = rng() % 4;
    for (size_t d = 0; d < rank; ++d) shape.push_back(1 + static_cast<int64_t>(rng() % 9));
    std::vector<Box> boxes(rng() % 7);
    for (Box& b : boxes) b = RandomBox(rng, shape);
    bool expected = false;
    for (size_t i = 0; i < boxes.size(); ++i) {
      for (size_t j = i + 1; j < boxes.size(); ++j) {
        expected = expected || BoxesOverlap(boxes[i], boxes[j]);
      }
    }
    auto pair = FindOverlappingPair(Pointers(boxes));
    ASSERT_EQ(pair.has_value(), expected) << "trial " << trial;
    if (pair) {
      EXPECT_LT(pair->first, pair->second);
      EXPECT_TRUE(BoxesOverlap(boxes[pair->first], boxes[pair->second]));
    }
  }
}

TEST(BoxSetTest, IntersectingPairsMatchesBruteForceOnRandomBoxes) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    Shape shape;
    const size_t rank = rng() % 4;
    for (size_t d = 0; d < rank; ++d) shape.push_back(1 + static_cast<int64_t>(rng() % 12));
    std::vector<Box> a(rng() % 6), b(rng() % 9);
    for (Box& x : a) x = RandomBox(rng, shape);
    for (Box& x : b) x = RandomBox(rng, shape);
    std::set<std::pair<uint32_t, uint32_t>> expected;
    for (uint32_t i = 0; i < a.size(); ++i) {
      for (uint32_t j = 0; j < b.size(); ++j) {
        if (BoxesOverlap(a[i], b[j])) expected.insert({i, j});
      }
    }
    auto pairs = IntersectingPairs(Pointers(a), Pointers(b));
    std::set<std::pair<uint32_t, uint32_t>> got(pairs.begin(), pairs.end());
    EXPECT_EQ(got.size(), pairs.size()) << "a pair was reported twice, trial " << trial;
    EXPECT_EQ(got, expected) << "trial " << trial;
  }
}

TEST(BoxSetTest, ColumnShardedBoxesAreCheckedWithoutPairwiseWork) {
  // 4,096 column shards: a sweep along rows would compare every pair; along columns none.
  std::vector<Box> boxes;
  for (int64_t c = 0; c < 4096; ++c) boxes.push_back(Box({0, c * 2}, {64, 2}));
  EXPECT_FALSE(FindOverlappingPair(Pointers(boxes)).has_value());
  boxes.push_back(Box({10, 4095}, {1, 2}));
  auto pair = FindOverlappingPair(Pointers(boxes));
  ASSERT_TRUE(pair.has_value());
  EXPECT_EQ(pair->second, 4096u);
  EXPECT_TRUE(BoxesOverlap(boxes[pair->first], boxes[4096]));
}

TEST(BoxSetTest, FindUncoveredPointFindsAMissingShard) {
  std::vector<Box> boxes;
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 4; ++c) {
      if (r == 2 && c == 1) continue;
      boxes.push_back(Box({r * 3, c * 5}, {3, 5}));
    }
  }
  auto point = FindUncoveredPoint(Pointers(boxes), {12, 20});
  ASSERT_TRUE(point.has_value());
  EXPECT_EQ(*point, (std::vector<int64_t>{6, 5}));
  boxes.push_back(Box({6, 5}, {3, 5}));
  EXPECT_FALSE(FindUncoveredPoint(Pointers(boxes), {12, 20}).has_value());
}

TEST(BoxSetTest, FindUncoveredPointWithNoBoxesAndForScalars) {
  EXPECT_EQ(*FindUncoveredPoint({}, {3, 4}), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(*FindUncoveredPoint({}, {}), std::vector<int64_t>{});
  std::vector<Box> scalar = {Box({}, {})};
  EXPECT_FALSE(FindUncoveredPoint(Pointers(scalar), {}).has_value());
  EXPECT_FALSE(FindUncoveredPoint({}, {0, 4}).has_value());  // no elements at all
}

TEST(BoxSetTest, FindUncoveredPointReturnsOnlyUncoveredPointsAndRespectsTheBudget) {
  std::mt19937_64 rng(5);
  int found = 0;
  for (int trial = 0; trial < 1000; ++trial) {
    Shape shape = {1 + static_cast<int64_t>(rng() % 6), 1 + static_cast<int64_t>(rng() % 6)};
    std::vector<Box> boxes(rng() % 5);
    for (Box& b : boxes) b = RandomBox(rng, shape);
    auto point = FindUncoveredPoint(Pointers(boxes), shape);
    if (!point) continue;
    ++found;
    for (const Box& b : boxes) EXPECT_FALSE(Contains(b, Box(*point, {1, 1})) && !b.empty());
  }
  EXPECT_GT(found, 500);
  std::vector<Box> boxes = {Box({0, 0}, {1, 1}), Box({1, 1}, {1, 1})};
  EXPECT_FALSE(FindUncoveredPoint(Pointers(boxes), {4, 4}, 1).has_value());
  EXPECT_TRUE(FindUncoveredPoint(Pointers(boxes), {4, 4}, 100).has_value());
}

TEST(BoxSetTest, PointToString) {
  EXPECT_EQ(PointToString({2, 0}), "(2, 0)");
  EXPECT_EQ(PointToString({}), "()");
}

}  // namespace
}  // namespace sp
