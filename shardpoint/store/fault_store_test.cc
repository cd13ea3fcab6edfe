#include "shardpoint/store/fault_store.h"

#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shardpoint/store/memory_store.h"

namespace sp {
namespace {

using ::testing::HasSubstr;
using Op = FaultStore::Op;

#define SP_ASSERT_OK(expr)                                                      \
  do {                                                                          \
    ::sp::Status sp_assert_status_ = (expr);                                    \
    ASSERT_TRUE(sp_assert_status_.ok()) << #expr << ": " << sp_assert_status_; \
  } while (0)

class FaultStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(base_.CreateDirs("/ckpt").ok()); }

  // Creates `path` through the fault store; syncs the file when asked (the directory never).
  Status Write(std::string_view path, std::string_view content, bool sync) {
    SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs_.NewWritableFile(path));
    SP_RETURN_IF_ERROR(file->WriteAt(0, AsBytes(content)));
    if (sync) SP_RETURN_IF_ERROR(file->Sync());
    return file->Close();
  }

  // Writes `path` in the base store directly: it existed before the fault store touched it.
  void Preexisting(std::string_view path, std::string_view content) {
    auto file = base_.NewWritableFile(path);
    ASSERT_TRUE(file.ok());
    ASSERT_TRUE((*file)->WriteAt(0, AsBytes(content)).ok());
    ASSERT_TRUE((*file)->Close().ok());
  }

  // The content of `path` in the base store, or nullopt when it does not exist.
  std::optional<std::string> Content(std::string_view path) {
    auto read = base_.ReadFile(path);
    if (!read.ok()) return std::nullopt;
    return *read;
  }

  bool Exists(std::string_view path) {
    auto exists = base_.Exists(path);
    return exists.ok() && *exists;
  }

  MemoryStore base_;
  FaultStore fs_{&base_};
};

// ---------------------------------------------------------------------------------------------
// Error injection.

// WriteFileDurably (store.h): the old content survives a failure at every step, a temporary that
// could not be written is removed, and the new content replaces the old when every step succeeds.
TEST_F(FaultStoreTest, WriteFileDurablyKeepsTheOldFileOnEveryFailure) {
  Preexisting("/ckpt/meta", "old");
  for (Op op : {Op::kCreate, Op::kWrite, Op::kSync, Op::kClose, Op::kRename}) {
    fs_.FailNext(op, UnavailableError("device detached"));
    Status status = WriteFileDurably(fs_, "/ckpt", "meta", "meta.tmp-1", "new");
    EXPECT_EQ(status.code(), StatusCode::kUnavailable) << FaultStore::OpName(op);
    EXPECT_NE(status.message().find("device detached"), std::string::npos) << status;
    EXPECT_EQ(Content("/ckpt/meta"), "old") << FaultStore::OpName(op);
    // Left after a failed rename only, holding all of the new content.
    if (op == Op::kRename) {
      EXPECT_EQ(Content("/ckpt/meta.tmp-1"), "new");
    } else {
      EXPECT_FALSE(Exists("/ckpt/meta.tmp-1")) << FaultStore::OpName(op);
    }
  }
  SP_ASSERT_OK(WriteFileDurably(fs_, "/ckpt", "meta", "meta.tmp-1", "new"));
  EXPECT_EQ(Content("/ckpt/meta"), "new");
  EXPECT_FALSE(Exists("/ckpt/meta.tmp-1"));
  // Once the directory is synced, a crash keeps the new content: the file was synced before
  // the rename.
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/meta"), "new");
}

TEST_F(FaultStoreTest, FailNextFailsExactlyCountCallsAndChangesNothing) {
  auto file = fs_.NewWritableFile("/ckpt/f");
  ASSERT_TRUE(file.ok());
  fs_.FailNext(Op::kWrite, ResourceExhaustedError("No space left on device"), 2);
  Status first = (*file)->WriteAt(8, AsBytes("lost"));
  EXPECT_EQ(first.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(first.message(), "write /ckpt/f at offset 8: No space left on device");
  EXPECT_EQ((*file)->WriteAt(0, AsBytes("lost")).code(), StatusCode::kResourceExhausted);
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes("kept")));
  EXPECT_EQ(Content("/ckpt/f"), "kept");
  EXPECT_EQ(fs_.count(Op::kWrite), 3);
}

