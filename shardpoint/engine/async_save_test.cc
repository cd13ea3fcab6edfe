// Tests of AsyncSaver: the checkpoint holds the state as it was when Start returned, a failing save
// surfaces on Wait on every rank and commits nothing, staging memory is reused and bounded.
#include "shardpoint/engine/async_save.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/format/writer.h"
#include "shardpoint/store/fault_store.h"
#include "shardpoint/store/memory_store.h"
#include "shardpoint/testing/hook_store.h"
#include "shardpoint/testing/synthetic_model.h"

namespace sp {
namespace {

namespace spt = ::sp::testing;
using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kPath[] = "/ckpt";

// Forwards to a base store; every WriteAt blocks until Open() is called.
class GatedStore : public spt::ForwardingStore {
 public:
  explicit GatedStore(Store* base) : ForwardingStore(base) {}

  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view path) override {
    SP_ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, base()->NewWritableFile(path));
    return std::unique_ptr<WritableFile>(std::make_unique<File>(this, std::move(file)));
  }
  std::string name() const override { return "gated(" + base()->name() + ")"; }

 private:
  class File : public WritableFile {
   public:
    File(GatedStore* store, std::unique_ptr<WritableFile> base)
        : store_(store), base_(std::move(base)) {}
    Status WriteAt(uint64_t offset, ByteView data) override {
      store_->AwaitOpen();
      return base_->WriteAt(offset, data);
    }
    Status Preallocate(uint64_t size) override { return base_->Preallocate(size); }
    Status Sync() override { return base_->Sync(); }
    Status Close() override { return base_->Close(); }
    const std::string& path() const override { return base_->path(); }

   private:
    GatedStore* store_;
    std::unique_ptr<WritableFile> base_;
  };

  void AwaitOpen() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// A small state of one rank: a few tensors of several dtypes, each one piece, random bytes.
struct Tensors {
  std::vector<std::string> names;
  std::vector<DType> dtypes;
  std::vector<Shape> shapes;
  std::vector<std::vector<std::byte>> data;

  SaveState AsSaveState() const {
    SaveState state;
    for (size_t i = 0; i < names.size(); ++i) {
      state.tensors.push_back({names[i], dtypes[i], shapes[i],
                               {ConstPieceView{Box::Whole(shapes[i]), data[i].data()}}});
    }
    state.objects.push_back({"step", ObjectEncoding::kJson, "17"});
    return state;
  }
  uint64_t total_bytes() const {
    uint64_t total = 0;
    for (const auto& d : data) total += d.size();
    return total;
  }
};

Tensors MakeTensors(uint64_t seed, int64_t scale = 1) {
  std::mt19937_64 rng(seed);
  Tensors t;
  t.names = {"a.weight", "b.bias", "c.mask", "d.scale"};
  t.dtypes = {DType::kBFloat16, DType::kFloat32, DType::kBool, DType::kFloat8E4M3FN};
  t.shapes = {{33 * scale, 17}, {257 * scale}, {5, 7 * scale}, {1}};
  for (size_t i = 0; i < t.names.size(); ++i) {
    std::vector<std::byte>& bytes = t.data.emplace_back(ShapeVolume(t.shapes[i]) *
                                                        DTypeSize(t.dtypes[i]));
    for (std::byte& b : bytes) b = static_cast<std::byte>(rng());
    if (t.dtypes[i] == DType::kBool) {
      for (std::byte& b : bytes) b &= std::byte{1};
    }
  }
  return t;
}

// Loads every tensor of `like` (whole) from `path` and returns the bytes read back.
std::vector<std::vector<std::byte>> LoadBack(Store& store, const Tensors& like,
                                             std::string_view path = kPath) {
  std::vector<std::vector<std::byte>> out;
  LoadState state;
  for (size_t i = 0; i < like.names.size(); ++i) {
    out.emplace_back(like.data[i].size());
  }
  for (size_t i = 0; i < like.names.size(); ++i) {
    state.tensors.push_back({like.names[i], like.dtypes[i], like.shapes[i],
                             {PieceView{Box::Whole(like.shapes[i]), out[i].data()}}});
  }
  LoadOptions options;
  options.store = &store;
  Result<LoadResult> result = Load(state, path, options);
  EXPECT_TRUE(result.ok()) << result.status();
  return out;
}

// Runs body(rank, comm) on `ranks` threads of one ThreadCommGroup; returns each rank's status.
std::vector<Status> RunRanks(int ranks, const std::function<Status(int, Communicator&)>& body) {
  ThreadCommOptions comm_options;
  comm_options.timeout = std::chrono::seconds(60);
  ThreadCommGroup group(ranks, comm_options);
  std::vector<Status> statuses(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] { statuses[r] = body(r, group.comm(r)); });
  }
  for (std::thread& t : threads) t.join();
  return statuses;
}

