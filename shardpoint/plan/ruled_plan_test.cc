#include "shardpoint/plan/ruled_plan.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/plan/gathered_plans.h"
#include "shardpoint/plan/plan_codec.h"
#include "shardpoint/plan/plan_test_util.h"

namespace sp {
namespace {

using ::testing::HasSubstr;

// A tensor of the random job: laid out by a rule over some ranks, or cut irregularly.
struct JobTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::optional<MeshLayout> layout;
  std::map<int64_t, std::vector<Box>> irregular;  // rank -> its boxes (no layout)
};

Placement RandomPlacement(std::mt19937_64& rng, size_t tensor_rank) {
  if (tensor_rank == 0) return Placement::Replicate();  // a scalar is not split
  switch (rng() % 4) {
    case 0: return Placement::Replicate();
    case 1: return Placement::StridedShard(static_cast<int>(rng() % tensor_rank),
                                           2 + static_cast<int>(rng() % 2));
    default: return Placement::Shard(static_cast<int>(rng() % tensor_rank));
  }
}

// A mesh of at most `world` positions over a random subset of the ranks (in random order, or the
// identity), with random placements that give every position a box.
MeshLayout RandomLayout(std::mt19937_64& rng, const Shape& shape, int64_t world) {
  for (;;) {
    MeshLayout layout;
    int64_t volume = 1;
    const size_t dims = 1 + rng() % 3;
    for (size_t d = 0; d < dims; ++d) {
      const int64_t n = 1 + static_cast<int64_t>(rng() % 4);
      if (volume * n > world) break;
      layout.mesh_shape.push_back(n);
      volume *= n;
      layout.placements.push_back(RandomPlacement(rng, shape.size()));
    }
    if (layout.mesh_shape.empty()) {
      layout.mesh_shape = {1};
      layout.placements = {Placement::Replicate()};
    }
    if (rng() % 2 == 0 || volume < world) {
      std::vector<int64_t> ranks(world);
      std::iota(ranks.begin(), ranks.end(), 0);
      if (rng() % 2 == 0) {
        std::shuffle(ranks.begin(), ranks.end(), rng);
      } else {  // a strided submesh, as pipeline stages have
        const int64_t stride = std::max<int64_t>(1, world / volume);
        for (int64_t i = 0; i < world; ++i) ranks[i] = (i * stride) % world + (i * stride) / world;
      }
      ranks.resize(volume);
      std::set<int64_t> distinct(ranks.begin(), ranks.end());
      if (static_cast<int64_t>(distinct.size()) != volume) continue;
      layout.rank_list = ranks;
    }
    if (MeshChunksPerRank(shape, layout).ok()) return layout;
  }
}

std::vector<JobTensor> RandomJob(std::mt19937_64& rng, int64_t world) {
  std::vector<JobTensor> tensors;
  const int count = 1 + static_cast<int>(rng() % 12);
  for (int i = 0; i < count; ++i) {
    JobTensor t;
    t.name = "layers." + std::to_string(i) + (rng() % 2 ? ".weight" : ".bias");
    t.dtype = rng() % 3 == 0 ? DType::kBFloat16 : DType::kFloat32;
    const size_t rank = 1 + rng() % 3;
    for (size_t d = 0; d < rank; ++d) t.shape.push_back(static_cast<int64_t>(rng() % 13));
    if (rng() % 4 != 0) {
      t.layout = RandomLayout(rng, t.shape, world);
    } else {
      // Irregular: dim 0 cut at random points, each piece held by one or two random ranks.
      int64_t begin = 0;
      while (begin < t.shape[0] || (begin == 0 && t.shape[0] == 0)) {
        const int64_t size = std::min<int64_t>(t.shape[0] - begin, 1 + rng() % 4);
        Box box;
        box.offsets.push_back(begin);
        box.sizes.push_back(size);
        for (size_t d = 1; d < rank; ++d) {
          box.offsets.push_back(0);
          box.sizes.push_back(t.shape[d]);
        }
        const int64_t holder = static_cast<int64_t>(rng() % world);
        t.irregular[holder].push_back(box);
        if (rng() % 3 == 0) t.irregular[(holder + 1) % world].push_back(box);
        begin += size;
        if (size == 0) break;
      }
    }
    tensors.push_back(std::move(t));
  }
  return tensors;
}

// What rank `rank` lists: the tensors it holds (a rank outside a tensor's mesh, or not holding an
// irregular piece, does not list it), through CheckRuledBoxes as the engine does.
LocalSavePlan LocalPlanOf(const std::vector<JobTensor>& job, int64_t rank, bool with_layouts) {
  LocalSavePlan plan;
  for (const JobTensor& t : job) {
    LocalTensor local{t.name, t.dtype, t.shape, {}};
    if (t.layout) {
      Result<std::optional<Box>> box = MeshChunkForRank(t.shape, *t.layout, rank);
      EXPECT_TRUE(box.ok()) << box.status();
      if (!box.ok() || !box->has_value()) continue;
      local.boxes.push_back(**box);
      if (with_layouts) local.layout = t.layout;
      EXPECT_TRUE(CheckRuledBoxes(rank, &local).ok());
    } else {
      auto it = t.irregular.find(rank);
      if (it == t.irregular.end()) continue;
      local.boxes = it->second;
    }
    plan.tensors.push_back(std::move(local));
  }
  plan.objects.push_back(
      ObjectEntry{"step", ObjectEncoding::kJson, rank == 0 ? "10" : std::to_string(rank)});
  return plan;
}

// The coordinator's way with ruled messages: every shared part that arrives is added; a group
// whose part did not arrive is asked for it (its lowest rank sends it again, with the part).
Status GatherRuled(const std::vector<LocalSavePlan>& locals, GatheredPlans* gathered,
                   int* parts_sent, int* parts_asked) {
  const size_t world = locals.size();
  SharedPlans shared(world);
  std::vector<std::string> messages(world);
  std::vector<SharedPlans::Message> opened(world);
  for (size_t r = 0; r < world; ++r) {
    const bool with = SendsSharedPart(locals[r], static_cast<int64_t>(r), 0);
    *parts_sent += with ? 1 : 0;
    messages[r] = EncodeRuledLocalPlan(locals[r], with);
    SP_ASSIGN_OR_RETURN(opened[r], SharedPlans::Open(messages[r]));
    SP_RETURN_IF_ERROR(shared.Add(opened[r]));
  }
  for (size_t r = 0; r < world; ++r) {
    if (shared.Has(opened[r].digest)) continue;
    ++*parts_asked;
    messages[r] = EncodeRuledLocalPlan(locals[r], true);
    SP_ASSIGN_OR_RETURN(opened[r], SharedPlans::Open(messages[r]));
    SP_RETURN_IF_ERROR(shared.Add(opened[r]));
  }
  for (size_t r = 0; r < world; ++r) {
    SP_RETURN_IF_ERROR(shared.Expand(opened[r], static_cast<uint32_t>(r), gathered));
  }
  return OkStatus();
}

TEST(RuledPlanTest, RandomLayoutsPlanExactlyAsTheWholePlans) {
  std::mt19937_64 rng(20261128);
  int parts_sent = 0, parts_asked = 0, ranks = 0, ruled = 0, cell_tensors = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int64_t world = 1 + static_cast<int64_t>(rng() % 16);
    const std::vector<JobTensor> job = RandomJob(rng, world);
    std::vector<LocalSavePlan> whole, with_rules;
    for (int64_t r = 0; r < world; ++r) {
      whole.push_back(LocalPlanOf(job, r, false));
      with_rules.push_back(LocalPlanOf(job, r, true));
    }
    for (const JobTensor& t : job) ruled += t.layout ? 1 : 0;
    ranks += static_cast<int>(world);
    SavePlanOptions options;
    options.save_id = "t" + std::to_string(trial);
    options.files_per_rank = 1 + static_cast<int>(rng() % 2);
    GatheredPlans from_whole;
    for (const LocalSavePlan& local : whole) {
      ASSERT_TRUE(DecodeLocalSavePlanInto(EncodeLocalSavePlan(local), &from_whole).ok());
    }
    GatheredPlans from_ruled;
    Status gathered = GatherRuled(with_rules, &from_ruled, &parts_sent, &parts_asked);
    ASSERT_TRUE(gathered.ok()) << gathered;
    Result<GlobalSavePlan> expected = PlanSave(from_whole, options);
    Result<GlobalSavePlan> actual = PlanSave(from_ruled, options);
    ASSERT_EQ(expected.ok(), actual.ok());
    if (!expected.ok()) {  // an irregular tensor that leaves a hole: the same error either way
      EXPECT_EQ(expected.status().message(), actual.status().message());
      continue;
    }
    ASSERT_EQ(actual->metadata, expected->metadata);
    ASSERT_EQ(actual->ranks, expected->ranks);
    // Held as cells, the tensors of a rule built from their pattern's proof: the same plan.
    SavePlanOptions as_cells = options;
    as_cells.chunk_cells = true;
    Result<GlobalSavePlan> celled = PlanSave(from_ruled, as_cells);
    ASSERT_TRUE(celled.ok()) << celled.status();
    const GlobalSavePlan expanded = testing::WithCellsExpanded(*std::move(celled), &cell_tensors);
    ASSERT_EQ(expanded.metadata, expected->metadata);
    ASSERT_EQ(expanded.ranks, expected->ranks);
  }
  EXPECT_GT(cell_tensors, 1000);
  EXPECT_GT(ruled, 1000);
  // Random jobs give most ranks a list of their own, so most send their part; some guessed they
  // would not need to and were asked.
  EXPECT_LE(parts_sent + parts_asked, ranks);
  EXPECT_GT(parts_asked, 0);
}

