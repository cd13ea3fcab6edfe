// Failure and corruption tests of Save, Load and Verify: a save that fails on one rank, a crash at
// every step of the commit protocol, damaged data and metadata files, and errors that every rank of
// a collective call agrees on (docs/DESIGN.md decisions 4, 5 and 10; docs/FORMAT.md §3 and §4).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "shardpoint/base/coding.h"
#include "shardpoint/base/crc32c.h"
#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/comm_test_util.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/engine/load_internal.h"
#include "shardpoint/format/metadata_wire.h"
#include "shardpoint/format/native/metadata_codec.h"
#include "shardpoint/format/open_checkpoint.h"
#include "shardpoint/format/safetensors/safetensors.h"
#include "shardpoint/store/fault_store.h"
#include "shardpoint/store/memory_store.h"
#include "shardpoint/store/posix_store.h"
#include "shardpoint/testing/chunk_filter_reference.h"
#include "shardpoint/testing/hook_store.h"
#include "shardpoint/testing/synthetic_model.h"

namespace sp {
namespace {

namespace spt = ::sp::testing;
using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using Op = FaultStore::Op;

// Shows a test each payload its rank receives by Broadcast or Scatter and sends by Gather, as
// they travel (in the envelope of comm/collective.h), and lets it change them. A null tap passes
// its payloads as they are.
class PayloadTap final : public testing::ForwardingComm {
 public:
  using Tap = std::function<void(int rank, std::string& payload)>;
  PayloadTap(Communicator& inner, Tap broadcast, Tap gathered, Tap scattered)
      : ForwardingComm(inner),
        broadcast_(std::move(broadcast)),
        gathered_(std::move(gathered)),
        scattered_(std::move(scattered)) {}
  Result<std::string> Broadcast(std::string payload, int root) override {
    SP_ASSIGN_OR_RETURN(std::string received, ForwardingComm::Broadcast(std::move(payload), root));
    if (broadcast_) broadcast_(rank(), received);
    return received;
  }
  Result<std::vector<std::string>> Gather(std::string payload, int root) override {
    if (gathered_) gathered_(rank(), payload);
    return ForwardingComm::Gather(std::move(payload), root);
  }
  Result<std::string> Scatter(std::vector<std::string> payloads, int root) override {
    SP_ASSIGN_OR_RETURN(std::string received,
                        ForwardingComm::Scatter(std::move(payloads), root));
    if (scattered_) scattered_(rank(), received);
    return received;
  }
  // As processes would: they receive the metadata as bytes (ranks that share an address space
  // share the coordinator's decoded copy instead).
  bool shares_memory() const override { return false; }

 private:
  Tap broadcast_, gathered_, scattered_;
};

constexpr char kPath[] = "/ckpt";
constexpr char kMetadataPath[] = "/ckpt/shardpoint.metadata";
constexpr int kSaveRanks = 4;  // the training layout's 2x2 mesh
constexpr int kLoadRanks = 3;  // the serving layout

spt::ModelConfig SmallModel() {
  spt::ModelConfig config;
  config.layers = 1;
  config.hidden = 64;
  config.ffn = 96;
  config.vocab = 101;
  return config;
}

// A rank stuck in a collective fails the test instead of hanging it.
ThreadCommOptions Bounded() {
  ThreadCommOptions options;
  options.timeout = std::chrono::seconds(60);
  return options;
}

// Every rank returned the same error (code and message); returns it.
Status Agreed(const std::vector<Status>& statuses) {
  EXPECT_FALSE(statuses.empty());
  for (size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_FALSE(statuses[r].ok()) << "rank " << r << " succeeded";
    EXPECT_EQ(statuses[r], statuses[0]) << "rank " << r << ": " << statuses[r] << "\nrank 0: "
                                        << statuses[0];
  }
  return statuses.empty() ? OkStatus() : statuses[0];
}

// The files directly in `dir` and their bytes (empty when `dir` does not exist).
std::map<std::string, std::string> Snapshot(Store& store, std::string_view dir) {
  std::map<std::string, std::string> files;
  Result<std::vector<DirEntry>> entries = store.ListDir(dir);
  if (!entries.ok()) return files;
  for (const DirEntry& e : *entries) {
    if (!e.is_directory) files[e.name] = store.ReadFile(JoinPath(dir, e.name)).value();
  }
  return files;
}

std::set<std::string> Names(Store& store, std::string_view dir) {
  std::set<std::string> names;
  for (const auto& [name, bytes] : Snapshot(store, dir)) names.insert(name);
  return names;
}

// The save_id in the name of rank 0's data file ("d-<save_id>-r00000-f000.safetensors").
std::string SaveIdOfRank0(const std::set<std::string>& names) {
  for (const std::string& name : names) {
    const size_t at = name.find("-r00000-f000.safetensors");
    if (name.starts_with("d-") && at != std::string::npos) return name.substr(2, at - 2);
  }
  ADD_FAILURE() << "no data file of rank 0";
  return "";
}

// Replaces the file at `path` by `bytes`.
void Put(Store& store, std::string_view path, std::string_view bytes) {
  Result<std::unique_ptr<WritableFile>> file = store.NewWritableFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE((*file)->WriteAt(0, AsBytes(bytes)).ok());
  ASSERT_TRUE((*file)->Close().ok());
}

// Fails the k-th operation made through it (store calls and calls on the files it creates) and,
// when `sticky`, every operation after it: the machine stops working at step k.
class StepFailStore : public Store {
 public:
  StepFailStore(Store* base, int64_t fail_at, bool sticky)
      : base_(base), fail_at_(fail_at), sticky_(sticky) {}

  bool fired() const { return fired_.load(); }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override {
    SP_RETURN_IF_ERROR(Step("create", path));
    SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base_->NewWritableFile(path));
    return std::unique_ptr<WritableFile>(std::make_unique<File>(this, std::move(file)));
  }
  Result<std::unique_ptr<ReadableFile>> OpenReadable(std::string_view path) override {
    SP_RETURN_IF_ERROR(Step("open", path));
    return base_->OpenReadable(path);
  }
  Status CreateDirs(std::string_view p) override { return Do("mkdir", p, &Store::CreateDirs); }
  Status SyncDir(std::string_view p) override { return Do("syncdir", p, &Store::SyncDir); }
  Status RemoveFile(std::string_view p) override { return Do("remove", p, &Store::RemoveFile); }
  Status RemoveDir(std::string_view p) override { return Do("rmdir", p, &Store::RemoveDir); }
  Status Rename(std::string_view from, std::string_view to) override {
    SP_RETURN_IF_ERROR(Step("rename", from));
    return base_->Rename(from, to);
  }
  Result<bool> IsDirectory(std::string_view path) override {
    SP_RETURN_IF_ERROR(Step("isdir", path));
    return base_->IsDirectory(path);
  }
  Result<bool> Exists(std::string_view path) override {
    SP_RETURN_IF_ERROR(Step("exists", path));
    return base_->Exists(path);
  }
  Result<std::vector<DirEntry>> ListDir(std::string_view path) override {
    SP_RETURN_IF_ERROR(Step("list", path));
    return base_->ListDir(path);
  }
  std::string name() const override { return "step-fail(" + base_->name() + ")"; }

 private:
  class File : public WritableFile {
   public:
    File(StepFailStore* store, std::unique_ptr<WritableFile> base)
        : store_(store), base_(std::move(base)) {}
    Status WriteAt(uint64_t offset, ByteView data) override {
      SP_RETURN_IF_ERROR(store_->Step("write", path()));
      return base_->WriteAt(offset, data);
    }
    Status Preallocate(uint64_t size) override {
      SP_RETURN_IF_ERROR(store_->Step("preallocate", path()));
      return base_->Preallocate(size);
    }
    Status Sync() override {
      SP_RETURN_IF_ERROR(store_->Step("sync", path()));
      return base_->Sync();
    }
    Status Close() override {
      SP_RETURN_IF_ERROR(store_->Step("close", path()));
      return base_->Close();
    }
    const std::string& path() const override { return base_->path(); }

   private:
    StepFailStore* store_;
    std::unique_ptr<WritableFile> base_;
  };

  Status Step(std::string_view what, std::string_view path) {
    const int64_t n = ++calls_;
    if (n < fail_at_ || (n > fail_at_ && !sticky_)) return OkStatus();
    fired_ = true;
    return UnavailableError(std::string(what) + " " + std::string(path) + ": injected failure " +
                            "at step " + std::to_string(n));
  }
  Status Do(std::string_view what, std::string_view path, Status (Store::*op)(std::string_view)) {
    SP_RETURN_IF_ERROR(Step(what, path));
    return (base_->*op)(path);
  }

