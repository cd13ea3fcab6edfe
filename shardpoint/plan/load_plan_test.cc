#include "shardpoint/plan/load_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shardpoint/plan/plan_test_util.h"

namespace sp {
namespace {

using ::sp::testing::Tensor;
using ::testing::ElementsAre;

// Metadata of a 10 x 4 float32 "w" saved by 4 ranks with Shard(0): rows 3, 3, 3, 1.
CheckpointMetadata RowShardedCheckpoint() {
  std::vector<LocalSavePlan> locals(4);
  const int64_t rows[4][2] = {{0, 3}, {3, 3}, {6, 3}, {9, 1}};
  for (int r = 0; r < 4; ++r) {
    locals[r].tensors = {
        Tensor("w", DType::kFloat32, {10, 4}, {Box({rows[r][0], 0}, {rows[r][1], 4})})};
  }
  locals[0].tensors.push_back(Tensor("b", DType::kFloat32, {4}, {Box({0}, {4})}));
  locals[1].tensors.push_back(Tensor("a", DType::kInt64, {}, {Box({}, {})}));
  SavePlanOptions options;
  options.save_id = "x";
  Result<GlobalSavePlan> plan = PlanSave(locals, options);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan->metadata;
}

struct Row {  // one row of the worked example table, relative offsets as DCP states them
  std::vector<int64_t> storage_offsets, dest_offsets, lengths;
  bool operator==(const Row&) const = default;
};

Row ToRow(const ReadItem& item, const Box& target_box, const Box& stored_box) {
  return Row{Shape(RelativeTo(item.region, stored_box).offsets),
             Shape(RelativeTo(item.region, target_box).offsets), Shape(item.region.sizes)};
}

TEST(LoadPlanTest, WorkedReshardingExampleFromTheDcpReference) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  const TensorMetadata* w = md.FindTensor("w");
  const int64_t local_rows[3][2] = {{0, 4}, {4, 4}, {8, 2}};
  const std::vector<std::vector<Row>> expected = {
      {{{0, 0}, {0, 0}, {3, 4}}, {{0, 0}, {3, 0}, {1, 4}}},
      {{{1, 0}, {0, 0}, {2, 4}}, {{0, 0}, {2, 0}, {2, 4}}},
      {{{2, 0}, {0, 0}, {1, 4}}, {{0, 0}, {1, 0}, {1, 4}}}};
  const std::vector<std::vector<uint32_t>> expected_chunks = {{0, 1}, {1, 2}, {2, 3}};
  LoadPlanOptions options;
  options.strict = true;
  for (int r = 0; r < 3; ++r) {
    const Box local({local_rows[r][0], 0}, {local_rows[r][1], 4});
    std::vector<LocalTensor> targets = {Tensor("w", DType::kFloat32, {10, 4}, {local})};
    Result<LoadPlan> plan = PlanLoad(targets, md, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->items.size(), 2u);
    std::vector<Row> rows;
    std::vector<uint32_t> chunks;
    for (const ReadItem& item : plan->items) {
      EXPECT_EQ(item.target, 0u);
      EXPECT_EQ(item.target_box, 0u);
      rows.push_back(ToRow(item, local, w->chunks[item.stored_chunk].box));
      chunks.push_back(item.stored_chunk);
    }
    EXPECT_EQ(rows, expected[r]) << "local chunk L" << r;
    EXPECT_EQ(chunks, expected_chunks[r]);
    EXPECT_THAT(plan->unexpected_keys, ElementsAre("a", "b"));
    EXPECT_TRUE(plan->missing_keys.empty());
    EXPECT_EQ(plan->stored[0], w);
  }
}

TEST(LoadPlanTest, SavePlansCarryGridsAndAStaleGridIsNotTrusted) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  const TensorMetadata& w = *md.FindTensor("w");
  ASSERT_TRUE(w.grid.has_value());  // proved by PlanSave
  const std::vector<LocalTensor> targets = {
      Tensor("w", DType::kFloat32, {10, 4}, {Box({2, 1}, {6, 2}), Box({9, 0}, {1, 4})})};
  Result<LoadPlan> with_grid = PlanLoad(targets, md, LoadPlanOptions{});
  Result<LoadPlan> swept = PlanLoad(targets, md, LoadPlanOptions{.chunk_grids = false});
  ASSERT_TRUE(with_grid.ok() && swept.ok());
  EXPECT_EQ(with_grid->items, swept->items);
  // The chunks change under the grid the tensor carries (rows 0:3 and 3:6 swap places): the
  // plan follows the chunks, not the grid.
  CheckpointMetadata changed = md;
  TensorMetadata& t = changed.tensors[std::distance(md.tensors.data(), &w)];
  std::swap(t.chunks[0], t.chunks[1]);
  ASSERT_TRUE(t.grid.has_value());
  Result<LoadPlan> stale = PlanLoad(targets, changed, LoadPlanOptions{});
  Result<LoadPlan> fresh = PlanLoad(targets, changed, LoadPlanOptions{.chunk_grids = false});
  ASSERT_TRUE(stale.ok() && fresh.ok());
  EXPECT_EQ(stale->items, fresh->items);
  EXPECT_NE(stale->items, with_grid->items);
  // A grid of another shape is not used at all.
  t.grid->bounds[0].back() = 11;
  Result<LoadPlan> misfit = PlanLoad(targets, changed, LoadPlanOptions{});
  ASSERT_TRUE(misfit.ok());
  EXPECT_EQ(misfit->items, fresh->items);
}

