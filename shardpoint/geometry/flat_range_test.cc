#include "shardpoint/geometry/flat_range.h"

#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

using Point = std::vector<int64_t>;

// Global coordinates of the element at row-major position `flat` of `box`.
Point Unravel(const Box& box, int64_t flat) {
  Point p(box.rank());
  for (size_t d = box.rank(); d-- > 0;) {
    p[d] = box.offsets[d] + flat % box.sizes[d];
    flat /= box.sizes[d];
  }
  return p;
}

// The elements of `boxes`, each box in row-major order, concatenated.
std::vector<Point> Enumerate(const std::vector<Box>& boxes) {
  std::vector<Point> out;
  for (const Box& box : boxes) {
    for (int64_t i = 0; i < box.volume(); ++i) out.push_back(Unravel(box, i));
  }
  return out;
}

// Each piece: size 1 on dims < k, a range on dim k, the full extent of `box` beyond.
bool HasPrefixRangeFullForm(const Box& box, const Box& piece) {
  // Find the last dim that is not the full extent; everything before it must be size 1.
  size_t last_partial = 0;
  bool any_partial = false;
  for (size_t d = 0; d < piece.rank(); ++d) {
    if (piece.offsets[d] != box.offsets[d] || piece.sizes[d] != box.sizes[d]) {
      last_partial = d;
      any_partial = true;
    }
  }
  if (!any_partial) return true;
  for (size_t d = 0; d < last_partial; ++d) {
    if (piece.sizes[d] != 1) return false;
  }
  return Contains(box, piece);
}

void CheckAgainstReference(const Box& box, int64_t begin, int64_t end) {
  auto result = DecomposeFlatRange(box, begin, end);
  ASSERT_TRUE(result.ok()) << result.status();
  const std::vector<Box>& pieces = *result;
  const size_t max_pieces = box.rank() == 0 ? 1 : 2 * box.rank() - 1;
  EXPECT_LE(pieces.size(), max_pieces) << box.ToString();
  for (const Box& piece : pieces) {
    EXPECT_FALSE(piece.empty()) << piece.ToString();
    EXPECT_TRUE(HasPrefixRangeFullForm(box, piece)) << box.ToString() << " " << piece.ToString();
  }
  std::vector<Point> expected;
  for (int64_t i = begin; i < end; ++i) expected.push_back(Unravel(box, i));
  EXPECT_EQ(Enumerate(pieces), expected)
      << "box " << box.ToString() << " range [" << begin << ", " << end << ")";
}

TEST(FlatRangeTest, WorkedExample) {
  // Box [0:3, 0:4] (12 elements); range [2, 11) = row 0 cols 2..3, row 1, row 2 cols 0..2.
  auto result = DecomposeFlatRange(Box({0, 0}, {3, 4}), 2, 11);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(*result, (std::vector<Box>{Box({0, 2}, {1, 2}), Box({1, 0}, {1, 4}),
                                       Box({2, 0}, {1, 3})}));
}

TEST(FlatRangeTest, WholeBoxIsOneBox) {
  const Box box({4, 0, 2}, {2, 3, 5});
  auto result = DecomposeFlatRange(box, 0, box.volume());
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(*result, std::vector<Box>{box});
}

TEST(FlatRangeTest, EmptyRangeGivesNoBoxes) {
  auto result = DecomposeFlatRange(Box({0, 0}, {3, 4}), 5, 5);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->empty());
  auto empty_box = DecomposeFlatRange(Box({0, 0}, {3, 0}), 0, 0);
  ASSERT_TRUE(empty_box.ok());
  EXPECT_TRUE(empty_box->empty());
}

TEST(FlatRangeTest, RankZero) {
  auto result = DecomposeFlatRange(Box(), 0, 1);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(*result, std::vector<Box>{Box()});
  auto bad = DecomposeFlatRange(Box(), 0, 2);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

TEST(FlatRangeTest, Errors) {
  const Box box({0, 0}, {3, 4});
  auto reversed = DecomposeFlatRange(box, 5, 4);
  EXPECT_EQ(reversed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(reversed.status().message().find("[5, 4)"), std::string::npos)
      << reversed.status();
  auto past_end = DecomposeFlatRange(box, 0, 13);
  EXPECT_EQ(past_end.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(past_end.status().message().find("volume 12"), std::string::npos)
      << past_end.status();
  auto negative = DecomposeFlatRange(box, -1, 3);
  EXPECT_EQ(negative.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.status().message().find("[-1, 3)"), std::string::npos);
  EXPECT_EQ(DecomposeFlatRange(Box({0}, {-2}), 0, 0).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(FlatRangeTest, ExhaustiveSmallShapes) {
  const std::vector<Box> boxes = {Box({3}, {7}), Box({1, 2}, {3, 4}), Box({0, 0, 0}, {2, 3, 4}),
                                  Box({5, 1, 0, 2}, {2, 1, 3, 2}), Box({0, 0}, {1, 5})};
  for (const Box& box : boxes) {
    for (int64_t b = 0; b <= box.volume(); ++b) {
      for (int64_t e = b; e <= box.volume(); ++e) CheckAgainstReference(box, b, e);
    }
  }
}

TEST(FlatRangeTest, RandomShapesAgainstReference) {
  std::mt19937_64 rng(42);
  for (int iter = 0; iter < 3000; ++iter) {
    const size_t rank = 1 + rng() % 5;
    Box box;
    for (size_t d = 0; d < rank; ++d) {
      box.offsets.push_back(static_cast<int64_t>(rng() % 10));
      box.sizes.push_back(static_cast<int64_t>(1 + rng() % 5));
    }
    const int64_t volume = box.volume();
    int64_t begin = static_cast<int64_t>(rng() % (volume + 1));
    int64_t end = static_cast<int64_t>(rng() % (volume + 1));
    if (begin > end) std::swap(begin, end);
    CheckAgainstReference(box, begin, end);
  }
}

}  // namespace
}  // namespace sp