  Store* base_;
  const int64_t fail_at_;
  const bool sticky_;
  std::atomic<int64_t> calls_{0};
  std::atomic<bool> fired_{false};
};

// docs/FORMAT.md §3.1: the metadata header (32 bytes, a table of 24-byte section entries, a CRC).
char* SectionEntry(std::string& md, int section) { return md.data() + 32 + 24 * section; }

void ResealHeader(std::string& md) {
  const uint32_t header_length = DecodeFixed32(md.data() + 16);
  EncodeFixed32(md.data() + header_length - 4, Crc32c(md.data(), header_length - 4));
}

void ResealSection(std::string& md, int section) {
  char* entry = SectionEntry(md, section);
  EncodeFixed32(entry + 16, Crc32c(md.data() + DecodeFixed64(entry), DecodeFixed64(entry + 8)));
}

// Sets the dtype code of the first tensor record (§3.4, §3.5) and reseals the record's index
// entry, the two tensor sections and the header, so that only the code is wrong. Returns the
// tensor's name.
std::string SetFirstDTypeCode(std::string& md, uint8_t code) {
  const char* index = md.data() + DecodeFixed64(SectionEntry(md, 1));
  const uint32_t name_length = DecodeFixed32(index);
  const std::string name(index + 4, name_length);
  char* slot = md.data() + (index - md.data()) + 4 + name_length;  // offset, length, crc
  char* record = md.data() + DecodeFixed64(SectionEntry(md, 2)) + DecodeFixed64(slot);
  record[0] = static_cast<char>(code);
  EncodeFixed32(slot + 16, Crc32c(record, DecodeFixed64(slot + 8)));
  ResealSection(md, 1);
  ResealSection(md, 2);
  ResealHeader(md);
  return name;
}

// Two states of the small model in the training layout: A (seed 1) and B (seed 2).
class EngineFailureTest : public ::testing::Test {
 protected:
  EngineFailureTest()
      : pool_(4),
        a_(spt::MakeGlobalModel(SmallModel(), 1)),
        b_(spt::MakeGlobalModel(SmallModel(), 2)),
        a_shards_(spt::ShardModel(a_, spt::Which::kTrain, true).value()),
        b_shards_(spt::ShardModel(b_, spt::Which::kTrain, true).value()) {}

  std::vector<Status> SaveAll(bool use_b, Store* store, bool overwrite,
                              std::string_view path = kPath) {
    const spt::GlobalModel& model = use_b ? b_ : a_;
    const std::vector<spt::RankShards>& shards = use_b ? b_shards_ : a_shards_;
    return RunRanks(kSaveRanks, [&](Communicator& comm) {
      SaveOptions options;
      options.comm = &comm;
      options.store = store;
      options.pool = &pool_;
      options.overwrite = overwrite;
      options.format = format_;
      return Save(shards[comm.rank()].AsSaveState(model), path, options);
    }, Bounded());
  }

  void SaveA(Store* store, std::string_view path = kPath) {
    for (const Status& s : SaveAll(false, store, false, path)) ASSERT_TRUE(s.ok()) << s;
  }

  // Loads into the serving layout; `edit` may change a rank's request first.
  std::vector<Status> LoadAll(Store* store, std::vector<spt::RankShards>* shards,
                              std::vector<LoadResult>* results = nullptr,
                              const std::function<void(int, LoadState&)>& edit = nullptr,
                              bool strict = true, std::string_view path = kPath) {
    *shards = spt::ShardModel(a_, spt::Which::kServe, false).value();
    if (results != nullptr) results->assign(kLoadRanks, LoadResult());
    return RunRanks(kLoadRanks, [&](Communicator& inner) -> Status {
      PayloadTap tapped(inner, broadcast_tap_, gather_tap_, scatter_tap_);
      Communicator& comm = broadcast_tap_ || gather_tap_ || scatter_tap_ ? tapped : inner;
      LoadState state = (*shards)[comm.rank()].AsLoadState(a_);
      if (edit) edit(comm.rank(), state);
      LoadOptions options;
      options.comm = &comm;
      options.store = store;
      options.pool = &pool_;
      options.strict = strict;
      options.own_chunks_only = own_chunks_only_;
      options.verify_checksums = verify_checksums_;
      SP_ASSIGN_OR_RETURN(LoadResult result, Load(state, path, options));
      if (results != nullptr) (*results)[comm.rank()] = std::move(result);
      return OkStatus();
    }, Bounded());
  }

  Status LoadError(Store* store) {
    std::vector<spt::RankShards> shards;
    return Agreed(LoadAll(store, &shards));
  }

  // Loads `store` with every rank's broadcasts watched, every rank keeping every chunk
  // (LoadOptions::own_chunks_only off): the load is bit-exact, and each rank received the load's
  // metadata as the 16-digit nonce (the same on every rank), the kind byte `kind` and `body`, in
  // the envelope of comm/collective.h (a last tag byte).
  void ExpectMetadataBroadcast(Store* store, char kind, const std::string& body) {
    own_chunks_only_ = false;
    std::vector<std::string> received(kLoadRanks);
    broadcast_tap_ = [&](int rank, std::string& payload) {
      if (payload.size() >= body.size()) received[rank] = payload;
    };
    std::vector<spt::RankShards> shards;
    const std::vector<Status> statuses = LoadAll(store, &shards);
    broadcast_tap_ = nullptr;
    for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
    std::string first;
    EXPECT_EQ(spt::CountMismatches(a_, shards, &first), 0) << first;
    for (int r = 0; r < kLoadRanks; ++r) {
      const std::string& p = received[r];
      ASSERT_EQ(p.size(), 16 + 1 + body.size() + 1) << "rank " << r;
      EXPECT_EQ(p.substr(0, 16), received[0].substr(0, 16)) << "rank " << r;
      EXPECT_EQ(p[16], kind) << "rank " << r;
      EXPECT_TRUE(p.compare(17, body.size(), body) == 0) << "rank " << r;
    }
  }

  // Which state the checkpoint at `path` holds, bit for bit: 'A' or 'B'. An error when it does
  // not load, when Verify finds a defect, or when it matches neither state.
  Result<char> Identify(Store* store, std::string_view path = kPath) {
    std::vector<spt::RankShards> shards;
    for (const Status& s : LoadAll(store, &shards, nullptr, nullptr, true, path)) {
      SP_RETURN_IF_ERROR(s);
    }
    SP_ASSIGN_OR_RETURN(VerifyReport report, Verify(path, store, &pool_));
    if (!report.ok()) return DataLossError("verify: " + report.defects[0]);
    std::string first;
    if (spt::CountMismatches(a_, shards, &first) == 0) return 'A';
    if (spt::CountMismatches(b_, shards, &first) == 0) return 'B';
    return DataLossError("the checkpoint holds neither state: " + first);
  }

  // After a successful save the directory holds exactly the metadata and the files it names.
  void ExpectOnlyCommittedFiles(Store& store) {
    Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &store);
    ASSERT_TRUE(md.ok()) << md.status();
    std::set<std::string> expected = {kMetadataFileName};
    for (const DataFile& f : md->files) expected.insert(f.name);
    EXPECT_EQ(Names(store, kPath), expected);
  }

