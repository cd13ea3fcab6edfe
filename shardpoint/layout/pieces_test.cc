#include "shardpoint/layout/pieces.h"

#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

TEST(ValidateBoxesTest, AcceptsBoxesInside) {
  const std::vector<Box> boxes = {Box({0, 0}, {2, 6}), Box({2, 0}, {2, 6}), Box({4, 6}, {0, 0})};
  EXPECT_TRUE(ValidateBoxes("w", {4, 6}, boxes).ok());
  EXPECT_TRUE(ValidateBoxes("w", {4, 6}, {}).ok());
}

TEST(ValidateBoxesTest, OutOfBoundsNamesTensorBoxAndShape) {
  const std::vector<Box> boxes = {Box({0, 0}, {2, 6}), Box({3, 0}, {2, 6})};
  Status status = ValidateBoxes("model.layers.0.mlp.w1", {4, 6}, boxes);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("model.layers.0.mlp.w1"), std::string::npos) << status;
  EXPECT_NE(status.message().find("[3:5, 0:6]"), std::string::npos) << status;
  EXPECT_NE(status.message().find("[4, 6]"), std::string::npos) << status;
  EXPECT_EQ(ValidateBoxes("w", {4, 6}, std::vector<Box>{Box({-1, 0}, {1, 1})}).code(),
            StatusCode::kInvalidArgument);
}

TEST(ValidateBoxesTest, WrongRank) {
  Status status = ValidateBoxes("bias", {4, 6}, std::vector<Box>{Box({0}, {4})});
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("bias"), std::string::npos);
  EXPECT_NE(status.message().find("rank 1"), std::string::npos) << status;
}

TEST(FlatRangePiecesTest, WorkedExample) {
  // A rank holds rows 1..2 of a [4, 6] tensor; its flat range [3, 10) is row 1 cols 3..5 then
  // row 2 cols 0..3.
  auto pieces = FlatRangePieces({4, 6}, Box({1, 0}, {2, 6}), 3, 10);
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  EXPECT_EQ(*pieces, (std::vector<Piece>{{Box({1, 3}, {1, 3}), 0}, {Box({2, 0}, {1, 4}), 3}}));
}

TEST(FlatRangePiecesTest, OffsetsAreRunningAndRangeIsCovered) {
  std::mt19937_64 rng(8);
  for (int iter = 0; iter < 1000; ++iter) {
    const Shape shape = {static_cast<int64_t>(1 + rng() % 5), static_cast<int64_t>(1 + rng() % 5),
                         static_cast<int64_t>(1 + rng() % 5)};
    const Box box = Box::Whole(shape);
    int64_t begin = static_cast<int64_t>(rng() % (box.volume() + 1));
    int64_t end = static_cast<int64_t>(rng() % (box.volume() + 1));
    if (begin > end) std::swap(begin, end);
    auto pieces = FlatRangePieces(shape, box, begin, end);
    ASSERT_TRUE(pieces.ok());
    int64_t offset = 0;
    for (const Piece& piece : *pieces) {
      ASSERT_EQ(piece.element_offset, offset);
      // The piece's first element is flat element begin + offset of the whole tensor.
      int64_t flat = 0;
      for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + piece.box.offsets[d];
      ASSERT_EQ(flat, begin + offset);
      offset += piece.box.volume();
    }
    ASSERT_EQ(offset, end - begin);
  }
}

TEST(FlatRangePiecesTest, Errors) {
  EXPECT_EQ(FlatRangePieces({4, 6}, Box({3, 0}, {2, 6}), 0, 1).status().code(),
            StatusCode::kInvalidArgument);
  auto too_long = FlatRangePieces({4, 6}, Box({0, 0}, {2, 6}), 0, 13);
  EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.status().message().find("volume 12"), std::string::npos);
}

}  // namespace
}  // namespace sp