TEST_F(FaultStoreTest, FailMatchingHitsOnlyMatchingPathsUntilCleared) {
  fs_.FailMatching(Op::kCreate, ".tmp", UnavailableError("device detached"));
  for (int i = 0; i < 2; ++i) {
    Status status = Write("/ckpt/meta.tmp", "x", true);
    EXPECT_EQ(status.code(), StatusCode::kUnavailable);
    EXPECT_EQ(status.message(), "create /ckpt/meta.tmp: device detached");
  }
  EXPECT_FALSE(Exists("/ckpt/meta.tmp"));
  SP_ASSERT_OK(Write("/ckpt/data", "x", true));
  fs_.ClearFaults();
  SP_ASSERT_OK(Write("/ckpt/meta.tmp", "x", true));
  EXPECT_EQ(fs_.count(Op::kCreate), 4);
}

TEST_F(FaultStoreTest, RenameFaultMatchesEitherPathAndLeavesTheSource) {
  SP_ASSERT_OK(Write("/ckpt/x.tmp", "new", true));
  fs_.FailMatching(Op::kRename, ".metadata", DataLossError("I/O error"));
  Status status = fs_.Rename("/ckpt/x.tmp", "/ckpt/.metadata");
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "rename /ckpt/x.tmp to /ckpt/.metadata: I/O error");
  EXPECT_EQ(Content("/ckpt/x.tmp"), "new");
  EXPECT_FALSE(Exists("/ckpt/.metadata"));
}

// Each op in turn: one injected failure names the operation and the path, then the op works.
TEST_F(FaultStoreTest, EveryOpCanFailOnce) {
  SP_ASSERT_OK(Write("/ckpt/r", "readable", true));
  auto writer = fs_.NewWritableFile("/ckpt/w");
  ASSERT_TRUE(writer.ok());
  auto reader = fs_.OpenReadable("/ckpt/r");
  ASSERT_TRUE(reader.ok());
  std::string buffer(4, '\0');
  struct Case {
    Op op;
    std::string path;
    std::function<Status()> call;
  };
  std::vector<Case> cases = {
      {Op::kCreate, "/ckpt/c", [&] { return fs_.NewWritableFile("/ckpt/c").status(); }},
      {Op::kWrite, "/ckpt/w", [&] { return (*writer)->WriteAt(0, AsBytes("abc")); }},
      {Op::kSync, "/ckpt/w", [&] { return (*writer)->Sync(); }},
      {Op::kRename, "/ckpt/c", [&] { return fs_.Rename("/ckpt/c", "/ckpt/c2"); }},
      {Op::kSyncDir, "/ckpt", [&] { return fs_.SyncDir("/ckpt"); }},
      {Op::kOpen, "/ckpt/r", [&] { return fs_.OpenReadable("/ckpt/r").status(); }},
      {Op::kRead, "/ckpt/r",
       [&] { return (*reader)->ReadAt(0, AsMutableBytes(buffer.data(), 4)); }},
      {Op::kRemove, "/ckpt/c2", [&] { return fs_.RemoveFile("/ckpt/c2"); }},
      {Op::kCreateDirs, "/ckpt/d", [&] { return fs_.CreateDirs("/ckpt/d"); }},
      {Op::kList, "/ckpt/d", [&] { return fs_.ListDir("/ckpt/d").status(); }},
      {Op::kRemove, "/ckpt/d", [&] { return fs_.RemoveDir("/ckpt/d"); }},
  };
  for (const Case& c : cases) {
    fs_.FailNext(c.op, InternalError("injected"));
    Status failed = c.call();
    EXPECT_EQ(failed.code(), StatusCode::kInternal) << FaultStore::OpName(c.op);
    EXPECT_THAT(failed.message(), HasSubstr(c.path));
    EXPECT_THAT(failed.message(), HasSubstr(": injected"));
    Status retried = c.call();
    EXPECT_TRUE(retried.ok()) << FaultStore::OpName(c.op) << ": " << retried;
  }
  EXPECT_EQ(Content("/ckpt/w"), "abc");
  EXPECT_FALSE(Exists("/ckpt/d"));
  EXPECT_FALSE(Exists("/ckpt/c2"));
}

