#include "shardpoint/geometry/box.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

TEST(ShapeTest, VolumeAndToString) {
  EXPECT_EQ(ShapeVolume(Shape{}), 1);
  EXPECT_EQ(ShapeVolume(Shape{3, 4, 5}), 60);
  EXPECT_EQ(ShapeVolume(Shape{3, 0, 5}), 0);
  EXPECT_EQ(ShapeVolume(Dims{3, 0, 5}), 0);
  EXPECT_EQ(ShapeVolume(Dims{2, 3, 4, 5, 6}), 720);  // past the inline values
  EXPECT_EQ(ShapeToString(Shape{}), "[]");
  EXPECT_EQ(ShapeToString(Shape{4, 8}), "[4, 8]");
  EXPECT_EQ(ShapeToString(Dims{4, 8}), "[4, 8]");
}

TEST(BoxTest, BasicsAndToString) {
  Box box({2, 8}, {4, 8});
  EXPECT_EQ(box.rank(), 2u);
  EXPECT_EQ(box.volume(), 32);
  EXPECT_FALSE(box.empty());
  EXPECT_EQ(box.exclusive_max(0), 6);
  EXPECT_EQ(box.ToString(), "[2:6, 8:16]");
  EXPECT_EQ(Box().ToString(), "[]");
  // A box from hostile input whose end does not fit in 64 bits prints without overflowing.
  const int64_t big = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(Box({big, -1}, {1, 2}).ToString(),
            "[" + std::to_string(big) + ":" + std::to_string(big) + "+1, -1:1]");
  EXPECT_EQ(Box().volume(), 1);  // rank 0: a scalar
  EXPECT_TRUE(Box({0, 0}, {3, 0}).empty());
  EXPECT_EQ(Box::Whole({4, 5}), Box({0, 0}, {4, 5}));
}

TEST(BoxTest, IntersectOverlapping) {
  auto r = Intersect(Box({0, 0}, {4, 4}), Box({2, 1}, {4, 2}));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(*r, Box({2, 1}, {2, 2}));
}

TEST(BoxTest, IntersectTouchingIsEmpty) {
  // [0:4] and [4:8] share a boundary but no element.
  EXPECT_FALSE(Intersect(Box({0}, {4}), Box({4}, {4})).has_value());
  EXPECT_FALSE(Intersect(Box({0, 0}, {2, 2}), Box({2, 2}, {2, 2})).has_value());
  // Touching on one dim only.
  EXPECT_FALSE(Intersect(Box({0, 0}, {4, 2}), Box({1, 2}, {1, 5})).has_value());
}

TEST(BoxTest, IntersectWithEmptyBoxIsEmpty) {
  EXPECT_FALSE(Intersect(Box({0, 0}, {4, 0}), Box({0, 0}, {4, 4})).has_value());
  EXPECT_FALSE(Intersect(Box({0, 0}, {4, 4}), Box({1, 1}, {0, 1})).has_value());
}

TEST(BoxTest, IntersectRankZero) {
  auto r = Intersect(Box(), Box());
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->rank(), 0u);
  EXPECT_EQ(r->volume(), 1);
}

TEST(BoxTest, IntersectRankMismatch) {
  EXPECT_FALSE(Intersect(Box({0}, {4}), Box({0, 0}, {4, 4})).has_value());
}

TEST(BoxTest, IntersectRandomAgainstPointSets) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 500; ++iter) {
    const size_t rank = rng() % 4;
    Box a, b;
    for (size_t d = 0; d < rank; ++d) {
      a.offsets.push_back(static_cast<int64_t>(rng() % 5));
      a.sizes.push_back(static_cast<int64_t>(rng() % 4));
      b.offsets.push_back(static_cast<int64_t>(rng() % 5));
      b.sizes.push_back(static_cast<int64_t>(rng() % 4));
    }
    // Reference: count the points of [0, 9)^rank in both boxes.
    int64_t both = 0;
    int64_t total = 1;
    for (size_t d = 0; d < rank; ++d) total *= 9;
    for (int64_t p = 0; p < total; ++p) {
      bool in_a = true, in_b = true;
      int64_t rest = p;
      for (size_t d = 0; d < rank; ++d) {
        const int64_t x = rest % 9;
        rest /= 9;
        in_a = in_a && x >= a.offsets[d] && x < a.exclusive_max(d);
        in_b = in_b && x >= b.offsets[d] && x < b.exclusive_max(d);
      }
      both += in_a && in_b;
    }
    auto r = Intersect(a, b);
    if (both == 0) {
      EXPECT_FALSE(r.has_value()) << a.ToString() << " " << b.ToString();
    } else {
      ASSERT_TRUE(r.has_value()) << a.ToString() << " " << b.ToString();
      EXPECT_EQ(r->volume(), both);
      EXPECT_TRUE(Contains(a, *r));
      EXPECT_TRUE(Contains(b, *r));
      EXPECT_EQ(Intersect(b, a), r);  // symmetric
    }
  }
}

