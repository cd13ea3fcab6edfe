// Checkpoints on S3 under faults, against a real server (SeaweedFS on 127.0.0.1): throttling
// (503 SlowDown, 429) and connection resets injected by a proxy in front of it
// (store/s3/s3_fault_proxy.h), and the server killed in the middle of a save, then restarted or
// not. A save either commits a checkpoint that loads bit-exact or fails on every rank with the
// same error, and never leaves the previous checkpoint unreadable. Skips when no server can be
// started.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <thread>

#include "shardpoint/checkpoint.h"
#include "shardpoint/comm/thread_comm.h"
#include "shardpoint/store/s3/s3_client.h"
#include "shardpoint/store/s3/s3_fault_proxy.h"
#include "shardpoint/store/s3/s3_store.h"
#include "shardpoint/store/s3/s3_test_server.h"
#include "shardpoint/testing/hook_store.h"
#include "shardpoint/testing/split_matrix.h"

namespace sp {
namespace {

using ::testing::HasSubstr;

constexpr char kBucket[] = "faults";
// [kRows, kCols] fp32 row-split over 4 ranks: 6 MiB a rank, two 5 MiB parts a data file.
constexpr int64_t kRows = 1536, kCols = 4096;

class S3FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<testing::S3TestServer>> server = testing::S3TestServer::Start();
    if (server.status().code() == StatusCode::kNotFound) GTEST_SKIP() << server.status();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_TRUE(S3Client(server_->config()).CreateBucket(kBucket).ok());
  }

  // A store on the server, or on `endpoint` in front of it, with 5 MiB parts and quick retries.
  std::unique_ptr<S3Store> StoreAt(const std::string& endpoint, int attempts) {
    S3Config config = server_->config();
    config.endpoint = endpoint;
    S3ClientOptions options;
    options.max_attempts = attempts;
    options.first_backoff = std::chrono::milliseconds(20);
    options.max_backoff = std::chrono::milliseconds(1000);
    options.deadline = std::chrono::seconds(120);
    S3StoreOptions store_options;
    store_options.part_bytes = uint64_t{5} << 20;
    return std::make_unique<S3Store>(std::make_shared<S3Client>(config, options), kBucket,
                                     store_options);
  }

  std::unique_ptr<testing::S3TestServer> server_;
};

std::vector<Status> SaveStep(Store* store, const std::string& url, int step) {
  return testing::SaveRowSplit(url, step, kRows, kCols, 4, store, /*overwrite=*/true);
}

Status AllOk(const std::vector<Status>& statuses) { return testing::FirstError(statuses); }

Status LoadAndCheck(Store* store, const std::string& url, int step) {
  return testing::LoadColumnSplitAndCheck(url, step, kRows, kCols, 3, store);
}

// Throttling and resets on about a third of the requests: retried, and the save, the resharded
// load and verify all come out right. Which requests are hit depends on how the threads' requests
// interleave, and a round makes a few dozen, so rounds are repeated (each checked) until both
// faults have been injected, at most four times.
TEST_F(S3FaultTest, ThrottlingAndResetsAreRetried) {
  Result<std::unique_ptr<testing::S3FaultProxy>> proxy =
      testing::S3FaultProxy::Start(server_->port(), 7);
  ASSERT_TRUE(proxy.ok()) << proxy.status();
  std::unique_ptr<S3Store> store = StoreAt((*proxy)->endpoint(), 25);
  const std::string url = "s3://faults/run/step-1";
  for (int status : {503, 429}) {
    SCOPED_TRACE(status);
    (*proxy)->SetFaults({.throttle = 0.15, .throttle_status = status, .reset = 0.15,
                         .reset_within_bytes = uint64_t{6} << 20});
    const uint64_t throttled = (*proxy)->throttled(), resets = (*proxy)->resets();
    for (int round = 0; round < 4; ++round) {
      Status saved = AllOk(SaveStep(store.get(), url, status));
      ASSERT_TRUE(saved.ok()) << saved;
      Status loaded = LoadAndCheck(store.get(), url, status);
      EXPECT_TRUE(loaded.ok()) << loaded;
      Result<VerifyReport> report = Verify(url, store.get());
      ASSERT_TRUE(report.ok()) << report.status();
      EXPECT_TRUE(report->ok()) << (report->defects.empty() ? "" : report->defects.front());
      if ((*proxy)->throttled() > throttled && (*proxy)->resets() > resets) break;
    }
    EXPECT_GT((*proxy)->throttled(), throttled);
    EXPECT_GT((*proxy)->resets(), resets);
  }
  (*proxy)->SetFaults({});
  std::unique_ptr<S3Store> direct = StoreAt(server_->endpoint(), 1);
  EXPECT_TRUE(LoadAndCheck(direct.get(), url, 429).ok());
}

