#include "shardpoint/plan/save_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/plan/plan_test_util.h"

namespace sp {
namespace {

using ::sp::testing::Tensor;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

SavePlanOptions Options(int files_per_rank = 1, bool lowest = false) {
  SavePlanOptions options;
  options.save_id = "s7";
  options.files_per_rank = files_per_rank;
  options.dedup_to_lowest_rank = lowest;
  return options;
}

// A uint8 tensor of `bytes` elements held whole, so its size in bytes is `bytes`.
LocalTensor Replicated(std::string name, int64_t bytes) {
  return Tensor(std::move(name), DType::kUInt8, {bytes}, {Box({0}, {bytes})});
}

// The rank that writes chunk `c` of tensor `name`.
int32_t Writer(const GlobalSavePlan& plan, std::string_view name, size_t c = 0) {
  const TensorMetadata* t = plan.metadata.FindTensor(name);
  return plan.metadata.files[t->chunks[c].file].writer_rank;
}

Status PlanError(const std::vector<LocalSavePlan>& locals, SavePlanOptions options = Options()) {
  Result<GlobalSavePlan> plan = PlanSave(locals, options);
  EXPECT_FALSE(plan.ok());
  return plan.status();
}

// 10 x 4 float32 "w" saved by 4 ranks with Shard(0): rows 3, 3, 3, 1 (torch.chunk).
constexpr int64_t kRows[4][2] = {{0, 3}, {3, 3}, {6, 3}, {9, 1}};
std::vector<LocalSavePlan> RowShardedLocals() {
  std::vector<LocalSavePlan> locals(4);
  for (int r = 0; r < 4; ++r) {
    locals[r].tensors.push_back(
        Tensor("w", DType::kFloat32, {10, 4}, {Box({kRows[r][0], 0}, {kRows[r][1], 4})}));
  }
  return locals;
}

TEST(SavePlanTest, RowShardedTensorOneChunkPerRank) {
  const std::vector<LocalSavePlan> locals = RowShardedLocals();
  const auto& rows = kRows;
  Result<GlobalSavePlan> plan = PlanSave(locals, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const CheckpointMetadata& md = plan->metadata;
  EXPECT_EQ(md.save_id, "s7");
  EXPECT_EQ(md.world_size, 4);
  EXPECT_EQ(md.checksum_block_bytes, kDefaultChecksumBlockBytes);
  ASSERT_EQ(md.files.size(), 4u);
  for (const DataFile& f : md.files) EXPECT_EQ(f.name, "");  // the format's writer names them
  ASSERT_EQ(md.tensors.size(), 1u);
  ASSERT_EQ(md.tensors[0].chunks.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    const StoredChunk& chunk = md.tensors[0].chunks[r];
    EXPECT_EQ(chunk.box, Box({rows[r][0], 0}, {rows[r][1], 4}));
    EXPECT_EQ(chunk.file, static_cast<uint32_t>(r));
    EXPECT_EQ(chunk.data_offset, 0u);
    EXPECT_EQ(chunk.byte_length, static_cast<uint64_t>(rows[r][1] * 4 * 4));
    EXPECT_TRUE(chunk.block_crc32c.empty());
    EXPECT_EQ(md.files[r].writer_rank, r);
    EXPECT_EQ(md.files[r].data_start, 0u);
    EXPECT_EQ(md.files[r].size, 0u);
    ASSERT_EQ(plan->ranks[r].writes.size(), 1u);
    EXPECT_EQ(plan->ranks[r].writes[0],
              (ChunkWrite{0, 0, static_cast<uint32_t>(r), 0, static_cast<uint32_t>(r), 0,
                          chunk.byte_length}));
    EXPECT_THAT(plan->ranks[r].files, ElementsAre(static_cast<uint32_t>(r)));
  }
}

TEST(SavePlanTest, GridCellsAndDeferredWritesHoldTheSamePlanAndAreTakenOnce) {
  // The row-sharded tensor above, and a tensor two ranks hold in uneven pieces (not a grid).
  std::vector<LocalSavePlan> locals = RowShardedLocals();
  locals[0].tensors.push_back(Tensor("v", DType::kInt8, {4, 4}, {Box({0, 0}, {1, 4})}));
  locals[1].tensors.push_back(
      Tensor("v", DType::kInt8, {4, 4}, {Box({1, 0}, {3, 2}), Box({1, 2}, {3, 2})}));
  const Result<GlobalSavePlan> expected = PlanSave(locals, Options());
  ASSERT_TRUE(expected.ok()) << expected.status();
  SavePlanOptions options = Options();
  options.chunk_cells = true;
  options.defer_writes = true;
  Result<GlobalSavePlan> plan = PlanSave(locals, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const TensorMetadata& v = plan->metadata.tensors[0];
  const TensorMetadata& w = plan->metadata.tensors[1];
  ASSERT_TRUE(v.cells.has_value());  // three chunks that are no grid: their boxes listed
  EXPECT_EQ(v.cells->boxes, (std::vector<int64_t>{0, 0, 1, 4, 1, 0, 3, 2, 1, 2, 3, 2}));
  EXPECT_EQ(ChunkBox(v, 2), Box({1, 2}, {3, 2}));
  TensorMetadata v_listed = v;
  ExpandChunkCells(&v_listed);
  EXPECT_EQ(v_listed.chunks, expected->metadata.tensors[0].chunks);
  ASSERT_TRUE(w.cells.has_value());  // four rows: a grid, its cells' boxes the grid's
  EXPECT_TRUE(w.cells->boxes.empty());
  EXPECT_TRUE(w.chunks.empty());
  EXPECT_EQ(w.cells->files, (std::vector<uint32_t>{0, 1, 2, 3}));
  // After v's chunks in the files of ranks 0 (4 bytes) and 1 (12).
  EXPECT_EQ(w.cells->data_offsets, (std::vector<uint64_t>{4, 12, 0, 0}));
  EXPECT_EQ(ChunkBox(w, 3), Box({9, 0}, {1, 4}));
  // No rank holds a write until it is taken; then each has exactly its planned writes, once.
  for (const RankSavePlan& r : plan->ranks) EXPECT_TRUE(r.writes.empty());
  EXPECT_EQ(plan->deferred_counts, (std::vector<uint32_t>{2, 3, 1, 1}));
  // Rounds of at least 4 writes: ranks 0 and 1 (5 writes), then 2 and 3 (2, the last ones); a
  // round of at least 1 write ends after rank 0, and one of 0 still takes a rank.
  EXPECT_EQ(DeferredRoundEnd(*plan, 0, 4), 2u);
  EXPECT_EQ(DeferredRoundEnd(*plan, 2, 4), 4u);
  EXPECT_EQ(DeferredRoundEnd(*plan, 0, 1), 1u);
  EXPECT_EQ(DeferredRoundEnd(*plan, 1, 0), 2u);
  // w is at the same place of every rank's list: one local tensor and box for its chunks; v's
  // chunks come from boxes 0 and 1 of rank 1's second tensor.
  ASSERT_EQ(plan->deferred.size(), 2u);
  EXPECT_EQ(plan->deferred[0].locals,
            (std::vector<GlobalSavePlan::LocalBox>{{1, 0}, {1, 0}, {1, 1}}));
  EXPECT_TRUE(plan->deferred[1].locals.empty());
  EXPECT_EQ(plan->deferred[1].local, (GlobalSavePlan::LocalBox{0, 0}));
  ASSERT_TRUE(TakeDeferredWrites(&*plan, 1, 3).ok());
  EXPECT_TRUE(plan->ranks[0].writes.empty());
  EXPECT_EQ(plan->ranks[1], expected->ranks[1]);
  EXPECT_EQ(plan->ranks[2], expected->ranks[2]);
  // Rank 1 writes v's chunks 1 and 2 (its boxes 0 and 1, 6 bytes each), then its rows of w.
  ASSERT_EQ(plan->ranks[1].writes.size(), 3u);
  EXPECT_EQ(plan->ranks[1].writes[1], (ChunkWrite{1, 1, 1, 0, 2, 6, 6}));
  EXPECT_EQ(plan->ranks[1].writes[2], (ChunkWrite{0, 0, 1, 1, 1, 12, 48}));
  const Status twice = TakeDeferredWrites(&*plan, 2, 4);
  EXPECT_EQ(twice.code(), StatusCode::kInternal);
  EXPECT_THAT(twice.message(), HasSubstr("rank 2 already holds its writes"));
  ASSERT_TRUE(TakeDeferredWrites(&*plan, 0, 1).ok());
  ASSERT_TRUE(TakeDeferredWrites(&*plan, 3, 9).ok());  // past the last rank: to it
  EXPECT_EQ(plan->ranks, expected->ranks);
  DropDeferredWrites(&*plan);
  EXPECT_TRUE(plan->deferred.empty());
  EXPECT_TRUE(TakeDeferredWrites(&*plan, 0, 4).ok());  // nothing deferred: nothing to do
  EXPECT_EQ(DeferredRoundEnd(*plan, 1, 4), 4u);          // and one round of every rank
  // Two files a rank lay out rank by rank: nothing is deferred.
  options.files_per_rank = 2;
  Result<GlobalSavePlan> two = PlanSave(locals, options);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_TRUE(two->deferred.empty());
  EXPECT_EQ(two->ranks[1].writes.size(), 3u);
}

TEST(SavePlanTest, ReplicasAreBalancedByBytesLargestFirst) {
  // Every rank holds all four tensors. Largest first to the lightest holder:
  // a(100) -> r0, b(60) -> r1, c(50) -> r1 (60 < 100), d(40) -> r0 (100 < 110).
  std::vector<LocalSavePlan> locals(2);
  for (auto& local : locals) {
    local.tensors = {Replicated("d", 40), Replicated("c", 50), Replicated("a", 100),
                     Replicated("b", 60)};
  }
  Result<GlobalSavePlan> plan = PlanSave(locals, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Writer(*plan, "a"), 0);
  EXPECT_EQ(Writer(*plan, "b"), 1);
  EXPECT_EQ(Writer(*plan, "c"), 1);
  EXPECT_EQ(Writer(*plan, "d"), 0);
  // Local indices point into each rank's own tensor order.
  ASSERT_EQ(plan->ranks[0].writes.size(), 2u);
  EXPECT_EQ(plan->ranks[0].writes[0].local_tensor, 2u);  // a, first in (name, box) order
  EXPECT_EQ(plan->ranks[0].writes[1].local_tensor, 0u);  // d
  EXPECT_EQ(plan->ranks[0].writes[1].data_offset, 100u);
}

TEST(SavePlanTest, EqualReplicasSpreadOverAllHolders) {
  std::vector<LocalSavePlan> locals(4);
  for (auto& local : locals) {
    for (char c = 'a'; c < 'a' + 8; ++c) local.tensors.push_back(Replicated(std::string(1, c), 64));
  }
  Result<GlobalSavePlan> plan = PlanSave(locals, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(plan->ranks[r].writes.size(), 2u) << "rank " << r;
  EXPECT_EQ(Writer(*plan, "a"), 0);
  EXPECT_EQ(Writer(*plan, "b"), 1);
  EXPECT_EQ(Writer(*plan, "e"), 0);
}

TEST(SavePlanTest, SoleHoldersAreCountedBeforeReplicas) {
  // Rank 0 alone holds 1,000 bytes of "big"; the replicated "small" goes to rank 1.
  std::vector<LocalSavePlan> locals(2);
  locals[0].tensors = {Replicated("big", 1000), Replicated("small", 10)};
  locals[1].tensors = {Replicated("small", 10)};
  Result<GlobalSavePlan> plan = PlanSave(locals, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Writer(*plan, "big"), 0);
  EXPECT_EQ(Writer(*plan, "small"), 1);
  // With dedup_to_lowest_rank the lowest holder always writes.
  plan = PlanSave(locals, Options(1, /*lowest=*/true));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Writer(*plan, "small"), 0);
  EXPECT_TRUE(plan->ranks[1].files.empty());
  EXPECT_EQ(plan->metadata.files.size(), 1u);
}

TEST(SavePlanTest, FilesAreBinPackedLargestFirstIntoTheLightest) {
  // Sizes 100, 60, 50, 5: 100 -> f0, 60 -> f1, 50 -> f1 (60 < 100), 5 -> f0 (100 < 110).
  std::vector<LocalSavePlan> locals(1);
  locals[0].tensors = {Replicated("p", 60), Replicated("q", 100), Replicated("r", 50),
                       Replicated("s", 5)};
  Result<GlobalSavePlan> plan = PlanSave(locals, Options(2));
  ASSERT_TRUE(plan.ok()) << plan.status();
  const CheckpointMetadata& md = plan->metadata;
  ASSERT_EQ(md.files.size(), 2u);
  EXPECT_EQ(md.files[0].writer_rank, 0);
  EXPECT_EQ(md.files[1].writer_rank, 0);
  auto where = [&](std::string_view name) {
    const StoredChunk& c = md.FindTensor(name)->chunks[0];
    return std::make_pair(c.file, c.data_offset);
  };
  EXPECT_EQ(where("q"), std::make_pair(0u, uint64_t{0}));  // f0: q(100) then s(5)
  EXPECT_EQ(where("s"), std::make_pair(0u, uint64_t{100}));
  EXPECT_EQ(where("p"), std::make_pair(1u, uint64_t{0}));  // f1: p(60), r(50) by name
  EXPECT_EQ(where("r"), std::make_pair(1u, uint64_t{60}));
  const auto& writes = plan->ranks[0].writes;
  ASSERT_EQ(writes.size(), 4u);
  EXPECT_EQ(writes[0].tensor, md.FindTensor("q") - md.tensors.data());
  EXPECT_EQ(writes[1].data_offset, 100u);
  EXPECT_EQ(writes[2].file, 1u);
  EXPECT_EQ(writes[3].data_offset, 60u);
}

TEST(SavePlanTest, NeverCreatesEmptyFiles) {
  std::vector<LocalSavePlan> locals(3);
  locals[0].tensors = {Replicated("a", 8), Replicated("b", 8)};
  locals[2].tensors = {Tensor("c", DType::kInt64, {2, 2}, {Box({0, 0}, {2, 2})})};
  Result<GlobalSavePlan> plan = PlanSave(locals, Options(8));
  ASSERT_TRUE(plan.ok()) << plan.status();
  const CheckpointMetadata& md = plan->metadata;
  ASSERT_EQ(md.files.size(), 3u);
  EXPECT_EQ(md.files[0].writer_rank, 0);
  EXPECT_EQ(md.files[1].writer_rank, 0);
  EXPECT_EQ(md.files[2].writer_rank, 2);
  EXPECT_TRUE(plan->ranks[1].files.empty());
  EXPECT_TRUE(plan->ranks[1].writes.empty());
  EXPECT_THAT(plan->ranks[2].files, ElementsAre(2u));
}

TEST(SavePlanTest, ChunksAreSortedByBoxAndEmptyBoxesDropped) {
  std::vector<LocalSavePlan> locals(2);
  locals[0].tensors = {Tensor("w", DType::kBFloat16, {4, 6},
                              {Box({2, 3}, {2, 3}), Box({0, 0}, {0, 6}), Box({0, 3}, {2, 3})})};
  locals[1].tensors = {Tensor("w", DType::kBFloat16, {4, 6},
                              {Box({2, 0}, {2, 3}), Box({0, 0}, {2, 3}), Box({4, 6}, {0, 0})})};
  Result<GlobalSavePlan> plan = PlanSave(locals, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto& chunks = plan->metadata.tensors[0].chunks;
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].box, Box({0, 0}, {2, 3}));
  EXPECT_EQ(chunks[1].box, Box({0, 3}, {2, 3}));
  EXPECT_EQ(chunks[2].box, Box({2, 0}, {2, 3}));
  EXPECT_EQ(chunks[3].box, Box({2, 3}, {2, 3}));
  EXPECT_EQ(chunks[0].byte_length, 12u);
  // Rank 0 writes its local boxes 2 then 0 (box order), rank 1 its boxes 1 then 0.
  ASSERT_EQ(plan->ranks[0].writes.size(), 2u);
  EXPECT_EQ(plan->ranks[0].writes[0].local_box, 2u);
  EXPECT_EQ(plan->ranks[0].writes[1].local_box, 0u);
  EXPECT_EQ(plan->ranks[0].writes[1].data_offset, 12u);
  EXPECT_EQ(plan->ranks[1].writes[0].local_box, 1u);
}

TEST(SavePlanTest, ScalarsAndZeroSizedTensors) {
  std::vector<LocalSavePlan> locals(3);
  for (auto& local : locals) {
    local.tensors = {Tensor("step", DType::kInt64, {}, {Box({}, {})}),
                     Tensor("nothing", DType::kFloat32, {0, 4}, {Box({0, 0}, {0, 4})})};
  }
  Result<GlobalSavePlan> plan = PlanSave(locals, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const TensorMetadata* step = plan->metadata.FindTensor("step");
  ASSERT_EQ(step->chunks.size(), 1u);
  EXPECT_EQ(step->chunks[0].box, Box({}, {}));
  EXPECT_EQ(step->chunks[0].byte_length, 8u);
  EXPECT_EQ(Writer(*plan, "step"), 0);
  const TensorMetadata* nothing = plan->metadata.FindTensor("nothing");
  ASSERT_NE(nothing, nullptr);
  EXPECT_TRUE(nothing->chunks.empty());
  EXPECT_EQ(plan->metadata.files.size(), 1u);
}

TEST(SavePlanTest, ObjectsKeepTheLowestRanksCopySortedByName) {
  std::vector<LocalSavePlan> locals(3);
  locals[2].objects = {{"lr", ObjectEncoding::kJson, "0.2"}, {"b", ObjectEncoding::kBytes, "x"}};
  locals[1].objects = {{"lr", ObjectEncoding::kJson, "0.1"}};
  locals[0].objects = {{"z", ObjectEncoding::kPickle, "p"}};
  Result<GlobalSavePlan> plan = PlanSave(locals, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  const auto& objects = plan->metadata.objects;
  ASSERT_EQ(objects.size(), 3u);
  EXPECT_EQ(objects[0].name, "b");
  EXPECT_EQ(objects[1].name, "lr");
  EXPECT_EQ(objects[1].payload, "0.1");
  EXPECT_EQ(objects[2].encoding, ObjectEncoding::kPickle);
  EXPECT_TRUE(plan->metadata.files.empty());
}

TEST(SavePlanTest, PlanDependsOnlyOnWhatIsHeld) {
  std::vector<LocalSavePlan> a(3), b(3);
  for (int r = 0; r < 3; ++r) {
    a[r].tensors = {Replicated("x", 30), Replicated("y", 30), Replicated("z", 30)};
    b[r].tensors = {Replicated("z", 30), Replicated("x", 30), Replicated("y", 30)};
  }
  Result<GlobalSavePlan> pa = PlanSave(a, Options()), pb = PlanSave(b, Options());
  ASSERT_TRUE(pa.ok() && pb.ok());
  for (std::string_view name : {"x", "y", "z"}) EXPECT_EQ(Writer(*pa, name), Writer(*pb, name));
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(pa->ranks[r].writes.size(), 1u);
    EXPECT_EQ(pa->ranks[r].writes[0].tensor, pb->ranks[r].writes[0].tensor);
  }
}

TEST(SavePlanTest, MismatchedShapeOrDtypeNamesBothRanks) {
  std::vector<LocalSavePlan> locals(4);
  locals[0].tensors = {Tensor("w", DType::kFloat32, {4, 8}, {Box({0, 0}, {4, 8})})};
  locals[3].tensors = {Tensor("w", DType::kFloat32, {4, 9}, {Box({0, 0}, {4, 9})})};
  Status s = PlanError(locals);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "tensor 'w': rank 0 has shape [4, 8] but rank 3 has [4, 9]");
  locals[3].tensors = {Tensor("w", DType::kBFloat16, {4, 8}, {})};
  s = PlanError(locals);
  EXPECT_EQ(s.message(), "tensor 'w': rank 0 has dtype float32 but rank 3 has bfloat16");
}

TEST(SavePlanTest, BoxOutsideShapeIsRejected) {
  std::vector<LocalSavePlan> locals(3);
  locals[2].tensors = {Tensor("w", DType::kFloat32, {4, 8}, {Box({0, 8}, {4, 8})})};
  Status s = PlanError(locals);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "tensor 'w': rank 2 holds box [0:4, 8:16], which is not within shape [4, 8]");
  locals[2].tensors = {Tensor("w", DType::kFloat32, {4, 8}, {Box({0}, {4})})};
  EXPECT_EQ(PlanError(locals).message(),
            "tensor 'w': rank 2 holds box [0:4], which is not within shape [4, 8]");
  locals[2].tensors = {Tensor("w", DType::kFloat32, {4, 8}, {Box({0, 0}, {4})})};
  EXPECT_EQ(PlanError(locals).message(),
            "tensor 'w': rank 2 holds a box with 2 offsets and 1 sizes");
}

TEST(SavePlanTest, InvalidShapesAreRejected) {
  std::vector<LocalSavePlan> locals(1);
  locals[0].tensors = {Tensor("w", DType::kFloat32, {4, -1}, {})};
  EXPECT_EQ(PlanError(locals).message(),
            "tensor 'w': rank 0 has invalid shape [4, -1] (negative dimension)");
  locals[0].tensors = {Tensor("w", DType::kFloat64, {int64_t{1} << 31, int64_t{1} << 30}, {})};
  EXPECT_EQ(PlanError(locals).message(),
            "tensor 'w': rank 0 has shape [2147483648, 1073741824], whose byte size overflows");
}

TEST(SavePlanTest, DuplicateNamesAreRejected) {
  std::vector<LocalSavePlan> locals(2);
  locals[1].tensors = {Replicated("w", 4), Replicated("w", 4)};
  EXPECT_EQ(PlanError(locals).message(), "tensor 'w': rank 1 lists it twice");
  locals[1].tensors.clear();
  locals[1].objects = {{"o", ObjectEncoding::kJson, "1"}, {"o", ObjectEncoding::kJson, "2"}};
  EXPECT_EQ(PlanError(locals).message(), "object 'o': rank 1 lists it twice");
  locals[0].tensors = {Replicated("o", 4)};
  locals[1].objects.pop_back();
  Status s = PlanError(locals);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "name 'o' is a tensor on rank 0 and an object on rank 1");
}

TEST(SavePlanTest, OverlappingChunksNameBoxesAndHolders) {
  std::vector<LocalSavePlan> locals(3);
  locals[0].tensors = {Tensor("w", DType::kFloat32, {6, 8}, {Box({0, 0}, {4, 8})})};
  locals[1].tensors = {Tensor("w", DType::kFloat32, {6, 8}, {Box({2, 0}, {4, 8})})};
  locals[2].tensors = {Tensor("w", DType::kFloat32, {6, 8}, {Box({2, 0}, {4, 8})})};
  Status s = PlanError(locals);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      s.message(),
      "tensor 'w': chunk [0:4, 0:8] held by rank 0 overlaps chunk [2:6, 0:8] held by ranks 1, 2");
}