TEST(AsyncSaverTest, CheckpointHoldsTheStateAsOfStart) {
  MemoryStore memory;
  GatedStore gated(&memory);
  Tensors tensors = MakeTensors(1);
  const Tensors original = tensors;
  AsyncSaver saver;
  SaveOptions options;
  options.store = &gated;
  options.threads = 2;
  ASSERT_TRUE(saver.Start(tensors.AsSaveState(), kPath, options).ok());
  // No byte can have been written yet: the gate holds every write.
  EXPECT_FALSE(saver.Done());
  for (auto& bytes : tensors.data) std::memset(bytes.data(), 0xAB, bytes.size());
  gated.Open();
  ASSERT_TRUE(saver.Wait().ok());
  EXPECT_TRUE(saver.Done());
  EXPECT_EQ(LoadBack(memory, original), original.data);
  EXPECT_TRUE(saver.Wait().ok());  // nothing running: OK
}

TEST(AsyncSaverTest, RoundTripsAResharded4RankModelAndWholeOnOneRank) {
  spt::ModelConfig config;
  config.layers = 1;
  config.hidden = 64;
  config.ffn = 96;
  config.vocab = 101;
  const spt::GlobalModel model = spt::MakeGlobalModel(config, 7);
  Result<std::vector<spt::RankShards>> train = spt::ShardModel(model, spt::Which::kTrain, true);
  ASSERT_TRUE(train.ok()) << train.status();
  MemoryStore store;
  std::vector<Status> saved = RunRanks(4, [&](int r, Communicator& comm) {
    AsyncSaver saver;
    SaveOptions options;
    options.comm = &comm;
    options.store = &store;
    options.threads = 1;
    SP_RETURN_IF_ERROR(saver.Start((*train)[r].AsSaveState(model), kPath, options));
    // Training goes on: the caller's shards change right away.
    for (AlignedBuffer& b : (*train)[r].buffers[0]) std::memset(b.data(), 0, b.size());
    return saver.Wait();
  });
  for (const Status& s : saved) ASSERT_TRUE(s.ok()) << s;
  Result<std::vector<spt::RankShards>> serve = spt::ShardModel(model, spt::Which::kServe, false);
  ASSERT_TRUE(serve.ok()) << serve.status();
  std::vector<Status> loaded = RunRanks(3, [&](int r, Communicator& comm) -> Status {
    LoadOptions options;
    options.comm = &comm;
    options.store = &store;
    return Load((*serve)[r].AsLoadState(model), kPath, options).status();
  });
  for (const Status& s : loaded) ASSERT_TRUE(s.ok()) << s;
  std::string first_mismatch;
  EXPECT_EQ(spt::CountMismatches(model, *serve, &first_mismatch), 0) << first_mismatch;
  // And every tensor whole on one rank, as consolidation reads it.
  Result<std::vector<spt::RankShards>> whole = spt::ShardModel(model, spt::Which::kWhole, false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_EQ(whole->size(), 1u);
  LoadOptions options;
  options.store = &store;
  const Result<LoadResult> one = Load((*whole)[0].AsLoadState(model), kPath, options);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->bytes_read, model.total_bytes());
  EXPECT_EQ(spt::CountMismatches(model, *whole, &first_mismatch), 0) << first_mismatch;
}

