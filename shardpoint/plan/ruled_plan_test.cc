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
#include "shardpoint/plan/gathered_plans.h"
#include "shardpoint/plan/plan_codec.h"

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
  int parts_sent = 0, parts_asked = 0, ranks = 0, ruled = 0;
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
  }
  EXPECT_GT(ruled, 1000);
  // Random jobs give most ranks a list of their own, so most send their part; some guessed they
  // would not need to and were asked.
  EXPECT_LE(parts_sent + parts_asked, ranks);
  EXPECT_GT(parts_asked, 0);
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
