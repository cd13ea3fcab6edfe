// Tests of the retention library: step names, listing, gc planning and crash-safe deletion.
#include "shardpoint/manage/retention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "shardpoint/engine/edit_test_util.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/store/fault_store.h"
#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
namespace spt = ::sp::testing;

void Put(Store& store, const std::string& path, std::string_view bytes) {
  Result<std::unique_ptr<WritableFile>> file = store.NewWritableFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE((*file)->WriteAt(0, AsBytes(bytes)).ok());
  ASSERT_TRUE((*file)->Close().ok());
}

void SaveStep(Store& store, const std::string& path, float value) {
  ASSERT_TRUE(store.CreateDirs(path).ok());
  Status s = spt::SaveWhole(&store, path, {spt::Iota("w", {4, 3}, value)});
  ASSERT_TRUE(s.ok()) << s;
}

std::vector<std::string> Removed(const GcPlan& plan) {
  std::vector<std::string> names;
  for (const GcDecision& d : plan.decisions) {
    if (d.remove) names.push_back(d.checkpoint.name);
  }
  return names;
}

TEST(StepOfNameTest, TrailingDecimalNumber) {
  EXPECT_EQ(StepOfName("step_000100"), 100);
  EXPECT_EQ(StepOfName("step-100"), 100);
  EXPECT_EQ(StepOfName("global_step100"), 100);
  EXPECT_EQ(StepOfName("iter_0000100"), 100);
  EXPECT_EQ(StepOfName("ckpt.7"), 7);
  EXPECT_EQ(StepOfName("42"), 42);
  EXPECT_EQ(StepOfName("step_0"), 0);
  EXPECT_EQ(StepOfName("v2_step_30"), 30);
  EXPECT_EQ(StepOfName("999999999999999999"), 999999999999999999);
}

TEST(StepOfNameTest, NotAStep) {
  EXPECT_EQ(StepOfName(""), std::nullopt);
  EXPECT_EQ(StepOfName("latest"), std::nullopt);
  EXPECT_EQ(StepOfName("step_100.tmp"), std::nullopt);
  EXPECT_EQ(StepOfName(".step_100"), std::nullopt);                 // hidden / temporary
  EXPECT_EQ(StepOfName("step_1000000000000000000"), std::nullopt);  // 19 digits: overflow risk
}

TEST(ListCheckpointsTest, FindsStepsCommitsAndLatest) {
  MemoryStore store;
  SaveStep(store, "/run/step_000100", 1);
  SaveStep(store, "/run/step-200", 2);
  ASSERT_TRUE(store.CreateDirs("/run/global_step300").ok());  // a save in progress
  Put(store, "/run/global_step300/d-x-r00000-f000.safetensors.tmp", "partial");
  ASSERT_TRUE(store.CreateDirs("/run/iter_0000050").ok());  // PyTorch DCP
  Put(store, "/run/iter_0000050/.metadata", "dcp");
  Put(store, "/run/iter_0000050/__0_0.distcp", "0123456789");
  ASSERT_TRUE(store.CreateDirs("/run/step_400").ok());  // damaged native metadata
  Put(store, "/run/step_400/shardpoint.metadata", "not a metadata file");
  ASSERT_TRUE(store.CreateDirs("/run/logs").ok());
  ASSERT_TRUE(store.CreateDirs("/run/.step_500").ok());
  Put(store, "/run/step_600", "a plain file");

  Result<CheckpointListing> listing = ListCheckpoints("/run", &store);
  ASSERT_TRUE(listing.ok()) << listing.status();
  std::vector<std::string> names;
  for (const StepCheckpoint& c : listing->checkpoints) names.push_back(c.name);
  EXPECT_THAT(names,
              ElementsAre("iter_0000050", "step_000100", "step-200", "global_step300", "step_400"));
  const auto& c = listing->checkpoints;
  EXPECT_EQ(c[0].step, 50);
  EXPECT_TRUE(c[0].committed);
  EXPECT_EQ(c[0].format, "torch-dcp");
  EXPECT_EQ(c[0].bytes, 13u);
  EXPECT_EQ(c[0].path, "/run/iter_0000050");
  EXPECT_TRUE(c[1].committed);
  EXPECT_EQ(c[1].format, "native");
  EXPECT_TRUE(c[2].committed);
  EXPECT_FALSE(c[3].committed);
  EXPECT_EQ(c[3].bytes, 7u);
  EXPECT_FALSE(c[4].committed);
  EXPECT_THAT(c[4].problem, HasSubstr("/run/step_400/shardpoint.metadata"));
  ASSERT_NE(listing->latest_checkpoint(), nullptr);
  EXPECT_EQ(listing->latest_checkpoint()->name, "step-200");

  // The native size is every file's bytes: the metadata plus the data files it names.
  Result<CheckpointMetadata> md = ReadCheckpointMetadata("/run/step-200", &store);
  ASSERT_TRUE(md.ok());
  uint64_t expected = store.ReadFile("/run/step-200/shardpoint.metadata")->size();
  for (const DataFile& f : md->files) expected += f.size;
  EXPECT_EQ(c[2].bytes, expected);
}

