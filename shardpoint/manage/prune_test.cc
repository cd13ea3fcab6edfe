// Tests of Prune: what it removes and rewrites, what it leaves byte for byte, its errors, and a
// crash at every step (FaultStore) leaving the old or the new checkpoint.
#include "shardpoint/manage/prune.h"

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

constexpr char kPath[] = "/ckpt";

// Two ranks. "model.*" is split between them; "optim.a" is split too (so both ranks' main files
// mix kept and pruned chunks); "optim.b" lives on rank 1 only, in its own file with
// files_per_rank 2; "extra" lives whole on rank 0.
std::vector<spt::WholeTensor> Tensors() {
  return {spt::Iota("model.w", {8, 4}, 0), spt::Iota("model.b", {8}, 100),
          spt::Iota("optim.a", {8, 4}, 200), spt::Iota("optim.b", {64, 16}, 300, 1),
          spt::Iota("extra", {3, 3}, 400, 0)};
}

std::vector<ObjectEntry> Objects() {
  return {{"optim.step", ObjectEncoding::kJson, "12"}, {"train.step", ObjectEncoding::kJson, "7"}};
}

void SaveSample(Store& store, int files_per_rank = 1) {
  ASSERT_TRUE(store.CreateDirs(kPath).ok());
  SaveOptions options;
  options.files_per_rank = files_per_rank;
  options.checksum_block_bytes = 64;  // several blocks per chunk
  Status s = spt::SaveWhole(&store, kPath, Tensors(), Objects(), 2, options);
  ASSERT_TRUE(s.ok()) << s;
}

std::map<std::string, std::string> Files(Store& store) {
  std::map<std::string, std::string> files;
  const std::vector<DirEntry> entries = store.ListDir(kPath).value();
  for (const DirEntry& e : entries) {
    files[e.name] = store.ReadFile(JoinPath(kPath, e.name)).value();
  }
  return files;
}

// Every tensor of `expected` loads bit-exact from the checkpoint and it has no others; Verify is
// clean.
void ExpectHolds(Store& store, const std::vector<std::string>& names) {
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &store);
  ASSERT_TRUE(md.ok()) << md.status();
  std::vector<std::string> stored;
  for (const TensorMetadata& t : md->tensors) stored.push_back(t.name);
  std::vector<std::string> sorted = names;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(stored, sorted);
  for (const spt::WholeTensor& t : Tensors()) {
    if (std::find(names.begin(), names.end(), t.name) == names.end()) continue;
    Result<std::vector<std::byte>> bytes = spt::LoadWhole(&store, kPath, t.name);
    ASSERT_TRUE(bytes.ok()) << t.name << ": " << bytes.status();
    EXPECT_TRUE(*bytes == t.bytes) << t.name;
  }
  Result<VerifyReport> report = Verify(kPath, &store);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << report->defects[0];
}

TEST(PruneTest, RemovesPrefixRewritesOnlyAffectedFiles) {
  MemoryStore store;
  SaveSample(store, 2);
  const std::map<std::string, std::string> before = Files(store);
  Result<CheckpointMetadata> old_md = ReadCheckpointMetadata(kPath, &store);
  ASSERT_TRUE(old_md.ok());

  Result<PruneReport> report = Prune(kPath, {"optim."}, {&store});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->tensors_removed, ElementsAre("optim.a", "optim.b"));
  EXPECT_THAT(report->objects_removed, ElementsAre("optim.step"));
  EXPECT_EQ(report->tensor_bytes_removed, (32u + 1024u) * 4);
  ExpectHolds(store, {"model.w", "model.b", "extra"});

  Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &store);
  ASSERT_TRUE(md.ok());
  EXPECT_EQ(md->save_id, old_md->save_id);
  ASSERT_EQ(md->objects.size(), 1u);
  EXPECT_EQ(md->objects[0].name, "train.step");
  EXPECT_EQ(md->objects[0].payload, "7");

  // Untouched files keep their names and bytes; every old file that held a pruned chunk is gone;
  // the directory holds exactly the metadata and the files it names.
  const std::map<std::string, std::string> after = Files(store);
  for (const std::string& name : report->files_untouched) {
    ASSERT_TRUE(after.count(name)) << name;
    EXPECT_EQ(after.at(name), before.at(name)) << name;
  }
  std::set<std::string> expected = {kMetadataFileName};
  for (const DataFile& f : md->files) expected.insert(f.name);
  std::set<std::string> found;
  for (const auto& [name, bytes] : after) found.insert(name);
  EXPECT_EQ(found, expected);
  for (const std::string& name : report->files_rewritten) EXPECT_FALSE(after.count(name)) << name;
  for (const std::string& name : report->files_dropped) EXPECT_FALSE(after.count(name)) << name;
  EXPECT_EQ(report->files_written.size(), report->files_rewritten.size());
  EXPECT_FALSE(report->files_written.empty());
  EXPECT_EQ(report->files_untouched.size() + report->files_rewritten.size() +
                report->files_dropped.size(),
            old_md->files.size());
  // optim.b (64 KiB, largest) sits alone in rank 1's second file: dropped, not rewritten.
  EXPECT_EQ(report->files_dropped.size(), 1u);
}

TEST(PruneTest, FileWithoutPrunedChunksStaysByteForByte) {
  MemoryStore store;
  SaveSample(store, 2);
  // "extra" lives on rank 0 alone; with two files on rank 0, pruning it leaves at least one file
  // untouched.
  Result<PruneReport> report = Prune(kPath, {"extra"}, {&store});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_FALSE(report->files_untouched.empty());
  ExpectHolds(store, {"model.w", "model.b", "optim.a", "optim.b"});
}