TEST(AsyncSaverTest, FailedSaveSurfacesOnWaitOnEveryRankAndCommitsNothing) {
  MemoryStore memory;
  FaultStore faults(&memory);
  faults.FailMatching(FaultStore::Op::kWrite, "-r00001-", UnavailableError("disk gone"));
  std::vector<Status> statuses = RunRanks(3, [&](int r, Communicator& comm) {
    Tensors tensors = MakeTensors(10 + r);
    for (std::string& name : tensors.names) name = "rank" + std::to_string(r) + "." + name;
    AsyncSaver saver;
    SaveOptions options;
    options.comm = &comm;
    options.store = &faults;
    SP_RETURN_IF_ERROR(saver.Start(tensors.AsSaveState(), kPath, options));
    return saver.Wait();
  });
  for (const Status& s : statuses) {
    EXPECT_EQ(s, statuses[0]);
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_THAT(s.message(), HasSubstr("disk gone"));
  }
  EXPECT_EQ(ReadCheckpointMetadata(kPath, &memory).status().code(), StatusCode::kNotFound);
}

TEST(AsyncSaverTest, UnreportedFailureIsReturnedByTheNextStart) {
  MemoryStore memory;
  FaultStore faults(&memory);
  faults.FailNext(FaultStore::Op::kSync, DataLossError("bad sector"));
  const Tensors tensors = MakeTensors(3);
  AsyncSaver saver;
  SaveOptions options;
  options.store = &faults;
  ASSERT_TRUE(saver.Start(tensors.AsSaveState(), kPath, options).ok());
  const Status again = saver.Start(tensors.AsSaveState(), "/other", options);
  EXPECT_EQ(again.code(), StatusCode::kDataLoss) << again;
  EXPECT_THAT(again.message(), StartsWith("previous async save to /ckpt: "));
  EXPECT_THAT(again.message(), HasSubstr("bad sector"));
  // The error was reported once; the next save proceeds.
  ASSERT_TRUE(saver.Start(tensors.AsSaveState(), "/other", options).ok());
  ASSERT_TRUE(saver.Wait().ok());
  EXPECT_EQ(LoadBack(memory, tensors, "/other"), tensors.data);
  EXPECT_EQ(ReadCheckpointMetadata(kPath, &memory).status().code(), StatusCode::kNotFound);
}

TEST(AsyncSaverTest, StagingIsReusedAcrossSaves) {
  MemoryStore store;
  AsyncSaver saver;
  SaveOptions options;
  options.store = &store;
  options.overwrite = true;
  const Tensors first = MakeTensors(4);
  ASSERT_TRUE(saver.Start(first.AsSaveState(), kPath, options).ok());
  ASSERT_TRUE(saver.Wait().ok());
  const uint64_t capacity = saver.staging_capacity_bytes();
  EXPECT_GE(capacity, first.total_bytes());
  EXPECT_LE(capacity, first.total_bytes() + 64 * first.names.size());
  const Tensors second = MakeTensors(5);  // same sizes, other values
  ASSERT_TRUE(saver.Start(second.AsSaveState(), kPath, options).ok());
  ASSERT_TRUE(saver.Wait().ok());
  EXPECT_EQ(saver.staging_capacity_bytes(), capacity);
  EXPECT_EQ(LoadBack(store, second), second.data);
  const Tensors larger = MakeTensors(6, 3);
  ASSERT_TRUE(saver.Start(larger.AsSaveState(), kPath, options).ok());
  ASSERT_TRUE(saver.Wait().ok());
  EXPECT_GT(saver.staging_capacity_bytes(), capacity);
  EXPECT_EQ(LoadBack(store, larger), larger.data);
}