TEST(SavePlanTest, UncoveredElementsAreCountedAndOneIsShown) {
  std::vector<LocalSavePlan> locals(4);
  for (int r = 0; r < 4; ++r) {
    if (r == 2) continue;  // the shard of rank 2 is missing
    locals[r].tensors = {Tensor("w", DType::kFloat32, {8, 4}, {Box({2 * r, 0}, {2, 4})})};
  }
  Status s = PlanError(locals);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "tensor 'w' of shape [8, 4]: no rank holds 8 of its 32 elements (for example the "
            "element at (4, 0))");
  for (auto& local : locals) local.tensors.clear();
  locals[1].tensors = {Tensor("w", DType::kFloat32, {8, 4}, {Box({0, 0}, {0, 4})})};
  EXPECT_EQ(PlanError(locals).message(),
            "tensor 'w' of shape [8, 4]: no rank holds 32 of its 32 elements (for example the "
            "element at (0, 0))");
}

TEST(SavePlanTest, OptionsAreValidated) {
  std::vector<LocalSavePlan> locals(1);
  EXPECT_EQ(PlanError(locals, Options(0)).message(),
            "save plan: files_per_rank must be at least 1, got 0");
  SavePlanOptions options = Options();
  options.checksum_block_bytes = 0;
  EXPECT_EQ(PlanError(locals, options).message(),
            "save plan: checksum_block_bytes must be positive, got 0");
}

