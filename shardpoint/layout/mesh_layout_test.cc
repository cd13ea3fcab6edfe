#include "shardpoint/layout/mesh_layout.h"

#include <map>
#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace sp {
namespace {

using Kind = Placement::Kind;

std::vector<Box> ChunksOrDie(const Shape& shape, const MeshLayout& layout) {
  auto result = MeshChunksPerRank(shape, layout);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *result : std::vector<Box>{};
}

TEST(MeshLayoutTest, TorchChunkExamples) {
  const MeshLayout layout{{4}, {Placement::Shard(0)}, {}};
  EXPECT_EQ(ChunksOrDie({10}, layout),
            (std::vector<Box>{Box({0}, {3}), Box({3}, {3}), Box({6}, {3}), Box({9}, {1})}));
  // 5 over 4: ceil 2 -> 2, 2, 1, 0; the empty chunk sits at the global size.
  EXPECT_EQ(ChunksOrDie({5}, layout),
            (std::vector<Box>{Box({0}, {2}), Box({2}, {2}), Box({4}, {1}), Box({5}, {0})}));
  EXPECT_EQ(ChunksOrDie({8}, layout),
            (std::vector<Box>{Box({0}, {2}), Box({2}, {2}), Box({4}, {2}), Box({6}, {2})}));
}

TEST(MeshLayoutTest, TwoMeshDimsOnOneTensorDimCompose) {
  const MeshLayout layout{{2, 2}, {Placement::Shard(0), Placement::Shard(0)}, {}};
  EXPECT_EQ(ChunksOrDie({8, 8}, layout),
            (std::vector<Box>{Box({0, 0}, {2, 8}), Box({2, 0}, {2, 8}), Box({4, 0}, {2, 8}),
                              Box({6, 0}, {2, 8})}));
  // Uneven: 10 -> [0,5) [5,10); each -> 3 + 2.
  EXPECT_EQ(ChunksOrDie({10}, layout),
            (std::vector<Box>{Box({0}, {3}), Box({3}, {2}), Box({5}, {3}), Box({8}, {2})}));
}

TEST(MeshLayoutTest, TwoDimMeshShardingTwoTensorDimsWithReplication) {
  // Mesh (2, 3): dim 0 shards tensor dim 1, dim 1 replicates.
  const MeshLayout layout{{2, 3}, {Placement::Shard(1), Placement::Replicate()}, {}};
  const auto chunks = ChunksOrDie({4, 6}, layout);
  ASSERT_EQ(chunks.size(), 6u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(chunks[r], Box({0, 0}, {4, 3}));
    EXPECT_EQ(chunks[3 + r], Box({0, 3}, {4, 3}));
  }
}

TEST(MeshLayoutTest, StridedShardFollowedByShardIsContiguous) {
  // torch's _StridedShard example: FSDP (dp) x TP (tp) on an [8, 8] tensor, right-to-left.
  const MeshLayout layout{{2, 2}, {Placement::StridedShard(0, 2), Placement::Shard(0)}, {}};
  EXPECT_EQ(ChunksOrDie({8, 8}, layout),
            (std::vector<Box>{Box({0, 0}, {2, 8}), Box({4, 0}, {2, 8}), Box({2, 0}, {2, 8}),
                              Box({6, 0}, {2, 8})}));
}

TEST(MeshLayoutTest, NonContiguousStridedShardNamesTheTensorDim) {
  const MeshLayout layout{{2}, {Placement::StridedShard(1, 2)}, {}};
  auto result = MeshChunk({3, 8}, layout, {0});
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("tensor dim 1"), std::string::npos)
      << result.status();
  EXPECT_NE(result.status().message().find("{[0, 2), [4, 6)}"), std::string::npos)
      << result.status();
}

TEST(MeshLayoutTest, RankList) {
  const MeshLayout layout{{2, 2}, {Placement::Shard(0), Placement::Replicate()}, {4, 5, 6, 7}};
  auto chunk = MeshChunkForRank({6}, layout, 6);
  ASSERT_TRUE(chunk.ok());
  ASSERT_TRUE(chunk->has_value());
  EXPECT_EQ(**chunk, Box({3}, {3}));
  auto absent = MeshChunkForRank({6}, layout, 1);
  ASSERT_TRUE(absent.ok());
  EXPECT_FALSE(absent->has_value());
  auto plain = MeshChunkForRank({6}, MeshLayout{{2}, {Placement::Shard(0)}, {}}, 2);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->has_value());
  auto duplicate =
      MeshChunksPerRank({6}, MeshLayout{{2}, {Placement::Shard(0)}, {3, 3}});
  EXPECT_EQ(duplicate.status().code(), StatusCode::kInvalidArgument);
  auto short_list = MeshChunksPerRank({6}, MeshLayout{{2}, {Placement::Shard(0)}, {3}});
  EXPECT_EQ(short_list.status().code(), StatusCode::kInvalidArgument);
}

