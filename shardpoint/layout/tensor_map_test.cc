#include "shardpoint/layout/tensor_map.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

Box ChunkOrDie(const Shape& shape, const Shape& mesh, const std::vector<std::vector<int>>& map,
               int64_t inner_rank) {
  auto result = TensorMapChunk(shape, mesh, map, inner_rank);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : Box();
}

TEST(TensorMapTest, TwoDimMeshWorkedByHand) {
  // mesh_shape (2, 4); tensor_map (1, 0): tensor dim 0 by mesh dim 0 (size 2, counted 1 from the
  // right), tensor dim 1 by mesh dim 1 (size 4). Rank r has coordinate (r / 4, r % 4).
  const Shape mesh = {2, 4};
  const std::vector<std::vector<int>> map = {{1}, {0}};
  EXPECT_EQ(ChunkOrDie({8, 8}, mesh, map, 0), Box({0, 0}, {4, 2}));
  EXPECT_EQ(ChunkOrDie({8, 8}, mesh, map, 3), Box({0, 6}, {4, 2}));
  EXPECT_EQ(ChunkOrDie({8, 8}, mesh, map, 6), Box({4, 4}, {4, 2}));
  EXPECT_EQ(ChunkOrDie({8, 8}, mesh, map, 7), Box({4, 6}, {4, 2}));
  // The reverse map (0, 1) puts mesh dim 1 on tensor dim 0.
  EXPECT_EQ(ChunkOrDie({8, 8}, mesh, {{0}, {1}}, 6), Box({4, 4}, {2, 4}));
}

TEST(TensorMapTest, TupleMappingFirstListedIsOutermost) {
  // Layout((2, 2, 2), ("dp", "sp", "mp"))(("dp", "mp"), "None"): tensor_map ((2, 0), -1).
  // Rows are split by dp, then each half by mp: slice = 2 * dp + mp; sp replicates.
  const Shape mesh = {2, 2, 2};
  const std::vector<std::vector<int>> map = {{2, 0}, {-1}};
  for (int64_t r = 0; r < 8; ++r) {
    const int64_t dp = r / 4, mp = r % 2;
    const int64_t slice = 2 * dp + mp;
    EXPECT_EQ(ChunkOrDie({8, 4}, mesh, map, r), Box({2 * slice, 0}, {2, 4})) << r;
  }
  EXPECT_EQ(ChunkOrDie({8, 4}, mesh, map, 5), Box({6, 0}, {2, 4}));  // (1, 0, 1)
  EXPECT_EQ(ChunkOrDie({8, 4}, mesh, map, 3), Box({2, 0}, {2, 4}));  // (0, 1, 1)
}

TEST(TensorMapTest, BalancedAndUnevenSplits) {
  // 10 over 4 devices: balanced 3, 3, 2, 2; with the mesh dim marked uneven, torch.chunk 3,3,3,1.
  TensorMapLayout layout{{4}, {{0}}, {}, {}};
  std::vector<Box> balanced, uneven;
  for (int64_t r = 0; r < 4; ++r) {
    balanced.push_back(*TensorMapChunk({10}, layout, r));
  }
  EXPECT_EQ(balanced, (std::vector<Box>{Box({0}, {3}), Box({3}, {3}), Box({6}, {2}),
                                        Box({8}, {2})}));
  layout.uneven_mesh_dims = {0};
  for (int64_t r = 0; r < 4; ++r) uneven.push_back(*TensorMapChunk({10}, layout, r));
  EXPECT_EQ(uneven, (std::vector<Box>{Box({0}, {3}), Box({3}, {3}), Box({6}, {3}),
                                      Box({9}, {1})}));
  // Fewer elements than devices, balanced: 1, 1, 0, 0.
  layout.uneven_mesh_dims.clear();
  EXPECT_EQ(*TensorMapChunk({2}, layout, 3), Box({2}, {0}));
}