// A mesh over exactly `ranks` (in random order), of one or two dimensions, with random
// placements that give every position a box of `shape`.
MeshLayout LayoutOver(std::mt19937_64& rng, const Shape& shape, std::vector<int64_t> ranks) {
  const int64_t n = static_cast<int64_t>(ranks.size());
  for (;;) {
    MeshLayout layout;
    int64_t first = 1 + static_cast<int64_t>(rng() % n);
    while (n % first != 0) --first;
    layout.mesh_shape = {first};
    if (n / first > 1) layout.mesh_shape.push_back(n / first);
    for (size_t d = 0; d < layout.mesh_shape.size(); ++d) {
      layout.placements.push_back(RandomPlacement(rng, shape.size()));
    }
    if (rng() % 2 == 0) std::shuffle(ranks.begin(), ranks.end(), rng);
    layout.rank_list = ranks;
    if (MeshChunksPerRank(shape, layout).ok()) return layout;
  }
}

// A tensor one rank lists in the staged job below: laid out by `layout`, or the rank's `boxes`.
struct Listing {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::optional<MeshLayout> layout;
  std::vector<Box> boxes;
};

// What every rank lists in a pipeline-like job: the ranks are cut into stages of consecutive
// ranks, and every rank of a stage lists the same tensors (so each stage sends one shared part):
// tensors laid out over the stage's ranks, and tensors cut irregularly along dim 0 whose pieces
// one or two ranks of the stage hold (the others list an empty piece). Some tensors span the
// stages: one laid out over every rank and listed by all (in every stage's part), and one
// replicated over every rank but listed by the first stage only.
std::vector<std::vector<Listing>> StagedJob(std::mt19937_64& rng, int64_t world) {
  const int64_t stages = 1 + static_cast<int64_t>(rng() % std::min<int64_t>(3, world));
  std::vector<std::vector<Listing>> lists(world);
  std::vector<int64_t> everyone(world);
  std::iota(everyone.begin(), everyone.end(), 0);
  auto random_shape = [&](size_t min_rank) {  // scalars too: their chunks take no values
    Shape shape;
    const size_t rank = min_rank + rng() % (4 - min_rank);
    for (size_t d = 0; d < rank; ++d) shape.push_back(static_cast<int64_t>(rng() % 13));
    return shape;
  };
  auto list_ruled = [&](const std::string& name, DType dtype, const Shape& shape,
                        const MeshLayout& layout, const std::vector<int64_t>& listers) {
    for (int64_t r : listers) {
      Listing l{name, dtype, shape, layout, {}};
      Result<std::optional<Box>> box = MeshChunkForRank(shape, layout, r);
      EXPECT_TRUE(box.ok()) << box.status();
      l.boxes = {box.ok() && box->has_value() ? **box : Box()};
      lists[r].push_back(std::move(l));
    }
  };
  for (int64_t s = 0; s < stages; ++s) {
    const int64_t begin = world * s / stages, end = world * (s + 1) / stages;
    std::vector<int64_t> ranks(end - begin);
    std::iota(ranks.begin(), ranks.end(), begin);
    const int count = 1 + static_cast<int>(rng() % 8);
    for (int i = 0; i < count; ++i) {
      const std::string name = "stage" + std::to_string(s) + ".t" + std::to_string(i);
      const DType dtype = rng() % 3 == 0 ? DType::kBFloat16 : DType::kFloat32;
      const bool irregular = rng() % 4 == 0;
      const Shape shape = random_shape(irregular ? 1 : 0);
      if (!irregular) {
        list_ruled(name, dtype, shape, LayoutOver(rng, shape, ranks), ranks);
        continue;
      }
      std::map<int64_t, std::vector<Box>> held;
      for (int64_t row = 0; row < shape[0];) {
        const int64_t size = std::min<int64_t>(shape[0] - row, 1 + rng() % 4);
        Box box;
        box.offsets.push_back(row);
        box.sizes.push_back(size);
        for (size_t d = 1; d < shape.size(); ++d) {
          box.offsets.push_back(0);
          box.sizes.push_back(shape[d]);
        }
        const int64_t holder = begin + static_cast<int64_t>(rng() % ranks.size());
        held[holder].push_back(box);
        if (rng() % 3 == 0) held[begin + (holder - begin + 1) % ranks.size()].push_back(box);
        row += size;
      }
      for (int64_t r : ranks) {
        Listing l{name, dtype, shape, std::nullopt, held[r]};
        if (l.boxes.empty()) l.boxes.push_back(Box(Dims(shape.size(), 0), Dims(shape.size(), 0)));
        lists[r].push_back(std::move(l));
      }
    }
  }
  if (rng() % 2 == 0) {  // tied: laid out over every rank, listed in every stage's part
    const Shape shape = random_shape(0);
    list_ruled("tied", DType::kFloat32, shape, LayoutOver(rng, shape, everyone), everyone);
    if (stages > 1 && rng() % 8 == 0) lists[world - 1].back().dtype = DType::kBFloat16;
  }
  if (rng() % 2 == 0) {  // replicated over every rank, listed by the first stage's ranks only
    const Shape shape = random_shape(0);
    MeshLayout replicated{{world}, {Placement::Replicate()}, everyone};
    list_ruled("shared", DType::kFloat32, shape, replicated,
               std::vector<int64_t>(everyone.begin(), everyone.begin() + world / stages));
  }
  return lists;
}