  void ExpectNoCheckpoint(Store& store) {
    Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &store);
    ASSERT_FALSE(md.ok());
    EXPECT_EQ(md.status().code(), StatusCode::kNotFound) << md.status();
    EXPECT_THAT(md.status().message(), HasSubstr("no committed checkpoint at /ckpt"));
  }

  // The crash sweep: for k = 1, 2, ... a save of B (over A when `with_old`) fails at its k-th
  // store operation (and at every later one when `sticky`), then the machine crashes. What the
  // directory holds afterwards must be nothing (only without A), A, or B, whole and bit-exact;
  // B whenever the save returned OK. Stops at the first k that the save never reaches.
  void CrashSweep(bool with_old, bool sticky) {
    std::map<std::string, int> outcomes;
    for (int64_t k = 1;; ++k) {
      ASSERT_LT(k, 10000) << "the save kept failing";
      MemoryStore base;
      // The directory exists beforehand (see SaveIntoNewDirectoryIsLostInACrash).
      ASSERT_TRUE(base.CreateDirs(kPath).ok());
      if (with_old) SaveA(&base);
      FaultStore fault(&base);
      StepFailStore steps(&fault, k, sticky);
      const std::vector<Status> saved = SaveAll(true, &steps, true);
      for (const Status& s : saved) ASSERT_EQ(s, saved[0]) << "step " << k;
      ASSERT_TRUE(fault.SimulateCrash().ok());
      std::string outcome = "none";
      Result<CheckpointMetadata> committed = ReadCheckpointMetadata(kPath, &base);
      if (committed.ok() || with_old) {
        Result<char> found = Identify(&base);
        ASSERT_TRUE(found.ok()) << "step " << k << ": " << found.status();
        outcome = std::string(1, *found);
      } else {
        ASSERT_EQ(committed.status().code(), StatusCode::kNotFound) << committed.status();
      }
      if (saved[0].ok()) {
        ASSERT_EQ(outcome, "B") << "step " << k << " reported success";
      }
      ++outcomes[outcome];
      if (!steps.fired()) {
        EXPECT_TRUE(saved[0].ok()) << saved[0];
        break;
      }
    }
    EXPECT_GT(outcomes[with_old ? "A" : "none"], 0);
    EXPECT_GT(outcomes["B"], 0);
    EXPECT_EQ(outcomes.size(), 2u);
  }

  CheckpointFormat format_ = CheckpointFormat::kNative;  // of the saves
  // When one is set, LoadAll's ranks run as processes would (no shared address space) and show
  // these every payload they receive by Broadcast, send by Gather, receive by Scatter (PayloadTap).
  PayloadTap::Tap broadcast_tap_, gather_tap_, scatter_tap_;
  bool own_chunks_only_ = true;  // LoadAll's LoadOptions::own_chunks_only
  bool verify_checksums_ = true;  // LoadAll's LoadOptions::verify_checksums
  ThreadPool pool_;
  spt::GlobalModel a_, b_;
  std::vector<spt::RankShards> a_shards_, b_shards_;
};

// ---- 1. A rank that fails mid-save ----------------------------------------------------------

TEST_F(EngineFailureTest, DataFileWriteFailureOnOneRankFailsEveryRankAlike) {
  MemoryStore base;
  FaultStore store(&base);
  store.FailMatching(Op::kWrite, "-r00002-", ResourceExhaustedError("no space left (injected)"));
  Status s = Agreed(SaveAll(true, &store, false));
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank 2: preallocate /ckpt/d-"),
                                 HasSubstr("-r00002-f000.safetensors.tmp: no space left")));
  ExpectNoCheckpoint(base);
  // The other ranks removed their files; what is left is rank 2's temporary file at most (see
  // FailedPreallocateLeavesTemporaryFile), which the next save at this path removes.
  for (const std::string& name : Names(base, kPath)) {
    EXPECT_THAT(name, AllOf(HasSubstr("-r00002-"), HasSubstr(".safetensors.tmp")));
  }
  store.ClearFaults();
  SaveA(&store);
  ExpectOnlyCommittedFiles(base);
  EXPECT_EQ(Identify(&base).value(), 'A');
}

TEST_F(EngineFailureTest, SyncFailureOnOneRankFailsEveryRankAndRemovesAllDataFiles) {
  MemoryStore base;
  FaultStore store(&base);
  store.FailMatching(Op::kSync, "-r00002-", DataLossError("Input/output error (injected)"));
  Status s = Agreed(SaveAll(true, &store, false));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank 2: sync /ckpt/d-"),
                                 HasSubstr("-r00002-f000.safetensors.tmp: Input/output error")));
  ExpectNoCheckpoint(base);
  EXPECT_EQ(Names(base, kPath), std::set<std::string>());
}

TEST_F(EngineFailureTest, RenameFailureOnOneRankFailsEveryRankAndRemovesAllDataFiles) {
  MemoryStore base;
  FaultStore store(&base);
  store.FailMatching(Op::kRename, "-r00002-", InternalError("rename refused (injected)"));
  Status s = Agreed(SaveAll(true, &store, false));
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank 2: rename /ckpt/d-"),
                                 HasSubstr("-r00002-f000.safetensors.tmp to /ckpt/d-"),
                                 HasSubstr("-r00002-f000.safetensors: rename refused")));
  ExpectNoCheckpoint(base);
  EXPECT_EQ(Names(base, kPath), std::set<std::string>());
}

TEST_F(EngineFailureTest, MetadataWriteFailureOnCoordinatorFailsEveryRankAlike) {
  MemoryStore base;
  FaultStore store(&base);
  store.FailMatching(Op::kWrite, "shardpoint.metadata", ResourceExhaustedError("quota (injected)"));
  Status s = Agreed(SaveAll(true, &store, false));
  ExpectNoCheckpoint(base);
  // A failed commit leaves the data files (the metadata might be in place; docs/FORMAT.md §4)
  // and removes the metadata temporary it could not write; the next save removes the rest.
  std::set<std::string> left = Names(base, kPath);
  const std::string temp = "shardpoint.metadata.tmp-" + SaveIdOfRank0(left);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "rank 0: write /ckpt/" + temp + " at offset 0: quota (injected)");
  EXPECT_THAT(left, ::testing::Not(Contains(temp)));
  EXPECT_EQ(left.size(), static_cast<size_t>(kSaveRanks));
  for (int r = 0; r < kSaveRanks; ++r) {
    const std::string rank = "-r0000" + std::to_string(r) + "-f000.safetensors";
    EXPECT_EQ(std::count_if(left.begin(), left.end(),
                            [&](const std::string& n) { return n.ends_with(rank); }), 1);
  }
  store.ClearFaults();
  SaveA(&store);
  ExpectOnlyCommittedFiles(base);
  EXPECT_EQ(Identify(&base).value(), 'A');
}

TEST_F(EngineFailureTest, InvalidStateOnOneRankFailsEveryRankBeforeAnythingIsWritten) {
  MemoryStore base;
  Status s = Agreed(RunRanks(kSaveRanks, [&](Communicator& comm) {
    SaveState state = a_shards_[comm.rank()].AsSaveState(a_);
    if (comm.rank() == 3) state.tensors.push_back(state.tensors[0]);
    SaveOptions options;
    options.comm = &comm;
    options.store = &base;
    options.pool = &pool_;
    return Save(state, kPath, options);
  }, Bounded()));
  EXPECT_EQ(s, InvalidArgumentError("rank 3: tensor 'model.embed.weight' appears twice in the "
                                    "state of one rank"));
  EXPECT_FALSE(base.Exists(kPath).value());
}

// Regression: WriteRankFiles (save.cc) registered a data file for cleanup only after its
// Preallocate and header write succeeded, so a rank whose Preallocate failed (a full disk, the
// likeliest case) left its possibly large "<name>.tmp" behind.
TEST_F(EngineFailureTest, FailedPreallocateLeavesTemporaryFile) {
  MemoryStore base;
  FaultStore store(&base);
  store.FailMatching(Op::kWrite, "-r00002-", ResourceExhaustedError("no space left (injected)"));
  Agreed(SaveAll(true, &store, false)).IgnoreError();
  EXPECT_EQ(Names(base, kPath), std::set<std::string>());
}

// Regression: the metadata temporary was "shardpoint.metadata.tmp", not the
// "shardpoint.metadata.tmp-<save_id>" of docs/FORMAT.md §4, so saves racing into one directory
// shared it.
TEST_F(EngineFailureTest, MetadataTemporaryNameLacksSaveId) {
  MemoryStore base;
  FaultStore store(&base);
  store.FailMatching(Op::kRename, "shardpoint.metadata", UnavailableError("injected"));
  Status s = Agreed(SaveAll(true, &store, false));
  std::set<std::string> left = Names(base, kPath);
  const std::string temp = "shardpoint.metadata.tmp-" + SaveIdOfRank0(left);
  EXPECT_THAT(left, Contains(temp));
  EXPECT_EQ(s.message(), "rank 0: rename /ckpt/" + temp + " to /ckpt/shardpoint.metadata: injected");
}

// ---- 2. A failed save damages no committed checkpoint ---------------------------------------

struct Fault {
  Op op;
  const char* substring;
};
constexpr Fault kFaults[] = {{Op::kWrite, "-r00002-"},
                             {Op::kSync, "-r00002-"},
                             {Op::kRename, "-r00002-"},
                             {Op::kWrite, "shardpoint.metadata"},
                             {Op::kRename, "shardpoint.metadata"}};

TEST_F(EngineFailureTest, FailedSaveLeavesCheckpointAtAnotherPathByteForByte) {
  MemoryStore base;
  FaultStore store(&base);
  SaveA(&store, "/old");
  const std::map<std::string, std::string> before = Snapshot(base, "/old");
  for (const Fault& fault : kFaults) {
    store.FailMatching(fault.op, fault.substring, UnavailableError("injected"));
    Status s = Agreed(SaveAll(true, &store, false, kPath));
    EXPECT_THAT(s.message(), HasSubstr(fault.substring));
    store.ClearFaults();
    EXPECT_EQ(Snapshot(base, "/old"), before) << s;
  }
  EXPECT_EQ(Identify(&base, "/old").value(), 'A');
}

