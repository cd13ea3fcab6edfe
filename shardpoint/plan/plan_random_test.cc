// Randomized end-to-end checks of the planners against a plain element-by-element reference:
// random tensors laid out on random meshes are planned, "written" into simulated files as
// 32-bit element ids, and read back through load plans for other random meshes.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "shardpoint/exec/thread_pool.h"
#include "shardpoint/format/chunk_grid.h"
#include "shardpoint/plan/load_plan.h"
#include "shardpoint/plan/plan_codec.h"
#include "shardpoint/plan/plan_test_util.h"
#include "shardpoint/plan/save_plan.h"

namespace sp {
namespace {

using ::sp::testing::ForEachElement;
using ::sp::testing::LinearIndex;
using ::sp::testing::Mesh;
using ::sp::testing::TakeDeferredInRounds;
using ::sp::testing::WithCellsExpanded;
using ::sp::testing::MeshBox;
using ::sp::testing::RandomMesh;

struct GlobalTensor {
  std::string name;
  Shape shape;
  Mesh save_mesh;
};

std::vector<GlobalTensor> RandomTensors(std::mt19937_64& rng, int64_t world) {
  std::vector<GlobalTensor> tensors(1 + rng() % 5);
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].name = "t" + std::to_string(rng() % 1000) + "." + std::to_string(i);
    const size_t rank = rng() % 4;
    for (size_t d = 0; d < rank; ++d) tensors[i].shape.push_back(rng() % 9);
    tensors[i].save_mesh = RandomMesh(rng, rank, world);
  }
  return tensors;
}

// Each rank holds its mesh box of every tensor (ranks outside a tensor's mesh hold none; some
// ranks also add an empty box). Tensors are listed in a rank-specific order.
std::vector<LocalSavePlan> LocalPlans(std::mt19937_64& rng, const std::vector<GlobalTensor>& ts,
                                      int64_t world) {
  std::vector<LocalSavePlan> locals(world);
  for (int64_t r = 0; r < world; ++r) {
    for (const GlobalTensor& t : ts) {
      LocalTensor lt{t.name, DType::kInt32, t.shape, {}};
      if (rng() % 4 == 0)
        lt.boxes.push_back(Box(std::vector<int64_t>(t.shape.size(), 0), Shape(t.shape.size(), 0)));
      if (r < t.save_mesh.world_size()) lt.boxes.push_back(MeshBox(t.shape, t.save_mesh, r));
      locals[r].tensors.push_back(std::move(lt));
    }
    std::shuffle(locals[r].tensors.begin(), locals[r].tensors.end(), rng);
  }
  return locals;
}

// Simulated data files: element ids (row-major global index) written per the plan.
using Files = std::vector<std::vector<int32_t>>;

Files WriteAll(const GlobalSavePlan& plan, const std::vector<LocalSavePlan>& locals) {
  Files files(plan.metadata.files.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    for (const ChunkWrite& w : plan.ranks[r].writes) {
      const LocalTensor& lt = locals[r].tensors[w.local_tensor];
      const TensorMetadata& tm = plan.metadata.tensors[w.tensor];
      const StoredChunk& chunk = tm.chunks[w.chunk];
      EXPECT_EQ(lt.name, tm.name);
      EXPECT_EQ(lt.boxes[w.local_box], chunk.box) << "rank " << r << " writes a box it lacks";
      EXPECT_EQ(plan.metadata.files[w.file].writer_rank, static_cast<int32_t>(r));
      EXPECT_EQ(w.data_offset, chunk.data_offset);
      EXPECT_EQ(w.byte_length, chunk.byte_length);
      EXPECT_EQ(w.file, chunk.file);
      std::vector<int32_t>& file = files[w.file];
      EXPECT_EQ(w.data_offset, file.size() * 4) << "chunks are not back to back";
      ForEachElement(chunk.box, [&](const std::vector<int64_t>& p, int64_t) {
        file.push_back(static_cast<int32_t>(LinearIndex(p, Shape(p.size(), 0), tm.shape)));
      });
    }
  }
  for (const auto& file : files) EXPECT_FALSE(file.empty()) << "an empty file was planned";
  return files;
}