TEST(LoadPlanTest, ItemsAreSortedByFileOffsetAndRegion) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  std::vector<LocalTensor> targets;
  for (auto [offset, rows] : {std::pair{8, 2}, std::pair{4, 4}, std::pair{0, 4}}) {
    targets.push_back(Tensor("w", DType::kFloat32, {10, 4}, {Box({offset, 0}, {rows, 4})}));
  }
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::pair<uint32_t, Box>> got;
  for (const ReadItem& item : plan->items) got.emplace_back(item.target, item.region);
  const std::vector<std::pair<uint32_t, Box>> expected = {
      {2, Box({0, 0}, {3, 4})}, {2, Box({3, 0}, {1, 4})}, {1, Box({4, 0}, {2, 4})},
      {1, Box({6, 0}, {2, 4})}, {0, Box({8, 0}, {1, 4})}, {0, Box({9, 0}, {1, 4})}};
  EXPECT_EQ(got, expected);
}

TEST(LoadPlanTest, ColumnShardedSaveLoadedRowShardedNarrowsBothDims) {
  std::vector<LocalSavePlan> locals(2);
  locals[0].tensors = {Tensor("w", DType::kFloat16, {4, 6}, {Box({0, 0}, {4, 3})})};
  locals[1].tensors = {Tensor("w", DType::kFloat16, {4, 6}, {Box({0, 3}, {4, 3})})};
  Result<GlobalSavePlan> saved = PlanSave(locals, SavePlanOptions{});
  ASSERT_TRUE(saved.ok()) << saved.status();
  std::vector<LocalTensor> targets = {Tensor("w", DType::kFloat16, {4, 6}, {Box({1, 0}, {2, 6})})};
  Result<LoadPlan> plan = PlanLoad(targets, saved->metadata, LoadPlanOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->items.size(), 2u);
  EXPECT_EQ(plan->items[0].region, Box({1, 0}, {2, 3}));
  EXPECT_EQ(plan->items[0].stored_chunk, 0u);
  EXPECT_EQ(plan->items[1].region, Box({1, 3}, {2, 3}));
  EXPECT_EQ(plan->items[1].stored_chunk, 1u);
}

TEST(LoadPlanTest, ScalarsEmptyBoxesAndSeveralBoxesPerTarget) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  std::vector<LocalTensor> targets = {
      Tensor("a", DType::kInt64, {}, {Box({}, {})}),
      Tensor("w", DType::kFloat32, {10, 4}, {Box({5, 0}, {0, 4}), Box({9, 2}, {1, 2})})};
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->items.size(), 2u);
  EXPECT_EQ(plan->items[0].target, 0u);  // "a" lives in rank 1's file, w's rows 9:10 in rank 3's
  EXPECT_EQ(plan->items[0].region, Box({}, {}));
  EXPECT_EQ(plan->items[1].target, 1u);
  EXPECT_EQ(plan->items[1].target_box, 1u);
  EXPECT_EQ(plan->items[1].stored_chunk, 3u);
  EXPECT_EQ(plan->items[1].region, Box({9, 2}, {1, 2}));
  EXPECT_THAT(plan->unexpected_keys, ElementsAre("b"));
}