TEST_F(EngineFailureTest, FailedOverwriteKeepsThePreviousCheckpointLoadable) {
  for (const Fault& fault : kFaults) {
    MemoryStore base;
    FaultStore store(&base);
    SaveA(&store);
    const CheckpointMetadata old = ReadCheckpointMetadata(kPath, &base).value();
    std::map<std::string, std::string> before = Snapshot(base, kPath);
    store.FailMatching(fault.op, fault.substring, UnavailableError("injected"));
    Status s = Agreed(SaveAll(true, &store, true));
    EXPECT_EQ(s.code(), StatusCode::kUnavailable);
    EXPECT_THAT(s.message(), HasSubstr(fault.substring));
    std::map<std::string, std::string> after = Snapshot(base, kPath);
    for (const auto& [name, bytes] : before) EXPECT_EQ(after[name], bytes) << name << ", " << s;
    EXPECT_EQ(ReadCheckpointMetadata(kPath, &base).value().save_id, old.save_id);
    EXPECT_EQ(Identify(&base).value(), 'A') << s;
  }
}

// PyTorch DCP data files have fixed names: a save replacing a DCP checkpoint must not rename its
// files over the old ones before its commit.
TEST_F(EngineFailureTest, TorchDcpCrashAtAnyStepLeavesTheOldOrTheNewCheckpoint) {
  format_ = CheckpointFormat::kTorchDcp;
  CrashSweep(/*with_old=*/true, /*sticky=*/false);
}

TEST_F(EngineFailureTest, TorchDcpFailedOverwriteKeepsTheOldCheckpointAndTheNewOneReplacesIt) {
  format_ = CheckpointFormat::kTorchDcp;
  MemoryStore base;
  FaultStore store(&base);
  SaveA(&store);
  const std::map<std::string, std::string> before = Snapshot(base, kPath);
  EXPECT_TRUE(before.count("__0_0.distcp")) << "a fresh DCP save keeps torch's file names";
  store.FailMatching(Op::kWrite, "__2_0", UnavailableError("injected"));
  EXPECT_EQ(Agreed(SaveAll(true, &store, true)).code(), StatusCode::kUnavailable);
  EXPECT_EQ(Snapshot(base, kPath), before);
  EXPECT_EQ(Identify(&base).value(), 'A');
  store.ClearFaults();
  for (const Status& s : SaveAll(true, &store, true)) ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(Identify(&base).value(), 'B');
  for (const auto& [name, bytes] : Snapshot(base, kPath)) {  // A's files are gone
    EXPECT_TRUE(name == ".metadata" || name.find('-') != std::string::npos) << name;
  }
}

TEST_F(EngineFailureTest, SaveWithoutOverwriteOnCommittedPathFailsAndWritesNothing) {
  MemoryStore base;
  FaultStore store(&base);
  SaveA(&store);
  const std::map<std::string, std::string> before = Snapshot(base, kPath);
  store.ResetCounts();
  Status s = Agreed(SaveAll(true, &store, false));
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(s.message(), "rank 0: a committed checkpoint already exists at /ckpt (pass overwrite "
                         "to replace it)");
  for (Op op : {Op::kCreate, Op::kWrite, Op::kSync, Op::kClose, Op::kRename, Op::kSyncDir,
                Op::kRemove, Op::kCreateDirs}) {
    EXPECT_EQ(store.count(op), 0) << FaultStore::OpName(op);
  }
  EXPECT_EQ(Snapshot(base, kPath), before);
  EXPECT_EQ(Identify(&base).value(), 'A');
}

// ---- 3. A crash at every step of the commit protocol ----------------------------------------

TEST_F(EngineFailureTest, CrashAfterAFailureAtAnyStepOfAnOverwriteLeavesOldOrNew) {
  CrashSweep(/*with_old=*/true, /*sticky=*/false);
}

TEST_F(EngineFailureTest, CrashAtAnyStepOfAnOverwriteLeavesOldOrNew) {
  CrashSweep(/*with_old=*/true, /*sticky=*/true);
}

TEST_F(EngineFailureTest, CrashAfterAFailureAtAnyStepOfAFirstSaveLeavesNothingOrNew) {
  CrashSweep(/*with_old=*/false, /*sticky=*/false);
}

TEST_F(EngineFailureTest, CrashAtAnyStepOfAFirstSaveLeavesNothingOrNew) {
  CrashSweep(/*with_old=*/false, /*sticky=*/true);
}

// Regression: Save (save.cc, PlanOnCoordinator) created the checkpoint directory with CreateDirs
// but never synced its parent, so the new directory entry was not durable: a save into a new
// directory returned OK and a crash right after lost the whole checkpoint.
// Two saves racing to a new path on a POSIX file system: the metadata is linked into place
// (PosixStore::WriteFileIf), so the save that checked the path first but commits second fails
// rather than replacing the other's checkpoint; the next save there removes what it left.
TEST(EngineCommitTest, OfTwoSavesRacingToANewPathOnlyOneCommits) {
  std::string dir = (std::filesystem::temp_directory_path() / "sp_race_XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/step-1";
  PosixStore posix;
  auto save = [&](float value, Store* store, bool overwrite) {
    const std::vector<float> w(64, value);
    SaveState state;
    state.tensors.push_back(SaveTensor{"w", DType::kFloat32, {64},
                                       {ConstPieceView{Box({0}, {64}), AsBytes(w.data(), 256).data()}}});
    SaveOptions options;
    options.store = store;
    options.overwrite = overwrite;
    return Save(state, path, options);
  };
  auto loaded = [&]() -> float {
    std::vector<float> w(64, -1.0f);
    LoadState state;
    state.tensors.push_back(LoadTensor{"w", DType::kFloat32, {64},
                                       {PieceView{Box({0}, {64}), AsMutableBytes(w.data(), 256).data()}}});
    Result<LoadResult> result = Load(state, path, LoadOptions{});
    EXPECT_TRUE(result.ok()) << result.status();
    return w[63];
  };
  Status other;
  spt::HookStore racing(&posix, [&] { other = save(2.0f, &posix, false); });
  Status lost = save(1.0f, &racing, false);
  ASSERT_TRUE(other.ok()) << other;
  EXPECT_EQ(lost.code(), StatusCode::kAlreadyExists) << lost;
  EXPECT_THAT(lost.message(),
              HasSubstr("the save to " + path + " was not committed: another save committed a "
                        "checkpoint there while this one was writing"));
  EXPECT_EQ(loaded(), 2.0f);
  ASSERT_TRUE(save(3.0f, &posix, true).ok());
  EXPECT_EQ(loaded(), 3.0f);
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(path)) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, 2u) << "the metadata and one data file";
  std::filesystem::remove_all(dir);
}

TEST_F(EngineFailureTest, SaveIntoNewDirectoryIsLostInACrash) {
  MemoryStore base;
  FaultStore store(&base);
  SaveA(&store);
  ASSERT_TRUE(store.SimulateCrash().ok());
  Result<char> found = Identify(&base);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_EQ(*found, 'A');
}

// ---- 4. Corruption --------------------------------------------------------------------------

class EngineCorruptionTest : public EngineFailureTest {
 protected:
  void SetUp() override {
    SaveA(&base_);
    md_ = ReadCheckpointMetadata(kPath, &base_).value();
    metadata_bytes_ = base_.ReadFile(kMetadataPath).value();
  }
  // A chunk of the first tensor ("model.embed.weight") and the path of its data file.
  const TensorMetadata& tensor() const { return md_.tensors[0]; }
  const StoredChunk& chunk() const { return tensor().chunks[0]; }
  const DataFile& file() const { return md_.files[chunk().file]; }
  std::string file_path() const { return JoinPath(kPath, file().name); }

  // ReadCheckpointMetadata, Verify and Load (on every rank alike, the message prefixed by the
  // coordinator's rank) all fail with `code` and `message`.
  void ExpectUnreadableMetadata(StatusCode code, const std::string& message) {
    Result<CheckpointMetadata> md = ReadCheckpointMetadata(kPath, &base_);
    ASSERT_FALSE(md.ok());
    EXPECT_EQ(md.status(), Status(code, message));
    EXPECT_EQ(LoadError(&base_), Status(code, "rank 0: " + message));
    Result<VerifyReport> report = Verify(kPath, &base_, &pool_);
    ASSERT_FALSE(report.ok());
    EXPECT_EQ(report.status(), Status(code, message));
  }