TEST(MeshLayoutTest, Errors) {
  EXPECT_EQ(MeshChunk({4}, MeshLayout{{2, 2}, {Placement::Shard(0)}, {}}, {0, 0}).status().code(),
            StatusCode::kInvalidArgument);
  auto bad_dim = MeshChunk({4}, MeshLayout{{2}, {Placement::Shard(1)}, {}}, {0});
  EXPECT_EQ(bad_dim.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad_dim.status().message().find("S(1)"), std::string::npos) << bad_dim.status();
  EXPECT_EQ(MeshChunk({4}, MeshLayout{{2}, {Placement::Shard(0)}, {}}, {2}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(MeshChunk({4}, MeshLayout{{0}, {Placement::Shard(0)}, {}}, {0}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      MeshChunk({4}, MeshLayout{{2}, {Placement::StridedShard(0, 0)}, {}}, {0}).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(MeshChunk({-1}, MeshLayout{{2}, {Placement::Shard(0)}, {}}, {0}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(MeshLayoutTest, RankZeroTensorIsReplicated) {
  EXPECT_EQ(ChunksOrDie({}, MeshLayout{{3}, {Placement::Replicate()}, {}}),
            (std::vector<Box>{Box(), Box(), Box()}));
}

// Reference: explicit index lists with torch.chunk / _StridedShard splitting.
std::vector<int64_t> TorchChunk(const std::vector<int64_t>& v, int64_t n, int64_t c) {
  const int64_t size = (static_cast<int64_t>(v.size()) + n - 1) / n;
  std::vector<int64_t> out;
  for (int64_t i = c * size; i < (c + 1) * size && i < static_cast<int64_t>(v.size()); ++i) {
    out.push_back(v[i]);
  }
  return out;
}

// Returns nullopt when some dim's index list is not contiguous.
std::optional<Box> ReferenceChunk(const Shape& shape, const MeshLayout& layout,
                                  const std::vector<int64_t>& coordinate) {
  std::vector<std::vector<int64_t>> index(shape.size());
  for (size_t d = 0; d < shape.size(); ++d) {
    for (int64_t i = 0; i < shape[d]; ++i) index[d].push_back(i);
  }
  for (size_t m = 0; m < layout.placements.size(); ++m) {
    const Placement& p = layout.placements[m];
    const int64_t n = layout.mesh_shape[m];
    if (p.kind == Kind::kShard) index[p.dim] = TorchChunk(index[p.dim], n, coordinate[m]);
    if (p.kind == Kind::kStridedShard) {
      std::vector<int64_t> out;
      for (int64_t j = 0; j < p.split_factor; ++j) {
        for (int64_t x : TorchChunk(TorchChunk(index[p.dim], p.split_factor, j), n, coordinate[m])) {
          out.push_back(x);
        }
      }
      index[p.dim] = out;
    }
  }
  Box box;
  for (size_t d = 0; d < shape.size(); ++d) {
    for (size_t k = 1; k < index[d].size(); ++k) {
      if (index[d][k] != index[d][k - 1] + 1) return std::nullopt;
    }
    box.offsets.push_back(index[d].empty() ? shape[d] : index[d][0]);
    box.sizes.push_back(static_cast<int64_t>(index[d].size()));
  }
  return box;
}

TEST(MeshLayoutTest, RandomLayoutsMatchReferenceAndCoverOncePerReplica) {
  std::mt19937_64 rng(99);
  int strided_errors = 0, strided_ok = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const size_t rank = rng() % 4;
    Shape shape;
    for (size_t d = 0; d < rank; ++d) shape.push_back(static_cast<int64_t>(rng() % 9));
    MeshLayout layout;
    const size_t mesh_rank = 1 + rng() % 3;
    int64_t replicas = 1;
    for (size_t m = 0; m < mesh_rank; ++m) {
      layout.mesh_shape.push_back(static_cast<int64_t>(1 + rng() % 3));
      const int choice = rank == 0 ? 0 : static_cast<int>(rng() % 5);
      if (choice == 0) {
        layout.placements.push_back(Placement::Replicate());
        replicas *= layout.mesh_shape.back();
      } else if (choice == 4) {
        layout.placements.push_back(Placement::StridedShard(static_cast<int>(rng() % rank),
                                                            static_cast<int>(1 + rng() % 3)));
      } else {
        layout.placements.push_back(Placement::Shard(static_cast<int>(rng() % rank)));
      }
    }
    const int64_t volume = ShapeVolume(layout.mesh_shape);
    std::map<std::vector<int64_t>, int64_t> coverage;
    bool all_ok = true;
    for (int64_t r = 0; r < volume; ++r) {
      const auto coordinate = UnravelMeshIndex(layout.mesh_shape, r);
      const auto expected = ReferenceChunk(shape, layout, coordinate);
      auto got = MeshChunk(shape, layout, coordinate);
      if (!expected.has_value()) {
        ASSERT_FALSE(got.ok());
        EXPECT_NE(got.status().message().find("tensor dim"), std::string::npos);
        all_ok = false;
        continue;
      }
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(*got, *expected);
      ASSERT_TRUE(WithinShape(*got, shape));
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
    bool strided = false;
    for (const Placement& p : layout.placements) strided |= p.kind == Kind::kStridedShard;
    if (strided) (all_ok ? strided_ok : strided_errors)++;
    if (!all_ok) continue;
    // Every element is held by exactly `replicas` ranks (once per replica group).
    EXPECT_EQ(static_cast<int64_t>(coverage.size()), ShapeVolume(shape));
    for (const auto& [point, count] : coverage) ASSERT_EQ(count, replicas);
  }
  EXPECT_GT(strided_ok, 0);
  EXPECT_GT(strided_errors, 0);
}

}  // namespace
}  // namespace sp