// The server killed when the data files are about to be written and started again a second later:
// the requests in between are retried until it answers, and the save commits.
TEST_F(S3FaultTest, ServerKilledMidSaveAndRestartedTheSaveCommits) {
  std::unique_ptr<S3Store> store = StoreAt(server_->endpoint(), 200);
  const std::string url = "s3://faults/run/step-2";
  ASSERT_TRUE(AllOk(SaveStep(store.get(), url, 1)).ok());
  // The thread that restarts the server lives to the end of the test: the server is killed when
  // the thread that started it exits (PR_SET_PDEATHSIG).
  struct Restarter {
    std::promise<void> done;
    std::thread thread;
    Status status;
    ~Restarter() {
      if (!thread.joinable()) return;
      done.set_value();
      thread.join();
    }
  } restarter;
  testing::HookStore killing(store.get(), [&] {
    server_->Kill();
    restarter.thread = std::thread([&, done = restarter.done.get_future()] {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      restarter.status = server_->Restart();
      done.wait();
    });
  });
  Status saved = AllOk(SaveStep(&killing, url, 2));
  ASSERT_TRUE(saved.ok()) << saved;
  EXPECT_TRUE(restarter.status.ok()) << restarter.status;
  Status loaded = LoadAndCheck(store.get(), url, 2);
  EXPECT_TRUE(loaded.ok()) << loaded;
}

// The server killed and not back: every rank fails with the same error, naming the object, after
// a bounded number of attempts (no hang); started again, it serves the previous checkpoint.
TEST_F(S3FaultTest, ServerGoneMidSaveEveryRankFailsAndThePreviousCheckpointStays) {
  std::unique_ptr<S3Store> store = StoreAt(server_->endpoint(), 3);
  const std::string url = "s3://faults/run/step-3";
  ASSERT_TRUE(AllOk(SaveStep(store.get(), url, 1)).ok());
  testing::HookStore killing(store.get(), [&] { server_->Kill(); });
  const auto start = std::chrono::steady_clock::now();
  std::vector<Status> statuses = SaveStep(&killing, url, 2);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  ASSERT_EQ(statuses.size(), 4u);
  for (const Status& s : statuses) {
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
    EXPECT_EQ(s.message(), statuses[0].message());
  }
  EXPECT_THAT(statuses[0].message(), HasSubstr("s3://faults/run/step-3/"));
  EXPECT_THAT(statuses[0].message(), HasSubstr("(after 3 attempts)"));
  const Status restarted = server_->Restart();
  ASSERT_TRUE(restarted.ok()) << restarted;
  // A server just started answers 500 for a while: a client that retries longer reads.
  std::unique_ptr<S3Store> patient = StoreAt(server_->endpoint(), 200);
  Status loaded = LoadAndCheck(patient.get(), url, 1);
  EXPECT_TRUE(loaded.ok()) << loaded;
  Result<VerifyReport> report = Verify(url, patient.get());
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->ok()) << (report->defects.empty() ? "" : report->defects.front());
}

}  // namespace
}  // namespace sp