  MemoryStore base_;
  CheckpointMetadata md_;
  std::string metadata_bytes_;
};

TEST_F(EngineCorruptionTest, VerifyOfSoundCheckpointCountsEveryFileChunkAndByte) {
  VerifyReport report = Verify(kPath, &base_, &pool_).value();
  EXPECT_TRUE(report.ok()) << report.defects[0];
  uint64_t chunks = 0, bytes = 0;
  for (const TensorMetadata& t : md_.tensors) {
    chunks += t.chunks.size();
    for (const StoredChunk& c : t.chunks) bytes += c.byte_length;
  }
  EXPECT_EQ(md_.files.size(), static_cast<size_t>(kSaveRanks));
  EXPECT_EQ(report.files_checked, md_.files.size());
  EXPECT_EQ(report.chunks_checked, chunks);
  EXPECT_EQ(report.bytes_checked, bytes);
  EXPECT_EQ(bytes, a_.total_bytes());  // each tensor stored exactly once
  EXPECT_EQ(Identify(&base_).value(), 'A');
}

TEST_F(EngineCorruptionTest, TruncatedDataFile) {
  const std::string bytes = base_.ReadFile(file_path()).value();
  Put(base_, file_path(), std::string_view(bytes).substr(0, bytes.size() - 3));
  const std::string sizes = std::to_string(bytes.size() - 3) + " bytes, expected " +
                            std::to_string(bytes.size());
  Status s = LoadError(&base_);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank "), HasSubstr("data file " + file_path() +
                                                                " has " + sizes)));
  VerifyReport report = Verify(kPath, &base_, &pool_).value();
  EXPECT_THAT(report.defects, Contains("data file " + file().name + " has " + sizes));
  EXPECT_EQ(report.files_checked, md_.files.size() - 1);
}

TEST_F(EngineCorruptionTest, FlippedBitInDataFileNamesTensorChunkAndFile) {
  std::string bytes = base_.ReadFile(file_path()).value();
  const uint64_t at = file().data_start + chunk().data_offset + chunk().byte_length / 2;
  bytes[at] = static_cast<char>(bytes[at] ^ 0x10);
  Put(base_, file_path(), bytes);
  const std::string where = "checksum mismatch in tensor '" + tensor().name + "' chunk " +
                            chunk().box.ToString() + " (file " + file_path() +
                            ", chunk bytes 0.." + std::to_string(chunk().byte_length) +
                            "): expected crc32c 0x";
  Status s = LoadError(&base_);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank "), HasSubstr(where)));
  VerifyReport report = Verify(kPath, &base_, &pool_).value();
  ASSERT_EQ(report.defects.size(), 1u);
  EXPECT_THAT(report.defects[0], StartsWith(where));
  EXPECT_EQ(report.files_checked, md_.files.size());
}

TEST_F(EngineCorruptionTest, MissingDataFile) {
  ASSERT_TRUE(base_.RemoveFile(file_path()).ok());
  Status s = LoadError(&base_);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank "), HasSubstr("open " + file_path() + ": ")));
  VerifyReport report = Verify(kPath, &base_, &pool_).value();
  EXPECT_THAT(report.defects, Contains(StartsWith("data file " + file().name +
                                                  " cannot be opened: ")));
  EXPECT_EQ(report.files_checked, md_.files.size() - 1);
}

// Regression: Load (load.cc, OpenFiles) passed on the store's kNotFound for a data file that the
// committed metadata names, the code that ReadCheckpointMetadata uses for "no checkpoint here";
// a caller that resumes when a checkpoint exists and starts afresh on kNotFound would silently
// drop a damaged checkpoint. A committed checkpoint missing one of its files is data loss.
TEST_F(EngineCorruptionTest, MissingDataFileIsReportedAsNotFound) {
  ASSERT_TRUE(base_.RemoveFile(file_path()).ok());
  Status s = LoadError(&base_);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr(file_path()));
}

// A data file's safetensors header is for other readers but for its checksums: Load takes the
// chunks' places from the committed metadata, and, when it verifies, their checksums from the
// header, which it checks against the CRC the metadata records (docs/FORMAT.md §2.2). Verify
// compares the whole header with the metadata.
TEST_F(EngineCorruptionTest, AlteredDataFileHeaderIsFoundByVerifyAndVerifiedLoads) {
  std::string bytes = base_.ReadFile(file_path()).value();
  const size_t at = bytes.find(tensor().name + "@");
  ASSERT_LT(at, file().data_start);
  bytes[at] = 'M';  // "Model.embed.weight@...": still valid JSON, another tensor name
  Put(base_, file_path(), bytes);
  VerifyReport report = Verify(kPath, &base_, &pool_).value();
  EXPECT_THAT(report.defects, Contains("data file " + file().name +
                                       ": its safetensors header does not match the metadata"));
  std::vector<spt::RankShards> shards;
  const Status s = Agreed(LoadAll(&base_, &shards));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(), HasSubstr("data file " + file().name + ": its header's CRC32C is 0x"));
  verify_checksums_ = false;  // unverified loads do not read the headers
  for (const Status& unverified : LoadAll(&base_, &shards)) {
    ASSERT_TRUE(unverified.ok()) << unverified;
  }
  std::string first;
  EXPECT_EQ(spt::CountMismatches(a_, shards, &first), 0) << first;
}

TEST_F(EngineCorruptionTest, EveryBitFlipInMetadataIsDetected) {
  for (size_t i = 0; i < metadata_bytes_.size(); ++i) {
    std::string bytes = metadata_bytes_;
    bytes[i] = static_cast<char>(bytes[i] ^ (1 << (i % 8)));
    Result<CheckpointMetadata> md = DecodeMetadata(bytes, kMetadataPath);
    ASSERT_FALSE(md.ok()) << "a flip of bit " << i % 8 << " of byte " << i << " went unnoticed";
    // A flip in the major version may make it a newer one; anything else is corruption.
    const bool newer_major = i >= 8 && i < 12 && DecodeFixed32(bytes.data() + 8) > 3;
    EXPECT_EQ(md.status().code(),
              newer_major ? StatusCode::kFailedPrecondition : StatusCode::kDataLoss)
        << md.status();
    EXPECT_THAT(md.status().message(), StartsWith("metadata file /ckpt/shardpoint.metadata: "));
  }
  std::string bytes = metadata_bytes_;
  bytes[bytes.size() / 2] ^= 0x04;
  Put(base_, kMetadataPath, bytes);
  Status s = ReadCheckpointMetadata(kPath, &base_).status();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("checksum mismatch"));
  ExpectUnreadableMetadata(StatusCode::kDataLoss, s.message());
}

TEST_F(EngineCorruptionTest, TruncatedMetadataFile) {
  const uint32_t header_length = DecodeFixed32(metadata_bytes_.data() + 16);
  for (size_t size : {size_t{0}, size_t{7}, size_t{31}, size_t{32}, size_t{header_length - 1},
                      size_t{header_length}, metadata_bytes_.size() / 2,
                      metadata_bytes_.size() - 1}) {
    Put(base_, kMetadataPath, std::string_view(metadata_bytes_).substr(0, size));
    Status s = ReadCheckpointMetadata(kPath, &base_).status();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << size << ": " << s;
    EXPECT_THAT(s.message(), StartsWith("metadata file /ckpt/shardpoint.metadata: ")) << size;
  }
  Put(base_, kMetadataPath, std::string_view(metadata_bytes_).substr(0, 17));
  ExpectUnreadableMetadata(StatusCode::kDataLoss, "metadata file /ckpt/shardpoint.metadata: "
                                                  "file of 17 bytes is shorter than the 32-byte "
                                                  "header");
  Put(base_, kMetadataPath, std::string_view(metadata_bytes_).substr(0, metadata_bytes_.size() - 1));
  ExpectUnreadableMetadata(StatusCode::kDataLoss,
                           ReadCheckpointMetadata(kPath, &base_).status().message());
}

TEST_F(EngineCorruptionTest, MetadataOfAFutureMajorVersionIsRefusedByVersion) {
  std::string bytes = metadata_bytes_;
  ASSERT_EQ(DecodeFixed32(bytes.data() + 8), 4u);  // a save writes 4.0
  EncodeFixed32(bytes.data() + 8, 5);
  EncodeFixed32(bytes.data() + 12, 1);
  ResealHeader(bytes);
  Put(base_, kMetadataPath, bytes);
  ExpectUnreadableMetadata(StatusCode::kFailedPrecondition,
                           "metadata file /ckpt/shardpoint.metadata: checkpoint format version "
                           "5.1 is newer than this reader (4.x)");
}

