// S3Store runs the store conformance suite against a real S3 server (SeaweedFS on 127.0.0.1,
// s3_test_server.h), each test in a fresh directory of one bucket, with parts of the minimum
// size so that multipart uploads are exercised by files of a few MiB.
#include "shardpoint/store/s3/s3_store.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "shardpoint/store/s3/s3_fault_proxy.h"
#include "shardpoint/store/s3/s3_test_server.h"
#include "shardpoint/store/store_conformance.h"

namespace sp {
namespace {

constexpr const char* kBucket = "conformance";

// The one server of this test binary, started on first use; null when it could not be, with
// why in `failure` (kNotFound: no weed binary, so the tests skip; anything else fails them).
testing::S3TestServer* Server(Status* failure) {
  static Status why;
  // Destroyed (the server killed) when the process exits.
  using Server = std::unique_ptr<testing::S3TestServer>;
  static Server server = []() -> Server {
    Result<std::unique_ptr<testing::S3TestServer>> started = testing::S3TestServer::Start();
    if (!started.ok()) {
      why = started.status();
      return nullptr;
    }
    S3Client client((*started)->config());
    why = client.CreateBucket(kBucket);
    if (!why.ok()) return nullptr;
    return std::move(*started);
  }();
  if (failure != nullptr) *failure = why;
  return server.get();
}

Result<StoreTestEnv> MakeS3Env() {
  static std::atomic<int> next{0};
  Status why;
  testing::S3TestServer* server = Server(&why);
  if (server == nullptr) return why;
  StoreTestEnv env;
  S3StoreOptions options;
  options.part_bytes = uint64_t{5} << 20;
  env.store = std::make_unique<S3Store>(std::make_shared<S3Client>(server->config()), kBucket,
                                        options);
  env.root = "/t" + std::to_string(next++);
  SP_RETURN_IF_ERROR(env.store->CreateDirs(env.root));
  return env;
}

StoreConformanceParam S3Param() {
  StoreConformanceParam param;
  param.name = "S3";
  param.make = MakeS3Env;
  param.handles_follow_renames = false;
  param.unavailable = []() -> std::optional<std::string> {
    Status why;
    if (Server(&why) == nullptr && why.code() == StatusCode::kNotFound) {
      return std::string(why.message());
    }
    return std::nullopt;
  };
  return param;
}

// Files written by several threads at once in pieces that straddle parts: every part is
// assembled in a file's memory and sent in the background, and the parts in flight over all the
// files stay within the store's budget. Read back with scatter reads cut into many GETs.
TEST(S3StoreTest, PartsInFlightStayWithinTheStoreBudgetAndReadsAreCut) {
  Status why;
  testing::S3TestServer* server = Server(&why);
  if (server == nullptr && why.code() == StatusCode::kNotFound) GTEST_SKIP() << why.message();
  ASSERT_NE(server, nullptr) << why;
  S3StoreOptions options;
  options.part_bytes = uint64_t{5} << 20;
  options.part_budget_bytes = uint64_t{10} << 20;  // two parts
  options.read_part_bytes = uint64_t{1} << 20;
  S3Store store(std::make_shared<S3Client>(server->config()), kBucket, options);
  ASSERT_TRUE(store.CreateDirs("/budget").ok());

  constexpr int kFiles = 3, kThreads = 4;
  constexpr uint64_t kPiece = (uint64_t{3} << 20) + 123;  // never a whole part
  constexpr uint64_t kPieces = 3;                          // per thread and file
  const uint64_t file_bytes = kPiece * kPieces * kThreads;
  std::vector<std::string> contents(kFiles);
  std::vector<std::unique_ptr<WritableFile>> files;
  for (int f = 0; f < kFiles; ++f) {
    std::mt19937_64 rng(f + 1);
    contents[f].resize(file_bytes);
    for (char& c : contents[f]) c = static_cast<char>(rng());
    Result<std::unique_ptr<WritableFile>> file =
        store.NewWritableFile("/budget/f" + std::to_string(f));
    ASSERT_TRUE(file.ok()) << file.status();
    files.push_back(std::move(*file));
  }
  // Thread t writes pieces t, t + kThreads, ... of every file, the files interleaved.
  std::vector<Status> written(kThreads);
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&, t] {
      for (uint64_t k = t; k < kPieces * kThreads && written[t].ok(); k += kThreads) {
        for (int f = 0; f < kFiles && written[t].ok(); ++f) {
          written[t] = files[f]->WriteAt(
              k * kPiece, ByteView(reinterpret_cast<const std::byte*>(contents[f].data()) +
                                       k * kPiece,
                                   kPiece));
        }
      }
    });
  }
  for (std::thread& w : writers) w.join();
  for (const Status& w : written) ASSERT_TRUE(w.ok()) << w;
  for (auto& file : files) ASSERT_TRUE(file->Close().ok());
  EXPECT_GT(store.peak_part_bytes_in_flight(), 0u);
  EXPECT_LE(store.peak_part_bytes_in_flight(), options.part_budget_bytes);

  // A write of whole parts goes from the caller's bytes; the tail part from the file's memory.
  const uint64_t big = 4 * options.part_bytes + 4321;
  std::string direct(big, '\0');
  std::mt19937_64 rng(99);
  for (char& c : direct) c = static_cast<char>(rng());
  Result<std::unique_ptr<WritableFile>> whole = store.NewWritableFile("/budget/whole");
  ASSERT_TRUE(whole.ok());
  ASSERT_TRUE((*whole)->WriteAt(0, AsBytes(direct)).ok());
  Status rewrite = (*whole)->WriteAt(options.part_bytes, AsBytes("x"));
  EXPECT_EQ(rewrite.code(), StatusCode::kFailedPrecondition) << rewrite;
  EXPECT_NE(rewrite.message().find("already sent"), std::string_view::npos) << rewrite;
  ASSERT_TRUE((*whole)->Close().ok());

  // Scatter reads across the 1 MiB GET boundaries, into pieces of odd sizes.
  for (int f = 0; f <= kFiles; ++f) {
    const std::string path = f < kFiles ? "/budget/f" + std::to_string(f) : "/budget/whole";
    const std::string& want = f < kFiles ? contents[f] : direct;
    Result<std::unique_ptr<ReadableFile>> reader = store.OpenReadable(path);
    ASSERT_TRUE(reader.ok()) << reader.status();
    ASSERT_EQ((*reader)->size(), want.size());
    const uint64_t from = 777, length = want.size() - 1000;
    std::string got(length, '\0');
    std::vector<MutableByteView> pieces;
    for (uint64_t at = 0, n = 1; at < length; at += n, n = n * 3 + 17) {
      n = std::min(n, length - at);
      pieces.push_back(MutableByteView(reinterpret_cast<std::byte*>(got.data()) + at, n));
    }
    Status read = (*reader)->ReadVAt(from, pieces);
    ASSERT_TRUE(read.ok()) << read;
    EXPECT_TRUE(got == want.substr(from, length)) << path;
    // Past the end: the bytes held arrive, and the read says what was short.
    std::string tail(2000, '\0');
    Status past = (*reader)->ReadAt(
        want.size() - 1000, MutableByteView(reinterpret_cast<std::byte*>(tail.data()), 2000));
    EXPECT_EQ(past.code(), StatusCode::kDataLoss) << past;
    EXPECT_TRUE(tail.substr(0, 1000) == want.substr(want.size() - 1000));
  }
}