TEST(SavePlanTest, NoRanksGiveAnEmptyPlan) {
  Result<GlobalSavePlan> plan = PlanSave({}, Options());
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->metadata.world_size, 0);
  EXPECT_TRUE(plan->ranks.empty());
}

// Megatron's separation_hint: every file holds only chunks of tensors under a separation prefix
// or only others.
TEST(SavePlanTest, SeparatedPrefixesGetFilesOfTheirOwn) {
  std::vector<LocalSavePlan> locals(2);
  for (int r = 0; r < 2; ++r) {
    for (const char* name : {"model.w", "optim.m", "optim.v", "sched.x"}) {
      locals[r].tensors.push_back(
          Tensor(name, DType::kFloat32, {4, 4}, {Box({2 * r, 0}, {2, 4})}));
    }
  }
  for (int files_per_rank : {1, 2, 3}) {
    SavePlanOptions options = Options(files_per_rank);
    options.separate_key_prefixes = {"optim.", "sched."};
    Result<GlobalSavePlan> plan = PlanSave(locals, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const CheckpointMetadata& md = plan->metadata;
    std::map<uint32_t, std::set<std::string>> groups_in_file;
    for (const TensorMetadata& t : md.tensors) {
      const std::string group = t.name.substr(0, t.name.find('.'));
      for (const StoredChunk& c : t.chunks) groups_in_file[c.file].insert(group);
    }
    ASSERT_EQ(groups_in_file.size(), md.files.size());
    for (const auto& [file, groups] : groups_in_file) {
      EXPECT_EQ(groups.size(), 1u) << md.files[file].name << " holds " << groups.size()
                                   << " groups (files_per_rank " << files_per_rank << ")";
    }
    // Per rank: model (1 chunk: 1 file), optim (2 chunks: min(files_per_rank, 2) files), sched
    // (1 file), numbered on from k = 0 with the others first: a rank's files are listed in the
    // order of k, rank 0's first.
    const size_t optim_files = std::min(files_per_rank, 2);
    EXPECT_EQ(md.files.size(), 2 * (2 + optim_files));
    EXPECT_EQ(md.files[0].writer_rank, 0);
    EXPECT_EQ(md.files[md.files.size() / 2 - 1].writer_rank, 0);  // k = 1 + optim_files
    EXPECT_EQ(md.files[md.files.size() / 2].writer_rank, 1);
    EXPECT_EQ(md.tensors[0].chunks[0].file, 0u);  // model.w of rank 0: k = 0
    // Every rank writes into its own files only, in file order.
    for (size_t r = 0; r < plan->ranks.size(); ++r) {
      for (const ChunkWrite& w : plan->ranks[r].writes) {
        EXPECT_EQ(md.files[w.file].writer_rank, static_cast<int32_t>(r));
      }
    }
  }
}

TEST(SavePlanTest, SeparationWithoutMatchesChangesNothing) {
  std::vector<LocalSavePlan> locals(2);
  for (int r = 0; r < 2; ++r) {
    locals[r].tensors.push_back(Tensor("w", DType::kFloat32, {4}, {Box({2 * r}, {2})}));
  }
  SavePlanOptions options = Options();
  Result<GlobalSavePlan> plain = PlanSave(locals, options);
  options.separate_key_prefixes = {"optim."};
  Result<GlobalSavePlan> separated = PlanSave(locals, options);
  ASSERT_TRUE(plain.ok() && separated.ok());
  EXPECT_EQ(separated->ranks, plain->ranks);
  ASSERT_EQ(separated->metadata.files.size(), 2u);
  EXPECT_EQ(separated->metadata.files[1].writer_rank, 1);
}

TEST(SavePlanTest, EmptySeparationPrefixIsRefused) {
  std::vector<LocalSavePlan> locals(1);
  locals[0].tensors.push_back(Tensor("w", DType::kFloat32, {4}, {Box({0}, {4})}));
  SavePlanOptions options = Options();
  options.separate_key_prefixes = {"optim.", ""};
  EXPECT_THAT(PlanError(locals, options).message(),
              HasSubstr("a separation prefix is empty (it would match every key)"));
}

// 12 ranks, 60 tensors of random layouts (row shards, replicas over pairs of ranks, whole on
// every rank, scalars, irregular bands), some under separation prefixes, several files per rank.
std::vector<LocalSavePlan> MixedLocals(std::mt19937_64& rng) {
  constexpr int kRanks = 12;
  std::vector<LocalSavePlan> locals(kRanks);
  for (int t = 0; t < 60; ++t) {
    const std::string name = std::string(t % 3 == 0 ? "optim." : t % 5 == 0 ? "ema." : "model.") +
                             "t" + std::to_string(t);
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 40), cols = 1 + rng() % 9;
    const DType dtype = rng() % 2 ? DType::kFloat32 : DType::kBFloat16;
    for (int r = 0; r < kRanks; ++r) {
      std::vector<Box> boxes;
      switch (t % 5) {
        case 0: {  // rows over every rank, torch.chunk style
          const int64_t step = (rows + kRanks - 1) / kRanks;
          const int64_t begin = std::min(rows, r * step);
          boxes.push_back(Box({begin, 0}, {std::min(rows, begin + step) - begin, cols}));
          break;
        }
        case 1: {  // rows over 6 pairs, each half held by both ranks of a pair
          const int64_t step = (rows + 5) / 6;
          const int64_t begin = std::min(rows, (r / 2) * step);
          boxes.push_back(Box({begin, 0}, {std::min(rows, begin + step) - begin, cols}));
          break;
        }
        case 2:  // whole on every rank
          boxes.push_back(Box({0, 0}, {rows, cols}));
          break;
        case 3:  // bands of rows on the first ranks, split at a column that varies by band
          if (r < 4 && rows >= 4) {
            const int64_t begin = rows * r / 4, end = rows * (r + 1) / 4;
            const int64_t cut = 1 + static_cast<int64_t>((r * 7 + t) % cols);
            if (cut < cols) {
              boxes.push_back(Box({begin, 0}, {end - begin, cut}));
              boxes.push_back(Box({begin, cut}, {end - begin, cols - cut}));
            } else {
              boxes.push_back(Box({begin, 0}, {end - begin, cols}));
            }
          } else if (r == 0 && rows < 4) {
            boxes.push_back(Box({0, 0}, {rows, cols}));
          }
          break;
        default:  // a scalar on every rank
          break;
      }
      if (t % 5 == 4) {
        locals[r].tensors.push_back(Tensor(name, dtype, {}, {Box({}, {})}));
      } else if (!boxes.empty()) {
        locals[r].tensors.push_back(Tensor(name, dtype, {rows, cols}, std::move(boxes)));
      }
    }
  }
  for (LocalSavePlan& local : locals) {
    std::shuffle(local.tensors.begin(), local.tensors.end(), rng);
  }
  return locals;
}