TEST(AsyncSaverTest, BudgetExceededOnOneRankFailsItsStartAndEveryRanksWait) {
  MemoryStore store;
  const uint64_t budget = MakeTensors(0).total_bytes() + 4096;
  std::vector<Status> started(2), waited(2), restarted(2), rewaited(2);
  RunRanks(2, [&](int r, Communicator& comm) {
    const Tensors tensors = MakeTensors(20 + r, r == 1 ? 4 : 1);  // rank 1 holds more
    AsyncSaver saver(budget);
    SaveOptions options;
    options.comm = &comm;
    options.store = &store;
    started[r] = saver.Start(tensors.AsSaveState(), kPath, options);  // no collective call
    waited[r] = saver.Wait();
    // The failure was returned by Start on rank 1: the next Start does not return it again.
    const Tensors small = MakeTensors(40 + r, 1);
    restarted[r] = saver.Start(small.AsSaveState(), kPath, options);
    rewaited[r] = saver.Wait();
    return OkStatus();
  });
  EXPECT_TRUE(started[0].ok()) << started[0];
  EXPECT_EQ(started[1].code(), StatusCode::kResourceExhausted) << started[1];
  EXPECT_THAT(started[1].message(), StartsWith("async save to /ckpt needs "));
  for (const Status& s : waited) {
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(s.message(), StartsWith("rank 1: async save to /ckpt needs "));
    EXPECT_THAT(s.message(), HasSubstr("over the budget of " + std::to_string(budget) + " bytes"));
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(restarted[r].ok()) << restarted[r];
    EXPECT_TRUE(rewaited[r].ok()) << rewaited[r];
  }
  EXPECT_TRUE(ReadCheckpointMetadata(kPath, &store).ok());
}

TEST(AsyncSaverTest, RankThatFailedBeforeStartFailsEveryRanksWait) {
  MemoryStore store;
  std::vector<Status> started(2), waited(2);
  RunRanks(2, [&](int r, Communicator& comm) {
    const Tensors tensors = MakeTensors(50 + r, 1);
    AsyncSaver saver;
    SaveOptions options;
    options.comm = &comm;
    options.store = &store;
    started[r] = r == 0 ? saver.StartFailed(InvalidArgumentError("object 'cfg' is not plain data"),
                                            kPath, options)
                        : saver.Start(tensors.AsSaveState(), kPath, options);
    waited[r] = saver.Wait();
    return OkStatus();
  });
  EXPECT_EQ(started[0].message(), "object 'cfg' is not plain data");
  EXPECT_TRUE(started[1].ok()) << started[1];
  for (const Status& s : waited) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
    EXPECT_EQ(s.message(), "rank 0: object 'cfg' is not plain data");
  }
  EXPECT_EQ(ReadCheckpointMetadata(kPath, &store).status().code(), StatusCode::kNotFound);
}

TEST(AsyncSaverTest, DestructorWaitsForTheSaveToCommit) {
  MemoryStore store;
  const Tensors tensors = MakeTensors(8);
  {
    AsyncSaver saver;
    SaveOptions options;
    options.store = &store;
    ASSERT_TRUE(saver.Start(tensors.AsSaveState(), kPath, options).ok());
  }
  EXPECT_EQ(LoadBack(store, tensors), tensors.data);
}

TEST(AsyncSaverTest, RejectsAPieceWithoutData) {
  AsyncSaver saver;
  SaveState state;
  state.tensors.push_back({"w", DType::kFloat32, {4}, {ConstPieceView{Box({0}, {4}), nullptr}}});
  MemoryStore store;
  SaveOptions options;
  options.store = &store;
  const Status status = saver.Start(state, kPath, options);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr("tensor 'w' piece [0:4] has no data"));
}