// What a version-1 writer left (every chunk listed in the metadata, data files saying 1.0), what
// a version-2 writer left (tables at fixed width, data files saying 2.0) and what a version-3
// writer left (the checksums in the records, packed) still open, load and verify, with their
// grids found or read when they are opened.
TEST_F(EngineCorruptionTest, VersionOneTwoAndThreeCheckpointsStillLoadAndVerify) {
  ASSERT_EQ(md_.version_major, 4u);
  ASSERT_TRUE(md_.checksums_in_headers);
  size_t grids = 0;
  for (const TensorMetadata& t : md_.tensors) grids += t.grid.has_value();
  ASSERT_GT(grids, 0u);
  std::vector<std::string> current_files;
  // The metadata with its chunks' checksums, as the headers hold them: what older versions store.
  CheckpointMetadata with_checksums = md_;
  with_checksums.checksums_in_headers = false;
  for (uint32_t f = 0; f < md_.files.size(); ++f) {
    current_files.push_back(base_.ReadFile(JoinPath(kPath, md_.files[f].name)).value());
    Result<SafetensorsHeader> header = ParseSafetensorsHeader(
        current_files.back(), current_files.back().size(), md_.files[f].name);
    ASSERT_TRUE(header.ok()) << header.status();
    Result<DataFileChecksums> table =
        ReadDataFileChecksums(*header, md_.checksum_block_bytes, md_.files[f].name);
    ASSERT_TRUE(table.ok()) << table.status();
    for (TensorMetadata& t : with_checksums.tensors) {
      for (StoredChunk& c : t.chunks) {
        if (c.file != f) continue;
        const std::span<const uint32_t> crcs = table->Of(c.data_offset, c.byte_length);
        c.block_crc32c = InlineVector<uint32_t, 2>(crcs);
      }
    }
  }
  for (const uint32_t major : {1u, 2u, 3u}) {
    SCOPED_TRACE(major);
    CheckpointMetadata written = with_checksums;
    for (size_t i = 0; i < md_.files.size(); ++i) {
      std::string bytes = current_files[i];
      const size_t at = bytes.find("\"format_version\":\"4.0\"");
      ASSERT_LT(at, md_.files[i].data_start) << md_.files[i].name;
      bytes[at + 18] = static_cast<char>('0' + major);
      bytes[at + 20] = major == 3 ? '1' : '0';
      Put(base_, JoinPath(kPath, md_.files[i].name), bytes);
      written.files[i].header_crc32c = Crc32c(bytes.substr(0, md_.files[i].data_start));
    }
    const std::string metadata = EncodeMetadata(written, major);
    ASSERT_EQ(DecodeFixed32(metadata.data() + 8), major);
    Put(base_, kMetadataPath, metadata);
    CheckpointMetadata md = ReadCheckpointMetadata(kPath, &base_).value();
    EXPECT_EQ(md.version_major, major);
    // Before 3.1 the metadata does not say that the data files hold checksums (they still do).
    EXPECT_EQ(md.data_file_checksums, major == 3);
    EXPECT_FALSE(md.checksums_in_headers);
    md.version_major = 4;
    md.version_minor = 0;
    md.data_file_checksums = true;
    for (size_t i = 0; i < md.files.size(); ++i) {
      if (major < 3) {
        EXPECT_EQ(md.files[i].header_crc32c, 0u);
      }
      md.files[i].header_crc32c = md_.files[i].header_crc32c;
    }
    EXPECT_EQ(md, with_checksums);
    size_t found = 0;
    for (const TensorMetadata& t : md.tensors) found += t.grid.has_value();
    EXPECT_EQ(found, grids);
    EXPECT_EQ(Identify(&base_).value(), 'A');
    Result<VerifyReport> report = Verify(kPath, &base_, &pool_);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->defects.empty()) << report->defects.front();
  }
}

// Also shows that the resealed header above is valid: only the major version made it fail.
TEST_F(EngineCorruptionTest, MetadataOfANewerMinorVersionStillLoads) {
  std::string bytes = metadata_bytes_;
  EncodeFixed32(bytes.data() + 12, 7);
  ResealHeader(bytes);
  Put(base_, kMetadataPath, bytes);
  CheckpointMetadata md = ReadCheckpointMetadata(kPath, &base_).value();
  EXPECT_EQ(md.version_minor, 7u);
  EXPECT_EQ(Identify(&base_).value(), 'A');
}

// With LoadOptions::own_chunks_only off, a load's coordinator hands its ranks a native
// checkpoint's metadata file as stored, behind the load's nonce and the kind byte 'N', and each
// rank decodes it to what opening the checkpoint
// gives, which is also what the wire encoding it was sent in before gave.
TEST_F(EngineCorruptionTest, ALoadsRanksReceiveTheNativeMetadataFileAsStored) {
  const CheckpointMetadata opened = OpenCheckpointMetadata(base_, kPath, &pool_).value();
  EXPECT_EQ(ReadNativeMetadataFile(base_, kPath, "prefix").value(), "prefix" + metadata_bytes_);
  EXPECT_EQ(ReadNativeMetadataFile(base_, "/nowhere").status(),
            NotFoundError("no committed checkpoint at /nowhere (shardpoint.metadata is missing)"));
  const CheckpointMetadata decoded =
      DecodeNativeCheckpointMetadata(metadata_bytes_, kPath, &pool_).value();
  const CheckpointMetadata wired = DecodeMetadataFromWire(EncodeMetadataForWire(opened)).value();
  EXPECT_EQ(decoded, opened);
  EXPECT_EQ(decoded, wired);
  size_t grids = 0, indexes = 0;
  for (size_t t = 0; t < decoded.tensors.size(); ++t) {
    const TensorMetadata& d = decoded.tensors[t];
    EXPECT_EQ(d.grid, opened.tensors[t].grid) << d.name;
    EXPECT_EQ(d.index, opened.tensors[t].index) << d.name;
    EXPECT_EQ(d.grid, wired.tensors[t].grid) << d.name;
    EXPECT_EQ(d.index, wired.tensors[t].index) << d.name;
    grids += d.grid.has_value();
    indexes += d.index.has_value();
  }
  EXPECT_GT(grids, 0u);
  EXPECT_EQ(grids + indexes, decoded.tensors.size());
  // A version-1 file lists every chunk: each rank finds the grids when it opens the file.
  const CheckpointMetadata v1 =
      DecodeNativeCheckpointMetadata(EncodeMetadata(md_, 1), kPath, &pool_).value();
  ASSERT_EQ(v1.tensors.size(), decoded.tensors.size());
  for (size_t t = 0; t < v1.tensors.size(); ++t) {
    EXPECT_EQ(v1.tensors[t].grid, decoded.tensors[t].grid) << v1.tensors[t].name;
  }

  // The broadcast itself: the nonce, 'N' and the file.
  ExpectMetadataBroadcast(&base_, 'N', metadata_bytes_);

  // A broadcast whose kind byte is neither is refused alike on every rank.
  broadcast_tap_ = [&](int, std::string& payload) {
    if (payload.size() >= metadata_bytes_.size()) payload[16] = 'X';
  };
  EXPECT_EQ(LoadError(&base_),
            DataLossError("the load's metadata broadcast (" +
                          std::to_string(17 + metadata_bytes_.size()) +
                          " bytes) does not start with a nonce of 16 bytes and a kind byte ('N' "
                          "or 'W')"));
  // Bytes of the file damaged on the way are found by every rank's decoding, as in the file.
  broadcast_tap_ = [&](int, std::string& payload) {
    if (payload.size() >= metadata_bytes_.size()) payload[17 + metadata_bytes_.size() / 2] ^= 4;
  };
  const Status damaged = LoadError(&base_);
  EXPECT_EQ(damaged.code(), StatusCode::kDataLoss);
  EXPECT_THAT(damaged.message(),
              AllOf(StartsWith("rank 0: metadata file /ckpt/shardpoint.metadata: "),
                    HasSubstr("checksum mismatch")));
}

// Another format's metadata, which its driver assembles from several files, goes decoded and
// encoded for the wire, behind the kind byte 'W' (LoadOptions::own_chunks_only off).
TEST_F(EngineFailureTest, ALoadsRanksReceiveATorchDcpCheckpointsMetadataEncodedForTheWire) {
  format_ = CheckpointFormat::kTorchDcp;
  MemoryStore base;
  SaveA(&base);
  const CheckpointMetadata opened = OpenCheckpointMetadata(base, kPath, &pool_).value();
  ExpectMetadataBroadcast(&base, 'W', EncodeMetadataForWire(opened));
}