TEST(RuledPlanTest, StagesPlanTheirRuledTensorsFromTheRulesExactlyAsFromBoxes) {
  std::mt19937_64 rng(20261129);
  ThreadPool pool(3);
  int ruled = 0, errors = 0, cell_tensors = 0, deferred_plans = 0;
  for (int trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int64_t world = 1 + static_cast<int64_t>(rng() % 16);
    const std::vector<std::vector<Listing>> lists = StagedJob(rng, world);
    std::vector<LocalSavePlan> whole(world), with_rules(world);
    std::vector<size_t> ruleless(world, 0);
    for (int64_t r = 0; r < world; ++r) {
      for (const Listing& l : lists[r]) {
        whole[r].tensors.push_back(LocalTensor{l.name, l.dtype, l.shape, l.boxes});
        LocalTensor t{l.name, l.dtype, l.shape, l.boxes};
        t.layout = l.layout;
        ASSERT_TRUE(CheckRuledBoxes(r, &t).ok());
        with_rules[r].tensors.push_back(std::move(t));
        ruleless[r] += l.layout ? 0 : 1;
        ruled += l.layout ? 1 : 0;
      }
    }
    SavePlanOptions options;
    options.save_id = "s" + std::to_string(trial);
    options.files_per_rank = 1 + static_cast<int>(rng() % 2);
    options.dedup_to_lowest_rank = rng() % 4 == 0;
    GatheredPlans from_whole;
    for (const LocalSavePlan& local : whole) from_whole.AddRank(local);
    GatheredPlans from_ruled;
    int sent = 0, asked = 0;
    Status gathered = GatherRuled(with_rules, &from_ruled, &sent, &asked);
    ASSERT_TRUE(gathered.ok()) << gathered;
    // The table keeps a rank's tensors without a rule, and its part for the others.
    for (int64_t r = 0; r < world; ++r) {
      EXPECT_EQ(from_ruled.tensors(r).size(), ruleless[r]);
      EXPECT_NE(from_ruled.part_of(r), GatheredPlans::kNoPart);
    }
    Result<GlobalSavePlan> expected = PlanSave(from_whole, options);
    // On a pool in every other trial: the same plan and the same error.
    if (trial % 2 == 1) options.pool = &pool;
    Result<GlobalSavePlan> actual = PlanSave(from_ruled, options);
    ASSERT_EQ(expected.ok(), actual.ok()) << (expected.ok() ? actual.status() : expected.status());
    if (!expected.ok()) {  // a tied tensor of two dtypes, or a hole: the same error either way
      EXPECT_EQ(expected.status().message(), actual.status().message());
      ++errors;
      continue;
    }
    ASSERT_EQ(actual->metadata, expected->metadata);
    ASSERT_EQ(actual->ranks, expected->ranks);
    for (size_t t = 0; t < actual->metadata.tensors.size(); ++t) {
      EXPECT_EQ(actual->metadata.tensors[t].grid, expected->metadata.tensors[t].grid);
    }
    SavePlanOptions as_cells = options;
    as_cells.chunk_cells = true;
    as_cells.defer_writes = true;
    Result<GlobalSavePlan> celled = PlanSave(from_ruled, as_cells);
    ASSERT_TRUE(celled.ok()) << celled.status();
    ASSERT_TRUE(
        testing::TakeDeferredInRounds(rng, options.pool, &*celled, &deferred_plans).ok());
    for (size_t t = 0; t < celled->metadata.tensors.size(); ++t) {
      const TensorMetadata& tensor = celled->metadata.tensors[t];
      EXPECT_EQ(tensor.grid, expected->metadata.tensors[t].grid);
      // Held as cells, with no chunk; their boxes listed where they form no grid.
      ASSERT_TRUE(tensor.cells.has_value());
      EXPECT_TRUE(tensor.chunks.empty());
      EXPECT_EQ(tensor.cells->boxes.size(),
                tensor.grid ? 0 : ChunkCount(tensor) * 2 * tensor.shape.size());
    }
    const GlobalSavePlan expanded = testing::WithCellsExpanded(*std::move(celled), &cell_tensors);
    ASSERT_EQ(expanded.metadata, expected->metadata);
    ASSERT_EQ(expanded.ranks, expected->ranks);
  }
  EXPECT_GT(cell_tensors, 1000);
  EXPECT_GT(deferred_plans, 100);
  EXPECT_GT(ruled, 3000);
  EXPECT_GT(errors, 0);
}