TEST(AsyncSaverTest, BorrowedPiecesAreWrittenFromTheCallersMemoryWithoutStaging) {
  MemoryStore memory;
  GatedStore gated(&memory);
  Tensors tensors = MakeTensors(9);
  const Tensors original = tensors;
  AsyncSaver saver(/*staging_budget_bytes=*/16);  // the budget bounds copies, not borrowed memory
  SaveOptions options;
  options.store = &gated;
  ASSERT_TRUE(saver.Start(tensors.AsSaveState(), kPath, options, AsyncStaging::kBorrow).ok());
  EXPECT_EQ(saver.staging_capacity_bytes(), 0u);
  // Borrowed memory is written as it is when the writes run: a change before them shows.
  std::memset(tensors.data[1].data(), 0x5A, tensors.data[1].size());
  gated.Open();
  ASSERT_TRUE(saver.Wait().ok());
  Tensors expected = original;
  expected.data[1] = tensors.data[1];
  EXPECT_EQ(LoadBack(memory, original), expected.data);
}

TEST(AsyncSaverTest, PiecesWithoutMemoryAreFilledByTheBackgroundSave) {
  MemoryStore store;
  const Tensors tensors = MakeTensors(10, 5);
  SaveState state = tensors.AsSaveState();
  state.tensors[0].pieces[0].data = nullptr;  // a.weight and c.mask come from fill_piece
  state.tensors[2].pieces[0].data = nullptr;
  std::mutex mu;
  std::vector<size_t> filled;
  SaveOptions options;
  options.store = &store;
  options.fill_budget_bytes = 64;  // below either piece: one held at a time
  options.fill_piece = [&](size_t t, size_t p, MutableByteView out) {
    EXPECT_EQ(p, 0u);
    EXPECT_EQ(out.size(), tensors.data[t].size());
    std::memcpy(out.data(), tensors.data[t].data(), out.size());
    std::lock_guard<std::mutex> lock(mu);
    filled.push_back(t);
    return OkStatus();
  };
  for (AsyncStaging staging : {AsyncStaging::kCopy, AsyncStaging::kBorrow}) {
    filled.clear();
    AsyncSaver saver;
    options.overwrite = true;
    ASSERT_TRUE(saver.Start(state, kPath, options, staging).ok());
    ASSERT_TRUE(saver.Wait().ok());
    // Copied staging holds only the pieces with memory.
    const uint64_t copied = tensors.data[1].size() + tensors.data[3].size();
    if (staging == AsyncStaging::kCopy) {
      EXPECT_GE(saver.staging_capacity_bytes(), copied);
      EXPECT_LT(saver.staging_capacity_bytes(), copied + 256);
    }
    std::sort(filled.begin(), filled.end());
    EXPECT_EQ(filled, (std::vector<size_t>{0, 2}));
    EXPECT_EQ(LoadBack(store, tensors), tensors.data);
  }
}