// Every element of every tensor is written exactly once.
void ExpectWrittenOnce(const GlobalSavePlan& plan) {
  for (const TensorMetadata& tm : plan.metadata.tensors) {
    std::vector<int> count(ShapeVolume(tm.shape), 0);
    std::map<std::pair<uint32_t, uint32_t>, int> per_chunk;
    for (const RankSavePlan& rp : plan.ranks) {
      for (const ChunkWrite& w : rp.writes) {
        if (&plan.metadata.tensors[w.tensor] != &tm) continue;
        ++per_chunk[{w.tensor, w.chunk}];
        ForEachElement(tm.chunks[w.chunk].box, [&](const std::vector<int64_t>& p, int64_t) {
          ++count[LinearIndex(p, Shape(p.size(), 0), tm.shape)];
        });
      }
    }
    EXPECT_EQ(per_chunk.size(), tm.chunks.size()) << tm.name;
    for (size_t e = 0; e < count.size(); ++e) {
      ASSERT_EQ(count[e], 1) << "tensor " << tm.name << " element " << e;
    }
  }
}

// Loads every tensor into the boxes of a random mesh and checks each element arrives once with
// the right value.
void LoadAndCheck(std::mt19937_64& rng, const std::vector<GlobalTensor>& ts,
                  const GlobalSavePlan& plan, const Files& files) {
  const int64_t world = 1 + rng() % 6;
  for (int64_t r = 0; r < world; ++r) {
    std::vector<LocalTensor> targets;
    for (const GlobalTensor& t : ts) {
      Mesh mesh = RandomMesh(rng, t.shape.size(), 8);
      LocalTensor lt{t.name, DType::kInt32, t.shape, {}};
      for (int64_t k = 0; k < 1 + static_cast<int64_t>(rng() % 2); ++k) {
        lt.boxes.push_back(MeshBox(t.shape, mesh, rng() % mesh.world_size()));
      }
      targets.push_back(std::move(lt));
    }
    Result<LoadPlan> lp = PlanLoad(targets, plan.metadata, LoadPlanOptions{});
    ASSERT_TRUE(lp.ok()) << lp.status();
    // Chunk grids found by arithmetic give the plan of the sweeps, item for item.
    Result<LoadPlan> swept =
        PlanLoad(targets, plan.metadata, LoadPlanOptions{.chunk_grids = false});
    ASSERT_TRUE(swept.ok()) << swept.status();
    ASSERT_EQ(lp->items, swept->items);
    // So do chunks listed in another order (not a row-major grid: the sweeps plan them), up to
    // the chunks' numbers.
    CheckpointMetadata shuffled = plan.metadata;
    for (TensorMetadata& tm : shuffled.tensors) {
      std::shuffle(tm.chunks.begin(), tm.chunks.end(), rng);
    }
    Result<LoadPlan> reordered = PlanLoad(targets, shuffled, LoadPlanOptions{});
    ASSERT_TRUE(reordered.ok()) << reordered.status();
    // Indexed as a received or opened checkpoint is (a grid where the order still is one, a
    // ChunkIndex otherwise), the same chunks give the same plan, item for item.
    CheckpointMetadata indexed = shuffled;
    for (TensorMetadata& tm : indexed.tensors) {
      tm.grid.reset();
      tm.index.reset();
    }
    IndexChunkGrids(&indexed);
    Result<LoadPlan> by_index = PlanLoad(targets, indexed, LoadPlanOptions{});
    ASSERT_TRUE(by_index.ok()) << by_index.status();
    ASSERT_EQ(by_index->items, reordered->items);
    auto where = [](const LoadPlan& p) {
      std::vector<std::tuple<uint32_t, uint64_t, Box, uint32_t, uint32_t>> out;
      for (const ReadItem& item : p.items) {
        const StoredChunk& chunk = p.stored[item.target]->chunks[item.stored_chunk];
        out.emplace_back(chunk.file, chunk.data_offset, item.region, item.target, item.target_box);
      }
      return out;
    };
    ASSERT_EQ(where(*reordered), where(*lp));
    std::vector<std::vector<std::vector<int32_t>>> buffers(targets.size());
    for (size_t i = 0; i < targets.size(); ++i) {
      for (const Box& b : targets[i].boxes) buffers[i].emplace_back(b.volume(), -1);
    }
    for (const ReadItem& item : lp->items) {
      const Box& tbox = targets[item.target].boxes[item.target_box];
      const StoredChunk& chunk = lp->stored[item.target]->chunks[item.stored_chunk];
      ASSERT_TRUE(Contains(tbox, item.region) && Contains(chunk.box, item.region));
      ForEachElement(item.region, [&](const std::vector<int64_t>& p, int64_t) {
        int32_t& dst =
            buffers[item.target][item.target_box][LinearIndex(p, tbox.offsets, tbox.sizes)];
        EXPECT_EQ(dst, -1) << "element read twice";
        dst = files[chunk.file]
                   [chunk.data_offset / 4 + LinearIndex(p, chunk.box.offsets, chunk.box.sizes)];
      });
    }
    for (size_t i = 0; i < targets.size(); ++i) {
      for (size_t b = 0; b < targets[i].boxes.size(); ++b) {
        ForEachElement(targets[i].boxes[b], [&](const std::vector<int64_t>& p, int64_t pos) {
          ASSERT_EQ(buffers[i][b][pos], LinearIndex(p, Shape(p.size(), 0), targets[i].shape))
              << targets[i].name << " box " << targets[i].boxes[b].ToString();
        });
      }
    }
  }
}