TEST(TensorMapTest, PerRankWithRankList) {
  const TensorMapLayout layout{{2, 2}, {{1}, {-1}}, {8, 9, 10, 11}, {}};
  auto result = TensorMapChunksPerRank({4, 3}, layout, 16);
  ASSERT_TRUE(result.ok()) << result.status();
  ASSERT_EQ(result->size(), 16u);
  for (int r = 0; r < 8; ++r) EXPECT_FALSE((*result)[r].has_value()) << r;
  for (int r = 12; r < 16; ++r) EXPECT_FALSE((*result)[r].has_value()) << r;
  EXPECT_EQ((*result)[8], Box({0, 0}, {2, 3}));
  EXPECT_EQ((*result)[9], Box({0, 0}, {2, 3}));  // replica along mesh dim 1
  EXPECT_EQ((*result)[10], Box({2, 0}, {2, 3}));
  EXPECT_EQ((*result)[11], Box({2, 0}, {2, 3}));
}

TEST(TensorMapTest, ForRankAgreesWithPerRank) {
  const TensorMapLayout layout{{2, 3}, {{0}, {1}}, {5, 0, 4, 1, 3, 2}, {1}};
  auto all = TensorMapChunksPerRank({7, 5}, layout, 8);
  ASSERT_TRUE(all.ok()) << all.status();
  for (int64_t rank = -1; rank < 9; ++rank) {
    auto one = TensorMapChunkForRank({7, 5}, layout, rank);
    ASSERT_TRUE(one.ok()) << one.status();
    const std::optional<Box> expected =
        rank >= 0 && rank < 8 ? (*all)[rank] : std::optional<Box>();
    EXPECT_EQ(*one, expected) << rank;
  }
  // Global rank 0 sits at position 1 of rank_list: coordinate (0, 1). Tensor dim 0 goes to mesh
  // dim 1 (size 3, uneven: torch.chunk of 7 is 3, 3, 1), tensor dim 1 to mesh dim 0 (size 2,
  // balanced: 3, 2); coordinate (0, 1) holds rows 3..5 and columns 0..2.
  EXPECT_EQ(*TensorMapChunkForRank({7, 5}, layout, 0), Box({3, 0}, {3, 3}));
  // An empty rank list: global rank r is inner rank r; ranks past the mesh hold nothing.
  const TensorMapLayout plain{{4}, {{0}}, {}, {}};
  EXPECT_EQ(*TensorMapChunkForRank({10}, plain, 2), Box({6}, {2}));
  EXPECT_FALSE(TensorMapChunkForRank({10}, plain, 4)->has_value());
  const TensorMapLayout duplicate{{2}, {{0}}, {1, 1}, {}};
  auto twice = TensorMapChunkForRank({4}, duplicate, 0);
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(twice.status().message(), "rank_list holds rank 1 twice");
  const TensorMapLayout short_list{{2, 2}, {{0}}, {0, 1, 2}, {}};
  EXPECT_EQ(TensorMapChunkForRank({4}, short_list, 0).status().message(),
            "rank_list has 3 ranks, expected the mesh volume 4 of mesh_shape [2, 2]");
}