// A part that lists a tensor twice, or a tensor that two parts list with different dtypes: the
// errors of the whole plans.
TEST(RuledPlanTest, PartsThatDisagreeGiveTheErrorsOfWholePlans) {
  const MeshLayout mesh{{2}, {Placement::Shard(0)}, {}};
  auto ruled = [&](std::string name, DType dtype, int64_t rank) {
    LocalTensor t{std::move(name), dtype, {8}, {}};
    t.layout = mesh;
    t.boxes = {**MeshChunkForRank(t.shape, mesh, rank)};
    return t;
  };
  std::vector<LocalSavePlan> twice(2), dtypes(2);
  for (int64_t r = 0; r < 2; ++r) {
    twice[r].tensors = {ruled("w", DType::kFloat32, r), ruled("w", DType::kFloat32, r)};
    dtypes[r].tensors = {ruled("w", r == 0 ? DType::kFloat32 : DType::kInt32, r)};
  }
  for (const auto& [locals, message] :
       {std::pair{twice, "tensor 'w': rank 0 lists it twice"},
        std::pair{dtypes, "tensor 'w': rank 0 has dtype float32 but rank 1 has int32"}}) {
    GatheredPlans gathered;
    int sent = 0, asked = 0;
    ASSERT_TRUE(GatherRuled(locals, &gathered, &sent, &asked).ok());
    Result<GlobalSavePlan> plan = PlanSave(gathered, SavePlanOptions{});
    EXPECT_EQ(plan.status().message(), message);
    std::vector<LocalSavePlan> whole = locals;
    for (LocalSavePlan& local : whole) {
      for (LocalTensor& t : local.tensors) t.layout.reset();
    }
    EXPECT_EQ(PlanSave(whole, SavePlanOptions{}).status().message(), message);
  }
}