// A part that fails in the background fails the file: its next write returns that failure
// without sending anything, Close fails, and no object appears.
TEST(S3StoreTest, APartThatFailsInTheBackgroundFailsTheFile) {
  Status why;
  testing::S3TestServer* server = Server(&why);
  if (server == nullptr && why.code() == StatusCode::kNotFound) GTEST_SKIP() << why.message();
  ASSERT_NE(server, nullptr) << why;
  Result<std::unique_ptr<testing::S3FaultProxy>> proxy =
      testing::S3FaultProxy::Start(server->port());
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  S3Config via = server->config();
  via.endpoint = (*proxy)->endpoint();
  S3ClientOptions once;
  once.max_attempts = 1;
  auto client = std::make_shared<S3Client>(via, once);
  S3StoreOptions options;
  options.part_bytes = uint64_t{5} << 20;
  S3Store store(client, kBucket, options);
  ASSERT_TRUE(store.CreateDirs("/failing").ok());
  const std::string part(options.part_bytes, 'p');
  Result<std::unique_ptr<WritableFile>> file = store.NewWritableFile("/failing/f");
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_TRUE((*file)->WriteAt(0, AsBytes(part)).ok());  // part 1, sent before returning

  (*proxy)->SetFaults({.throttle = 1.0});
  // Part 2 assembled in the file's memory (two writes), sent in the background, throttled.
  ASSERT_TRUE((*file)->WriteAt(options.part_bytes, AsBytes(part.substr(0, 1000))).ok());
  Status second = (*file)->WriteAt(options.part_bytes + 1000, AsBytes(part.substr(1000)));
  Status failed = second.ok() ? (*file)->Sync() : second;
  for (int i = 0; i < 100 && failed.ok(); ++i) {  // the part's answer may still be on its way
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    failed = (*file)->Sync();
  }
  EXPECT_EQ(failed.code(), StatusCode::kUnavailable) << failed;
  EXPECT_NE(failed.message().find("/failing/f"), std::string_view::npos) << failed;
  EXPECT_NE(failed.message().find("SlowDown"), std::string_view::npos) << failed;
  const uint64_t sent = client->requests_sent();
  Status third = (*file)->WriteAt(2 * options.part_bytes, AsBytes(part));
  EXPECT_EQ(third.message(), failed.message());
  EXPECT_EQ(client->requests_sent(), sent) << "a write after the failure sent a part";
  EXPECT_FALSE((*file)->Close().ok());
  (*proxy)->SetFaults({});
  Result<bool> exists = store.Exists("/failing/f");
  ASSERT_TRUE(exists.ok()) << exists.status();
  EXPECT_FALSE(*exists);
}

INSTANTIATE_TEST_SUITE_P(S3, StoreConformanceTest, ::testing::Values(S3Param()),
                         StoreConformanceParamName);

}  // namespace
}  // namespace sp