TEST_F(FaultStoreTest, FailedCloseStillReleasesTheHandle) {
  auto file = fs_.NewWritableFile("/ckpt/f");
  ASSERT_TRUE(file.ok());
  fs_.FailNext(Op::kClose, DataLossError("Input/output error"));
  Status status = (*file)->Close();
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_EQ(status.message(), "close /ckpt/f: Input/output error");
  EXPECT_EQ((*file)->Close().code(), StatusCode::kFailedPrecondition);
}

TEST_F(FaultStoreTest, CountsEveryCall) {
  SP_ASSERT_OK(fs_.CreateDirs("/ckpt/a/b"));
  SP_ASSERT_OK(Write("/ckpt/a/b/f", "x", true));
  fs_.FailNext(Op::kOpen, NotFoundError("gone"));
  EXPECT_FALSE(fs_.ReadFile("/ckpt/a/b/f").ok());
  ASSERT_TRUE(fs_.ReadFile("/ckpt/a/b/f").ok());
  EXPECT_EQ(fs_.count(Op::kCreateDirs), 1);
  EXPECT_EQ(fs_.count(Op::kCreate), 1);
  EXPECT_EQ(fs_.count(Op::kWrite), 1);
  EXPECT_EQ(fs_.count(Op::kSync), 1);
  EXPECT_EQ(fs_.count(Op::kClose), 1);
  EXPECT_EQ(fs_.count(Op::kOpen), 2);
  EXPECT_EQ(fs_.count(Op::kRead), 1);
  EXPECT_EQ(fs_.count(Op::kRename), 0);
  fs_.ResetCounts();
  EXPECT_EQ(fs_.count(Op::kOpen), 0);
  EXPECT_EQ(fs_.name(), "fault(memory)");
}

// ---------------------------------------------------------------------------------------------
// Crash simulation.

TEST_F(FaultStoreTest, CrashDropsUnsyncedWrites) {
  auto file = fs_.NewWritableFile("/ckpt/f");
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes("version one")));
  SP_ASSERT_OK((*file)->Sync());
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes("VERSION")));
  SP_ASSERT_OK((*file)->WriteAt(100, AsBytes("beyond")));
  EXPECT_EQ(Content("/ckpt/f")->size(), 106u);
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/f"), "version one");
}

TEST_F(FaultStoreTest, FailedSyncMakesNothingDurable) {
  auto file = fs_.NewWritableFile("/ckpt/f");
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes("data")));
  fs_.FailNext(Op::kSync, DataLossError("Input/output error"));
  EXPECT_FALSE((*file)->Sync().ok());
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/f"), "");
}

TEST_F(FaultStoreTest, FileNeverSyncedBecomesEmpty) {
  SP_ASSERT_OK(Write("/ckpt/f", "unsynced", /*sync=*/false));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/f"), "");
}

TEST_F(FaultStoreTest, FileWhoseDirectoryWasNeverSyncedDisappears) {
  SP_ASSERT_OK(Write("/ckpt/f", "synced data", /*sync=*/true));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_FALSE(Exists("/ckpt/f"));
  EXPECT_TRUE(Exists("/ckpt"));  // it existed before the fault store touched it
}

TEST_F(FaultStoreTest, UnsyncedRenameIsRevertedWithTheFileItReplaced) {
  Preexisting("/ckpt/.metadata", "old metadata");
  SP_ASSERT_OK(Write("/ckpt/.metadata.tmp", "new metadata", true));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.Rename("/ckpt/.metadata.tmp", "/ckpt/.metadata"));
  EXPECT_EQ(Content("/ckpt/.metadata"), "new metadata");
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/.metadata"), "old metadata");
  EXPECT_EQ(Content("/ckpt/.metadata.tmp"), "new metadata");
}