TEST(RuledPlanTest, RanksOfOneLayoutShareOnePartAndSendItOnce) {
  // 64 ranks, 2 pipeline stages of 32 (ranks 0-31 and 32-63), each stage a 4 x 8 mesh (DP x TP)
  // holding its own layers: two shared parts, sent unasked by ranks 0 and 32.
  constexpr int64_t kWorld = 64;
  std::vector<LocalSavePlan> locals(kWorld);
  std::set<Fingerprint128> digests;
  size_t whole_bytes = 0, ruled_bytes = 0;
  for (int64_t r = 0; r < kWorld; ++r) {
    const int64_t stage = r / 32;
    MeshLayout mesh{{4, 8}, {Placement::Shard(0), Placement::Shard(1)}, {}};
    for (int64_t i = 0; i < 32; ++i) mesh.rank_list.push_back(stage * 32 + i);
    for (int layer = 0; layer < 10; ++layer) {
      LocalTensor t{"layers." + std::to_string(stage * 10 + layer) + ".weight", DType::kBFloat16,
                    {1024, 4096}, {}};
      t.layout = mesh;
      t.boxes = {**MeshChunkForRank(t.shape, mesh, r)};
      ASSERT_TRUE(CheckRuledBoxes(r, &t).ok());
      locals[r].tensors.push_back(std::move(t));
    }
    digests.insert(SharedPartDigest(locals[r]));
    EXPECT_EQ(SendsSharedPart(locals[r], r, 0), r % 32 == 0) << r;
    whole_bytes += EncodeLocalSavePlan(locals[r]).size();
    ruled_bytes += EncodeRuledLocalPlan(locals[r], SendsSharedPart(locals[r], r, 0)).size();
  }
  EXPECT_EQ(digests.size(), 2u);
  int sent = 0, asked = 0;
  GatheredPlans gathered;
  ASSERT_TRUE(GatherRuled(locals, &gathered, &sent, &asked).ok());
  EXPECT_EQ(sent, 2);
  EXPECT_EQ(asked, 0);
  // Without the part, a rank's message is its digest, an empty own part and no objects.
  EXPECT_EQ(EncodeRuledLocalPlan(locals[5], false).size(), 4u + 16 + 1 + 4 + 4 + 4);
  EXPECT_LT(ruled_bytes * 10, whole_bytes);
  Result<GlobalSavePlan> plan = PlanSave(gathered, SavePlanOptions{});
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->metadata.tensors.size(), 20u);
  EXPECT_EQ(plan->metadata.tensors[0].chunks.size(), 32u);
}