TEST(SavePlanTest, APoolGivesTheSamePlanAndTheSameFirstError) {
  std::mt19937_64 rng(7301);
  ThreadPool pool(4);
  int plans = 0, errors = 0;
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::vector<LocalSavePlan> locals = MixedLocals(rng);
    SavePlanOptions options = Options(1 + static_cast<int>(rng() % 3), rng() % 4 == 0);
    if (trial % 2 == 1) options.separate_key_prefixes = {"optim.", "ema."};
    if (trial % 4 == 3) {
      // Leave holes in two tensors sharded over every rank (a rank drops its box of one): the
      // first by name is reported.
      for (int hole : {static_cast<int>(rng() % 12), static_cast<int>(rng() % 12)}) {
        std::vector<LocalTensor>& tensors = locals[hole].tensors;
        auto it = std::find_if(tensors.begin(), tensors.end(), [](const LocalTensor& t) {
          const int number = std::stoi(t.name.substr(t.name.rfind('t') + 1));
          return number % 5 == 0 && t.boxes[0].volume() > 0;
        });
        ASSERT_NE(it, tensors.end());
        tensors.erase(it);
      }
    }
    Result<GlobalSavePlan> inline_plan = PlanSave(locals, options);
    options.pool = &pool;
    Result<GlobalSavePlan> pooled = PlanSave(locals, options);
    ASSERT_EQ(pooled.ok(), inline_plan.ok());
    if (!inline_plan.ok()) {
      EXPECT_EQ(pooled.status().message(), inline_plan.status().message());
      EXPECT_THAT(std::string(inline_plan.status().message()), HasSubstr("no rank holds"));
      ++errors;
      continue;
    }
    ASSERT_EQ(pooled->metadata, inline_plan->metadata);
    ASSERT_EQ(pooled->ranks, inline_plan->ranks);
    for (size_t t = 0; t < pooled->metadata.tensors.size(); ++t) {
      EXPECT_EQ(pooled->metadata.tensors[t].grid, inline_plan->metadata.tensors[t].grid);
    }
    if (options.files_per_rank > 1 || trial % 2 == 1) {
      EXPECT_GT(pooled->metadata.files.size(), 12u);
    }
    ++plans;
  }
  EXPECT_GE(errors, 5);
  EXPECT_GE(plans, 25);
}