// Ranks in separate processes (LoadOptions::own_chunks_only, the default) each send the
// coordinator the boxes they load and are sent only their part of the metadata: every tensor's
// header and exactly the stored chunks their boxes reach, under their stored numbers, with the
// files those name; rank 0, which plans shared reads, is sent nothing (it is the coordinator and
// keeps what it opened). In every format, and bit-exact. A part damaged on the way, a bad kind
// byte, a damaged request and a checkpoint the coordinator cannot open each fail every rank with
// the same error, naming the rank where it arose.
TEST_F(EngineFailureTest, EachLoadRankIsSentOnlyTheChunksItsBoxesReach) {
  const std::string tag(1, '\0');  // the envelope's last byte for a value (comm/collective.h)
  for (const CheckpointFormat format : {CheckpointFormat::kNative, CheckpointFormat::kTorchDcp}) {
    SCOPED_TRACE(static_cast<int>(format));
    format_ = format;
    MemoryStore base;
    SaveA(&base);
    const CheckpointMetadata opened = OpenCheckpointMetadata(base, kPath, &pool_).value();
    const std::string whole = EncodeMetadataForWire(opened);
    std::vector<std::string> asked(kLoadRanks), sent(kLoadRanks);
    gather_tap_ = [&](int rank, std::string& p) {
      if (asked[rank].empty()) asked[rank] = p;
    };
    scatter_tap_ = [&](int rank, std::string& p) {
      if (sent[rank].empty()) sent[rank] = p;
    };
    std::vector<spt::RankShards> shards;
    std::vector<LoadResult> results;
    const std::vector<Status> statuses = LoadAll(&base, &shards, &results);
    gather_tap_ = scatter_tap_ = nullptr;
    for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
    std::string first;
    EXPECT_EQ(spt::CountMismatches(a_, shards, &first), 0) << first;
    uint64_t all = 0;
    for (const TensorMetadata& t : opened.tensors) all += t.chunks.size();
    EXPECT_EQ(asked[0], "A" + tag);  // the whole metadata
    EXPECT_EQ(sent[0], tag);         // the coordinator keeps its own
    EXPECT_EQ(results[0].metadata_chunks, all);
    for (int r = 1; r < kLoadRanks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      ASSERT_GT(asked[r].size(), 2u);
      ASSERT_EQ(asked[r][0], 'F');
      const ChunkFilter filter =
          DecodeChunkFilter(std::string_view(asked[r]).substr(1, asked[r].size() - 2), "test")
              .value();
      EXPECT_EQ(filter.size(), shards[r].AsLoadState(a_).tensors.size());
      const std::string part = EncodeMetadataPartForWire(opened, filter);
      ASSERT_EQ(sent[r].size(), 16 + 1 + part.size() + 1);
      EXPECT_EQ(sent[r].substr(16), "W" + part + tag);
      EXPECT_LT(part.size(), whole.size());
      const CheckpointMetadata mine = DecodeMetadataFromWire(part).value();
      ASSERT_EQ(mine.tensors.size(), opened.tensors.size());
      uint64_t kept = 0;
      for (size_t t = 0; t < opened.tensors.size(); ++t) {
        auto it = filter.find(opened.tensors[t].name);
        kept += testing::ExpectPartOf(opened.tensors[t], mine.tensors[t],
                                      it != filter.end() ? &it->second : nullptr);
      }
      EXPECT_EQ(results[r].metadata_chunks, kept);
      EXPECT_LT(kept, all);
      // The files its chunks name, as opened; the others only counted.
      std::set<uint32_t> named;
      for (const TensorMetadata& t : mine.tensors) {
        for (const StoredChunk& c : t.chunks) named.insert(c.file);
      }
      for (const ObjectEntry& o : mine.objects) {
        if (o.stored) named.insert(o.stored->file);
      }
      ASSERT_EQ(mine.files.size(), opened.files.size());
      for (uint32_t f = 0; f < mine.files.size(); ++f) {
        EXPECT_EQ(mine.files[f], named.count(f) ? opened.files[f] : DataFile()) << "file " << f;
      }
    }
  }
  format_ = CheckpointFormat::kNative;
  MemoryStore base;
  SaveA(&base);
  // A part truncated on its way to rank 2: its decoding fails, and every rank with it.
  scatter_tap_ = [](int rank, std::string& p) {
    if (rank == 2 && p.size() > 100) p.erase(p.size() - 11, 10);
  };
  Status failed = LoadError(&base);
  EXPECT_EQ(failed.code(), StatusCode::kDataLoss);
  EXPECT_THAT(failed.message(),
              StartsWith("rank 2: checkpoint metadata received from the coordinator"));
  // A bad kind byte on rank 1.
  size_t length = 0;
  scatter_tap_ = [&](int rank, std::string& p) {
    if (rank == 1 && p.size() > 100) {
      p[16] = 'N';
      length = p.size() - 1;
    }
  };
  failed = LoadError(&base);
  EXPECT_EQ(failed, DataLossError("rank 1: the load's metadata part (" + std::to_string(length) +
                                  " bytes) does not start with a nonce of 16 bytes and 'W'"));
  // A request damaged on its way from rank 2: the coordinator names it.
  scatter_tap_ = nullptr;
  gather_tap_ = [](int rank, std::string& p) {
    if (rank == 2 && p.size() > 5 && p[0] == 'F') p[4] = '\x7f';  // a count past the bytes
  };
  failed = LoadError(&base);
  EXPECT_EQ(failed.code(), StatusCode::kDataLoss);
  EXPECT_THAT(failed.message(), StartsWith("rank 0: the chunk filter of rank 2"));
  // A checkpoint the coordinator cannot open.
  gather_tap_ = [](int, std::string&) {};
  MemoryStore empty;
  failed = LoadError(&empty);
  EXPECT_EQ(failed.code(), StatusCode::kNotFound);
  EXPECT_THAT(failed.message(), StartsWith("rank 0: no committed checkpoint at /ckpt"));
  gather_tap_ = nullptr;
}

// The coordinator's answers to a round of requests (AnswerMetadataRequests): the whole metadata,
// encoded once, for those that ask for it; each part as EncodeMetadataPartForWire makes it, the
// same bytes for ranks that ask alike; nothing for the coordinator; a request that is not one
// refused naming its rank.
TEST_F(EngineFailureTest, TheCoordinatorAnswersEachRequestAndAlikeOnesFromOneEncoding) {
  MemoryStore base;
  SaveA(&base);
  const CheckpointMetadata opened = OpenCheckpointMetadata(base, kPath, &pool_).value();
  ChunkFilter rows, none;
  for (const TensorMetadata& t : opened.tensors) {
    rows[t.name] = {Box::Whole(t.shape)};
    if (!t.shape.empty()) rows[t.name][0].sizes[0] = 1;
  }
  const std::vector<std::string> requests = {MetadataRequest(&rows), MetadataRequest(nullptr),
                                             MetadataRequest(&none), MetadataRequest(&rows),
                                             MetadataRequest(&rows), MetadataRequest(nullptr)};
  const MetadataPartEncoder encoder(opened, &pool_);
  std::vector<std::string> out(requests.size());
  std::string whole;
  ASSERT_TRUE(AnswerMetadataRequests(encoder, requests, 10, "pre", 14, &whole, out, &pool_).ok());
  EXPECT_EQ(whole, EncodeMetadataForWire(opened));
  EXPECT_EQ(out[0], "pre" + EncodeMetadataPartForWire(opened, rows));
  EXPECT_EQ(out[1], "pre" + whole);
  EXPECT_EQ(out[2], "pre" + EncodeMetadataPartForWire(opened, none));
  EXPECT_EQ(out[3], out[0]);
  EXPECT_EQ(out[4], "");  // rank 14, the coordinator
  EXPECT_EQ(out[5], out[1]);
  EXPECT_LT(out[2].size(), out[0].size());
  std::vector<std::string> bad = requests;
  bad[3] = "Fxyz";
  bad[5] = "Q";
  Status refused = AnswerMetadataRequests(encoder, bad, 10, "pre", 14, &whole, out, &pool_);
  EXPECT_EQ(refused.code(), StatusCode::kDataLoss);
  EXPECT_THAT(refused.message(), StartsWith("the chunk filter of rank 13: "));
  bad[3] = requests[3];
  EXPECT_EQ(AnswerMetadataRequests(encoder, bad, 10, "pre", 14, &whole, out, &pool_),
            DataLossError("the load's metadata request of rank 15 (1 bytes) starts with "
                          "neither 'A' nor 'F'"));
}