TEST(PruneTest, DryRunChangesNothing) {
  MemoryStore store;
  SaveSample(store);
  const auto before = Files(store);
  PruneOptions options{&store, true};
  Result<PruneReport> report = Prune(kPath, {"model.", "train."}, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_THAT(report->tensors_removed, ElementsAre("model.b", "model.w"));
  EXPECT_THAT(report->objects_removed, ElementsAre("train.step"));
  EXPECT_EQ(Files(store), before);
}

TEST(PruneTest, PrefixMatchingNothingIsAnErrorNamingIt) {
  MemoryStore store;
  SaveSample(store);
  const auto before = Files(store);
  Result<PruneReport> report = Prune(kPath, {"optim.", "nothing.here"}, {&store});
  EXPECT_EQ(report.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(report.status().message(),
              HasSubstr("prefix 'nothing.here' matches no tensor or object in /ckpt"));
  EXPECT_EQ(Files(store), before);
  EXPECT_EQ(Prune(kPath, {}, {&store}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(Prune(kPath, {""}, {&store}).status().message(), HasSubstr("empty prefix"));
  EXPECT_EQ(Prune("/none", {"x"}, {&store}).status().code(), StatusCode::kNotFound);
}

TEST(PruneTest, CorruptChunkStopsThePruneAndChangesNothing) {
  MemoryStore store;
  SaveSample(store);
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &store);
  ASSERT_TRUE(md.ok());
  // Flip a byte of model.w's first chunk: it has to be copied when optim.a is pruned.
  const TensorMetadata* w = md->FindTensor("model.w");
  const StoredChunk& c = w->chunks[0];
  const std::string file = JoinPath(kPath, md->files[c.file].name);
  std::string bytes = store.ReadFile(file).value();
  bytes[md->files[c.file].data_start + c.data_offset + 5] ^= 0x40;
  {
    auto out = store.NewWritableFile(file).value();
    ASSERT_TRUE(out->WriteAt(0, AsBytes(bytes)).ok());
    ASSERT_TRUE(out->Close().ok());
  }
  const auto before = Files(store);
  Result<PruneReport> report = Prune(kPath, {"optim.a"}, {&store});
  EXPECT_EQ(report.status().code(), StatusCode::kDataLoss) << report.status();
  EXPECT_THAT(report.status().message(), HasSubstr("model.w"));
  EXPECT_EQ(Files(store), before);
}

TEST(PruneTest, SecondPruneOfAPrunedCheckpoint) {
  MemoryStore store;
  SaveSample(store);
  ASSERT_TRUE(Prune(kPath, {"optim.a"}, {&store}).ok());
  ASSERT_TRUE(Prune(kPath, {"model.b"}, {&store}).ok());
  ExpectHolds(store, {"model.w", "optim.b", "extra"});
}

// The machine stops after every number of changes and crashes: the checkpoint is then the old
// one or the new one, whole, bit-exact and clean under Verify.
TEST(PruneTest, CrashSweepLeavesOldOrNew) {
  std::set<std::string> outcomes;
  for (int64_t budget = 0;; ++budget) {
    ASSERT_LT(budget, 1000);
    MemoryStore base;
    SaveSample(base, 2);
    FaultStore fault(&base);
    spt::StopAfterStore stop(&fault, budget);
    Result<PruneReport> report = Prune(kPath, {"optim."}, {&stop});
    ASSERT_TRUE(fault.SimulateCrash().ok());
    Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &base);
    ASSERT_TRUE(md.ok()) << "budget " << budget << ": " << md.status();
    if (md->FindTensor("optim.a") != nullptr) {
      SCOPED_TRACE("old, budget " + std::to_string(budget));
      ExpectHolds(base, {"model.w", "model.b", "optim.a", "optim.b", "extra"});
      outcomes.insert("old");
    } else {
      SCOPED_TRACE("new, budget " + std::to_string(budget));
      ExpectHolds(base, {"model.w", "model.b", "extra"});
      outcomes.insert("new");
    }
    if (!stop.stopped()) {
      ASSERT_TRUE(report.ok()) << report.status();
      break;
    }
  }
  EXPECT_EQ(outcomes, (std::set<std::string>{"old", "new"}));
}

// Megatron's separation_hint: a save that separates "optim." writes files holding only optimizer
// chunks or none, loads back bit-exact, and a prune of "optim." then only drops whole files.
TEST(PruneTest, SeparatedSaveRoundTripsAndPrunesByDroppingFiles) {
  MemoryStore store;
  ASSERT_TRUE(store.CreateDirs(kPath).ok());
  SaveOptions options;
  options.separate_key_prefixes = {"optim."};
  Status saved = spt::SaveWhole(&store, kPath, Tensors(), Objects(), 2, options);
  ASSERT_TRUE(saved.ok()) << saved;
  ExpectHolds(store, {"model.w", "model.b", "optim.a", "optim.b", "extra"});
  Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &store);
  ASSERT_TRUE(md.ok());
  std::map<uint32_t, std::set<bool>> kinds;  // file -> {holds optim chunks?}
  for (const TensorMetadata& t : md->tensors) {
    for (const StoredChunk& c : t.chunks) kinds[c.file].insert(t.name.starts_with("optim."));
  }
  ASSERT_EQ(kinds.size(), 4u);  // two ranks, each with a model file and an optimizer file
  for (const auto& [file, k] : kinds) EXPECT_EQ(k.size(), 1u) << md->files[file].name;

  Result<PruneReport> report = Prune(kPath, {"optim."}, {&store});
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->files_rewritten.empty());
  EXPECT_EQ(report->files_dropped.size(), 2u);
  EXPECT_EQ(report->files_untouched.size(), 2u);
  EXPECT_EQ(report->bytes_copied, 0u);
  ExpectHolds(store, {"model.w", "model.b", "extra"});
}

}  // namespace
}  // namespace sp