TEST(LoadPlanTest, MissingKeysStrictAndNonStrict) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  std::vector<LocalTensor> targets = {Tensor("b", DType::kFloat32, {4}, {Box({0}, {4})}),
                                      Tensor("nope", DType::kFloat32, {4}, {Box({0}, {4})})};
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(plan.status().message(), "1 key is missing from the checkpoint: 'nope'");
  plan = PlanLoad(targets, md, LoadPlanOptions{.strict = false});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_THAT(plan->missing_keys, ElementsAre("nope"));
  EXPECT_EQ(plan->stored[1], nullptr);
  EXPECT_EQ(plan->stored[0], md.FindTensor("b"));
  EXPECT_THAT(plan->unexpected_keys, ElementsAre("a", "w"));
  ASSERT_EQ(plan->items.size(), 1u);
  EXPECT_EQ(plan->items[0].target, 0u);
}

TEST(LoadPlanTest, ManyMissingKeysAreListedUpToTen) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  std::vector<LocalTensor> targets;
  for (int i = 0; i < 13; ++i)
    targets.push_back(Tensor("k" + std::to_string(i), DType::kBool, {}, {}));
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().message(),
            "13 keys are missing from the checkpoint: 'k0', 'k1', 'k2', 'k3', 'k4', 'k5', 'k6', "
            "'k7', 'k8', 'k9' and 3 more");
}

TEST(LoadPlanTest, ShapeAndDtypeMismatches) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  std::vector<LocalTensor> targets = {Tensor("w", DType::kFloat32, {10, 5}, {})};
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message(),
            "tensor 'w': checkpoint has shape [10, 4], destination has [10, 5]");
  targets = {Tensor("w", DType::kBFloat16, {10, 4}, {Box({0, 0}, {10, 4})})};
  plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message(),
            "tensor 'w': checkpoint has dtype float32, destination has bfloat16; pass cast=True "
            "to convert");
  plan = PlanLoad(targets, md, LoadPlanOptions{.allow_cast = true});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->items.size(), 4u);
}

TEST(LoadPlanTest, TargetBoxOutsideShape) {
  const CheckpointMetadata md = RowShardedCheckpoint();
  std::vector<LocalTensor> targets = {Tensor("w", DType::kFloat32, {10, 4}, {Box({8, 0}, {4, 4})})};
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(plan.status().message(),
            "tensor 'w': destination box [8:12, 0:4] is not within shape [10, 4]");
  targets[0].boxes = {Box({0, 0}, {1})};
  plan = PlanLoad(targets, md, LoadPlanOptions{});
  EXPECT_EQ(plan.status().message(),
            "tensor 'w': destination box with 2 offsets and 1 sizes is not within shape [10, 4]");
}

TEST(LoadPlanTest, HoleInTheCheckpointIsDataLoss) {
  CheckpointMetadata md = RowShardedCheckpoint();
  TensorMetadata& w = md.tensors[md.FindTensor("w") - md.tensors.data()];
  w.chunks.mut().erase(w.chunks.mut().begin() + 1);  // rows 3:6 lost
  std::vector<LocalTensor> targets = {
      Tensor("w", DType::kFloat32, {10, 4}, {Box({0, 0}, {4, 4}), Box({6, 0}, {4, 4})})};
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(plan.status().message(),
            "tensor 'w': the checkpoint's chunks cover 12 of the 16 elements of destination box "
            "[0:4, 0:4]; 4 elements are missing");
  targets[0].boxes.erase(targets[0].boxes.begin());
  EXPECT_TRUE(PlanLoad(targets, md, LoadPlanOptions{}).ok());  // rows 6:10 are intact
}

TEST(LoadPlanTest, OverlappingOrMalformedStoredChunksAreDataLoss) {
  CheckpointMetadata md = RowShardedCheckpoint();
  TensorMetadata& w = md.tensors[md.FindTensor("w") - md.tensors.data()];
  w.chunks[1].box = Box({2, 0}, {4, 4});
  std::vector<LocalTensor> targets = {
      Tensor("w", DType::kFloat32, {10, 4}, {Box({0, 0}, {10, 4})})};
  Result<LoadPlan> plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(plan.status().message(),
            "tensor 'w': stored chunks [0:3, 0:4] and [2:6, 0:4] overlap inside destination box "
            "[0:10, 0:4]; the checkpoint metadata is inconsistent");
  w.chunks[1].box = Box({3, 0}, {3});
  plan = PlanLoad(targets, md, LoadPlanOptions{});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(plan.status().message(),
            "tensor 'w': stored chunk 1 is not a box within shape [10, 4]; the checkpoint "
            "metadata is corrupt");
}

}  // namespace
}  // namespace sp