TEST(BoxTest, Contains) {
  const Box outer({2, 2}, {4, 4});
  EXPECT_TRUE(Contains(outer, outer));
  EXPECT_TRUE(Contains(outer, Box({3, 2}, {3, 4})));
  EXPECT_FALSE(Contains(outer, Box({1, 2}, {2, 2})));  // starts before
  EXPECT_FALSE(Contains(outer, Box({3, 3}, {3, 4})));  // ends after
  EXPECT_TRUE(Contains(outer, Box({100, 100}, {0, 1})));  // empty inner: anywhere
  EXPECT_FALSE(Contains(outer, Box({2}, {1})));  // rank mismatch
  EXPECT_TRUE(Contains(Box(), Box()));
}

TEST(BoxTest, WithinShape) {
  const Shape shape = {4, 6};
  EXPECT_TRUE(WithinShape(Box({0, 0}, {4, 6}), shape));
  EXPECT_TRUE(WithinShape(Box({4, 6}, {0, 0}), shape));  // empty box at the end
  EXPECT_FALSE(WithinShape(Box({1, 0}, {4, 6}), shape));
  EXPECT_FALSE(WithinShape(Box({-1, 0}, {1, 1}), shape));
  EXPECT_FALSE(WithinShape(Box({0, 0}, {-1, 1}), shape));
  EXPECT_FALSE(WithinShape(Box({5, 0}, {0, 1}), shape));  // offset past the end
  EXPECT_FALSE(WithinShape(Box({0}, {4}), shape));         // wrong rank
  EXPECT_FALSE(WithinShape(Box({0, 0}, {4}), shape));      // malformed box
  EXPECT_TRUE(WithinShape(Box(), Shape{}));
}

TEST(BoxTest, WithinShapeDoesNotOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  // offset + size overflows int64; must still be rejected.
  EXPECT_FALSE(WithinShape(Box({kMax}, {kMax}), Shape{kMax}));
  EXPECT_FALSE(WithinShape(Box({1}, {kMax}), Shape{kMax}));
  EXPECT_TRUE(WithinShape(Box({1}, {kMax - 1}), Shape{kMax}));
  EXPECT_FALSE(WithinShape(Box({kMax - 2}, {3}), Shape{kMax}));
}

TEST(BoxTest, RelativeTo) {
  EXPECT_EQ(RelativeTo(Box({5, 7}, {2, 3}), Box({4, 6}, {8, 8})), Box({1, 1}, {2, 3}));
  EXPECT_EQ(RelativeTo(Box(), Box()), Box());
}

TEST(BoxTest, OrderingIsOffsetsThenSizes) {
  std::vector<Box> boxes = {Box({1, 0}, {1, 1}), Box({0, 5}, {1, 1}), Box({0, 5}, {1, 0}),
                            Box({0, 0}, {9, 9})};
  std::sort(boxes.begin(), boxes.end());
  EXPECT_EQ(boxes[0], Box({0, 0}, {9, 9}));
  EXPECT_EQ(boxes[1], Box({0, 5}, {1, 0}));
  EXPECT_EQ(boxes[2], Box({0, 5}, {1, 1}));
  EXPECT_EQ(boxes[3], Box({1, 0}, {1, 1}));
  EXPECT_TRUE(Box({0}, {1}) < Box({0}, {2}));
  EXPECT_FALSE(Box({0}, {2}) < Box({0}, {2}));
  EXPECT_NE(Box({0}, {2}), Box({0}, {3}));
}

}  // namespace
}  // namespace sp