// Counts a rank's all-gathers and what its scatters bring it.
class ScatterCountingComm final : public testing::ForwardingComm {
 public:
  using ForwardingComm::ForwardingComm;
  Result<std::vector<std::string>> AllGather(std::string p) override {
    ++all_gathers;
    return ForwardingComm::AllGather(std::move(p));
  }
  Result<std::string> Scatter(std::vector<std::string> p, int root) override {
    Result<std::string> out = ForwardingComm::Scatter(std::move(p), root);
    if (out.ok()) scattered += out->size();
    return out;
  }
  int all_gathers = 0;
  uint64_t scattered = 0;
};

TEST_F(EngineFailureTest, InProcessRanksAreEachSentTheirOwnReadsByRankZero) {
  // Threads of one process share reads: rank 0 assigns every needed stored byte to one rank, in
  // one pass, and sends each rank its own reads; no rank receives every rank's needs.
  MemoryStore base;
  SaveA(&base);
  std::vector<spt::RankShards> shards = spt::ShardModel(a_, spt::Which::kServe, false).value();
  std::vector<int> all_gathers(kLoadRanks);
  std::vector<uint64_t> scattered(kLoadRanks), read(kLoadRanks);
  const std::vector<Status> statuses = RunRanks(kLoadRanks, [&](Communicator& inner) -> Status {
    EXPECT_TRUE(inner.shares_memory());
    ScatterCountingComm comm(inner);
    LoadOptions options;
    options.comm = &comm;
    options.store = &base;
    options.pool = &pool_;
    SP_ASSIGN_OR_RETURN(LoadResult result,
                        Load(shards[comm.rank()].AsLoadState(a_), kPath, options));
    all_gathers[comm.rank()] = comm.all_gathers;
    scattered[comm.rank()] = comm.scattered;
    read[comm.rank()] = result.bytes_read;
    return OkStatus();
  }, Bounded());
  for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
  std::string first;
  EXPECT_EQ(spt::CountMismatches(a_, shards, &first), 0) << first;
  uint64_t total_read = 0;
  for (int r = 0; r < kLoadRanks; ++r) {
    EXPECT_EQ(all_gathers[r], 0) << "rank " << r;
    EXPECT_GT(scattered[r], 0u) << "rank " << r;
    total_read += read[r];
  }
  EXPECT_EQ(total_read, a_.total_bytes());  // every stored byte once, among the ranks
}

TEST_F(EngineFailureTest, InProcessRanksShareTheCoordinatorsDecodedMetadata) {
  // Threads of one process receive the address of the coordinator's decoded copy, not the file:
  // the nonce, 'P' and 8 bytes (and the envelope's tag byte), on every rank, in every format;
  // no broadcast of the load is larger.
  for (const CheckpointFormat format : {CheckpointFormat::kNative, CheckpointFormat::kTorchDcp}) {
    format_ = format;
    MemoryStore base;
    SaveA(&base);
    std::vector<spt::RankShards> shards =
        spt::ShardModel(a_, spt::Which::kServe, false).value();
    std::vector<std::vector<size_t>> broadcasts(kLoadRanks);
    const std::vector<Status> statuses =
        RunRanks(kLoadRanks, [&](Communicator& inner) -> Status {
          class Sizes final : public testing::ForwardingComm {
           public:
            Sizes(Communicator& inner, std::vector<size_t>* sizes)
                : ForwardingComm(inner), sizes_(sizes) {}
            Result<std::string> Broadcast(std::string p, int root) override {
              Result<std::string> out = ForwardingComm::Broadcast(std::move(p), root);
              if (out.ok()) sizes_->push_back(out->size());
              return out;
            }

           private:
            std::vector<size_t>* sizes_;
          } comm(inner, &broadcasts[inner.rank()]);
          LoadOptions options;
          options.comm = &comm;
          options.store = &base;
          options.pool = &pool_;
          return Load(shards[comm.rank()].AsLoadState(a_), kPath, options).status();
        }, Bounded());
    for (const Status& s : statuses) ASSERT_TRUE(s.ok()) << s;
    std::string first;
    EXPECT_EQ(spt::CountMismatches(a_, shards, &first), 0) << first;
    for (int r = 0; r < kLoadRanks; ++r) {
      // The metadata's, then only small ones (the verdicts of gathers).
      ASSERT_FALSE(broadcasts[r].empty()) << "rank " << r;
      EXPECT_EQ(broadcasts[r][0], 16u + 1 + 8 + 1) << "rank " << r;
      EXPECT_LE(*std::max_element(broadcasts[r].begin(), broadcasts[r].end()), 26u);
    }
  }
  // A checkpoint the coordinator cannot open fails every rank alike, named by the coordinator.
  MemoryStore empty;
  std::vector<spt::RankShards> shards;
  const Status missing = LoadError(&empty);
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), StartsWith("rank 0: "));
}

TEST_F(EngineCorruptionTest, UnknownDTypeCode) {
  for (uint8_t code : {uint8_t{0}, uint8_t{21}, uint8_t{255}}) {
    std::string bytes = metadata_bytes_;
    const std::string name = SetFirstDTypeCode(bytes, code);
    EXPECT_EQ(name, tensor().name);
    Put(base_, kMetadataPath, bytes);
    ExpectUnreadableMetadata(StatusCode::kDataLoss,
                             "metadata file /ckpt/shardpoint.metadata: tensor \"" + name +
                                 "\": unknown dtype code " + std::to_string(code));
  }
  // The same edit with the dtype's own code leaves a valid file.
  std::string bytes = metadata_bytes_;
  SetFirstDTypeCode(bytes, DTypeCode(tensor().dtype));
  EXPECT_EQ(bytes, metadata_bytes_);
}

// ---- 5. The same failure on every rank of a load --------------------------------------------

TEST_F(EngineFailureTest, MissingKeyOnOneRankFailsEveryRankAlike) {
  MemoryStore base;
  SaveA(&base);
  std::vector<spt::RankShards> shards;
  Status s = Agreed(LoadAll(&base, &shards, nullptr, [](int rank, LoadState& state) {
    if (rank == 1) state.tensors.push_back(LoadTensor{"model.no_such_tensor", DType::kFloat32, {3}, {}});
  }));
  EXPECT_EQ(s, NotFoundError("rank 1: 1 key is missing from the checkpoint: "
                             "'model.no_such_tensor'"));
  s = Agreed(LoadAll(&base, &shards, nullptr, [](int rank, LoadState& state) {
    if (rank == 2) state.objects.push_back("no.such.object");
  }));
  EXPECT_EQ(s, NotFoundError("rank 2: key 'no.such.object' is not in the checkpoint at /ckpt"));

  // Not strict: the load succeeds and only the asking rank hears of the missing key.
  std::vector<LoadResult> results;
  std::vector<Status> loaded = LoadAll(&base, &shards, &results, [](int rank, LoadState& state) {
    if (rank == 1) state.tensors.push_back(LoadTensor{"model.no_such_tensor", DType::kFloat32, {3}, {}});
  }, /*strict=*/false);
  for (const Status& status : loaded) ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(results[1].missing_keys, std::vector<std::string>{"model.no_such_tensor"});
  EXPECT_TRUE(results[0].missing_keys.empty());
  EXPECT_TRUE(results[2].missing_keys.empty());
  std::string first;
  EXPECT_EQ(spt::CountMismatches(a_, shards, &first), 0) << first;
}

TEST_F(EngineFailureTest, ReadFailureOnOneRankFailsEveryRankAlike) {
  MemoryStore base;
  FaultStore store(&base);
  SaveA(&store);
  store.FailMatching(Op::kRead, "-r00003-", DataLossError("Input/output error (injected)"));
  std::vector<spt::RankShards> shards;
  Status s = Agreed(LoadAll(&store, &shards));
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank "), HasSubstr("read /ckpt/d-"),
                                 HasSubstr("-r00003-f000.safetensors at offset "),
                                 HasSubstr(": Input/output error (injected)")));
}

TEST_F(EngineFailureTest, ShapeMismatchOnOneRankFailsEveryRankAlike) {
  MemoryStore base;
  SaveA(&base);
  std::vector<spt::RankShards> shards;
  Status s = Agreed(LoadAll(&base, &shards, nullptr, [](int rank, LoadState& state) {
    for (LoadTensor& t : state.tensors) {
      if (rank == 0 && t.name == "model.final_norm.weight") t.shape = {65};
    }
  }));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(StartsWith("rank 0: "), HasSubstr("model.final_norm.weight")));
}

}  // namespace
}  // namespace sp