// With one file per rank and nothing to separate, the files are laid out in passes over the
// tensors rather than rank by rank (AssignOneFilePerRank). A separation prefix that matches no
// key takes the pass per rank to the same layout, so the two must agree to the byte: chunks whose
// length is a multiple of 4096 first in each file, each kind in (tensor, chunk) order.
TEST(SavePlanTest, OneFilePerRankIsLaidOutAsThePassPerRankLaysItOut) {
  std::mt19937_64 rng(9127);
  ThreadPool pool(3);
  int aligned_after_other = 0;
  for (int trial = 0; trial < 30; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::vector<LocalSavePlan> locals = MixedLocals(rng);
    // Chunks of 4096 bytes and of other lengths, in tensors between the others by name, and a
    // rank that holds nothing (it gets no file).
    for (int t = 0; t < 20; ++t) {
      const int64_t rows = 12 * (1 + static_cast<int64_t>(rng() % 3));
      const int64_t cols = rng() % 2 ? 1024 : 1000;
      const std::string name = "model.t" + std::to_string(t) + "x";
      for (int r = 0; r < 12; ++r) {
        const int64_t step = rows / 12;
        locals[r].tensors.push_back(
            Tensor(name, DType::kFloat32, {rows, cols}, {Box({r * step, 0}, {step, cols})}));
      }
    }
    locals.emplace_back();
    std::shuffle(locals.begin(), locals.end(), rng);
    SavePlanOptions options = Options(1, rng() % 4 == 0);
    if (trial % 2 == 1) options.pool = &pool;
    Result<GlobalSavePlan> fast = PlanSave(locals, options);
    options.separate_key_prefixes = {"\x01no key starts so"};
    Result<GlobalSavePlan> per_rank = PlanSave(locals, options);
    ASSERT_TRUE(fast.ok()) << fast.status().ToString();
    ASSERT_TRUE(per_rank.ok()) << per_rank.status().ToString();
    ASSERT_EQ(fast->metadata, per_rank->metadata);
    ASSERT_EQ(fast->ranks, per_rank->ranks);
    EXPECT_EQ(fast->metadata.files.size(), 12u);  // the empty rank has none
    for (const RankSavePlan& rank : fast->ranks) {
      ASSERT_LE(rank.files.size(), 1u);
      uint64_t end = 0;
      bool other_seen = false;
      for (const ChunkWrite& w : rank.writes) {
        EXPECT_EQ(w.file, rank.files[0]);
        EXPECT_EQ(w.data_offset, end);
        end += w.byte_length;
        const bool aligned = w.byte_length % kDataAlignmentBytes == 0;
        if (aligned && other_seen) ++aligned_after_other;
        other_seen = other_seen || !aligned;
      }
    }
  }
  EXPECT_EQ(aligned_after_other, 0);
}