TEST(ListCheckpointsTest, MissingDirectoryAndFile) {
  MemoryStore store;
  Result<CheckpointListing> missing = ListCheckpoints("/nowhere", &store);
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound) << missing.status();
  Put(store, "/file", "x");
  Result<CheckpointListing> file = ListCheckpoints("/file", &store);
  EXPECT_EQ(file.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(file.status().message(), HasSubstr("/file is not a directory"));
}

TEST(ListCheckpointsTest, EmptyDirectoryHasNoLatest) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs("/run").ok());
  Result<CheckpointListing> listing = ListCheckpoints("/run", &store);
  ASSERT_TRUE(listing.ok());
  EXPECT_TRUE(listing->checkpoints.empty());
  EXPECT_EQ(listing->latest_checkpoint(), nullptr);
}

// A listing of committed checkpoints at the given steps ("step_<n>"), plus uncommitted ones.
CheckpointListing Synthetic(const std::vector<int64_t>& committed,
                            const std::vector<int64_t>& uncommitted = {}) {
  CheckpointListing listing;
  std::map<int64_t, bool> steps;
  for (int64_t s : committed) steps[s] = true;
  for (int64_t s : uncommitted) steps[s] = false;
  for (const auto& [step, ok] : steps) {
    StepCheckpoint c;
    c.step = step;
    c.name = "step_" + std::to_string(step);
    c.path = "/run/" + c.name;
    c.committed = ok;
    c.bytes = 10;
    if (ok) listing.latest = listing.checkpoints.size();
    listing.checkpoints.push_back(c);
  }
  return listing;
}

TEST(PlanGcTest, KeepLastAndKeepEvery) {
  CheckpointListing listing = Synthetic({100, 200, 300, 400, 500, 600, 700});
  Result<GcPlan> plan = PlanGc(listing, {2, 0});
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(Removed(*plan),
              ElementsAre("step_100", "step_200", "step_300", "step_400", "step_500"));
  EXPECT_EQ(plan->removals(), 5u);
  EXPECT_EQ(plan->bytes_to_remove(), 50u);
  EXPECT_EQ(plan->decisions[6].reason, "latest");
  EXPECT_EQ(plan->decisions[5].reason, "keep-last");
  EXPECT_EQ(plan->decisions[0].reason, "expired");

  plan = PlanGc(listing, {1, 300});
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(Removed(*plan), ElementsAre("step_100", "step_200", "step_400", "step_500"));
  EXPECT_EQ(plan->decisions[2].reason, "keep-every");
}

TEST(PlanGcTest, NeverRemovesTheNewestCommittedOrAnUncommitted) {
  // Uncommitted steps newer and older than the newest committed one; keep_last counts committed
  // checkpoints only.
  CheckpointListing listing = Synthetic({100, 200, 300}, {50, 250, 400});
  Result<GcPlan> plan = PlanGc(listing, {1, 0});
  ASSERT_TRUE(plan.ok());
  EXPECT_THAT(Removed(*plan), ElementsAre("step_100", "step_200"));
  for (const GcDecision& d : plan->decisions) {
    if (!d.checkpoint.committed) {
      EXPECT_EQ(d.reason, "uncommitted") << d.checkpoint.name;
    }
  }
  // Only uncommitted ones: nothing goes.
  plan = PlanGc(Synthetic({}, {1, 2, 3}), {1, 0});
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(Removed(*plan).empty());
  // One committed one: it is the latest.
  plan = PlanGc(Synthetic({5}), {1, 0});
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(Removed(*plan).empty());
}