TEST(TensorMapTest, Errors) {
  auto out_of_mesh = TensorMapChunk({4, 4}, {2, 2}, {{2}, {-1}}, 0);
  EXPECT_EQ(out_of_mesh.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(out_of_mesh.status().message().find("tensor dim 0 maps to 2"), std::string::npos)
      << out_of_mesh.status();
  auto twice = TensorMapChunk({4, 4}, {2, 2}, {{0}, {0}}, 0);
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.status().message().find("more than once"), std::string::npos);
  EXPECT_EQ(TensorMapChunk({4, 4}, {2, 2}, {{0}}, 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorMapChunk({4}, {2, 2}, {{0}}, 4).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorMapChunk({4}, {2, 2}, {{-2}}, 0).status().code(),
            StatusCode::kInvalidArgument);
  const TensorMapLayout short_list{{2, 2}, {{0}}, {0, 1, 2}, {}};
  EXPECT_EQ(TensorMapChunksPerRank({4}, short_list, 8).status().code(),
            StatusCode::kInvalidArgument);
  const TensorMapLayout duplicate{{2}, {{0}}, {1, 1}, {}};
  EXPECT_EQ(TensorMapChunksPerRank({4}, duplicate, 8).status().code(),
            StatusCode::kInvalidArgument);
  const TensorMapLayout outside{{2}, {{0}}, {0, 9}, {}};
  EXPECT_EQ(TensorMapChunksPerRank({4}, outside, 8).status().code(),
            StatusCode::kInvalidArgument);
}

// The earlier hyper_parallel formula (even splits only): slice id over the mapped mesh dims with
// the first listed most significant, slice size = size / split count.
Box SeedFormula(const Shape& shape, const Shape& mesh, const std::vector<std::vector<int>>& map,
                int64_t rank) {
  const size_t k = mesh.size();
  std::vector<int64_t> dev(k);
  for (size_t i = k; i-- > 0;) {
    dev[i] = rank % mesh[i];
    rank /= mesh[i];
  }
  Box box;
  for (size_t axis = 0; axis < shape.size(); ++axis) {
    int64_t split = 1, slice_id = 0, coef = 1;
    for (int m : map[axis]) split *= m == -1 ? 1 : mesh[k - 1 - m];
    for (auto it = map[axis].rbegin(); it != map[axis].rend(); ++it) {
      if (*it == -1) continue;
      slice_id += dev[k - 1 - *it] * coef;
      coef *= mesh[k - 1 - *it];
    }
    const int64_t size = shape[axis] / split;
    box.offsets.push_back(slice_id * size);
    box.sizes.push_back(size);
  }
  return box;
}

TEST(TensorMapTest, RandomLayoutsMatchSeedFormulaAndCoverOncePerReplica) {
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 2000; ++iter) {
    Shape mesh;
    const size_t mesh_rank = 1 + rng() % 3;
    for (size_t m = 0; m < mesh_rank; ++m) mesh.push_back(static_cast<int64_t>(1 + rng() % 3));
    const size_t rank = 1 + rng() % 3;
    std::vector<std::vector<int>> map(rank);
    std::vector<int> order;
    for (size_t m = 0; m < mesh_rank; ++m) order.push_back(static_cast<int>(m));
    std::shuffle(order.begin(), order.end(), rng);
    int64_t replicas = 1;
    for (int m : order) {
      const size_t slot = rng() % (rank + 1);  // == rank: mesh dim unused (replicates)
      if (slot == rank) {
        replicas *= mesh[mesh_rank - 1 - m];
      } else {
        map[slot].push_back(m);
      }
    }
    for (auto& entry : map) {
      if (entry.empty() && rng() % 2) entry.push_back(-1);
    }
    // Shapes divisible by the split count, so the seed formula applies.
    Shape shape;
    for (size_t d = 0; d < rank; ++d) {
      int64_t split = 1;
      for (int m : map[d]) split *= m == -1 ? 1 : mesh[mesh_rank - 1 - m];
      shape.push_back(split * static_cast<int64_t>(1 + rng() % 3));
    }
    std::map<std::vector<int64_t>, int64_t> coverage;
    const int64_t volume = ShapeVolume(mesh);
    for (int64_t r = 0; r < volume; ++r) {
      auto got = TensorMapChunk(shape, mesh, map, r);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(*got, SeedFormula(shape, mesh, map, r));
      std::vector<int64_t> p(rank);
      for (int64_t e = 0; e < got->volume(); ++e) {
        int64_t rest = e;
        for (size_t d = rank; d-- > 0;) {
          p[d] = got->offsets[d] + rest % got->sizes[d];
          rest /= got->sizes[d];
        }
        ++coverage[p];
      }
    }
    ASSERT_EQ(static_cast<int64_t>(coverage.size()), ShapeVolume(shape));
    for (const auto& [point, count] : coverage) ASSERT_EQ(count, replicas);
  }
}

TEST(TensorMapTest, UnevenShapesStillCoverOncePerReplica) {
  std::mt19937_64 rng(6);
  for (int iter = 0; iter < 1000; ++iter) {
    TensorMapLayout layout;
    layout.mesh_shape = {static_cast<int64_t>(1 + rng() % 4), static_cast<int64_t>(1 + rng() % 4)};
    layout.tensor_map = {{1, 0}};
    if (rng() % 2) layout.uneven_mesh_dims.push_back(static_cast<int>(rng() % 2));
    const Shape shape = {static_cast<int64_t>(rng() % 12)};
    std::vector<int64_t> count(shape[0], 0);
    for (int64_t r = 0; r < ShapeVolume(layout.mesh_shape); ++r) {
      auto got = TensorMapChunk(shape, layout, r);
      ASSERT_TRUE(got.ok());
      ASSERT_TRUE(WithinShape(*got, shape));
      for (int64_t i = 0; i < got->sizes[0]; ++i) ++count[got->offsets[0] + i];
    }
    for (int64_t c : count) ASSERT_EQ(c, 1);
  }
}

}  // namespace
}  // namespace sp