// A tensor of which every rank writes one chunk, each of a length that is a multiple of 4096,
// leads every file: its chunks come first, in name order, so each lies at the same offset of its
// rank's file as long as the ranks' leading chunks before it have the same lengths, whatever
// other chunks the ranks own before it in name order. Such a tensor's cells are then two runs in
// the metadata (docs/FORMAT.md, section 3.5), or three where the last rank holds fewer rows. A
// tensor that misses a rank, has a rank write two chunks or has an unaligned chunk does not lead;
// and the pass per rank lays the files out alike.
TEST(SavePlanTest, TensorsOverEveryRankLeadEveryFile) {
  std::mt19937_64 rng(4411);
  ThreadPool pool(3);
  for (int trial = 0; trial < 20; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int ranks = 2 + static_cast<int>(rng() % 7);
    std::vector<LocalSavePlan> locals(ranks);
    std::set<std::string> leading;
    std::set<std::string> uneven;  // leading, with chunks of other lengths than on the last rank
    for (int t = 0; t < 12; ++t) {
      const std::string name = "t" + std::to_string(10 + t);
      const int kind = static_cast<int>(rng() % 7);
      // kind 0: two rows of 1024 float32 on every rank (leads); 1: replicated; 2: the same with
      // 1000 columns (unaligned); 3: every rank but the last; 4: rows 1 and 3 by turns (leads
      // when the ranks are even; else rank 0 also holds the last band's 3 and it does not); 5:
      // torch.chunk's rows, 3 on every rank and 1 on the last (leads); 6: as many chunks as
      // ranks, but the last rank's two rows held by rank 0.
      const int64_t cols = kind == 2 ? 1000 : 1024;
      for (int r = 0; r < ranks; ++r) {
        if (kind == 1) {
          locals[r].tensors.push_back(Replicated(name, 4096 * (1 + t % 3)));
        } else if (kind == 4) {
          const Shape shape = {4 * ((ranks + 1) / 2), cols};
          std::vector<Box> boxes = {r % 2 == 0 ? Box({4 * (r / 2), 0}, {1, cols})
                                               : Box({4 * (r / 2) + 1, 0}, {3, cols})};
          if (r == 0 && ranks % 2 == 1) boxes.push_back(Box({4 * (ranks / 2) + 1, 0}, {3, cols}));
          locals[r].tensors.push_back(Tensor(name, DType::kFloat32, shape, boxes));
        } else if (kind == 6) {
          std::vector<Box> boxes = {Box({2 * r, 0}, {2, cols})};
          if (r == 0) boxes.push_back(Box({2 * (ranks - 1), 0}, {2, cols}));
          if (r + 1 < ranks) {
            locals[r].tensors.push_back(Tensor(name, DType::kFloat32, {2 * ranks, cols}, boxes));
          }
        } else if (kind == 5) {
          const int64_t rows = r + 1 < ranks ? 3 : 1;
          locals[r].tensors.push_back(Tensor(name, DType::kFloat32, {3 * ranks - 2, cols},
                                             {Box({3 * r, 0}, {rows, cols})}));
        } else if (kind != 3 || r + 1 < ranks) {
          const int64_t holders = kind == 3 ? ranks - 1 : ranks;
          locals[r].tensors.push_back(Tensor(name, DType::kFloat32, {2 * holders, cols},
                                             {Box({2 * r, 0}, {2, cols})}));
        }
      }
      if (kind == 0 || kind == 5 || (kind == 4 && ranks % 2 == 0)) leading.insert(name);
      if (kind == 4 && ranks % 2 == 0) uneven.insert(name);
    }
    SavePlanOptions options = Options(1, rng() % 4 == 0);
    if (trial % 2 == 1) options.pool = &pool;
    Result<GlobalSavePlan> plan = PlanSave(locals, options);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    options.separate_key_prefixes = {"\x01no key starts so"};
    Result<GlobalSavePlan> per_rank = PlanSave(locals, options);
    ASSERT_TRUE(per_rank.ok()) << per_rank.status().ToString();
    ASSERT_EQ(plan->metadata, per_rank->metadata);
    ASSERT_EQ(plan->ranks, per_rank->ranks);
    // The leading tensors back to back from 0 in every file, in name order: each chunk where the
    // rank's leading chunks before it end, so at the same offset on every rank but the last until
    // a leading tensor with chunks of other lengths.
    const CheckpointMetadata& md = plan->metadata;
    std::vector<uint64_t> end(ranks, 0);
    bool even_so_far = true;
    for (const TensorMetadata& tensor : md.tensors) {
      if (!leading.contains(tensor.name)) continue;
      ASSERT_EQ(tensor.chunks.size(), static_cast<size_t>(ranks));
      std::set<uint64_t> offsets;
      for (const StoredChunk& chunk : tensor.chunks) {
        const int32_t rank = md.files[chunk.file].writer_rank;
        EXPECT_EQ(chunk.data_offset, end[rank]) << tensor.name << " rank " << rank;
        if (rank + 1 < ranks) offsets.insert(chunk.data_offset);
        end[rank] += chunk.byte_length;
      }
      if (even_so_far) {
        EXPECT_EQ(offsets.size(), 1u) << tensor.name;
      }
      even_so_far = even_so_far && !uneven.contains(tensor.name);
    }
    // In each file: the leading chunks, then the other aligned ones, then the rest.
    for (const RankSavePlan& rank : plan->ranks) {
      int kind = 0;
      for (const ChunkWrite& w : rank.writes) {
        const bool leads = leading.contains(md.tensors[w.tensor].name);
        const int this_kind = leads ? 0 : w.byte_length % kDataAlignmentBytes == 0 ? 1 : 2;
        EXPECT_GE(this_kind, kind) << md.tensors[w.tensor].name;
        kind = std::max(kind, this_kind);
      }
    }
  }
}

// Five tensors of 2^62 bytes on one rank cannot be laid out in one file: the offsets would wrap.
TEST(SavePlanTest, AFileOfMoreThan2To64BytesIsRefused) {
  std::vector<LocalSavePlan> locals(2);
  for (int t = 0; t < 5; ++t) {
    locals[1].tensors.push_back(Replicated("big" + std::to_string(t), int64_t{1} << 62));
  }
  EXPECT_THAT(PlanError(locals).message(),
              HasSubstr("data file 0 of rank 1 would exceed 2^64 bytes"));
  SavePlanOptions options = Options();
  options.separate_key_prefixes = {"big3"};  // four of them in one file: the last one ends at 2^64
  EXPECT_THAT(PlanError(locals, options).message(),
              HasSubstr("data file 0 of rank 1 would exceed 2^64 bytes"));
}

}  // namespace
}  // namespace sp