TEST(PlanGcTest, BadPolicy) {
  EXPECT_THAT(PlanGc(Synthetic({1}), {0, 0}).status().message(),
              HasSubstr("keep_last must be at least 1, got 0"));
  EXPECT_THAT(PlanGc(Synthetic({1}), {1, -3}).status().message(),
              HasSubstr("keep_every must be 0 (off) or positive, got -3"));
}

TEST(ExecuteGcTest, RemovesExactlyThePlannedDirectories) {
  MemoryStore store;
  for (int step : {1, 2, 3, 4}) SaveStep(store, "/run/step_" + std::to_string(step), step);
  ASSERT_TRUE(store.CreateDirs("/run/step_0/sub").ok());  // uncommitted, older than all
  Put(store, "/run/step_0/sub/x", "x");
  Result<CheckpointListing> listing = ListCheckpoints("/run", &store);
  ASSERT_TRUE(listing.ok());
  Result<GcPlan> plan = PlanGc(*listing, {2, 0});
  ASSERT_TRUE(plan.ok());
  Result<std::vector<std::string>> removed = ExecuteGc(*plan, &store);
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_THAT(*removed, ElementsAre("/run/step_1", "/run/step_2"));
  std::set<std::string> left;
  const std::vector<DirEntry> entries = store.ListDir("/run").value();
  for (const DirEntry& e : entries) left.insert(e.name);
  EXPECT_EQ(left, (std::set<std::string>{"step_0", "step_3", "step_4"}));
  Result<std::vector<std::byte>> w = spt::LoadWhole(&store, "/run/step_4", "w");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->size(), 48u);
}

TEST(DeleteCheckpointTest, RemovesTheCommitPointFirstAndSyncsIt) {
  MemoryStore base;
  SaveStep(base, "/run/step_1", 1);
  FaultStore fault(&base);
  // The first data-file removal fails: by then the metadata must be gone, durably.
  fault.FailMatching(FaultStore::Op::kRemove, "/d-", UnavailableError("disk gone"));
  Status s = DeleteCheckpoint("/run/step_1", &fault);
  EXPECT_THAT(s.message(), HasSubstr("disk gone"));
  ASSERT_TRUE(fault.SimulateCrash().ok());
  EXPECT_FALSE(base.Exists("/run/step_1/shardpoint.metadata").value());
  Result<CheckpointListing> listing = ListCheckpoints("/run", &base);
  ASSERT_TRUE(listing.ok());
  ASSERT_EQ(listing->checkpoints.size(), 1u);
  EXPECT_FALSE(listing->checkpoints[0].committed);
}

// A crash after every number of changes: the checkpoint is either still committed and sound, or
// uncommitted (never loadable), or gone; never committed with missing data.
TEST(DeleteCheckpointTest, CrashSweep) {
  std::set<std::string> outcomes;
  for (int64_t budget = 0;; ++budget) {
    ASSERT_LT(budget, 1000);
    MemoryStore base;
    SaveStep(base, "/run/step_7", 7);
    SaveStep(base, "/run/step_8", 8);
    FaultStore fault(&base);
    spt::StopAfterStore stop(&fault, budget);
    Status s = DeleteCheckpoint("/run/step_7", &stop);
    ASSERT_TRUE(fault.SimulateCrash().ok());
    Result<CheckpointListing> listing = ListCheckpoints("/run", &base);
    ASSERT_TRUE(listing.ok()) << listing.status();
    ASSERT_EQ(listing->latest_checkpoint()->name, "step_8");
    if (listing->checkpoints.size() == 1) {
      outcomes.insert("gone");
    } else if (listing->checkpoints[0].committed) {
      Result<VerifyReport> report = Verify("/run/step_7", &base);
      ASSERT_TRUE(report.ok()) << report.status();
      ASSERT_TRUE(report->ok()) << "budget " << budget << ": " << report->defects[0];
      outcomes.insert("committed");
    } else {
      EXPECT_FALSE(ReadCheckpointMetadata("/run/step_7", &base).ok());
      outcomes.insert("uncommitted");
    }
    if (!stop.stopped()) {
      ASSERT_TRUE(s.ok()) << s;
      break;
    }
  }
  EXPECT_EQ(outcomes, (std::set<std::string>{"committed", "uncommitted", "gone"}));
}

}  // namespace
}  // namespace sp