TEST(PlanRandomTest, RandomMeshesSaveEveryElementOnceAndLoadItBack) {
  std::mt19937_64 rng(20240601);
  ThreadPool pool(3);
  int grids = 0, other = 0;  // tensors of several chunks whose chunks form a grid, or not
  int cell_tensors = 0;      // tensors a plan made with SavePlanOptions::chunk_cells holds as cells
  int deferred_plans = 0;    // plans made with SavePlanOptions::defer_writes that deferred them
  for (int trial = 0; trial < 400; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    const int64_t world = 1 + rng() % 12;
    std::vector<GlobalTensor> tensors = RandomTensors(rng, world);
    std::vector<LocalSavePlan> locals = LocalPlans(rng, tensors, world);
    SavePlanOptions options;
    options.save_id = "r" + std::to_string(trial);
    options.files_per_rank = 1 + static_cast<int>(rng() % 3);
    options.dedup_to_lowest_rank = rng() % 4 == 0;
    // Plans travel as bytes: go through the codec like the engine does.
    for (LocalSavePlan& local : locals) {
      Result<LocalSavePlan> decoded = DecodeLocalSavePlan(EncodeLocalSavePlan(local));
      ASSERT_TRUE(decoded.ok()) << decoded.status();
      local = std::move(*decoded);
    }
    Result<GlobalSavePlan> plan = PlanSave(locals, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    for (RankSavePlan& rp : plan->ranks) {
      Result<RankSavePlan> decoded = DecodeRankSavePlan(EncodeRankSavePlan(rp));
      ASSERT_TRUE(decoded.ok());
      ASSERT_EQ(*decoded, rp);
    }
    ExpectWrittenOnce(*plan);
    for (const TensorMetadata& tm : plan->metadata.tensors) {
      if (tm.chunks.size() > 1) ++(FindChunkGrid(tm.chunks, tm.shape) ? grids : other);
    }
    Files files = WriteAll(*plan, locals);
    LoadAndCheck(rng, tensors, *plan, files);
    // Again, on a pool: the same plan.
    SavePlanOptions pooled = options;
    pooled.pool = &pool;
    Result<GlobalSavePlan> again = PlanSave(locals, pooled);
    ASSERT_TRUE(again.ok());
    ASSERT_EQ(again->ranks, plan->ranks) << "planning is not deterministic";
    ASSERT_EQ(again->metadata, plan->metadata);
    // With its grid tensors held as cells: the same plan once they are expanded.
    // And with its writes deferred, taken a few ranks at a time (on the pool or not).
    SavePlanOptions as_cells = trial % 2 == 0 ? pooled : options;
    as_cells.chunk_cells = true;
    as_cells.defer_writes = trial % 3 != 0;
    Result<GlobalSavePlan> celled = PlanSave(locals, as_cells);
    ASSERT_TRUE(celled.ok()) << celled.status();
    ASSERT_TRUE(TakeDeferredInRounds(rng, trial % 2 == 0 ? &pool : nullptr, &*celled,
                                     &deferred_plans).ok());
    EXPECT_TRUE(celled->deferred.empty());
    const GlobalSavePlan expanded = WithCellsExpanded(*std::move(celled), &cell_tensors);
    ASSERT_EQ(expanded.ranks, plan->ranks);
    ASSERT_EQ(expanded.metadata, plan->metadata);
    // The coordinator's way: every rank's message decoded into one GatheredPlans.
    GatheredPlans gathered;
    for (const LocalSavePlan& local : locals) {
      ASSERT_TRUE(DecodeLocalSavePlanInto(EncodeLocalSavePlan(local), &gathered).ok());
    }
    Result<GlobalSavePlan> from_messages = PlanSave(gathered, options);
    ASSERT_TRUE(from_messages.ok()) << from_messages.status();
    ASSERT_EQ(from_messages->metadata, plan->metadata);
    ASSERT_EQ(from_messages->ranks, plan->ranks);
  }
  // Device meshes cut every tensor into a grid (the shuffled copies in LoadAndCheck are not).
  EXPECT_GT(grids, 200);
  EXPECT_EQ(other, 0);
  EXPECT_GT(cell_tensors, grids);
  EXPECT_GT(deferred_plans, 50);
}

TEST(PlanRandomTest, BalancedOwnershipSpreadsReplicatedBytes) {
  // 8 ranks, mesh 2 (Shard(0)) x 4 (Replicate): each of the 2 row halves of 16 equal tensors is
  // held by 4 ranks. Balanced ownership gives every rank the same bytes; lowest-rank does not.
  std::vector<LocalSavePlan> locals(8);
  Mesh mesh{{2, 4}, {0, testing::kReplicate}};
  for (int t = 0; t < 16; ++t) {
    for (int64_t r = 0; r < 8; ++r) {
      locals[r].tensors.push_back(LocalTensor{
          "w" + std::to_string(t), DType::kFloat32, {64, 8}, {MeshBox({64, 8}, mesh, r)}});
    }
  }
  for (bool lowest : {false, true}) {
    SavePlanOptions options;
    options.dedup_to_lowest_rank = lowest;
    Result<GlobalSavePlan> plan = PlanSave(locals, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    std::vector<uint64_t> bytes(8, 0);
    for (size_t r = 0; r < 8; ++r) {
      for (const ChunkWrite& w : plan->ranks[r].writes) bytes[r] += w.byte_length;
    }
    if (!lowest) {
      EXPECT_EQ(bytes, std::vector<uint64_t>(8, 16 * 32 * 8 * 4 / 4));
    } else {
      EXPECT_EQ(bytes, (std::vector<uint64_t>{16 * 32 * 8 * 4, 0, 0, 0, 16 * 32 * 8 * 4, 0, 0, 0}));
    }
  }
}

}  // namespace
}  // namespace sp