// Ranges of pieces without memory (SaveOptions::fill_range, as device state is saved): each
// filled piece is asked for in disjoint ranges of at most kWriteTaskBytes covering it, the bytes
// round-trip in both formats, and a budget below one range lets one range be held at a time
// however many I/O threads there are.
TEST(AsyncSaverTest, RangesOfPiecesWithoutMemoryAreFilledAsTheyAreWritten) {
  Tensors tensors = MakeTensors(12);
  tensors.names.push_back("e.large");
  tensors.dtypes.push_back(DType::kFloat16);
  tensors.shapes.push_back({4099, 4099});  // 33.6 MB: two full ranges and a short one
  std::vector<std::byte>& large = tensors.data.emplace_back(4099 * 4099 * 2);
  std::mt19937_64 rng(12);
  for (std::byte& b : large) b = static_cast<std::byte>(rng());
  SaveState state = tensors.AsSaveState();
  state.tensors[0].pieces[0].data = nullptr;
  state.tensors[4].pieces[0].data = nullptr;
  struct Range {
    size_t tensor;
    uint64_t offset;
    uint64_t size;
    bool operator<(const Range& o) const {
      return std::tie(tensor, offset) < std::tie(o.tensor, o.offset);
    }
  };
  for (CheckpointFormat format : {CheckpointFormat::kNative, CheckpointFormat::kTorchDcp}) {
    for (uint64_t budget : {uint64_t{1}, uint64_t{256} << 20}) {
      SCOPED_TRACE(std::string(format == CheckpointFormat::kNative ? "native" : "torch-dcp") +
                   ", budget " + std::to_string(budget));
      MemoryStore store;
      std::mutex mu;
      std::vector<Range> ranges;
      int in_fill = 0;
      int most_in_fill = 0;
      SaveOptions options;
      options.store = &store;
      options.format = format;
      options.threads = 4;
      options.fill_budget_bytes = budget;
      options.fill_range = [&](size_t t, size_t p, uint64_t offset, MutableByteView out) {
        {
          std::lock_guard<std::mutex> lock(mu);
          most_in_fill = std::max(most_in_fill, ++in_fill);
          ranges.push_back({t, offset, out.size()});
        }
        EXPECT_EQ(p, 0u);
        EXPECT_LE(offset + out.size(), tensors.data[t].size());
        std::memcpy(out.data(), tensors.data[t].data() + offset, out.size());
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        std::lock_guard<std::mutex> lock(mu);
        --in_fill;
        return OkStatus();
      };
      AsyncSaver saver;
      ASSERT_TRUE(saver.Start(state, kPath, options, AsyncStaging::kBorrow).ok());
      ASSERT_TRUE(saver.Wait().ok());
      EXPECT_EQ(LoadBack(store, tensors), tensors.data);
      std::sort(ranges.begin(), ranges.end());
      std::map<size_t, uint64_t> covered;  // tensor -> bytes covered so far, in order
      for (const Range& r : ranges) {
        EXPECT_EQ(r.offset, covered[r.tensor]) << "tensor " << r.tensor;
        EXPECT_GT(r.size, 0u);
        EXPECT_LE(r.size, kWriteTaskBytes);
        covered[r.tensor] = r.offset + r.size;
      }
      EXPECT_EQ(covered, (std::map<size_t, uint64_t>{{0, tensors.data[0].size()},
                                                     {4, tensors.data[4].size()}}));
      if (budget == 1) {
        EXPECT_EQ(most_in_fill, 1);
      }
    }
  }
}

// Whole pieces (fill_piece) and ranges (fill_range) alike.
TEST(AsyncSaverTest, AFillErrorFailsTheSaveAndCommitsNothing) {
  const Tensors tensors = MakeTensors(11);
  SaveState state = tensors.AsSaveState();
  state.tensors[1].pieces[0].data = nullptr;
  const Status failure = InternalError("device copy failed: an illegal memory access");
  for (bool ranges : {false, true}) {
    SCOPED_TRACE(ranges ? "fill_range" : "fill_piece");
    MemoryStore store;
    SaveOptions options;
    options.store = &store;
    if (ranges) {
      options.fill_range = [&](size_t, size_t, uint64_t, MutableByteView) { return failure; };
    } else {
      options.fill_piece = [&](size_t, size_t, MutableByteView) { return failure; };
    }
    AsyncSaver saver;
    ASSERT_TRUE(saver.Start(state, kPath, options, AsyncStaging::kBorrow).ok());
    const Status status = saver.Wait();
    EXPECT_EQ(status.code(), StatusCode::kInternal) << status;
    EXPECT_THAT(status.message(), HasSubstr("device copy failed: an illegal memory access"));
    EXPECT_EQ(ReadCheckpointMetadata(kPath, &store).status().code(), StatusCode::kNotFound);
  }
}

}  // namespace
}  // namespace sp