TEST(RuledPlanTest, BoxesThatDoNotFollowTheLayoutAreRefused) {
  const MeshLayout mesh{{2, 2}, {Placement::Shard(0), Placement::Replicate()}, {}};
  LocalTensor t{"w", DType::kFloat32, {8, 4}, {Box({0, 0}, {4, 4})}};
  t.layout = mesh;
  EXPECT_TRUE(CheckRuledBoxes(1, &t).ok());
  EXPECT_EQ(t.boxes, std::vector<Box>{Box({0, 0}, {4, 4})});

  t.boxes = {Box({0, 0}, {4, 4})};
  Status wrong = CheckRuledBoxes(2, &t);
  EXPECT_EQ(wrong.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(wrong.message(),
            "tensor 'w': rank 2 holds piece [0:4, 0:4], but its layout (mesh [2, 2] placements "
            "(S(0), R)) gives it the chunk [4:8, 0:4]");

  t.boxes = {Box({4, 0}, {2, 4}), Box({6, 0}, {2, 4})};
  Status split = CheckRuledBoxes(3, &t);
  EXPECT_THAT(std::string(split.message()),
              HasSubstr("rank 3 holds pieces [4:6, 0:4], [6:8, 0:4], but its layout"));

  Status outside = CheckRuledBoxes(4, &t);
  EXPECT_EQ(outside.message(),
            "tensor 'w': rank 4 is not in the mesh of its layout (mesh [2, 2] placements (S(0), "
            "R))");

  // A rank whose chunk is empty may list no piece, or one empty piece.
  LocalTensor small{"b", DType::kFloat32, {1}, {}};
  small.layout = MeshLayout{{2}, {Placement::Shard(0)}, {}};
  EXPECT_TRUE(CheckRuledBoxes(1, &small).ok());
  ASSERT_EQ(small.boxes.size(), 1u);
  EXPECT_TRUE(small.boxes[0].empty());

  LocalTensor bad{"x", DType::kFloat32, {4}, {}};
  bad.layout = MeshLayout{{2}, {Placement::Shard(3)}, {}};
  EXPECT_THAT(std::string(CheckRuledBoxes(0, &bad).message()),
              HasSubstr("tensor 'x': tensor of shape [4] on mesh [2] placements (S(3))"));
}

// Seals `body` (magic onward) as the codec does.
std::string Sealed(std::string body) {
  const uint32_t crc = Crc32c(body);
  ByteWriter(&body).PutU32(crc);
  return body;
}

TEST(RuledPlanTest, BadMessagesGiveErrorsNotCrashes) {
  LocalSavePlan plan;
  LocalTensor t{"w", DType::kFloat32, {8, 4}, {Box({4, 0}, {4, 4})}};
  t.layout = MeshLayout{{2}, {Placement::Shard(0)}, {}};
  plan.tensors.push_back(t);
  plan.tensors.push_back(LocalTensor{"v", DType::kFloat32, {3}, {Box({0}, {3})}});
  plan.objects.push_back(ObjectEntry{"o", ObjectEncoding::kJson, "1"});
  const std::string message = EncodeRuledLocalPlan(plan, true);

  {  // A part that is not what its digest says.
    Result<SharedPlans::Message> opened = SharedPlans::Open(message);
    ASSERT_TRUE(opened.ok());
    opened->digest.low ^= 1;
    SharedPlans shared(2);
    EXPECT_THAT(std::string(shared.Add(*opened).message()),
                HasSubstr("its shared part has digest"));
    GatheredPlans gathered;
    EXPECT_EQ(shared.Expand(*opened, 0, &gathered).code(), StatusCode::kInternal);
  }
  {  // A mesh larger than the job, and a rank outside the mesh.
    Result<SharedPlans::Message> opened = SharedPlans::Open(message);
    ASSERT_TRUE(opened.ok());
    SharedPlans one(1);
    EXPECT_THAT(std::string(one.Add(*opened).message()), HasSubstr("more positions than"));
    SharedPlans three(3);
    ASSERT_TRUE(three.Add(*opened).ok());
    GatheredPlans gathered;
    ASSERT_TRUE(three.Expand(*opened, 0, &gathered).ok());
    ASSERT_TRUE(three.Expand(*opened, 1, &gathered).ok());
    EXPECT_EQ(three.Expand(*opened, 2, &gathered).message(),
              "tensor 'w': rank 2 is not in the mesh of its layout (mesh [2] placements (S(0)))");
  }
  // Every byte of the body changed in turn (and the message sealed again, so that the structure
  // is what is tested, not the checksum): an error or a plan, never a crash.
  std::mt19937_64 rng(3);
  int refused = 0;
  const std::string body = message.substr(0, message.size() - 4);
  for (size_t i = 0; i < body.size(); ++i) {
    for (int k = 0; k < 4; ++k) {
      std::string changed = body;
      changed[i] = static_cast<char>(k == 0 ? 0xFF : rng());
      const std::string sealed = Sealed(changed);  // the opened message views it
      Result<SharedPlans::Message> opened = SharedPlans::Open(sealed);
      if (!opened.ok()) {
        ++refused;
        continue;
      }
      if (opened->shared) opened->digest = Fingerprint(*opened->shared);
      SharedPlans shared(4);
      GatheredPlans gathered;
      Status status = shared.Add(*opened);
      if (status.ok()) status = shared.Expand(*opened, 1, &gathered);
      refused += status.ok() ? 0 : 1;
    }
  }
  EXPECT_GT(refused, static_cast<int>(body.size()));
  EXPECT_EQ(SharedPlans::Open(message.substr(0, message.size() - 1)).status().code(),
            StatusCode::kDataLoss);
}

}  // namespace
}  // namespace sp