TEST_F(FaultStoreTest, SyncedRenameSurvives) {
  Preexisting("/ckpt/.metadata", "old metadata");
  SP_ASSERT_OK(Write("/ckpt/.metadata.tmp", "new metadata", true));
  SP_ASSERT_OK(fs_.Rename("/ckpt/.metadata.tmp", "/ckpt/.metadata"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/.metadata"), "new metadata");
  EXPECT_FALSE(Exists("/ckpt/.metadata.tmp"));
}

TEST_F(FaultStoreTest, DurableContentFollowsTheFileAcrossRename) {
  auto file = fs_.NewWritableFile("/ckpt/tmp");
  ASSERT_TRUE(file.ok());
  SP_ASSERT_OK((*file)->WriteAt(0, AsBytes("synced")));
  SP_ASSERT_OK((*file)->Sync());
  SP_ASSERT_OK(fs_.Rename("/ckpt/tmp", "/ckpt/final"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK((*file)->WriteAt(6, AsBytes(" and more")));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/final"), "synced");
  EXPECT_FALSE(Exists("/ckpt/tmp"));
}

TEST_F(FaultStoreTest, UnsyncedRemovalIsUndone) {
  Preexisting("/ckpt/d-0", "chunk bytes");
  SP_ASSERT_OK(fs_.RemoveFile("/ckpt/d-0"));
  EXPECT_FALSE(Exists("/ckpt/d-0"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/d-0"), "chunk bytes");
  SP_ASSERT_OK(fs_.RemoveFile("/ckpt/d-0"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_FALSE(Exists("/ckpt/d-0"));
}

TEST_F(FaultStoreTest, TruncatingAnExistingFileIsUndoneUntilSynced) {
  Preexisting("/ckpt/.metadata", "committed");
  SP_ASSERT_OK(Write("/ckpt/.metadata", "partial", /*sync=*/false));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/.metadata"), "committed");
  SP_ASSERT_OK(Write("/ckpt/.metadata", "rewritten", /*sync=*/true));
  SP_ASSERT_OK(fs_.SimulateCrash());  // no SyncDir needed: the entry was already durable
  EXPECT_EQ(Content("/ckpt/.metadata"), "rewritten");
}

TEST_F(FaultStoreTest, DirectoryLostWithItsContentsWhenItsParentWasNotSynced) {
  SP_ASSERT_OK(fs_.CreateDirs("/ckpt/step-1/shards"));
  SP_ASSERT_OK(Write("/ckpt/step-1/shards/d-0", "data", true));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/step-1/shards"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/step-1"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_FALSE(Exists("/ckpt/step-1"));

  SP_ASSERT_OK(fs_.CreateDirs("/ckpt/step-1/shards"));
  SP_ASSERT_OK(Write("/ckpt/step-1/shards/d-0", "data", true));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/step-1/shards"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/step-1"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/step-1/shards/d-0"), "data");
}

TEST_F(FaultStoreTest, UnsyncedDirectoryRenameIsReverted) {
  SP_ASSERT_OK(fs_.CreateDirs("/ckpt/staging"));
  SP_ASSERT_OK(Write("/ckpt/staging/d-0", "data", true));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/staging"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.Rename("/ckpt/staging", "/ckpt/step-1"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/staging/d-0"), "data");
  EXPECT_FALSE(Exists("/ckpt/step-1"));

  SP_ASSERT_OK(fs_.Rename("/ckpt/staging", "/ckpt/step-1"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/step-1/d-0"), "data");
  EXPECT_FALSE(Exists("/ckpt/staging"));
}

TEST_F(FaultStoreTest, UnsyncedRenameOfAPreexistingTreeIsReverted) {
  ASSERT_TRUE(base_.CreateDirs("/ckpt/step-1/shards").ok());
  Preexisting("/ckpt/step-1/.metadata", "meta");
  Preexisting("/ckpt/step-1/shards/d-0", "chunk");
  Preexisting("/ckpt/untouched", "same");
  SP_ASSERT_OK(fs_.Rename("/ckpt/step-1", "/ckpt/trash"));
  SP_ASSERT_OK(fs_.RemoveFile("/ckpt/trash/shards/d-0"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/trash/shards"));  // durable inside the moved directory
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/step-1/.metadata"), "meta");
  EXPECT_FALSE(Exists("/ckpt/step-1/shards/d-0"));
  EXPECT_TRUE(Exists("/ckpt/step-1/shards"));
  EXPECT_FALSE(Exists("/ckpt/trash"));
  EXPECT_EQ(Content("/ckpt/untouched"), "same");
}

TEST_F(FaultStoreTest, UnsyncedRemovalOfADirectoryBringsBackItsDurableEntries) {
  SP_ASSERT_OK(fs_.CreateDirs("/ckpt/old"));
  SP_ASSERT_OK(Write("/ckpt/old/d-0", "chunk", true));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/old"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.RemoveFile("/ckpt/old/d-0"));
  SP_ASSERT_OK(fs_.RemoveDir("/ckpt/old"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/old/d-0"), "chunk");

  SP_ASSERT_OK(fs_.RemoveFile("/ckpt/old/d-0"));
  SP_ASSERT_OK(fs_.RemoveDir("/ckpt/old"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_FALSE(Exists("/ckpt/old"));
}

TEST_F(FaultStoreTest, CrossDirectoryRenameDurableOnBothSidesKeepsBothNames) {
  SP_ASSERT_OK(fs_.CreateDirs("/ckpt/a"));
  SP_ASSERT_OK(fs_.CreateDirs("/ckpt/b"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
  SP_ASSERT_OK(Write("/ckpt/a/f", "payload", true));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/a"));
  SP_ASSERT_OK(fs_.Rename("/ckpt/a/f", "/ckpt/b/f"));
  SP_ASSERT_OK(fs_.SyncDir("/ckpt/b"));
  SP_ASSERT_OK(fs_.SimulateCrash());
  EXPECT_EQ(Content("/ckpt/a/f"), "payload");
  EXPECT_EQ(Content("/ckpt/b/f"), "payload");
}

TEST_F(FaultStoreTest, HandlesOpenedBeforeACrashFail) {
  SP_ASSERT_OK(Write("/ckpt/r", "abc", true));
  auto writer = fs_.NewWritableFile("/ckpt/w");
  ASSERT_TRUE(writer.ok());
  auto reader = fs_.OpenReadable("/ckpt/r");
  ASSERT_TRUE(reader.ok());
  SP_ASSERT_OK(fs_.SimulateCrash());
  Status write = (*writer)->WriteAt(0, AsBytes("x"));
  EXPECT_EQ(write.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(write.message(), "write /ckpt/w: the file was lost in a simulated crash");
  EXPECT_EQ((*writer)->Sync().code(), StatusCode::kFailedPrecondition);
  std::string out(3, '\0');
  EXPECT_EQ((*reader)->ReadAt(0, AsMutableBytes(out.data(), 3)).code(),
            StatusCode::kFailedPrecondition);
  EXPECT_FALSE(Exists("/ckpt/w"));
}

// Random writes and syncs on one file: after a crash at a random point the file holds exactly
// what it held at its last sync (a plain reference: a string and a copy of it). Each round
// reopens the file, truncating it; without a sync in the round, the truncation is undone too.
TEST_F(FaultStoreTest, RandomWritesCrashToTheLastSyncedContent) {
  std::mt19937_64 rng(11);
  std::string synced;  // the durable content: empty once the new file's entry is synced
  for (int round = 0; round < 50; ++round) {
    auto file = fs_.NewWritableFile("/ckpt/f");
    ASSERT_TRUE(file.ok());
    SP_ASSERT_OK(fs_.SyncDir("/ckpt"));
    std::string current;
    int steps = static_cast<int>(rng() % 20);
    for (int i = 0; i < steps; ++i) {
      if (rng() % 4 == 0) {
        SP_ASSERT_OK((*file)->Sync());
        synced = current;
        continue;
      }
      uint64_t offset = rng() % 300;
      std::string data(1 + rng() % 50, static_cast<char>('a' + rng() % 26));
      SP_ASSERT_OK((*file)->WriteAt(offset, AsBytes(data)));
      if (current.size() < offset + data.size()) current.resize(offset + data.size(), '\0');
      current.replace(offset, data.size(), data);
    }
    ASSERT_EQ(Content("/ckpt/f"), current);
    SP_ASSERT_OK(fs_.SimulateCrash());
    ASSERT_EQ(Content("/ckpt/f"), synced) << "round " << round;
  }
}

// The commit protocol of docs/DESIGN.md (data and metadata to temporary names, fsync, rename, fsync
// the directory), crashed after every step: the checkpoint is always the old one or the whole new
// one. Skipping the data fsync must be caught, which shows the model can see a broken protocol.
class CommitProtocolTest : public FaultStoreTest {
 protected:
  std::vector<std::function<Status()>> Steps(bool sync_data) {
    auto data = std::make_shared<std::unique_ptr<WritableFile>>();
    auto meta = std::make_shared<std::unique_ptr<WritableFile>>();
    auto open = [this](std::shared_ptr<std::unique_ptr<WritableFile>> f, std::string path) {
      return [this, f, path]() -> Status {
        SP_ASSIGN_OR_RETURN(*f, fs_.NewWritableFile(path));
        return OkStatus();
      };
    };
    return {
        open(data, "/ckpt/d-1.safetensors"),
        [=] { return (*data)->WriteAt(0, AsBytes(kNewData)); },
        [=] { return sync_data ? (*data)->Sync() : OkStatus(); },
        [=] { return (*data)->Close(); },
        open(meta, "/ckpt/.metadata.tmp"),
        [=] { return (*meta)->WriteAt(0, AsBytes(kNewMeta)); },
        [=] { return (*meta)->Sync(); },
        [=] { return (*meta)->Close(); },
        [this] { return fs_.Rename("/ckpt/.metadata.tmp", "/ckpt/.metadata"); },
        [this] { return fs_.SyncDir("/ckpt"); },
    };
  }

  // "" when the store holds a valid checkpoint, else what is wrong with it.
  std::string Check(bool* committed) {
    std::optional<std::string> meta = Content("/ckpt/.metadata");
    *committed = meta == kNewMeta;
    if (meta == kOldMeta) return Content("/ckpt/d-0.safetensors") == kOldData ? "" : "old data";
    if (meta != kNewMeta) return "metadata is neither old nor new: " + meta.value_or("<absent>");
    return Content("/ckpt/d-1.safetensors") == kNewData ? "" : "new metadata without its data";
  }

  static constexpr const char* kOldMeta = "metadata v1 -> d-0";
  static constexpr const char* kOldData = "old chunk";
  static constexpr const char* kNewMeta = "metadata v2 -> d-1";
  static constexpr const char* kNewData = "new chunk, longer";
};

TEST_F(CommitProtocolTest, EveryCrashPointLeavesTheOldOrTheNewCheckpoint) {
  const size_t num_steps = Steps(true).size();
  for (size_t crash_after = 0; crash_after <= num_steps; ++crash_after) {
    base_.RemoveFile("/ckpt/d-1.safetensors").IgnoreError();
    base_.RemoveFile("/ckpt/.metadata.tmp").IgnoreError();
    Preexisting("/ckpt/.metadata", kOldMeta);
    Preexisting("/ckpt/d-0.safetensors", kOldData);
    std::vector<std::function<Status()>> steps = Steps(true);
    for (size_t i = 0; i < crash_after; ++i) SP_ASSERT_OK(steps[i]());
    SP_ASSERT_OK(fs_.SimulateCrash());
    bool committed = false;
    EXPECT_EQ(Check(&committed), "") << "crash after step " << crash_after;
    EXPECT_EQ(committed, crash_after == num_steps) << "crash after step " << crash_after;
  }
}

TEST_F(CommitProtocolTest, SkippingTheDataSyncIsCaught) {
  Preexisting("/ckpt/.metadata", kOldMeta);
  Preexisting("/ckpt/d-0.safetensors", kOldData);
  for (const auto& step : Steps(/*sync_data=*/false)) SP_ASSERT_OK(step());
  SP_ASSERT_OK(fs_.SimulateCrash());
  bool committed = false;
  EXPECT_EQ(Check(&committed), "new metadata without its data");
}

}  // namespace
}  // namespace sp
